"""``train.cuda_graphs=true``: the whole training step captured once as a CUDA graph and replayed.

For a small model the GPU finishes each kernel before the host has launched the next one: the step
costs what Python and the launches cost. A CUDA graph records the step's kernels (forward, backward,
optimizer) once and replays them with one launch. What that takes, and how it is met here:

- Static memory: the graph reads its input from the same addresses every time, so each batch is
  copied into buffers cloned from the first one (``_Inputs``); a batch of another shape, dtype or
  structure stops training with one line naming both shapes (the loader never makes a ragged batch:
  an epoch's tail is dropped, so only a Dataset whose samples change size can).
- A capturable optimizer: the runtime's fused Adam/AdamW/SGD keeps its step count on the device;
  its groups are marked ``capturable`` and the learning rate is a device tensor while it is
  captured, so the schedule can change it between replays: the scheduler still steps on the host,
  as without graphs, and writes the new rate into that tensor with one fill (a launch, no copy, no
  sync) before each replay. The optimizer's state dict keeps plain float rates, as without graphs.
- Warm-up and exact resume: capture needs a few eager steps first (on a side stream, as torch
  documents), which would move the weights. The weights, buffers, optimizer state and RNG streams are
  saved before and written back in place after the capture (a fresh optimizer's lazily made state is
  zeroed, which Adam and SGD treat exactly as their first step): the first replay continues from
  exactly the state the run was at, and the state the checkpoint holds is the one the graph updates.
  A resumed run captures again from its restored state, so stop-and-resume stays bit-identical
  (with ``train.deterministic=true``, as without graphs).
- Only the learning rate is fed to the graph: a schedule that changes any other hyperparameter of an
  optimizer group (betas, momentum, weight decay) after the capture would be ignored by the replayed
  step, so the first replay after such a change stops training with one line (``GraphedStep``).
- ``training_step`` runs only at the warm-up and the capture (``WARMUP_STEPS`` + 1 calls a launch),
  never again: state a task keeps beside the model would stop counting (Python values) or take the
  warm-up's extra updates and miss every replay's (device tensors, an EMA). A task with state of its
  own (it overrides ``state_dict``) is refused before anything starts (``check``). docs/gpu.md lists
  what cannot be detected (a task's own CUDA generator, device state a task keeps without saying).
- Nothing in the graph may need the host: a ``training_step`` that reads a value (``.item()``, a
  Python ``if`` on a tensor, boolean-mask indexing) cannot be captured; the capture error is turned
  into one line naming the task's line (``GraphError``).

Why ``torch.cuda.CUDAGraph`` and not ``torch.compile(mode="reduce-overhead")``: the runtime owns the
whole step (the task's loss, backward, the optimizer and the schedule), which is exactly one graph;
compile would add minutes of compilation at every launch and requeue, recompile on a new shape
instead of refusing it, and hide what broke behind its own fallbacks. docs/gpu.md.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ddp_slurm import errors
from ddp_slurm.config import Config, ConfigError
from ddp_slurm.train import rng

WARMUP_STEPS = 3  # eager steps on a side stream before the capture (torch's documented pattern uses 3)
CAPTURABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


class GraphError(errors.Error):
    """The step cannot run as a CUDA graph; the message is one line saying what broke and what to do."""


def check(cfg: Config, strategy: Any, world_size: int, cuda: bool, task_cls: type | None = None) -> None:
    """Refusals known before anything starts (ConfigError: exit 2, nothing created). ``strategy``: the
    run's (``strategy.Strategy``), which says whether its step can be captured; ``task_cls``: the task's
    class, refused when it keeps state of its own."""
    if not cfg.train.cuda_graphs:
        return
    if task_cls is not None and _keeps_state(task_cls):
        raise ConfigError(
            f"train.cuda_graphs=true calls {task_cls.__name__}.training_step only to warm up and capture "
            f"(about {WARMUP_STEPS + 1} times a launch), so state the task keeps (it overrides state_dict) "
            "would stop counting or count the warm-up, and not resume exactly: set train.cuda_graphs=false"
        )
    # What the captured step does not do (checked first: these hold on any machine)
    others = {
        f"dist.strategy={strategy.name}": not strategy.captures_graphs,
        f"train.accumulate={cfg.train.accumulate}": cfg.train.accumulate > 1,
        f"train.micro_batch_size={cfg.train.micro_batch_size}": cfg.train.micro_batch_size is not None,
        f"train.grad_clip={cfg.train.grad_clip}": cfg.train.grad_clip is not None,
        "train.activation_checkpoint=true": cfg.train.activation_checkpoint,
        "train.precision=fp16": cfg.train.precision == "fp16",  # the captured step has no gradient scaler
        # a rollback restores the optimizer's state in place of the tensors the captured graph points at
        f"guard.rollbacks={cfg.guard.rollbacks}": cfg.guard.rollbacks > 0,
    }
    clash = [key for key, on in others.items() if on]
    if clash:
        raise ConfigError(
            f"train.cuda_graphs=true captures a plain DDP step, not one with {' and '.join(clash)}: "
            "set train.cuda_graphs=false, or leave those at their defaults"
        )
    if not cuda:
        raise ConfigError(
            "train.cuda_graphs=true needs a CUDA GPU and torch sees none here: set train.cuda_graphs=false "
            "(CUDA graphs replay GPU kernels; on CPU there is nothing to capture)"
        )
    if world_size > 1:
        raise ConfigError(
            f"train.cuda_graphs=true trains one rank (world size 1) in this version, not {world_size}: "
            "set train.cuda_graphs=false for multi-rank runs"
        )


def _keeps_state(task_cls: type) -> bool:
    """Whether the task class overrides ``Task.state_dict`` (state of its own beyond the model)."""
    from ddp_slurm.train.task import Task

    return getattr(task_cls, "state_dict", Task.state_dict) is not Task.state_dict


def make_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    loss_of: Callable[[nn.Module, Any], torch.Tensor],
    device: torch.device,
    precision: str = "fp32",
) -> Callable[[Any], torch.Tensor]:
    """``step(batch) -> loss`` as ``step.make_step`` makes it, captured at the first call and replayed."""
    if not isinstance(optimizer, CAPTURABLE) or not all(g.get("fused") for g in optimizer.param_groups):
        raise GraphError(
            f"train.cuda_graphs=true needs the runtime's fused optimizer (train.optimizer adam, adamw or sgd), "
            f"and the task configures {type(optimizer).__name__} without fused=True: return None from "
            "configure_optimizer, or set train.cuda_graphs=false"
        )
    return GraphedStep(model, optimizer, scheduler, loss_of, device, precision)


class GraphedStep:
    """The captured step; the scheduler steps on the host after each replay, as in ``step.make_step``."""

    def __init__(self, model, optimizer, scheduler, loss_of, device: torch.device, precision: str) -> None:
        self.model, self.optimizer, self.scheduler, self.loss_of = model, optimizer, scheduler, loss_of
        self.device = device
        # autocast's weight cache must be off inside a graph (torch's CUDA graphs notes)
        self.cast = (
            torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)
            if precision == "bf16"
            else contextlib.nullcontext()
        )
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: _Inputs | None = None
        self.lrs: list[torch.Tensor] = []
        self.loss: torch.Tensor | None = None
        self.fixed: list[tuple[int, str, Any]] = []  # (group, key, value) the captured step keeps

    def __call__(self, batch: Any) -> torch.Tensor:
        if self.graph is None:
            self._capture(batch)
        assert self.graph is not None and self.inputs is not None and self.loss is not None
        self.inputs.fill(batch)
        for lr, group in zip(self.lrs, self.optimizer.param_groups):
            lr.fill_(group["lr"])  # the schedule's current rate: a kernel argument, not a copy
        self.graph.replay()
        self.scheduler.step()
        groups = self.optimizer.param_groups
        for index, key, value in self.fixed:  # a few host-side comparisons: no device work
            if not _same(groups[index][key], value):
                raise GraphError(
                    f"train.cuda_graphs=true: the schedule changed {key} of parameter group {index} "
                    f"({value!r} -> {groups[index][key]!r}) after the capture, and the captured optimizer step "
                    "keeps the value it was captured with (only the learning rate is fed to the graph): "
                    "schedule only the learning rate, or set train.cuda_graphs=false"
                )
        return self.loss.clone()  # the graph overwrites its output at the next replay

    def _eager(self, batch: Any) -> torch.Tensor:
        with self.cast:
            loss = self.loss_of(self.model, batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss

    def _capture(self, batch: Any) -> None:
        self.inputs = _Inputs(batch, self.device)
        model, optimizer = self.model, self.optimizer
        weights = [*model.parameters(), *model.buffers()]
        saved_weights = [t.detach().clone() for t in weights]
        saved_state = {p: {k: _clone(v) for k, v in s.items()} for p, s in optimizer.state.items()}
        saved_rng = rng.capture(cuda=True)
        rates = [g["lr"] for g in optimizer.param_groups]
        self.lrs = [torch.tensor(float(r), dtype=torch.float32, device=self.device) for r in rates]
        for group, lr in zip(optimizer.param_groups, self.lrs):
            group["lr"], group["capturable"] = lr, True
        optimizer._warned_capturable_if_run_uncaptured = True  # the warm-up runs uncaptured on purpose
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_STEPS):
                    self._eager(self.inputs.static)
            torch.cuda.current_stream(self.device).wait_stream(side)
            optimizer.zero_grad(set_to_none=True)  # backward inside the capture makes the graph's own grads
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    with self.cast:
                        loss = self.loss_of(model, self.inputs.static)
                    loss.backward()
                    optimizer.step()
            except Exception as exc:
                raise GraphError(explain(exc, self.loss_of)) from exc
        finally:
            for group, rate in zip(optimizer.param_groups, rates):
                group["lr"] = rate  # the schedule and the checkpoint keep plain floats
        with torch.no_grad():  # back to the state before the warm-up, in the memory the graph uses
            for t, saved in zip(weights, saved_weights):
                t.copy_(saved)
            for p, state in optimizer.state.items():
                before = saved_state.get(p, {})
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and key in before:
                        value.copy_(before[key])
                    elif isinstance(value, torch.Tensor):  # made by the warm-up: zero is Adam's and SGD's start
                        value.zero_()
        rng.restore(saved_rng)
        self.loss, self.graph = loss.detach(), graph
        self.fixed = fixed_hyperparameters(optimizer.param_groups)


def fixed_hyperparameters(groups: list[dict[str, Any]]) -> list[tuple[int, str, Any]]:
    """``(group index, key, value)`` of every optimizer hyperparameter a captured step keeps as it was
    captured: all but ``params`` and ``lr`` (fed to the graph before each replay)."""
    return [
        (i, key, value) for i, group in enumerate(groups) for key, value in group.items() if key not in ("params", "lr")
    ]


def _same(now: Any, captured: Any) -> bool:
    """Whether a group's hyperparameter is still the captured one: the same object, or an equal plain
    value (a tensor is compared by identity only: the graph reads it in place, and comparing values
    would wait for the device)."""
    if now is captured:
        return True
    if isinstance(now, torch.Tensor) or isinstance(captured, torch.Tensor):
        return False
    return bool(now == captured)


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


class _Inputs:
    """The graph's input buffers: a copy of the first batch's structure; each batch is copied in."""

    def __init__(self, batch: Any, device: torch.device) -> None:
        self.static = _map(batch, lambda t, path: _on_device(t, path, device).clone())
        self.layout = _layout(batch)

    def fill(self, batch: Any) -> None:
        layout = _layout(batch)
        if layout != self.layout:
            raise GraphError(
                f"train.cuda_graphs=true: this batch is {_describe(layout)} and the captured step takes "
                f"{_describe(self.layout)}: a graph replays fixed shapes, so every batch must have the same "
                "(a Dataset whose samples change size cannot be graphed): set train.cuda_graphs=false"
            )
        _copy(self.static, batch)


def _map(batch: Any, fn: Callable[[torch.Tensor, str], torch.Tensor], path: str = "batch") -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch, path)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map(b, fn, f"{path}[{i}]") for i, b in enumerate(batch))
    if isinstance(batch, dict):
        return {k: _map(v, fn, f"{path}[{k!r}]") for k, v in batch.items()}
    raise GraphError(
        f"train.cuda_graphs=true: {path} is a {type(batch).__name__}, and a captured step would replay the "
        "first batch's value forever: batches may hold only tensors (in tuples, lists, dicts); "
        "set train.cuda_graphs=false"
    )


def _on_device(t: torch.Tensor, path: str, device: torch.device) -> torch.Tensor:
    if t.device != device:
        raise GraphError(f"train.cuda_graphs=true: {path} is on {t.device}, not {device}: set train.cuda_graphs=false")
    return t


def _layout(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return (tuple(batch.shape), batch.dtype)
    if isinstance(batch, (list, tuple)):
        return tuple(_layout(b) for b in batch)
    if isinstance(batch, dict):
        return {k: _layout(v) for k, v in batch.items()}
    return type(batch).__name__


def _describe(layout: Any) -> str:
    if isinstance(layout, tuple) and len(layout) == 2 and isinstance(layout[1], torch.dtype):
        return f"{list(layout[0])} {str(layout[1]).removeprefix('torch.')}"
    if isinstance(layout, tuple):
        return "(" + ", ".join(_describe(x) for x in layout) + ")"
    if isinstance(layout, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in layout.items()) + "}"
    return str(layout)


def _copy(static: Any, batch: Any) -> None:
    if isinstance(static, torch.Tensor):
        static.copy_(batch, non_blocking=True)
    elif isinstance(static, dict):
        for key, value in static.items():
            _copy(value, batch[key])
    else:
        for s, b in zip(static, batch):
            _copy(s, b)


def explain(exc: BaseException, loss_of: Callable[..., Any]) -> str:
    """A failed capture in one line: where in the task's code, what kind of thing breaks a capture, and
    torch's own words."""
    code = getattr(loss_of, "__func__", loss_of).__code__.co_filename
    chain: list[BaseException] = []
    while exc is not None and exc not in chain:  # a failed capture's own error has the task's as its context
        chain.append(exc)
        exc = exc.__context__  # type: ignore[assignment]
    where, origin = "", chain[0]
    for candidate in reversed(chain):  # the innermost first: the error the task's code raised
        frames = [f for f in traceback.extract_tb(candidate.__traceback__) if f.filename == code]
        if frames:
            f, origin = frames[-1], candidate
            where = f" at {f.filename}:{f.lineno} ({(f.line or '').strip()})"
            break
    text = str(origin).strip()
    said = text.splitlines()[0] if text else type(origin).__name__
    return (
        f"train.cuda_graphs=true: the training step cannot be captured as a CUDA graph{where}: it needs a "
        "value on the host during the step (.item(), .cpu(), .tolist(), print of a tensor, a Python if on a "
        "tensor, boolean-mask indexing, nonzero) or branches on the data; make training_step device-only, "
        f"or set train.cuda_graphs=false (torch: {said})"
    )
