"""Warm start: a new run begins from another run's weights (``run.init_from``), and its optimizer's
moments with ``run.init_optimizer=true``.

Why its own module: a warm start is not a resume. A resume continues the same computation (its own
config, schedule, data position and RNG streams, bit-identically); a warm start is a new computation
that only borrows tensors: step 0, a fresh schedule over its own ``train.epochs``, its own seed. So
it never touches a run that resumes: when the run directory already holds a checkpoint of its own,
``run.init_from`` is ignored and that checkpoint wins (a requeued warm-started job must continue
where it stopped, not start over from the source).

The source is resolved once, on rank 0, before the run directory is made: a run directory means its
newest checkpoint that passes the gate (trusted, whole; whichever strategy wrote it: a folder of shards
is read whole), a file or a folder of shards means that one, ``<run dir>/best`` the run's best checkpoint
(``checkpoint/best.py``), read like any file or folder. It must hold this model (names and
shapes) and, with ``run.init_optimizer``, an optimizer of this run's structure (``fit``: another
grouping crashed the fused kernels); otherwise one line and exit 2, with nothing created. The resolved
checkpoint is written into the run's ``config.yaml`` (``run.init_from``) and the ``start`` line of
metrics.jsonl (``init_from``, ``init_step``), so the run says exactly which weights it began from.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ddp_slurm.config import Config
from ddp_slurm.errors import UsageError
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train.checkpoint import best, fit, gate, sharded
from ddp_slurm.train.checkpoint.backends import BACKENDS, backend_at
from ddp_slurm.train.checkpoint.errors import CheckpointError

log = logging.getLogger("ddp_slurm")


def _source(spec: str, shared: bool, rules: list[gate.Accept], template: fit.Template | None) -> Path:
    """The checkpoint ``run.init_from`` names, once the gate has found it whole and it fits this run;
    UsageError naming what is wrong."""
    path = Path(spec)
    what = f"run.init_from={spec}"
    if path.name == "best" and not path.is_dir():  # <run dir>/best: the checkpoint it names, checked below
        try:
            path = best.named(RunPaths(path.parent, shared)) or path
        except (ValueError, OSError) as exc:
            raise UsageError(f"{what}: {exc}") from None
    if path.is_dir() and not (path / sharded.COMMIT).exists():  # a run directory: its newest whole checkpoint
        paths = RunPaths(path, shared)
        backend = gate.backend_of(paths)
        try:
            found = gate.Gate(backend, paths, resumable=False).newest()
        except CheckpointError as exc:
            raise UsageError(f"{what}: {exc}") from None
        if found is None:
            raise UsageError(f"{what}: no checkpoint in that run directory; give a run that has saved one")
        path, record = found
    elif not path.exists():
        raise UsageError(
            f"{what}: no such run directory or checkpoint file; give runs/<name> or one of its checkpoints"
        )
    else:
        try:
            backend = backend_at(path)
            record = backend.read(path)
        except ValueError as exc:
            raise UsageError(
                f"{what}: not a usable checkpoint ({exc}); give another one or its run directory"
            ) from None
    try:
        gate.Gate(backend, RunPaths(path.parent.parent, shared), rules, template=template, resumable=False).check(
            record
        )
    except ValueError as exc:
        fix = "warm start needs the same model (model.* keys)" if "another model" in str(exc) else ""
        raise UsageError(f"{what} ({path}): {exc}" + (f"; {fix}" if fix else "")) from None
    return path


def locate(cfg: Config, reference: dict[str, Any], template: fit.Template | None) -> str | None:
    """Rank 0, before the run directory is taken: the checkpoint this new run starts from, checked against
    the model (``reference``: its state dict's names and shapes) and, with ``run.init_optimizer``, the
    optimizer's structure (``template``); or None (no ``run.init_from``, or the run directory has
    checkpoints of its own: they win)."""
    own = RunPaths(cfg.run_dir)
    if not cfg.run.init_from or any(b.candidates(own) for b in BACKENDS):
        return None
    rules: list[gate.Accept] = [gate.same_model(reference)]
    if cfg.run.init_optimizer:
        rules.append(_same_optimizer(cfg))
    return str(_source(cfg.run.init_from, cfg.run.shared, rules, template if cfg.run.init_optimizer else None))


def _same_optimizer(cfg: Config) -> gate.Accept:
    """With ``run.init_optimizer``: the source's ``train.optimizer`` is this run's."""

    def accept(record: dict[str, Any]) -> None:
        theirs = (record.get("config") or {}).get("train", {}).get("optimizer")
        if theirs not in (None, cfg.train.optimizer):
            raise ValueError(
                f"its optimizer is {theirs}, this run's train.optimizer={cfg.train.optimizer}; "
                "use the same optimizer or run.init_optimizer=false"
            )

    return accept


def load_into(cfg: Config, run: Any) -> dict[str, Any]:
    """Every rank: load the located source (``cfg.run.init_from``) into the run's model and, with
    ``run.init_optimizer``, its optimizer's per-parameter state (through the strategy: a sharded model
    takes its slice). Returns the fields of the ``start`` line.

    Only the moments (Adam's averages, SGD's momentum buffers) are taken from the source, not its
    hyperparameters: the learning rate, betas and weight decay stay this run's, so its own schedule
    (built over its own steps) is the one that runs.
    """
    path = Path(cfg.run.init_from)
    backend = backend_at(path)
    try:
        whole = backend.load_whole(path, backend.read(path, verify=False))
    except ValueError as exc:
        raise CheckpointError(f"cannot read run.init_from={path}: {exc}") from None
    run.strategy.load_whole(run.model, run.optimizer, whole, cfg.run.init_optimizer)
    if run.rank == 0:
        log.info(
            "warm start from %s (step %d)%s; step 0 of a new schedule",
            path,
            whole["step"],
            " with its optimizer state" if cfg.run.init_optimizer else "",
        )
    return {"init_from": str(path), "init_step": whole["step"], "init_optimizer": cfg.run.init_optimizer}
