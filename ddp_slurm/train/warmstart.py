"""Warm start: a new run begins from another run's weights (``run.init_from``), and its optimizer's
moments with ``run.init_optimizer=true``.

Why its own module: a warm start is not a resume. A resume continues the same computation (its own
config, schedule, data position and RNG streams, bit-identically); a warm start is a new computation
that only borrows tensors: step 0, a fresh schedule over its own ``train.epochs``, its own seed. So
it never touches a run that resumes: when the run directory already holds a checkpoint of its own,
``run.init_from`` is ignored and that checkpoint wins (a requeued warm-started job must continue
where it stopped, not start over from the source).

The source is resolved once, on rank 0, before the run directory is made: a run directory means its
newest valid checkpoint, a file means that file. A source that is missing, unreadable or holds
another model (names or shapes) is one line and exit 2, with nothing created. The resolved file is
written into the run's ``config.yaml`` (``run.init_from``) and the ``start`` line of metrics.jsonl
(``init_from``, ``init_step``), so the run says exactly which weights it began from.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from ddp_slurm.config import Config
from ddp_slurm.train import checkpoint
from ddp_slurm.train.rundir import UsageError

log = logging.getLogger("ddp_slurm")


def _source(spec: str, shared: bool) -> tuple[Path, dict[str, Any]]:
    """(checkpoint file, its state) for ``run.init_from``; UsageError naming what is wrong."""
    path = Path(spec)
    what = f"run.init_from={spec}"
    if path.is_dir():
        try:
            found = checkpoint.latest(path, shared=shared)
        except checkpoint.CheckpointError as exc:
            raise UsageError(f"{what}: {exc}") from None
        if found is None:
            raise UsageError(f"{what}: no checkpoint in that run directory; give a run that has saved one")
        return found
    if not path.is_file():
        raise UsageError(f"{what}: no such run directory or checkpoint file; give runs/<name> or a .pt checkpoint")
    try:
        return path, checkpoint.load(path)
    except (ValueError, OSError) as exc:
        raise UsageError(f"{what}: not a usable checkpoint ({exc}); give another file or its run directory") from None


def locate(cfg: Config, model_keys: dict[str, Any]) -> str | None:
    """Rank 0, before the run directory is taken: the checkpoint file this new run starts from, checked
    against the model (``model_keys``: the fresh model's state dict, on the meta device), or None (no
    ``run.init_from``, or the run directory has checkpoints of its own: they win)."""
    if not cfg.run.init_from or checkpoint.list_checkpoints(cfg.run_dir):
        return None
    if cfg.dist.strategy == "fsdp":  # the weights would have to be loaded into shards (DCP): not built yet
        raise UsageError(
            f"run.init_from={cfg.run.init_from}: a warm start trains under dist.strategy=ddp in this version; "
            "start the new run with dist.strategy=ddp, or without run.init_from"
        )
    path, state = _source(cfg.run.init_from, cfg.run.shared)
    where = f"run.init_from={cfg.run.init_from} ({path})"
    try:
        checkpoint.same_model(model_keys)(state)
    except ValueError as exc:
        raise UsageError(f"{where}: {exc}; warm start needs the same model (model.* keys)") from None
    if cfg.run.init_optimizer:
        if "optimizer" not in state:
            raise UsageError(f"{where}: the checkpoint holds no optimizer state; set run.init_optimizer=false")
        theirs = (state.get("config") or {}).get("train", {}).get("optimizer")
        if theirs not in (None, cfg.train.optimizer):
            raise UsageError(
                f"{where}: its optimizer is {theirs}, this run's train.optimizer={cfg.train.optimizer}; "
                "use the same optimizer or run.init_optimizer=false"
            )
    return str(path)


def load_into(cfg: Config, model: torch.nn.Module, optimizer: Any, rank: int) -> dict[str, Any]:
    """Every rank: load the located source (``cfg.run.init_from``, a file) into ``model`` and, with
    ``run.init_optimizer``, the optimizer's per-parameter state. Returns the fields of the ``start`` line.

    Only the moments (Adam's averages, SGD's momentum buffers) are taken from the source, not its
    hyperparameters: the learning rate, betas and weight decay stay this run's, so its own schedule
    (built over its own steps) is the one that runs.
    """
    path = Path(cfg.run.init_from)
    state = checkpoint.load(path)
    model.load_state_dict(state["model"])
    if cfg.run.init_optimizer:
        own = optimizer.state_dict()
        own["state"] = state["optimizer"]["state"]
        optimizer.load_state_dict(own)
    if rank == 0:
        log.info(
            "warm start from %s (step %d)%s; step 0 of a new schedule",
            path,
            state["step"],
            " with its optimizer state" if cfg.run.init_optimizer else "",
        )
    return {"init_from": str(path), "init_step": state["step"], "init_optimizer": cfg.run.init_optimizer}
