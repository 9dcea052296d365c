"""Evaluation at the end of an epoch: every test sample counted once over all ranks, whatever the world
size (``step.evaluate``), laid out as the strategy needs (FSDP pads the ranks with fewer batches, since
every forward of a sharded model is a collective); the task's ``best_metric`` tracked in the position
(so a checkpoint keeps it); one ``eval`` line in metrics.jsonl and one log line."""

from __future__ import annotations

import logging

from ddp_slurm.train import loader, logs, step
from ddp_slurm.train.hooks import Training

log = logging.getLogger("ddp_slurm")


def evaluate(t: Training) -> None:
    """Evaluate the model after this step (a collective), record it, log one line."""
    run, pos, tc = t.run, t.run.pos, t.run.cfg.train
    summary = f"epoch {pos.epoch + 1}/{tc.epochs}: train loss " + (f"{t.loss:.4f}" if t.loss is not None else "n/a")
    data = run.eval_data
    if data is not None:
        batches = loader.eval_batches(data, run.device, run.rank, run.world_size, tc.eval_batch_size, tc.workers)
        batches = run.strategy.eval_batches(batches, data, run.device, run.rank, run.world_size, tc.eval_batch_size)
        values, samples = step.evaluate(
            run.model, batches, run.task.eval_step, run.device, run.world_size, tc.precision, run.groups
        )
        pos.improve(values.get(run.task.best_metric) if run.task.best_metric else None, run.task.higher_is_better)
        t.metrics.write("eval", pos.step, pos.epoch, t.elapsed(), test_samples=samples, **values)
        shown = ", ".join(logs.metric(k, v, run.task.percent_metrics) for k, v in values.items())
        summary += f", test {shown} ({samples} samples)"
    log.info("%s, %s samples/s", summary, f"{t.rate:,.0f}" if t.rate else "n/a")
