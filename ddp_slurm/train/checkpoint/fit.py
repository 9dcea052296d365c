"""Does a checkpoint fit this run? Checked before anything of it is loaded into the run's objects.

A file can pass its seal and the run's config check and still not fit: the task's
``configure_optimizer`` was edited between two requeues (other parameter groups, another optimizer),
an optimizer state has the wrong shape (the fused kernels then read out of bounds: a segfault), the
scheduler state is another schedule's, or the position, RNG streams or best metric are missing or
garbage (written by another program or version). Loading such a file crashes every relaunch, and a
requeued job loops. ``fits(template)`` is an ``accept`` for ``format.latest``: a file that does not fit
raises ``DoesNotFit`` and is skipped like a corrupt one; when none fits, the run stops in one line
(exit 2) naming the file and what does not fit.

The template is the run's own structure, built on the meta device (no memory, no data): the model,
and the optimizer and scheduler the task would build for it. A task whose optimizer cannot be built on
the meta device gets the position, RNG and model checks only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ddp_slurm.train.optim import make_optimizer, make_scheduler

# Optimizer hyperparameters that come and go with torch versions and kernels: not a sign of another optimizer.
_VERSION_FLAGS = {"foreach", "fused", "capturable", "differentiable", "maximize", "decoupled_weight_decay"}
# torch optimizers whose per-parameter state is not the parameter's shape (factored or history based).
_NOT_ELEMENTWISE = {"Adafactor", "LBFGS", "SparseAdam"}


class DoesNotFit(ValueError):
    """The checkpoint is whole but not of this run's structure: skipped like a corrupt one."""


@dataclass(frozen=True)
class Template:
    """The run's structure: parameter shapes per optimizer group, group hyperparameter names, whether the
    optimizer keeps element-wise state, the scheduler's state keys. None: unknown (not checked)."""

    groups: list[tuple[list[tuple[int, ...]], set[str]]] | None
    elementwise: bool
    scheduler_keys: set[str] | None


def template(
    build_model: Callable[[], torch.nn.Module],
    build_optimizer: Callable[[torch.nn.Module], Any],
    build_scheduler: Callable[[Any], Any],
) -> Template:
    """The template of a run, from how it builds its model, optimizer and scheduler (on the meta device)."""
    try:
        with torch.device("meta"):
            model = build_model()
            optimizer = build_optimizer(model)
            scheduler = build_scheduler(optimizer)
    except Exception:  # a task's optimizer that needs real tensors: those parts are not checked
        return Template(None, False, None)
    groups = [([tuple(p.shape) for p in g["params"]], set(g) - {"params"}) for g in optimizer.param_groups]
    base = next((c for c in type(optimizer).__mro__ if c.__module__.startswith("torch.optim")), None)
    elementwise = base is not None and base.__name__ not in _NOT_ELEMENTWISE
    return Template(groups, elementwise, _public(scheduler.state_dict()))


def _public(state: dict[str, Any]) -> set[str]:
    return {k for k in state if not k.startswith("_") and k != "verbose"}


def fits(run: Template) -> Callable[[dict[str, Any]], None]:
    """An ``accept`` for ``format.latest``: DoesNotFit names what does not fit."""

    def accept(state: dict[str, Any]) -> None:
        _position(state)
        _rng(state.get("rng"))
        # A sharded folder's commit record (``model_shapes``) holds no optimizer: it lives in the shards,
        # which DCP's load checks against the live optimizer's own state dict.
        if run.groups is not None and "model_shapes" not in state:
            _optimizer(state.get("optimizer"), run)
        if run.scheduler_keys is not None:
            sched = state.get("scheduler")
            if not isinstance(sched, dict):
                raise DoesNotFit("its scheduler state is not a mapping")
            if _public(sched) != run.scheduler_keys:
                raise DoesNotFit(
                    f"its scheduler state is another schedule's (keys {sorted(_public(sched))[:4]}, this run's "
                    f"{sorted(run.scheduler_keys)[:4]})"
                )

    return accept


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _position(state: dict[str, Any]) -> None:
    if state.get("format", 1) < 2:  # the earliest layout is upgraded on load (state.upgrade)
        return
    for key in ("step", "epoch", "step_in_epoch"):
        if not _int(state.get(key)):
            raise DoesNotFit(f"its {key} is missing or not a count ({state.get(key)!r:.40})")
    if state["step_in_epoch"] > state["step"]:
        raise DoesNotFit(f"its step_in_epoch {state['step_in_epoch']} is beyond its step {state['step']}")
    elapsed = state.get("elapsed_s")
    if not isinstance(elapsed, (int, float)) or isinstance(elapsed, bool) or not 0 <= elapsed < math.inf:
        raise DoesNotFit(f"its elapsed_s is missing or not a time ({elapsed!r:.40})")
    best = state.get("best")
    if best is not None and (not isinstance(best, (int, float)) or isinstance(best, bool) or math.isnan(best)):
        raise DoesNotFit(f"its best metric is not a number ({best!r:.40})")


def _rng(rngs: Any) -> None:
    torch_size = torch.get_rng_state().numel()
    if not isinstance(rngs, list) or not rngs:
        raise DoesNotFit("its RNG streams are missing")
    for rank, rng in enumerate(rngs):
        where = f"its RNG streams of rank {rank}"
        if not isinstance(rng, dict):
            raise DoesNotFit(f"{where} are not a mapping")
        py = rng.get("python")
        if not (isinstance(py, tuple) and len(py) == 3 and isinstance(py[1], tuple) and len(py[1]) == 625):
            raise DoesNotFit(f"{where}: the python state is not one")
        t = rng.get("torch")
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.numel() == torch_size):
            raise DoesNotFit(f"{where}: the torch state is not one")
        np_state = rng.get("numpy")
        if np_state is not None and not (
            isinstance(np_state, list)
            and len(np_state) == 5
            and isinstance(np_state[1], torch.Tensor)
            and np_state[1].numel() == 624
        ):
            raise DoesNotFit(f"{where}: the numpy state is not one")
        cuda = rng.get("cuda")
        if cuda is not None and not (isinstance(cuda, torch.Tensor) and cuda.dtype == torch.uint8):
            raise DoesNotFit(f"{where}: the CUDA state is not one")


def _optimizer(saved: Any, run: Template) -> None:
    assert run.groups is not None
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
        raise DoesNotFit("its optimizer state is not one")
    groups, state = saved["param_groups"], saved.get("state")
    if not isinstance(state, dict) or len(groups) != len(run.groups):
        raise DoesNotFit(f"its optimizer has {len(groups)} parameter group(s), this run's {len(run.groups)}")
    shapes: dict[Any, tuple[int, ...]] = {}
    for i, (group, (want_shapes, want_keys)) in enumerate(zip(groups, run.groups)):
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            raise DoesNotFit(f"its optimizer's parameter group {i} is not one")
        if len(group["params"]) != len(want_shapes):
            raise DoesNotFit(
                f"its optimizer's parameter group {i} has {len(group['params'])} parameters, this run's "
                f"{len(want_shapes)} (configure_optimizer changed?)"
            )
        keys = set(group) - {"params"}
        if (keys ^ want_keys) - _VERSION_FLAGS:
            raise DoesNotFit(
                f"another optimizer (its settings {sorted(keys - want_keys)}, this run's {sorted(want_keys - keys)})"
            )
        shapes.update(zip(group["params"], want_shapes))
    for index, entry in state.items():
        if index not in shapes or not isinstance(entry, dict):
            raise DoesNotFit(f"its optimizer state names parameter {index!r:.20}, which the run has not")
        for name, value in entry.items():
            if not isinstance(value, torch.Tensor):
                continue
            if run.elementwise and value.dim() > 0 and tuple(value.shape) != shapes[index]:
                raise DoesNotFit(
                    f"its optimizer state {name} of parameter {index} has shape {list(value.shape)}, "
                    f"the parameter {list(shapes[index])}"
                )
            if value.is_floating_point() and not torch.isfinite(value).all():
                raise DoesNotFit(f"its optimizer state {name} of parameter {index} is not finite")


def of_task(task: Any, train: Any) -> Template:
    """The template of a task's run: its model, and its optimizer and scheduler or the runtime's defaults
    (``train``: the config's ``train`` section)."""

    meta = torch.device("meta")
    return template(
        task.build_model,
        lambda model: task.configure_optimizer(model) or make_optimizer(train, model.parameters(), meta),
        lambda opt: task.configure_scheduler(opt, 2) or make_scheduler(train, opt, 2),
    )
