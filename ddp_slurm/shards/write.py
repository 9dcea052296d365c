"""``ddp-slurm data write SRC --out DIR``: WebDataset shards from a folder, a JSONL list or a task's data.

Deterministic: the same input gives byte-identical shards (members in a fixed order, every header field
fixed: mtime 0, owner 0, mode 0644, PAX format). Samples are shuffled across shards as they are written
(a Feistel permutation keyed by ``--seed``), so a shard is a random draw of the data and windows of a few
shards mix well; each sample keeps its key, which names where it came from. Each shard is written under a
temporary name and renamed; ``DIR`` must not hold shards already (nothing is overwritten). The shards are
indexed at the end (``index.build``).

Sources:
- a folder: every file ``<key>.<ext>`` below it (the key is its path without the extensions, as in a tar);
- a ``.jsonl`` file: one sample per line, ``{"__key__": "a", "jpg": "images/a.jpg", "cls": 3}``: a string is a
  file (relative to the list's folder) whose bytes become that member, anything else its JSON text;
  ``__key__`` defaults to the line number;
- ``task=module:Class`` (then ``KEY=VALUE`` overrides): the task's ``train_data()`` (``--split eval``:
  ``eval_data()``), each sample's tensors as members ``0.npy``, ``1.npy``, ... (``shards.decode.tensors``
  reads them back), keyed by dataset index.
"""

from __future__ import annotations

import io
import json
import logging
import math
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ddp_slurm import errors, safefs
from ddp_slurm.shards import index, tarscan
from ddp_slurm.shards.order import Feistel, key

log = logging.getLogger(__name__)

Sample = tuple[str, list[tuple[str, bytes]]]  # (key, [(ext, bytes), ...])


def write(
    source: str,
    out: Path,
    overrides: Sequence[str] = (),
    *,
    shards: int | None = None,
    per_shard: int = 1000,
    seed: int = 0,
    split: str = "train",
) -> dict:
    """Write and index the shards (module docstring); the index's summary is returned."""
    out = Path(out)
    count, read = _source(source, list(overrides), split)
    if count == 0:
        raise errors.UsageError(f"{source} holds no samples")
    if out.exists() and any(out.glob("*.tar")):
        raise errors.UsageError(f"{out} already holds shards: choose an empty --out folder (nothing is overwritten)")
    safefs.make_dir(out)
    if per_shard < 1:
        raise errors.UsageError(f"--samples-per-shard {per_shard}: 1 or more")
    n_shards = shards if shards is not None else math.ceil(count / per_shard)
    if not 1 <= n_shards <= count:
        raise errors.UsageError(f"--shards {n_shards}: between 1 and the {count} samples")
    shuffle = Feistel(count, key(seed, 0, 0))
    width = max(6, len(str(n_shards - 1)))
    for s in range(n_shards):
        first, last = count * s // n_shards, count * (s + 1) // n_shards
        name = out / f"shard-{s:0{width}d}.tar"
        safefs.write_atomic(name, lambda f, a=first, b=last: _tar(f, (read(shuffle(i)) for i in range(a, b))))
    log.info("wrote %d samples in %d shards to %s", count, n_shards, out)
    return index.build(out)


def _tar(f: Any, samples: Any) -> None:
    with tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for sample_key, members in samples:
            for ext, data in members:
                info = tarfile.TarInfo(f"{sample_key}.{ext}")
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                tar.addfile(info, io.BytesIO(data))


def _source(source: str, overrides: list[str], split: str) -> tuple[int, Callable[[int], Sample]]:
    if source.startswith("task="):
        return _task(source, overrides, split)
    if overrides:
        raise errors.UsageError(f"KEY=VALUE overrides ({overrides[0]}) only go with a task= source")
    path = Path(source)
    if path.is_dir():
        return _folder(path)
    if path.is_file() and path.suffix == ".jsonl":
        return _jsonl(path)
    raise errors.UsageError(f"{source}: expected a folder, a .jsonl list or task=module:Class")


def _folder(folder: Path) -> tuple[int, Callable[[int], Sample]]:
    grouped: dict[str, list[tuple[str, Path]]] = {}
    for file in sorted(folder.rglob("*")):
        rel = file.relative_to(folder).as_posix()
        if not file.is_file() or any(part.startswith(".") for part in Path(rel).parts):
            continue
        parts = tarscan.split_name(rel)
        if parts is not None:
            grouped.setdefault(parts[0], []).append((parts[1], file))
    keys = sorted(grouped)
    return len(keys), lambda i: (keys[i], [(ext, file.read_bytes()) for ext, file in grouped[keys[i]]])


def _jsonl(path: Path) -> tuple[int, Callable[[int], Sample]]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise errors.UsageError(f"{path}:{n + 1}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise errors.UsageError(f"{path}:{n + 1}: expected an object of extension -> file or value")
        rows.append((str(row.pop("__key__", f"{n:09d}")), row))

    def read(i: int) -> Sample:
        sample_key, row = rows[i]
        members = []
        for ext, value in sorted(row.items()):
            data = (path.parent / value).read_bytes() if isinstance(value, str) else json.dumps(value).encode()
            members.append((ext, data))
        return sample_key, members

    return len(rows), read


def _task(source: str, overrides: list[str], split: str) -> tuple[int, Callable[[int], Sample]]:
    import torch

    from ddp_slurm import config, taskref
    from ddp_slurm.shards.decode import npy
    from ddp_slurm.train.task import Context, Tensors

    cfg = config.load(overrides=[source, *overrides])
    task_cls = taskref.resolve(cfg.task)
    ctx = Context(0, 1, 0, torch.device("cpu"), cfg.run.seed, Path(cfg.run.output_root), cfg.train.global_batch_size)
    task = task_cls(cfg.task_config, ctx)
    task.prepare_data()
    data = task.train_data() if split == "train" else task.eval_data()
    if data is None:
        raise errors.UsageError(f"{cfg.task} has no {split} data")

    def read(i: int) -> Sample:
        sample = tuple(t[i] for t in data.tensors) if isinstance(data, Tensors) else data[i]
        items = sample if isinstance(sample, (tuple, list)) else (sample,)
        return f"{i:09d}", [(f"{j}.npy", npy(item)) for j, item in enumerate(items)]

    return len(data), read
