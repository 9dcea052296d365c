"""Evaluation: at the end of each epoch and every ``eval.every_steps`` steps, every test sample counted
once over all ranks, whatever the world size (``step.evaluate``), laid out as the strategy needs (FSDP pads
the ranks with fewer batches, since every forward of a sharded model is a collective).

- A stop signal is honoured at each evaluation batch (``EvalVote``): the ranks agree on it before every
  batch, and a stop abandons the evaluation at once, writes no ``eval`` line and leaves the step's
  checkpoint marked unevaluated (``Position.evaluated``): the resumed run evaluates that step first.
- The evaluation runs on RNG streams of its own (a DataLoader's workers draw their seed from the global
  stream): training's streams are the same whether an evaluation ran, was abandoned or is redone.
- The task's ``best_metric`` is tracked in the position (so a checkpoint keeps its value, its step and
  early stopping's count); ``eval.patience`` evaluations in a row without an improvement of more than
  ``eval.min_delta`` end the run (``early_stop`` in metrics.jsonl, one log line).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from ddp_slurm.train import loader, logs, rng, step
from ddp_slurm.train.hooks import Training
from ddp_slurm.train.signals import StopFlag

log = logging.getLogger("ddp_slurm")

# What an evaluation came to (``Evaluations.run``)
NONE, DONE, IMPROVED, STOPPED, EARLY = "none", "done", "improved", "stopped", "early"


class EvalVote:
    """The ranks' agreement, before each evaluation batch, on whether to go on: a stop signal on any rank
    abandons the evaluation on every rank at the same batch. One MAX all-reduce of (requeue, terminate,
    has a batch) per batch; a rank whose shard ran out (DDP shards differ by a batch at most) keeps voting
    until no rank has a batch left, so every rank makes the same collectives. With one rank the flags are
    read directly.

    The flags are host values, so they travel as a host tensor on the host group (``group``): no copy to
    the device and no wait for it, so the vote overlaps the batch the device is still computing (on the
    training group each vote would copy the flags over and wait for the whole queue to read them back)."""

    def __init__(self, stop: StopFlag, world_size: int, group: Any) -> None:
        self.stop, self.world_size, self.group = stop, world_size, group
        self.requeue = self.terminate = False

    def __call__(self, has_batch: bool) -> bool | None:
        """True: evaluate this batch; False: no rank has a batch left; None: stop (abandon)."""
        flags = (float(self.stop.requeue_requested), float(self.stop.terminate_requested), float(has_batch))
        if self.world_size > 1:
            agreed = torch.tensor(flags)  # host memory
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
            flags = tuple(agreed.tolist())
        self.requeue, self.terminate = flags[0] > 0, flags[1] > 0
        if self.requeue or self.terminate:
            return None
        return flags[2] > 0


class Evaluations:
    """The evaluations of one launch: when they are due, running one, what it means for the run."""

    def __init__(self, t: Training, stop: StopFlag) -> None:
        run = t.run
        self.t, self.section = t, run.cfg.eval
        self.vote = EvalVote(stop, run.world_size, run.groups.host)

    def due(self, end_of_epoch: bool) -> bool:
        """Whether the state after this step is evaluated: at an epoch's end, and every ``eval.every_steps``."""
        every, step_now = self.section.every_steps, self.t.run.pos.step
        scheduled = bool(every and step_now % every == 0) and self.t.run.eval_data is not None
        return end_of_epoch or scheduled

    def pending(self, end_of_epoch: bool) -> bool:
        """A resumed run: its checkpoint's step was due an evaluation that a stop abandoned."""
        pos = self.t.run.pos
        return pos.step > 0 and pos.evaluated != pos.step and self.due(end_of_epoch)

    def run(self, end_of_epoch: bool) -> str:
        """Evaluate the model after this step when due (a collective); NONE (not due), DONE, IMPROVED (a new
        best: the step's checkpoint is kept as the best), STOPPED (a stop signal: abandoned) or EARLY
        (early stopping ends the run here)."""
        if not self.due(end_of_epoch):
            return NONE
        t = self.t
        run, pos, tc = t.run, t.run.pos, t.run.cfg.train
        where = f"epoch {pos.epoch + 1}/{tc.epochs}" if end_of_epoch else f"step {pos.step}"
        summary = f"{where}: train loss " + (f"{t.loss:.4f}" if t.loss is not None else "n/a")
        data, improved = run.eval_data, False
        if data is not None:
            streams = rng.rng_state(run.device)
            try:
                found = self._evaluate(data)
            finally:
                rng.set_rng_state(streams, run.device)
            if found is None:
                log.info("%s: evaluation abandoned on a stop signal; the resumed run evaluates this step", where)
                return STOPPED
            values, samples = found
            metric = values.get(run.task.best_metric) if run.task.best_metric else None
            improved = pos.improve(metric, run.task.higher_is_better, self.section.min_delta)
            t.metrics.write("eval", pos.step, pos.epoch, t.elapsed(), test_samples=samples, **values)
            shown = ", ".join(logs.metric(k, v, run.task.percent_metrics) for k, v in values.items())
            summary += f", test {shown} ({samples} samples)"
        else:
            pos.evaluated = pos.step
        log.info("%s, %s samples/s", summary, f"{t.rate:,.0f}" if t.rate else "n/a")
        patience = self.section.patience
        if patience is not None and pos.best is not None and pos.stale >= patience:
            self._early_stop(patience)
            return EARLY
        return IMPROVED if improved else DONE

    def _evaluate(self, data: Any) -> tuple[dict[str, float], int] | None:
        run, tc = self.t.run, self.t.run.cfg.train
        batches = loader.eval_batches(data, run.device, run.rank, run.world_size, tc.eval_batch_size, tc.workers)
        batches = run.strategy.eval_batches(batches, data, run.device, run.rank, run.world_size, tc.eval_batch_size)
        return step.evaluate(
            run.model,
            batches,
            run.task.eval_step,
            run.device,
            run.world_size,
            tc.precision,
            groups=run.groups,
            vote=self.vote,
        )

    def _early_stop(self, patience: int) -> None:
        t, pos, name = self.t, self.t.run.pos, self.t.run.task.best_metric
        why = (
            f"no improvement of {name} by more than eval.min_delta={self.section.min_delta:g} in {patience} evaluations"
        )
        t.metrics.write(
            "early_stop", pos.step, pos.epoch, t.elapsed(), reason=why, best=pos.best, best_step=pos.best_step
        )
        log.info(
            "early stop at step %d: %s; best %s at step %s",
            pos.step,
            why,
            logs.metric(name, pos.best, t.run.task.percent_metrics),
            pos.best_step,
        )
