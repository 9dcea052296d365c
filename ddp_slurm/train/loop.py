"""The training loop: one rank's view of a run, for any task. It knows no dataset or model by name.

Read ``_train`` top to bottom: resume or start, then steps until the last one or a stop signal. The
task supplies the model, the data and the loss (``train/task.py``); the step, the DDP wrapper and the
evaluation are in ``step.py``; what a checkpoint holds is in ``state.py``; the batches in ``loader.py``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_slurm.config import Config, ConfigError
from ddp_slurm.dist import allocation, slurm
from ddp_slurm.dist.env import DistEnv
from ddp_slurm.dist.group import on_rank0
from ddp_slurm.dist.watchdog import Watchdog
from ddp_slurm.exitcodes import EXIT_OK, EXIT_REQUEUE_CAP, EXIT_STOPPED
from ddp_slurm.train import checkpoint, determinism, loader, logs, rundir, runname, state, step, tb
from ddp_slurm.train.ckpt_async import AsyncCheckpointer
from ddp_slurm.train.metrics import MetricsWriter
from ddp_slurm.train.precision import check_precision
from ddp_slurm.train.signals import StopFlag
from ddp_slurm.train.task import Context, Task, Tensors

log = logging.getLogger("ddp_slurm")


class NonFiniteLoss(RuntimeError):
    """The loss or the weights became NaN/inf: stop before anything is saved."""


class LossWindow:
    """The training loss averaged over the steps between two log lines, and the rate over them.

    The loss stays on the device while it accumulates: reading it is the one host sync per window.
    """

    def __init__(self, device: torch.device, world_size: int, global_batch: int, step: int) -> None:
        self.sum, self.n, self.world_size, self.global_batch = (
            torch.zeros((), device=device),
            0,
            world_size,
            global_batch,
        )
        self.started, self.first_step = time.monotonic(), step
        self.loss: float | None = None
        self.rate: float | None = None

    def add(self, loss: torch.Tensor) -> None:
        self.sum += loss
        self.n += 1

    def close(self, step: int) -> dict[str, float]:
        """The window's figures for metrics.jsonl: loss (mean over steps and ranks), samples/s, mean step
        time, and how far apart the ranks' step times were ((slowest - fastest) / mean); starts the next
        window."""
        now = time.monotonic()
        steps = max(step - self.first_step, 1)
        mean = self.sum / max(self.n, 1)
        own = torch.tensor([(now - self.started) / steps] * 2, dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(mean)
            mean /= self.world_size
            times = torch.cat([own[:1], -own[1:]]).to(mean.device)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)  # slowest and (negated) fastest rank
            own = times.cpu() * torch.tensor([1.0, -1.0], dtype=torch.float64)
        slowest, fastest = own.tolist()
        self.loss, self.rate = mean.item(), steps * self.global_batch / (now - self.started)
        self.sum.zero_()
        self.n, self.started, self.first_step = 0, now, step
        return {
            "loss": self.loss,
            "samples_per_s": self.rate,
            "step_time_s": (slowest + fastest) / 2,
            "step_time_spread": (slowest - fastest) / max((slowest + fastest) / 2, 1e-12),
        }


def log_placement(env: DistEnv) -> list[str]:
    """Rank 0 logs once which host each rank runs on: the first thing to check when a job misbehaves.
    Returns every rank's host, in rank order."""
    host = socket.gethostname()
    hosts = [host] * env.world_size
    if env.world_size > 1:
        dist.all_gather_object(hosts, host)
    if env.rank == 0:
        log.info("ranks by host (%d ranks, %d hosts): %s", env.world_size, len(set(hosts)), logs.rank_map(hosts))
    return hosts


def train(
    cfg: Config,
    task_cls: type[Task],
    env: DistEnv,
    device: torch.device,
    backend: str,
    stop: StopFlag,
    dog: Watchdog | None = None,
) -> int:
    """Take the run directory (rank 0), then train; returns the exit code. ``dog`` hears of every step."""
    t0 = time.monotonic()
    try:
        check_precision(cfg.train.precision, device)
    except ConfigError as exc:
        raise rundir.UsageError(str(exc)) from None
    settings = determinism.apply(cfg.train.deterministic, device)  # before the first kernel runs
    if settings and env.rank == 0:
        log.info("train.deterministic: %s", ", ".join(settings))
    hosts = log_placement(env)
    try:  # slurm.* keys the allocation ignores (warnings), a --signal training would not catch (exit 2)
        warnings = on_rank0(env, lambda: allocation.check_current(cfg, os.environ))  # rank 0 asks scontrol once
    except ConfigError as exc:
        raise rundir.UsageError(str(exc)) from None
    if env.rank == 0:
        for line in warnings:
            log.warning("%s", line)
    if cfg.run.name is None:  # a new run: rank 0 names it, every rank of this launch uses that name
        cfg.run.name = runname.job_name(cfg, env.slurm_job_ref if env.in_slurm_job else None) or on_rank0(
            env, lambda: runname.new_name(cfg)
        )
    task = task_cls(
        cfg.task_config,
        Context(
            env.rank, env.world_size, env.local_rank, device, cfg.run.seed, cfg.run_dir, cfg.train.global_batch_size
        ),
    )
    lock = rundir.RunLock(cfg.run_dir, shared=cfg.run.shared)
    found: dict[str, Any] = {}

    def take_run_dir() -> Path | None:
        with torch.device("meta"):  # names and shapes only, no memory: what a resumable checkpoint must match
            reference = task.build_model().state_dict()
        latest = rundir.prepare(cfg, lock, reference)
        if latest is None:
            return None
        found["state"] = latest[1]
        return latest[0]

    # checkpoint.async: rank 0 writes in the background, at most one write in flight (ckpt_async.py)
    ckpt = AsyncCheckpointer(
        cfg.run_dir,
        cfg.checkpoint.keep,
        enabled=cfg.checkpoint.async_save,
        shared=cfg.run.shared,
        stop_pending=lambda: stop.requested,  # a stop during a save's wait cancels the write it supersedes
    )
    try:
        path = on_rank0(env, take_run_dir)  # only the path travels: each rank reads the file itself
        resumed = None if path is None else found["state"] if env.rank == 0 else checkpoint.load(path)
        return _train(cfg, task, env, device, backend, stop, resumed, t0, dog, hosts, ckpt)
    finally:
        if ckpt.in_flight:  # leaving on an error: the write in flight still ends whole (or not at all)
            try:
                ckpt.close()
            except checkpoint.CheckpointError as exc:
                log.error("%s", exc)
        lock.release()


def _train(
    cfg: Config,
    task: Task,
    env: DistEnv,
    device: torch.device,
    backend: str,
    stop: StopFlag,
    resumed: dict[str, Any] | None,
    t0: float,
    dog: Watchdog | None,
    hosts: list[str],
    ckpt: AsyncCheckpointer,
) -> int:
    if resumed is not None and resumed["finished"]:
        name, value = task.best_metric, resumed.get("best", resumed.get("best_accuracy"))
        best = f" (best test {logs.metric(name, value)})" if name and value is not None else ""
        log.info("run %s already finished at step %d%s; nothing to do", cfg.run_dir, resumed["step"], best)
        return EXIT_OK
    if env.in_slurm_job and env.restart_count > cfg.slurm.max_requeues:
        log.error(
            "requeue cap reached: restart %d > slurm.max_requeues=%d; not training. Raise the cap or "
            "launch again outside this job to resume",
            env.restart_count,
            cfg.slurm.max_requeues,
        )
        return EXIT_REQUEUE_CAP

    G, ws, tc = cfg.train.global_batch_size, env.world_size, cfg.train
    on_rank0(env, task.prepare_data)  # downloads happen once; the other ranks wait for them
    batches = loader.make_batches(task.train_data(), device, cfg.run.seed, G, env.rank, ws, tc)
    eval_data = task.eval_data()
    if isinstance(eval_data, Tensors):
        eval_data = eval_data.to(device)  # in memory: moved once, like the training tensors
    total_steps = tc.epochs * batches.steps_per_epoch
    total_steps = min(total_steps, tc.max_steps) if tc.max_steps is not None else total_steps

    torch.manual_seed(cfg.run.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    model = task.build_model().to(device)
    optimizer = task.configure_optimizer(model) or step.make_optimizer(tc, model.parameters(), device)
    scheduler = task.configure_scheduler(optimizer, total_steps) or step.make_scheduler(tc, optimizer, total_steps)
    if resumed is not None:
        pos = state.restore(resumed, model, optimizer, scheduler, task, cfg.run.seed, device, env.rank, ws)
    else:
        pos = state.Position()
        state.seed_rank(cfg.run.seed, env.rank, 0, device)  # each rank its own dropout/augmentation stream
    ddp = step.wrap_ddp(model, device, ws, warmup=lambda net: task.training_step(net, batches.first_batch()))
    train_step = step.make_step(ddp, optimizer, scheduler, task.training_step, device, tc.precision)

    board = tb.open_for(cfg, cfg.run_dir, env.rank)  # log.tensorboard: the same records as TensorBoard events
    metrics = MetricsWriter(cfg.run_dir / "metrics.jsonl" if env.rank == 0 else None, cfg.run.shared, sinks=(board,))

    def elapsed() -> float:
        return pos.elapsed_s + time.monotonic() - t0

    def save(finished: bool = False, urgent: bool = False) -> None:
        """Every rank hands rank 0 its RNG streams; rank 0 snapshots the state and writes it (in the
        background with checkpoint.async; ``urgent``: a stop or the end, whose write is waited for next)."""
        snapshot = state.capture(
            model,
            optimizer,
            scheduler,
            task,
            pos,
            finished,
            elapsed(),
            {"config": cfg.to_dict(), "restart_count": env.restart_count},
            device,
            env.rank,
            ws,
        )

        def write() -> None:
            if not all(torch.isfinite(p).all() for p in model.parameters()):
                raise NonFiniteLoss(
                    f"weights are not finite at step {pos.step}: not saving them; "
                    "the last good checkpoint is kept (lower train.lr?)"
                )
            path = ckpt.save(snapshot, urgent=urgent)  # None: handed to the writer, which logs it when durable
            if path is not None:
                log.info("checkpoint %s", path)

        on_rank0(env, write)
        pos.last_saved = pos.step

    metrics.write(
        "start",
        pos.step,
        pos.epoch,
        elapsed(),
        resumed=resumed is not None,
        restart_count=env.restart_count,
        world_size=ws,
        launcher=env.launcher,
        task=cfg.task,
        job_id=env.job_id,
    )
    log.info(
        "%s run %s: world size %d on %d node(s) via %s, backend %s, device %s, %s",
        "resuming" if resumed else "starting",
        cfg.run_dir,
        ws,
        env.num_nodes,
        env.launcher,
        backend,
        device,
        f"from step {pos.step} (restart {env.restart_count})" if resumed else "fresh start",
    )

    progress = logs.Progress(env.rank == 0, tc.log_every_s)
    votes = step.StopVote(stop, ws, device, failed=lambda: ckpt.failed)
    window = LossWindow(device, ws, G, pos.step)
    spe = batches.steps_per_epoch

    def epoch_steps() -> int:  # this epoch's steps for the progress display (train.max_steps may end it early)
        return min(spe, pos.step_in_epoch + total_steps - pos.step)

    epoch_batches = batches.epoch(pos.epoch, pos.step_in_epoch)
    progress.start_epoch(pos.epoch, tc.epochs, epoch_steps(), pos.step_in_epoch)
    requeue, terminate, _ = votes.exchange(None, pos.step, wait=True)  # a signal that came before the first step
    while not (requeue or terminate) and pos.step < total_steps:
        loss = train_step(next(epoch_batches))
        pos.advance()
        if dog is not None:
            dog.progress(pos.step)
        window.add(loss)
        end_of_epoch = pos.step_in_epoch == spe or pos.step == total_steps
        saving = end_of_epoch or bool(cfg.checkpoint.every_steps and pos.step % cfg.checkpoint.every_steps == 0)
        # The ranks agree on stopping one step late, without waiting for each other (step.StopVote);
        # before an evaluation or a save they wait, so that nothing non-finite is evaluated or saved.
        requeue, terminate, bad = votes.exchange(loss, pos.step, wait=saving)
        if votes.failed:  # rank 0's background write failed (disk full, read-only): its one line, every rank
            on_rank0(env, ckpt.wait)
        if bad:
            raise NonFiniteLoss(
                f"{votes.bad} (epoch {pos.epoch + 1}): stopping; nothing non-finite was saved "
                "(lower train.lr and start a new run.name)"
            )
        if pos.step % tc.log_every_steps == 0:
            metrics.write(
                "train",
                pos.step,
                pos.epoch,
                elapsed(),
                **window.close(pos.step),
                world_size=ws,
                lr=scheduler.get_last_lr()[0],
            )
        eta = (total_steps - pos.step) * G / window.rate if window.rate else None
        progress.update(pos.step, pos.epoch, pos.step_in_epoch, epoch_steps(), window.loss, window.rate, eta)

        if end_of_epoch:
            progress.end_epoch()
            evaluate(cfg, task, model, eval_data, env, device, pos, metrics, window, elapsed())
            pos.next_epoch()
            epoch_batches = batches.epoch(pos.epoch, 0)
            save(finished=pos.step >= total_steps, urgent=pos.step >= total_steps)
            if pos.step < total_steps:
                progress.start_epoch(pos.epoch, tc.epochs, epoch_steps(), 0)
        elif saving:
            save()
        if saving:  # a signal that came during the evaluation or the save stops here: this step is on disk
            requeue, terminate, _ = votes.exchange(None, pos.step, wait=True)

    votes.settle()  # the last step's flags, when a signal ended the loop: no collective left in flight
    progress.end_epoch()
    stop.stopping = True  # from here on stop signals are absorbed until the process exits (see signals.py)
    if (requeue or terminate) and pos.step < total_steps:
        return stop_on_signal(cfg, env, pos, requeue and not terminate, save, ckpt, metrics, elapsed())
    if requeue or terminate:  # came during the last step or the final evaluation: the work is done, no requeue
        log.info("stop signal after the last step: the run is finished, its final checkpoint is on disk")
    name = task.best_metric
    on_rank0(env, ckpt.wait)  # the final checkpoint is durable before the run says it ended
    metrics.write("end", pos.step, pos.epoch, elapsed(), **({f"best_{name}": pos.best} if name else {}))
    metrics.close()
    best = f", best test {logs.metric(name, pos.best)}" if name and pos.best is not None else ""
    log.info("finished: %d steps%s, %.1f s; run directory %s", pos.step, best, elapsed(), cfg.run_dir)
    return EXIT_OK


def evaluate(
    cfg: Config,
    task: Task,
    model: torch.nn.Module,
    eval_data: Any,
    env: DistEnv,
    device: torch.device,
    pos: state.Position,
    metrics: MetricsWriter,
    window: LossWindow,
    elapsed: float,
) -> None:
    """End of an epoch: evaluate (each sample once over all ranks), record, log one line."""
    tc = cfg.train
    summary = f"epoch {pos.epoch + 1}/{tc.epochs}: train loss " + (
        f"{window.loss:.4f}" if window.loss is not None else "n/a"
    )
    if eval_data is not None:
        batches = loader.eval_batches(eval_data, device, env.rank, env.world_size, tc.eval_batch_size, tc.workers)
        values, samples = step.evaluate(model, batches, task.eval_step, device, env.world_size, tc.precision)
        pos.improve(values.get(task.best_metric) if task.best_metric else None, task.higher_is_better)
        metrics.write("eval", pos.step, pos.epoch, elapsed, test_samples=samples, **values)
        shown = ", ".join(logs.metric(k, v) for k, v in values.items())
        summary += f", test {shown} ({samples} samples)"
    log.info("%s, %s samples/s", summary, f"{window.rate:,.0f}" if window.rate else "n/a")


def stop_on_signal(
    cfg: Config,
    env: DistEnv,
    pos: state.Position,
    wants_requeue: bool,
    save: Callable[..., None],
    ckpt: AsyncCheckpointer,
    metrics: MetricsWriter,
    elapsed: float,
) -> int:
    """Checkpoint (unless this step is already on disk), wait until it is durable, requeue if asked to,
    and say how to continue: never an exit (or a requeue) before the newest checkpoint is whole.

    SIGTERM (Slurm preemption, scancel, torchrun shutting down) never requeues from here: a preempting
    Slurm requeues the job itself, and a cancelled job should stay cancelled.
    """
    if pos.last_saved != pos.step:
        save(urgent=True)
    on_rank0(env, ckpt.wait)
    metrics.write("stop", pos.step, pos.epoch, elapsed, requeue=wants_requeue)
    metrics.close()
    if wants_requeue and env.in_slurm_job and cfg.slurm.requeue:
        if env.restart_count >= cfg.slurm.max_requeues:
            log.error(
                "requeue cap reached (%d requeues, slurm.max_requeues=%d): not requeueing; checkpoint at step %d "
                "is on disk, launch again to resume",
                env.restart_count,
                cfg.slurm.max_requeues,
                pos.step,
            )
            return EXIT_REQUEUE_CAP
        if env.rank == 0:
            slurm.requeue(env.slurm_job_ref)
    log.info("stopped on signal at step %d with a checkpoint; launch again to resume (exit %d)", pos.step, EXIT_STOPPED)
    return EXIT_STOPPED
