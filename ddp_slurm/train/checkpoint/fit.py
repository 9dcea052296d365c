"""Does a checkpoint fit this run? Checked before anything of it is loaded into the run's objects.

A checkpoint can pass its seal and the run's config check and still not fit: the task's
``configure_optimizer`` was edited between two requeues (other parameter groups, another optimizer),
an optimizer state has the wrong shape (the fused kernels then read out of bounds: a segfault), or the
scheduler state is another schedule's. Loading such a checkpoint crashes every relaunch, and a
requeued job loops. ``check(template, layout, scheduler)`` raises ``DoesNotFit``, and the checkpoint is
skipped like a corrupt one; when none fits, the run stops in one line (exit 2) naming it. A warm start
with ``run.init_optimizer`` takes the same check (a source of another grouping segfaulted there too).

Both backends are compared by one rule: the saved optimizer is described as a ``Layout`` (its groups:
which parameters, which hyperparameters; its state: a shape per parameter and entry), taken from the
whole file's optimizer state dict (parameters by position) or from a sharded checkpoint's commit
record (parameters by name, as ``get_state_dict`` keys them), and compared with the run's ``Template``.

The template is the run's own structure, built on the meta device (no memory, no data): the model,
and the optimizer and scheduler the task would build for it. A task whose optimizer cannot be built on
the meta device gets the schedule check only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ddp_slurm.train.optim import make_optimizer, make_scheduler

# Optimizer hyperparameters that come and go with torch versions and kernels: not a sign of another optimizer.
_VERSION_FLAGS = {"foreach", "fused", "capturable", "differentiable", "maximize", "decoupled_weight_decay"}
# torch optimizers whose per-parameter state is not the parameter's shape (factored or history based).
_NOT_ELEMENTWISE = {"Adafactor", "LBFGS", "SparseAdam"}

Shape = tuple[int, ...]


class DoesNotFit(ValueError):
    """The checkpoint is whole but not of this run's structure: skipped like a corrupt one."""


@dataclass(frozen=True)
class Template:
    """The run's structure: per optimizer group its parameters (name, shape) and hyperparameter names;
    whether the optimizer keeps element-wise state; the scheduler's state keys. None: unknown."""

    groups: list[tuple[list[tuple[str, Shape]], set[str]]] | None
    elementwise: bool
    scheduler_keys: set[str] | None


@dataclass(frozen=True)
class Layout:
    """A saved optimizer's structure: per group its parameters (positions or names) and hyperparameter
    names; per parameter, each state entry's shape (None: a plain value)."""

    groups: list[tuple[list[Any], set[str]]]
    state: dict[Any, dict[str, Shape | None]]


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
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [
        ([(names.get(id(p), "?"), tuple(p.shape)) for p in g["params"]], set(g) - {"params"})
        for g in optimizer.param_groups
    ]
    base = next((c for c in type(optimizer).__mro__ if c.__module__.startswith("torch.optim")), None)
    elementwise = base is not None and base.__name__ not in _NOT_ELEMENTWISE
    return Template(groups, elementwise, _public(scheduler.state_dict()))


def of_task(task: Any, train: Any) -> Template:
    """The template of a task's run: its model, and its optimizer and scheduler or the runtime's defaults
    (``train``: the config's ``train`` section)."""
    meta = torch.device("meta")
    return template(
        task.build_model,
        lambda model: task.configure_optimizer(model) or make_optimizer(train, model.parameters(), meta),
        lambda opt: task.configure_scheduler(opt, 2) or make_scheduler(train, opt, 2),
    )


def _public(state: dict[str, Any]) -> set[str]:
    return {k for k in state if not k.startswith("_") and k != "verbose"}


def layout_of_state_dict(saved: Any) -> Layout:
    """The layout of a whole optimizer state dict (parameters by position); DoesNotFit if it is not one,
    or if a floating-point state entry is not finite."""
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
        raise DoesNotFit("its optimizer state is not one")
    groups, state = saved["param_groups"], saved.get("state")
    if not isinstance(state, dict):
        raise DoesNotFit("its optimizer state is not one")
    out_groups = []
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            raise DoesNotFit(f"its optimizer's parameter group {i} is not one")
        out_groups.append((list(group["params"]), set(group) - {"params"}))
    out_state: dict[Any, dict[str, Shape | None]] = {}
    for index, entry in state.items():
        if not isinstance(entry, dict):
            raise DoesNotFit(f"its optimizer state of parameter {index!r:.20} is not a mapping")
        shapes: dict[str, Shape | None] = {}
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                if value.is_floating_point() and not torch.isfinite(value).all():
                    raise DoesNotFit(f"its optimizer state {name} of parameter {index} is not finite")
                shapes[str(name)] = tuple(value.shape)
            else:
                shapes[str(name)] = None
        out_state[index] = shapes
    return Layout(out_groups, out_state)


def layout_of_record(saved: Any) -> Layout:
    """The layout a sharded checkpoint's commit records (``optimizer_layout``: parameters by name);
    DoesNotFit when it is not one."""
    if (
        not isinstance(saved, dict)
        or not isinstance(saved.get("groups"), list)
        or not isinstance(saved.get("state"), dict)
    ):
        raise DoesNotFit("its optimizer layout is not one")
    groups = []
    for i, group in enumerate(saved["groups"]):
        ok = isinstance(group, dict) and isinstance(group.get("params"), list) and isinstance(group.get("keys"), list)
        if not ok or not all(isinstance(p, str) for p in group["params"]):
            raise DoesNotFit(f"its optimizer's parameter group {i} is not one")
        groups.append((list(group["params"]), {str(k) for k in group["keys"]}))
    state: dict[Any, dict[str, Shape | None]] = {}
    for name, entry in saved["state"].items():
        if not isinstance(entry, dict):
            raise DoesNotFit(f"its optimizer state of parameter {name!r:.40} is not a mapping")
        state[name] = {}
        for key, shape in entry.items():
            if shape is not None and not (
                isinstance(shape, (list, tuple)) and all(isinstance(d, int) and d >= 0 for d in shape)
            ):
                raise DoesNotFit(f"its optimizer state {key!r:.20} of parameter {name!r:.40} has no shape")
            state[name][str(key)] = None if shape is None else tuple(shape)
    return Layout(groups, state)


def check(run: Template, optimizer: Layout | None, scheduler: Any) -> None:
    """DoesNotFit naming what of a checkpoint's optimizer (``None``: not checked) or scheduler state does
    not fit the run's template."""
    if run.groups is not None and optimizer is not None:
        _optimizer(optimizer, run)
    if run.scheduler_keys is not None:
        if not isinstance(scheduler, dict):
            raise DoesNotFit("its scheduler state is not a mapping")
        if _public(scheduler) != run.scheduler_keys:
            raise DoesNotFit(
                f"its scheduler state is another schedule's (keys {sorted(_public(scheduler))[:4]}, this run's "
                f"{sorted(run.scheduler_keys)[:4]})"
            )


def _optimizer(saved: Layout, run: Template) -> None:
    assert run.groups is not None
    if len(saved.groups) != len(run.groups):
        raise DoesNotFit(f"its optimizer has {len(saved.groups)} parameter group(s), this run's {len(run.groups)}")
    shapes: dict[Any, Shape] = {}
    for i, ((params, keys), (want, want_keys)) in enumerate(zip(saved.groups, run.groups)):
        if len(params) != len(want):
            raise DoesNotFit(
                f"its optimizer's parameter group {i} has {len(params)} parameters, this run's "
                f"{len(want)} (configure_optimizer changed?)"
            )
        named = [p for p in params if isinstance(p, str)]
        if named and named != [name for name, _ in want]:
            other = next(p for p, (name, _) in zip(params, want) if p != name)
            raise DoesNotFit(
                f"its optimizer's parameter group {i} holds {other!r:.60}, where this run's holds others "
                "(configure_optimizer changed?)"
            )
        if (keys ^ want_keys) - _VERSION_FLAGS:
            raise DoesNotFit(
                f"another optimizer (its settings {sorted(keys - want_keys)}, this run's {sorted(want_keys - keys)})"
            )
        shapes.update(zip(params, (shape for _, shape in want)))
    for param, entry in saved.state.items():
        if param not in shapes:
            raise DoesNotFit(f"its optimizer state names parameter {param!r:.40}, which the run has not")
        for name, shape in entry.items():
            if run.elementwise and shape is not None and len(shape) > 0 and shape != shapes[param]:
                raise DoesNotFit(
                    f"its optimizer state {name} of parameter {param} has shape {list(shape)}, "
                    f"the parameter {list(shapes[param])}"
                )
