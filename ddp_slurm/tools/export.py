"""``ddp-slurm export RUN_DIR [--best | --step N] OUT``: a run's weights for inference, and ``load_model``.

Why: a checkpoint is for resuming (optimizer, RNG streams, the data's position, sealed; under fsdp a
folder of shards), not for prediction. An export is the model alone, as the task builds it::

    OUT/model.pt       the model's plain state_dict (CPU tensors, names as the task's build_model()
                       gives them; gathered whole from a folder of shards): torch.load(weights_only=True)
    OUT/config.yaml    the config of the run that wrote the checkpoint (the task and its sections)
    OUT/export.json    where it came from: run directory, checkpoint, step, strategy, and the run's
                       evaluation at that step when it made one

The checkpoint passes the gate like every other (trusted, whole, in place, this run's config): the
newest by default, the run's best (``<run dir>/best``) with ``--best``, or the one of step ``--step N``.
OUT must not exist (nothing is overwritten); it appears whole or not at all (written beside it, then
renamed). Nothing of the run directory is imported: the task is named, not loaded.

``ddp_slurm.load_model(OUT, device="cpu")`` builds the task's model from ``config.yaml`` and loads the
weights (strict: every name and shape), in eval mode; ``with_task=True`` returns the task too, for its
``eval_data``/``eval_step``. It imports the task the config names, so the folder and its files must be
yours (``safefs.check_trusted``), as for a resume.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from ddp_slurm import argtypes, config, errors, safefs
from ddp_slurm.exitcodes import EXIT_OK, EXIT_USAGE
from ddp_slurm.runpaths import RunPaths

PROG = "ddp-slurm export"
MODEL, ABOUT = "model.pt", "export.json"
CONFIG = RunPaths(Path()).config.name  # the run's config, under the name it has in a run directory
_POSITION = ("kind", "step", "epoch", "time_s", "test_samples")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argtypes.OneLineParser(
        prog=PROG,
        description="Write a run's model weights (a plain state_dict) and its config into a new folder OUT, "
        "for inference: ddp_slurm.load_model(OUT) builds the task's model with them.",
    )
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory (runs/<name>)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--best", action="store_true", help="the run's best checkpoint (<run dir>/best)")
    which.add_argument("--step", type=argtypes.integer(0), metavar="N", help="the checkpoint of step N")
    p.add_argument("out", type=Path, metavar="OUT", help="a new folder (it must not exist)")
    return p.parse_args(argv)


def choose(run_dir: Path, best: bool = False, step: int | None = None) -> tuple[Any, Path, dict[str, Any]]:
    """(backend, path, record) of the checkpoint to export, once the gate passed it; UsageError naming why not."""
    from ddp_slurm.train.checkpoint import best as best_file
    from ddp_slurm.train.checkpoint import gate

    saved = RunPaths(run_dir).config
    if not saved.is_file():
        raise errors.UsageError(f"{run_dir} is not a run directory (no config.yaml in it); give runs/<name>")
    cfg = config.read_resolved(saved)  # the runtime's keys only: nothing is imported
    safefs.check_run_dir(run_dir, cfg.run.shared)
    paths = RunPaths(run_dir, cfg.run.shared)
    backend = gate.backend_of(paths)
    check = gate.Gate(backend, paths, [gate.same_config(cfg)], resumable=False)
    candidates = check.candidates()
    if not best and step is None:
        found = check.newest()
        if found is None:
            raise errors.UsageError(f"{run_dir} holds no checkpoint yet: train it first")
        return backend, *found
    if best:
        try:
            named = best_file.named(paths)
        except ValueError as exc:
            raise errors.UsageError(str(exc)) from None
        if named is None:
            raise errors.UsageError(
                f"{run_dir} has no best checkpoint (no {paths.best.name} file: the run has not evaluated its "
                "task's best_metric yet); export the newest, or --step N"
            )
        wanted = [(s, p) for s, p in candidates if p == named]
        missing = f"its best file names {named.name}, which is not in {paths.checkpoints}"
    else:
        wanted = [(s, p) for s, p in candidates if s == step]
        have = ", ".join(str(s) for s, _ in sorted(candidates)) or "none"
        missing = f"it has no checkpoint of step {step} (steps: {have})"
    if not wanted:
        raise errors.UsageError(f"{run_dir}: {missing}")
    check.check_trust(wanted)
    try:
        record = check.judge(*wanted[0])
    except ValueError as exc:
        raise errors.UsageError(f"{wanted[0][1]} cannot be exported: {exc}") from None
    return backend, wanted[0][1], record


def write(out: Path, backend: Any, path: Path, record: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The export of checkpoint ``path`` into the new folder ``out``; returns what export.json says."""
    import torch
    import yaml

    try:
        whole = backend.load_whole(path, record)
    except FileNotFoundError:  # a run that is training pruned it after it was chosen
        raise CheckpointGone(path) from None
    model = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in whole["model"].items()}
    about = {
        "run_dir": str(run_dir.resolve()),
        "checkpoint": path.name,
        "step": whole["step"],
        "epoch": whole["epoch"],
        "strategy": (whole.get("config") or {}).get("dist", {}).get("strategy"),  # the run's, as it recorded it
        "evaluation": _evaluation(run_dir, whole["step"]),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    # made here, exclusively, under a name nobody can guess: a folder someone planted is never adopted
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    os.chmod(tmp, safefs.DIR_MODE)  # mkdtemp's 0o700 -> the run's folder mode, as make_dir gives
    try:
        safefs.write_atomic(tmp / MODEL, lambda f: torch.save(model, f))
        text = yaml.safe_dump(whole["config"], sort_keys=False)
        safefs.write_atomic(tmp / CONFIG, lambda f: f.write(text.encode()))
        safefs.write_atomic(tmp / ABOUT, lambda f: f.write((json.dumps(about, indent=2) + "\n").encode()))
        os.rename(tmp, out)  # fails when OUT appeared meanwhile: never overwritten
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    safefs.fsync_dir(out.parent)
    return about


class CheckpointGone(errors.Error):
    """The chosen checkpoint vanished before it was read: the run is training and pruned it (exit 1)."""

    def __init__(self, path: Path) -> None:
        super().__init__(
            f"{path} was removed while it was being exported (the run is training and pruned it, "
            "checkpoint.keep): export again, or choose a step that is kept"
        )
        self.path = path


PRUNED_RETRIES = 3
"""The newest checkpoint of a run that is training can be pruned between the choice and the read: choose again."""


def _export(run_dir: Path, out: Path, best: bool, step: int | None) -> tuple[dict[str, Any], Path]:
    tries = 1
    while True:
        try:
            try:
                backend, path, record = choose(run_dir, best, step)
            except FileNotFoundError as exc:  # listed, then pruned before it was read
                raise CheckpointGone(Path(exc.filename or run_dir)) from None
            return write(out, backend, path, record, run_dir), path
        except CheckpointGone:
            if best or step is not None or tries == PRUNED_RETRIES:  # what was asked for is gone
                raise
            tries += 1


def _evaluation(run_dir: Path, step: int) -> dict[str, Any] | None:
    """The run's evaluation at ``step`` (the launch that counts), or None."""
    from ddp_slurm.tools import history

    try:
        evals = history.read_history(run_dir).evals
    except history.ReportError:
        return None
    return next((r for r in evals if r["step"] == step), None)


def load_model(path: str | Path, device: Any = "cpu", with_task: bool = False) -> Any:
    """The task's model with the weights exported to ``path`` (see the module docstring), in eval mode on
    ``device``; ``(model, task)`` with ``with_task``. UsageError when the folder is not an export you own."""
    import torch

    from ddp_slurm import taskref
    from ddp_slurm.train.task import Context

    folder = Path(path)
    for item in (folder, folder / MODEL, folder / CONFIG):
        if not item.exists():
            raise errors.UsageError(f"{folder} is not an export ({item.name} is missing); make one with {PROG}")
        safefs.check_trusted(item, use="load a model from")
    cfg = config.read_resolved(folder / CONFIG)
    task_cls = taskref.resolve(cfg.task)
    cfg = config.resolve(cfg, task_cls)
    device = torch.device(device)
    ctx = Context(0, 1, 0, device, cfg.run.seed, folder, cfg.train.global_batch_size)
    task = task_cls(cfg.task_config, ctx)
    model = task.build_model()
    state = torch.load(folder / MODEL, map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    model = model.to(device).eval()
    return (model, task) if with_task else model


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    try:
        if os.path.lexists(out):
            raise errors.UsageError(f"{out} exists: give a new folder (an export never overwrites)")
        about, path = _export(Path(args.run_dir), out, args.best, args.step)
    except errors.Error as exc:  # a usage problem (2), or no checkpoint that can be read (1)
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return exc.exit_code
    except OSError as exc:
        sys.stderr.write(f"{PROG}: error: cannot write {out}: {exc.strerror or exc}\n")
        return EXIT_USAGE
    shown = about["evaluation"] or {}
    numbers = {k: v for k, v in shown.items() if k not in _POSITION and isinstance(v, (int, float))}
    metrics = ", ".join(f"{k}={v:.6g}" for k, v in numbers.items())
    sys.stdout.write(
        f"exported {path} (step {about['step']}{'; ' + metrics if metrics else ''}) to {out}: "
        f"load it with ddp_slurm.load_model({str(out)!r})\n"
    )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
