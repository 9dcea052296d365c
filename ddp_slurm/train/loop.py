"""The training loop: one rank's view of a run, for any task. It knows no dataset or model by name.

Read ``_train`` top to bottom: resume or start, then steps until the last one or a stop signal. The
task supplies the model, the data and the loss (``train/task.py``); the step and the evaluation are in
``step.py``, the DDP wrapper in ``ddp.py`` (FSDP2 in ``fsdp.py``), the optimizer and schedule in ``optim.py``,
the stop vote in ``vote.py``; what a checkpoint holds is in ``state.py``, when and how it is written in
``checkpoint/`` (its ``Checkpointer`` owns the checkpoint section); the batches in ``loader.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ddp_slurm.config import Config, ConfigError
from ddp_slurm.distributed.env import DistEnv
from ddp_slurm.distributed.group import on_rank0
from ddp_slurm.distributed.watchdog import Watchdog
from ddp_slurm.exitcodes import EXIT_OK, EXIT_REQUEUE_CAP, EXIT_STOPPED
from ddp_slurm.slurmjob import allocation, chain
from ddp_slurm.train import (
    accumulate,
    checkpoint,
    determinism,
    fsdp,
    graphs,
    loader,
    loggers,
    logs,
    rundir,
    runname,
    state,
    step,
    syncdebug,
    tb,
    warmstart,
)
from ddp_slurm.train.checkpoint import Checkpointer, fit
from ddp_slurm.train.checkpoint import sharded as sharded_format
from ddp_slurm.train.ddp import wrap_ddp
from ddp_slurm.train.metrics import MetricsWriter
from ddp_slurm.train.optim import make_optimizer, make_scheduler
from ddp_slurm.train.precision import check_precision
from ddp_slurm.train.signals import StopFlag
from ddp_slurm.train.task import Context, Task, Tensors
from ddp_slurm.train.vote import StopVote
from ddp_slurm.train.window import LossWindow, log_placement

log = logging.getLogger("ddp_slurm")


class NonFiniteLoss(RuntimeError):
    """The loss or the weights became NaN/inf: stop before anything is saved."""


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
    # Downloads happen once (the other ranks wait), and before the run directory exists: data that cannot
    # be had stops the launch with nothing created.
    on_rank0(env, task.prepare_data)
    lock = rundir.RunLock(cfg.paths)
    found: dict[str, Any] = {}

    def take_run_dir() -> Path | None:
        with torch.device("meta"):  # names and shapes only, no memory: what a resumable checkpoint must match
            reference = task.build_model().state_dict()
        init = warmstart.locate(cfg, reference)  # run.init_from: checked before the run directory is made
        if init is not None:
            cfg.run.init_from = init  # config.yaml records the very file
        latest = rundir.prepare(cfg, lock, reference, fit.of_task(task, cfg.train))
        if latest is None:
            return None
        found["state"] = latest[1]
        return latest[0]

    # the checkpoint section's owner: cadence, keep, async (rank 0 writes, at most one write in flight;
    # dist.strategy=fsdp: every rank writes its shards, rank 0 commits: checkpoint/sharded.py)
    sharded = cfg.dist.strategy == "fsdp"
    ckpt = Checkpointer(
        cfg.checkpoint,
        cfg.paths,
        sharded=sharded,
        stop_pending=lambda: stop.requested,  # a stop during a save's wait cancels the write it supersedes
    )
    try:
        path = on_rank0(env, take_run_dir)  # only the path travels: each rank reads the file itself
        cfg.run.init_from = on_rank0(env, lambda: cfg.run.init_from)  # the file rank 0 located, on every rank
        read = (lambda p: sharded_format.read_commit(p, verify_files=False)) if sharded else checkpoint.load
        resumed = None if path is None else found["state"] if env.rank == 0 else read(path)
        if sharded and resumed is not None:
            resumed = dict(resumed, folder=path)  # the shards are read by every rank in _train
        with contextlib.ExitStack() as closing:  # the loggers end their run on every way out (FAILED on an error)
            return _train(cfg, task, env, device, backend, stop, resumed, t0, dog, hosts, ckpt, closing)
    finally:
        syncdebug.reset(device)
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
    ckpt: Checkpointer,
    closing: contextlib.ExitStack,
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
    batches = loader.make_batches(task.train_data(), device, cfg.run.seed, G, env.rank, ws, tc)
    eval_data = task.eval_data()
    if isinstance(eval_data, Tensors):
        eval_data = eval_data.to(device)  # in memory: moved once, like the training tensors
    total_steps = tc.epochs * batches.steps_per_epoch
    total_steps = min(total_steps, tc.max_steps) if tc.max_steps is not None else total_steps

    torch.manual_seed(cfg.run.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    model = task.build_model().to(device)
    sharded = cfg.dist.strategy == "fsdp"
    if sharded:  # before the optimizer: the parameters become DTensors holding this rank's shard
        model = fsdp.shard(model, task.shard_units(model), device, tc.precision)
    optimizer = task.configure_optimizer(model) or make_optimizer(tc, model.parameters(), device)
    scheduler = task.configure_scheduler(optimizer, total_steps) or make_scheduler(tc, optimizer, total_steps)
    if resumed is not None and sharded:
        pos = sharded_format.restore(
            resumed["folder"], resumed, model, optimizer, scheduler, task, cfg.run.seed, device, env.rank, ws
        )
    elif resumed is not None:
        pos = state.restore(resumed, model, optimizer, scheduler, task, cfg.run.seed, device, env.rank, ws)
    else:
        pos = state.Position()
        state.seed_rank(cfg.run.seed, env.rank, 0, device)  # each rank its own dropout/augmentation stream
    warm = warmstart.load_into(cfg, model, optimizer, env.rank) if resumed is None and cfg.run.init_from else {}
    if sharded:
        ddp = model  # FSDP2 shards in place: the model is the module the step calls
    else:
        ddp = wrap_ddp(model, device, ws, settle=True)
    if tc.cuda_graphs:  # train.cuda_graphs: the whole step captured once and replayed (graphs.py)
        train_step = graphs.make_step(ddp, optimizer, scheduler, task.training_step, device, tc.precision)
    else:
        train_step = step.make_step(
            ddp, optimizer, scheduler, task.training_step, device, tc.precision, tc.accumulate, tc.grad_clip
        )

    board = tb.open_for(cfg, cfg.run_dir, env.rank)  # log.tensorboard: the same records as TensorBoard events
    sinks = (board, *loggers.open_sinks(cfg, cfg.run_dir, env.rank))  # log.mlflow, log.wandb, log.csv
    metrics = closing.enter_context(
        MetricsWriter(cfg.paths.metrics if env.rank == 0 else None, cfg.paths.shared, sinks=sinks)
    )

    def elapsed() -> float:
        return pos.elapsed_s + time.monotonic() - t0

    def save(finished: bool = False, urgent: bool = False) -> None:
        """Every rank hands rank 0 its RNG streams; rank 0 snapshots the state and writes it (in the
        background with checkpoint.async; ``urgent``: a stop or the end, whose write is waited for next).
        Under fsdp every rank writes its own shards (checkpoint/sharded.py)."""
        if sharded:
            extra = {"config": cfg.to_dict(), "restart_count": env.restart_count}
            try:
                args = (model, optimizer, scheduler, task, pos, finished, elapsed(), extra, device, env.rank, ws)
                snap = sharded_format.capture(*args)
            except ValueError as exc:
                raise NonFiniteLoss(f"{exc}: not saving them; the last good checkpoint is kept (lower train.lr?)")
            path = ckpt.save(snap, urgent=urgent)
            metrics.event("checkpoint", pos.step, pos.epoch, elapsed(), background=path is None)
            pos.last_saved = pos.step
            return
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
            if not step.all_finite(model.parameters()):  # one host sync for all of them
                raise NonFiniteLoss(
                    f"weights are not finite at step {pos.step}: not saving them; "
                    "the last good checkpoint is kept (lower train.lr?)"
                )
            path = ckpt.save(snapshot, urgent=urgent)  # None: handed to the writer, which logs it when durable
            metrics.event("checkpoint", pos.step, pos.epoch, elapsed(), background=path is None)

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
        **warm,
        best_metric=task.best_metric,
        higher_is_better=task.higher_is_better,
        launch=metrics.launch,
        steps_per_epoch=batches.steps_per_epoch,
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
        logs.resumed_from(pos.step, metrics.launch, env) if resumed else "fresh start",
    )

    progress = logs.Progress(env.rank == 0, tc.log_every_s)
    votes = StopVote(stop, ws, device, failed=lambda: ckpt.failed)
    window = LossWindow(device, ws, G, pos.step)
    norms = accumulate.NormWindow()  # train.grad_clip: the gradient norm before clipping
    watch = syncdebug.SyncWatch.from_environ(os.environ, device, pos.step)  # a test hook: docs/gpu.md
    spe = batches.steps_per_epoch

    def epoch_steps() -> int:  # this epoch's steps for the progress display (train.max_steps may end it early)
        return min(spe, pos.step_in_epoch + total_steps - pos.step)

    epoch_batches = batches.epoch(pos.epoch, pos.step_in_epoch)
    progress.start_epoch(pos.epoch, tc.epochs, epoch_steps(), pos.step_in_epoch)
    requeue, terminate, _ = votes.exchange(None, pos.step, wait=True)  # a signal that came before the first step
    while not (requeue or terminate) and pos.step < total_steps:
        watch.steady(pos.step)
        loss = train_step(next(epoch_batches))
        pos.advance()
        if dog is not None:
            dog.progress(pos.step)
        window.add(loss)
        norms.add(getattr(train_step, "grad_norm", None))
        end_of_epoch = pos.step_in_epoch == spe or pos.step == total_steps
        saving = ckpt.due(pos.step, end_of_epoch)
        if saving or pos.step % tc.log_every_steps == 0:  # the boundaries that may wait for the device
            watch.boundary()
        # The ranks agree on stopping one step late, without waiting for each other (StopVote);
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
                **norms.close(),
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

    watch.close()
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
        if cfg.dist.strategy == "fsdp":  # every forward is a collective: as many batches on every rank
            batches = fsdp.padded(batches, eval_data, device, env.rank, env.world_size, tc.eval_batch_size)
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
    ckpt: Checkpointer,
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
        on_rank0(env, lambda: chain.continue_job(cfg, env))  # scontrol requeue, or a chained successor
    # Every rank waits for rank 0's requeue and line: under srun --kill-on-bad-exit, the first rank to exit
    # 75 ends the step, and rank 0 must not be killed before them.
    on_rank0(
        env,
        lambda: log.info(
            "stopped on signal at step %d with a checkpoint; launch again to resume (exit %d)", pos.step, EXIT_STOPPED
        ),
    )
    return EXIT_STOPPED
