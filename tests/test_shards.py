"""Sharded data without training processes: the order (a pure function of (seed, epoch, position), O(shards)
memory), the index and every way a shard can stop matching it, the writer, and a rank's batches at any world
size and worker count (``ddp_slurm/shards``). Whole runs on shards: tests/test_shards_training.py."""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tracemalloc
from array import array
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path

import pytest
import torch
import xxhash
from helpers import flip_byte

from ddp_slurm import Shards, data, errors, safefs, skips
from ddp_slurm.shards import index, order
from ddp_slurm.shards.decode import tensors
from ddp_slurm.shards.errors import ShardError, ShardUsageError
from ddp_slurm.train import loader

SAMPLES, SHARDS = 300, 7


def write_points(folder: Path, n: int = SAMPLES, shards: int = SHARDS) -> Path:
    """``n`` samples (an 8-vector, a label, the sample's own number) through ``ddp-slurm data write`` from a
    JSONL list: shards of uneven sizes, then indexed."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"__key__": f"p{i:05d}", "x": [i] * 8, "cls": i % 10}) for i in range(n)]
    (folder / "points.jsonl").write_text("\n".join(lines))
    assert (
        data.main(["write", str(folder / "points.jsonl"), "--out", str(folder / "shards"), "--shards", str(shards)])
        == 0
    )
    return folder / "shards"


def decode(sample: dict) -> tuple[torch.Tensor, ...]:
    x = torch.tensor(json.loads(sample["x"]), dtype=torch.float32)
    return x, torch.tensor(int(sample["cls"])), torch.tensor(int(sample["__key__"][1:]))


def offsets_of(counts: list[int]) -> array:
    out = array("q", [0])
    for c in counts:
        out.append(out[-1] + c)
    return out


# -- the order ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 4097])
def test_feistel_is_a_bijection_on_any_domain(n: int) -> None:
    perm = order.Feistel(n, order.key(3, 1, 0))
    one_by_one = [perm(x) for x in range(n)]
    assert sorted(one_by_one) == list(range(n))
    assert perm.all().tolist() == one_by_one  # the array form an epoch's shard shuffle uses


@pytest.mark.parametrize("counts", [[50, 0, 7, 120, 1, 33, 90], [1] * 40, [1000]])
@pytest.mark.parametrize("window", [1, 3, 8])
def test_each_epoch_visits_every_sample_once_and_any_position_alone(counts: list[int], window: int) -> None:
    offsets = offsets_of(counts)
    first, alone = order.ShardOrder(offsets, 7, window), order.ShardOrder(offsets, 7, window)
    for epoch in (0, 1):
        ids = first.epoch(epoch)[:]
        assert sorted(ids) == list(range(sum(counts)))
        for p in (sum(counts) - 1, 0, sum(counts) // 2):  # computed alone, in any order, by a fresh object
            assert alone.id(epoch, p) == ids[p]
    assert first.epoch(0)[:] != first.epoch(1)[:] or sum(counts) == 1
    assert order.ShardOrder(offsets, 8, window).epoch(0)[:] != first.epoch(0)[:] or sum(counts) == 1


def test_a_global_batch_reads_the_shards_of_two_windows_at_most() -> None:
    counts, window, batch = [37, 80, 12, 64, 99, 5, 41, 73, 20, 66], 3, 32
    offsets = offsets_of(counts)
    ids = order.ShardOrder(offsets, 0, window).epoch(2)[:]
    shard_of = {g: s for s in range(len(counts)) for g in range(offsets[s], offsets[s + 1])}
    for start in range(0, len(ids) - batch + 1, batch):
        assert len({shard_of[g] for g in ids[start : start + batch]}) <= 2 * window


def test_the_order_of_a_billion_samples_in_100000_shards_holds_under_4_mb() -> None:
    """Measured with tracemalloc (arrays, strings and ints are Python allocations): what the catalog of 10^5
    shards keeps (paths, sizes, digests, first sample ids), and what the order keeps once an epoch is set up
    and a global batch drawn (with the first sample ids it shares with the catalog)."""
    folder = Path("/datasets/big/shards")
    digests = {"ends": "0123456789abcdef", "table": "fedcba9876543210" * 2}
    entries = [
        (folder / f"shard-{i:06d}.tar", {"size": 10**9, "mtime_ns": i, "samples": 10_000, **digests})
        for i in range(100_000)
    ]
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        catalog = index.Catalog(entries)
        middle = tracemalloc.take_snapshot()
        o = order.ShardOrder(catalog.offsets, 0, 8)
        batch = o.epoch(3)[500_000_000 : 500_000_000 + 1024]
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    held = {
        "catalog": sum(s.size_diff for s in middle.compare_to(before, "filename")),
        "order": sum(s.size_diff for s in after.compare_to(middle, "filename")) + catalog.offsets.buffer_info()[1] * 8,
    }
    assert len(catalog) == 10**9 and catalog.path(77) == folder / "shard-000077.tar" and len(set(batch)) == 1024
    print("at 10^9 samples in 10^5 shards: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in held.items()))
    assert held["order"] < 4 * 2**20 and held["catalog"] < 10 * 2**20, held


# -- the index and its checks ---------------------------------------------------------------------------


def test_a_folder_without_an_index_names_the_command(tmp_path: Path) -> None:
    shards = write_points(tmp_path)
    (shards / index.FOLDER / index.INDEX).unlink()
    with pytest.raises(ShardUsageError, match=r"has no shard index: run `ddp-slurm data index .*shards` once"):
        Shards(shards, decode)
    assert data.main(["index", str(shards)]) == 0
    assert len(Shards(shards, decode)) == SAMPLES


def test_a_shard_added_after_indexing_is_refused_until_indexed(tmp_path: Path) -> None:
    shards = write_points(tmp_path)
    (shards / "shard-000099.tar").write_bytes((shards / "shard-000000.tar").read_bytes())
    with pytest.raises(ShardUsageError, match="shard-000099.tar is not in the index: run `ddp-slurm data index"):
        Shards(shards, decode)


@pytest.mark.parametrize("damage", ["truncated", "touched", "deleted", "end flipped"])
def test_a_changed_shard_is_one_line_and_exit_65_before_any_order(tmp_path: Path, damage: str) -> None:
    shards = write_points(tmp_path)
    shard = shards / "shard-000003.tar"
    if damage == "truncated":
        os.truncate(shard, shard.stat().st_size - 1024)
    elif damage == "touched":
        os.utime(shard, ns=(0, shard.stat().st_mtime_ns + 1))
    elif damage == "deleted":
        shard.unlink()
    else:
        flip_byte(shard, shard.stat().st_size - 10)  # in the tar's closing blocks: no sample holds it
    if damage == "end flipped":  # the start check passes (size, mtime); opening the shard checks its ends
        s = Shards(shards, decode)
        with pytest.raises(ShardError, match=r"shard-000003.tar changed since it was indexed \(its size or its first"):
            s.raw(list(range(s.catalog.offsets[3], s.catalog.offsets[4])))
        return
    with pytest.raises(ShardError) as exc:
        Shards(shards, decode)
    assert exc.value.exit_code == 65 and "\n" not in str(exc.value)
    assert "shard-000003.tar" in str(exc.value) and "ddp-slurm data index" in str(exc.value)


def test_a_flipped_byte_inside_a_sample_is_caught_before_decode_names_its_key(tmp_path: Path) -> None:
    shards = write_points(tmp_path)
    s = Shards(shards, decode)
    table = s.catalog.table(2)
    at = table.start[5] + table.members[5][0][1]  # the first member's data of the shard's sixth sample
    flip_byte(shards / "shard-000002.tar", at)
    s = Shards(shards, decode)  # the start check passes: same size, same mtime
    gid = s.catalog.offsets[2] + 5
    s.raw([gid - 1])  # its neighbour still reads
    with pytest.raises(ShardError, match=rf"sample shard-000002.tar:{table.keys[5]} does not match its index"):
        s.raw([gid])


def test_a_worker_s_shard_error_reaches_the_log_as_its_own_line(tmp_path: Path) -> None:
    """torch re-raises a worker's exception with the worker's traceback as its message: one line is kept."""
    wrapped = "Caught ShardError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
    wrapped += '  File "x.py", line 1, in f\nddp_slurm.shards.errors.ShardError: sample a.tar:k does not match\n'
    assert str(ShardError(wrapped)) == "sample a.tar:k does not match"


def test_compressed_shards_are_refused_in_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "gz"
    folder.mkdir()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("a.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    (folder / "shard-0.tar").write_bytes(gzip.compress(buf.getvalue()))  # named .tar, gzip inside
    with pytest.raises(ShardError, match=r"shard-0.tar is a gzip-compressed tar: shards must be plain tars"):
        index.build(folder)
    (folder / "shard-0.tar").rename(folder / "shard-0.tar.gz")
    (folder / "shard-1.tar").write_bytes(buf.getvalue())
    with pytest.raises(ShardError, match=r"shard-0.tar.gz is compressed"):
        index.build(folder)


def test_a_sample_s_members_must_be_together(tmp_path: Path) -> None:
    folder = tmp_path / "apart"
    folder.mkdir()
    with tarfile.open(folder / "s.tar", "w") as tar:
        for name in ("a.x", "b.x", "a.y"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"1"))
    with pytest.raises(ShardError, match="the members of sample 'a' are not together"):
        index.build(folder)


def test_the_index_is_read_through_the_checkpoints_gate(tmp_path: Path) -> None:
    shards = write_points(tmp_path)
    file = shards / index.FOLDER / index.INDEX
    file.chmod(0o666)
    with pytest.raises(safefs.UnsafePath, match="writable by every user"):
        Shards(shards, decode)
    file.chmod(0o640)
    moved = file.with_name("elsewhere.json")
    file.rename(moved)
    file.symlink_to(moved)
    with pytest.raises(safefs.UnsafePath, match="symlink"):
        Shards(shards, decode)
    file.unlink()
    body = moved.read_bytes()
    file.write_bytes(body.replace(b'"samples"', b'"sampleZ"', 1))
    with pytest.raises(ShardError, match="its seal does not match"):
        Shards(shards, decode)
    assert issubclass(ShardUsageError, errors.UsageError)


def test_guard_drop_takes_a_sharded_sample_s_name(tmp_path: Path) -> None:
    assert skips.parse_samples("300, shard-000003.tar:p00042@1") == [(300, 0), ("shard-000003.tar:p00042", 1)]
    with pytest.raises(ValueError, match=r"'p00042' is not a dataset index, a shard.tar:key name, or either @EPOCH"):
        skips.parse_samples("300,p00042")
    s = Shards(write_points(tmp_path), decode)
    assert s.index_of(s.name(123)) == 123
    with pytest.raises(ShardUsageError, match="guard.drop names shard-000000.tar:nope: no such sample"):
        s.index_of("shard-000000.tar:nope")


def _reseal(file: Path, change) -> None:
    """The index rewritten with ``change(index)`` and sealed again with the project's own function: a forgery."""
    body = index.unsealed(file.read_bytes(), file)
    file.write_bytes(index.sealed(json.dumps(change(json.loads(body))).encode()))


@pytest.mark.parametrize(
    ("forge", "said"),
    [
        (lambda ix: {**ix, "shards": "all"}, "no list of shards"),
        (lambda ix: {**ix, "shards": [{**ix["shards"][0], "name": "../../etc/passwd.tar"}]}, "shard name"),
        (lambda ix: {**ix, "shards": [{**ix["shards"][0], "samples": -5}]}, "size, count or table"),
        (lambda ix: {**ix, "shards": [{**ix["shards"][0], "size": "big"}]}, "a shard entry without"),
    ],
    ids=["not-a-list", "path-outside", "negative-count", "string-size"],
)
def test_a_forged_but_sealed_index_is_refused_in_one_line(tmp_path: Path, forge, said: str) -> None:
    shards = write_points(tmp_path)
    _reseal(shards / index.FOLDER / index.INDEX, forge)
    with pytest.raises(ShardError, match=f"is damaged or not written by ddp-slurm \\(.*{said}"):
        Shards(shards, decode)


def test_a_forged_table_cannot_make_a_read_outside_its_shard(tmp_path: Path) -> None:
    """The table rewritten with a huge range and its digest put in the re-sealed index: refused before any read."""
    shards = write_points(tmp_path)
    file = shards / index.FOLDER / index.INDEX
    entry = json.loads(index.unsealed(file.read_bytes(), file))["shards"][0]
    table = shards / index.FOLDER / index.TABLES / f"{entry['table']}.json"
    t = json.loads(table.read_bytes())
    t["end"][0] = 10**15
    body = json.dumps(t).encode()
    digest = xxhash.xxh3_128_hexdigest(body)
    (table.parent / f"{digest}.json").write_bytes(body)
    _reseal(file, lambda ix: {**ix, "shards": [{**ix["shards"][0], "table": digest}, *ix["shards"][1:]]})
    s = Shards(shards, decode)
    with pytest.raises(ShardError, match=r"range 0-1000000000000000 in a shard of \d+ bytes"):
        s.raw([0])


def test_planted_links_in_the_index_folder_are_not_written_through(tmp_path: Path) -> None:
    shards = write_points(tmp_path)
    victim = tmp_path / "victim"
    victim.mkdir()
    shutil.rmtree(shards / index.FOLDER)
    (shards / index.FOLDER).symlink_to(victim)
    with pytest.raises(safefs.UnsafePath, match="symlink"):
        index.build(shards)
    assert list(victim.iterdir()) == []


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"window": 0}, "window=0"),
        ({"window": 2.5}, "window=2.5"),
        ({"readahead_mb": float("nan")}, "readahead_mb=nan"),
    ],
)
def test_bad_shards_arguments_are_one_line(tmp_path: Path, kwargs: dict, said: str) -> None:
    with pytest.raises(ShardUsageError, match=re.escape(f"Shards({said})")):
        Shards(tmp_path, decode, **kwargs)


# -- writing --------------------------------------------------------------------------------------------


def test_writing_is_deterministic_and_shuffles_across_shards(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a, b = write_points(tmp_path / "a"), write_points(tmp_path / "b")
    names = sorted(p.name for p in a.glob("*.tar"))
    assert len(names) == SHARDS
    assert all((a / n).read_bytes() == (b / n).read_bytes() for n in names)
    first = Shards(a, decode)
    keys = [first.name(g).split(":")[1] for g in range(first.catalog.offsets[1])]
    assert keys != sorted(keys), "the first shard holds a run of the input, not a draw"
    again = ["write", str(tmp_path / "a" / "points.jsonl"), "--out", str(a)]
    assert data.main(again) == 2
    assert "already holds shards: choose an empty --out folder" in capsys.readouterr().err


def test_a_folder_of_files_becomes_samples_by_key(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "cats").mkdir(parents=True)
    for i in range(5):
        (src / "cats" / f"{i:03d}.txt").write_text(f"cat {i}")
        (src / "cats" / f"{i:03d}.cls").write_text("1")
    assert data.main(["write", str(src), "--out", str(tmp_path / "out"), "--shards", "2"]) == 0
    s = Shards(tmp_path / "out", lambda d: d)
    got = sorted((d["__key__"], d["txt"], d["cls"]) for d in s.raw(list(range(5))))
    assert got == [(f"cats/{i:03d}", f"cat {i}".encode(), b"1") for i in range(5)]


def test_a_task_s_tensors_round_trip_through_npy_members(tmp_path: Path) -> None:
    out = tmp_path / "mnist"
    assert data.main(["write", "task=ddp_slurm.tasks.mnist:MNIST", "--out", str(out), "--shards", "3"]) == 0
    s = Shards(out, tensors)
    from ddp_slurm.tasks.mnist import data as mnist

    split = mnist.load_sample(train=True)
    for gid in (0, 1234, len(s) - 1):
        image, label = s[gid]
        i = int(s.name(gid).split(":")[1])
        assert torch.equal(image, split.images[i]) and torch.equal(label, split.labels[i])


# -- a rank's batches -----------------------------------------------------------------------------------


class Train:
    workers, prefetch = 0, 2


def global_batches(shards: Path, world: int, workers: int, epoch: int, start: int) -> list[list[int]]:
    """Each global batch's sample numbers from ``start`` in ``epoch``, gathered from ``world`` ranks' batch
    sources with ``workers`` worker processes each."""
    cfg = Train()
    cfg.workers = workers
    per_rank = []
    for rank in range(world):
        b = loader.make_batches(Shards(shards, decode), torch.device("cpu"), 5, 24, rank, world, cfg=cfg)
        per_rank.append([batch[2].tolist() for batch in b.epoch(epoch, start)])
        b.close()
    return [sorted(sum((rank[s] for rank in per_rank), [])) for s in range(len(per_rank[0]))]


def test_global_batches_are_the_same_at_any_world_size_and_worker_count(tmp_path: Path) -> None:
    shards = write_points(tmp_path)
    whole = global_batches(shards, 1, 0, 1, 0)
    assert len(whole) == SAMPLES // 24 and len({i for b in whole for i in b}) == len(whole) * 24
    assert global_batches(shards, 2, 2, 1, 0) == whole
    assert global_batches(shards, 3, 3, 1, 4) == whole[4:]  # a mid-epoch resume at another world size
    assert global_batches(shards, 1, 0, 2, 0) != whole


def test_ranks_of_a_node_take_turns_staging_and_a_planted_lock_link_is_refused(tmp_path: Path) -> None:
    shards = write_points(tmp_path)
    into = tmp_path / "node-local" / "ddp-slurm-shards"
    safefs.make_dir(into)
    hold = "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); fcntl.lockf(fd, fcntl.LOCK_EX)"
    holder = subprocess.Popen(
        [sys.executable, "-c", hold + "; print('held', flush=True); sys.stdin.read()", str(into / ".staging-lock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline() == "held\n"  # another rank of the node is staging
    with ThreadPoolExecutor(1) as pool:
        staging = pool.submit(Shards, shards, decode, stage=into.parent)
        with pytest.raises(FuturesTimeout):
            staging.result(timeout=1)  # it waits its turn: nothing copied beside the holder
        assert not list(into.glob("*.tar"))
        holder.stdin.close()  # the holder ends; the kernel drops its lock
        assert len(staging.result(timeout=120).staged) == SHARDS
    holder.wait()
    (into / ".staging-lock").unlink()
    (into / ".staging-lock").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(safefs.UnsafePath, match=r"\.staging-lock is a symlink"):
        Shards(shards, decode, stage=into.parent)


def test_a_worker_keeps_a_few_windows_of_tables_and_files(tmp_path: Path) -> None:
    shards = write_points(tmp_path, n=400, shards=40)
    s = Shards(shards, decode, window=2)
    for gid in range(0, len(s), 3):
        s.raw([gid])
    assert len(s._tables) <= 6 and len(s._fds) <= 6


def test_staged_copies_are_read_checked_and_made_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shards = write_points(tmp_path)
    local = tmp_path / "node-local"
    s = Shards(shards, decode, stage=local)
    copies = sorted((local / "ddp-slurm-shards").glob("*.tar"))
    assert len(copies) == SHARDS and sorted(s.staged) == copies
    assert [d["__key__"] for d in s.raw(list(range(len(s))))] == [s.name(g).split(":")[1] for g in range(len(s))]
    made = {c: c.stat().st_mtime_ns for c in copies}
    flip_byte(copies[0], copies[0].stat().st_size - 10)  # a stale copy: its end differs from the index
    Shards(shards, decode, stage=local)
    assert copies[0].stat().st_mtime_ns != made[copies[0]]  # made again
    assert all(c.stat().st_mtime_ns == made[c] for c in copies[1:])  # the others kept
    monkeypatch.delenv("SLURM_TMPDIR", raising=False)
    with pytest.raises(ShardUsageError, match=r"stage=True\) needs \$SLURM_TMPDIR"):
        Shards(shards, decode, stage=True)
    monkeypatch.setenv("SLURM_TMPDIR", str(local))
    assert Shards(shards, decode, stage=True).staged == s.staged
