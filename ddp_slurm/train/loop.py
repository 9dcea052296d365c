"""The training loop: one rank's view of a run, for any task. It knows no dataset, model or strategy by name.

``train`` prepares: the run's objects (``run.build``: data, model, the strategy's wrapper, optimizer,
schedule, step), the run directory and the checkpoint to resume from (``rundir.take`` on rank 0, the
``Checkpointer`` on every rank), the record of the run (``metrics.jsonl`` and the loggers). ``loop``
then reads top to bottom: steps until the last one, a stop signal or an early stop, the ranks agreeing
on stopping (``vote.py``), an evaluation and a checkpoint at the end of each epoch, an evaluation every
``eval.every_steps`` (``evaluation.py``: a stop honoured at each of its batches, the best and early
stopping) and a checkpoint every ``checkpoint.every_steps`` and after each new best. Side features (progress, the train lines, the watchdog's heartbeat, the
sync-debug watch) are hooks beside it (``hooks/``); ``stop_on_signal`` is the way out on a signal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from ddp_slurm.config import Config, accumulation, relaunch
from ddp_slurm.distributed.env import DistEnv
from ddp_slurm.distributed.group import on_rank0
from ddp_slurm.distributed.groups import Groups
from ddp_slurm.exitcodes import EXIT_OK, EXIT_REQUEUE_CAP, EXIT_STOPPED
from ddp_slurm.slurmjob import allocation, badnodes, chain, restarts
from ddp_slurm.train import determinism, hooks, loggers, logs, rng, rundir, runname, strategy, warmstart
from ddp_slurm.train.checkpoint import Checkpointer, CheckpointError, fit
from ddp_slurm.train.evaluation import EARLY, IMPROVED, NONE, STOPPED, Evaluations
from ddp_slurm.train.guard import Guard
from ddp_slurm.train.hooks import Training
from ddp_slurm.train.hooks.syncdebug import reset as reset_sync_debug
from ddp_slurm.train.metrics import MetricsWriter
from ddp_slurm.train.precision import check_precision
from ddp_slurm.train.run import build, make_task
from ddp_slurm.train.signals import StopFlag
from ddp_slurm.train.vote import StopVote
from ddp_slurm.train.window import log_placement

log = logging.getLogger("ddp_slurm")


def train(
    loaded: Config,
    task_cls: type,
    env: DistEnv,
    device: torch.device,
    backend: str,
    *,
    stop: StopFlag,
    dog: Any = None,
    named: Callable[[Config], None] | None = None,
) -> int:
    """Every rank: build the run, take the run directory (rank 0), resume or start, train; the exit code.
    ``dog``: the watchdog, which hears of every step.

    ``loaded`` is never written to: the run trains on its own copy (``Config.with_run``), which holds the name
    chosen here for a new run and the very checkpoint file a warm start located (config.yaml and every
    checkpoint record that copy). ``named(cfg)`` is given the copy as soon as the run is named."""
    started = time.monotonic()
    chosen = strategy.of(loaded.dist.strategy)  # decided once: everything below asks this object
    check_precision(loaded.train.precision, device, chosen)
    settings = determinism.apply(loaded.train.deterministic, device)  # before the first kernel runs
    if settings and env.rank == 0:
        log.info("train.deterministic: %s", ", ".join(settings))
    groups = Groups.make(device)  # every collective below names one of these (see distributed/groups.py)
    host = groups.host
    log_placement(env, host)
    # slurm.* keys the allocation ignores (warnings), a --signal training would not catch (exit 2)
    warnings = on_rank0(env, lambda: allocation.check_current(loaded, os.environ), host)  # rank 0 asks scontrol once
    for line in warnings if env.rank == 0 else ():
        log.warning("%s", line)
    run_name = loaded.run.name
    if run_name is None:  # a new run: rank 0 names it, every rank of this launch uses that name
        run_name = runname.job_name(loaded, env.slurm_job_ref if env.in_slurm_job else None) or on_rank0(
            env, lambda: runname.new_name(loaded), host
        )
    cfg = loaded.with_run(name=run_name)  # the run's own config, from here on the only one
    if named is not None:
        named(cfg)
    task = make_task(cfg, task_cls, env, device)
    # Downloads happen once (the other ranks wait), and before the run directory exists: data that cannot
    # be had stops the launch with nothing created.
    on_rank0(env, task.prepare_data, host)
    run = build(cfg, task, env, device, chosen, groups)
    side = hooks.for_run(run, dog)  # side features, their checkpoint parts registered before any is judged
    # the run's structure a checkpoint must fit: built on the meta device, on rank 0 only (the one that judges)
    template = fit.of_task(task, cfg.train) if env.rank == 0 else None
    ckpt = Checkpointer(
        cfg.checkpoint,
        cfg.paths,
        run.strategy.backend,
        run,
        cfg,
        template=template,
        stop_pending=lambda: stop.requested,
        hold=cfg.guard.suspect_steps if cfg.guard.rollbacks else 0,  # a rollback's target survives pruning
    )
    lock = rundir.RunLock(cfg.paths)
    kept: dict[str, Any] = {}

    def take() -> tuple[Any, ...]:
        """Rank 0: the warm-start source, checked before the run directory is made; the run directory;
        the checkpoint to resume. Only its path and a summary travel: each rank reads it itself. The
        warm-start source located goes into the run's own copy: config.yaml records the very file."""
        cfg.run.init_from = warmstart.locate(cfg, ckpt.reference, template)
        found = rundir.take(cfg, lock, ckpt)
        if found is None:
            return None, None, cfg.run.init_from
        kept["record"] = found[1]
        summary = found[1]["step"], found[1]["finished"], found[1]["best"]  # the gate checked all three
        return found[0], summary, cfg.run.init_from

    try:
        path, summary, cfg.run.init_from = on_rank0(env, take, host)  # every rank's copy: checkpoints record it
        if summary is not None and summary[1]:  # a finished run launched again
            name, best = task.best_metric, summary[2]
            shown = f" (best test {logs.metric(name, best, task.percent_metrics)})" if name and best is not None else ""
            log.info("run %s already finished at step %d%s; nothing to do", cfg.run_dir, summary[0], shown)
            return EXIT_OK
        if env.in_slurm_job and env.restart_count > cfg.slurm.max_requeues:
            log.error(
                "requeue cap reached: restart %d > slurm.max_requeues=%d; not training. Raise the cap or "
                "launch again outside this job to resume",
                env.restart_count,
                cfg.slurm.max_requeues,
            )
            return EXIT_REQUEUE_CAP
        resumed = ckpt.restore(path, kept.get("record"))
        warm: dict[str, Any] = {}
        if resumed is not None:
            run.pos = resumed
        else:
            rng.seed_rank(cfg.run.seed, env.rank, 0, device)  # each rank its own dropout/augmentation stream
            warm = warmstart.load_into(cfg, run) if cfg.run.init_from else {}
        sinks = loggers.open_sinks(cfg, env.rank)  # log.*: each behind a non-blocking boundary (rank 0 only)
        with MetricsWriter(cfg.paths.metrics if env.rank == 0 else None, cfg.paths.shared, sinks=sinks) as metrics:
            t = Training(run, metrics, started)
            _start(t, backend, resumed is not None, warm)
            votes = StopVote(stop, env.world_size, device, failed=lambda: ckpt.failed, group=groups.train)
            return loop(t, ckpt, votes, stop, side)
    finally:
        reset_sync_debug(device)
        if ckpt.in_flight:  # leaving on an error: the write in flight still ends whole (or not at all)
            with contextlib.suppress(CheckpointError):
                ckpt.close()
        run.close()  # DataLoader workers end before the run directory is released
        lock.release()


def loop(t: Training, ckpt: Checkpointer, votes: StopVote, stop: StopFlag, side: hooks.Hooks) -> int:
    """Steps until the last one, a stop signal or an early stop (``side``: the run's hooks); the exit code."""
    run, pos = t.run, t.run.pos
    evals = Evaluations(t, stop)
    guard = Guard(t, ckpt, votes, side, save=lambda: save(t, ckpt))  # loss spikes, bad data, faults (guard/)
    side.start(t)
    guard.start()
    batches = run.batches.epoch(pos.epoch, pos.step_in_epoch)
    side.epoch_start(t)
    requeue, terminate, _ = votes.exchange(None, pos.step, wait=True)  # a signal that came before the first step
    ended = NONE  # STOPPED: a stop signal inside an evaluation; EARLY: early stopping
    if not (requeue or terminate) and evals.pending(_end_of_epoch(run)):  # a stop abandoned this step's evaluation
        ended, batches = _close_step(t, ckpt, evals, side, batches, saving=True)
    while not (requeue or terminate) and ended == NONE and pos.step < run.total_steps:
        side.before_step(t)
        skipped = guard.skipped(pos.step + 1)  # a step of bad data: no batch drawn, no update
        loss = None if skipped else run.train_step(next(batches))
        pos.advance()
        guard.stepped(loss)
        side.stepped(t)
        end_of_epoch = _end_of_epoch(run)
        saving = ckpt.due(pos.step, end_of_epoch)
        waiting = saving or evals.due(end_of_epoch)
        if waiting or side.wants_host(pos.step):  # the boundaries that may wait for the device
            side.boundary(t)
        # The ranks agree on stopping one step late, without waiting for each other (StopVote); before an
        # evaluation or a save they wait, so that nothing non-finite is evaluated or saved.
        requeue, terminate, bad = votes.exchange(loss, pos.step, wait=waiting)
        if votes.failed:  # rank 0's background write failed (disk full, read-only): its one line, every rank
            ckpt.wait()
        ckpt.poll()  # a background write now durable says so here, before this step's progress line
        moved = guard.check(bad)  # a spike or a non-finite loss: rolled back to replay, or to skip bad data
        if moved is not None:
            batches = moved
            continue
        if loss is not None:
            side.after_step(t, loss)
        ended, batches = _close_step(t, ckpt, evals, side, batches, saving)
        if saving and ended == NONE:  # a signal that came during the evaluation or the save stops here
            requeue, terminate, _ = votes.exchange(None, pos.step, wait=True)
    # The last step's flags, when a signal ended the loop (no collective left in flight): judged before its
    # save, so that a spike on the very step a signal lands on is rolled back, not checkpointed.
    guard.check(votes.settle()[2])
    side.end(t)
    # The data's worker processes end now: a requeue cancels the Slurm step, whose SIGTERM would kill them
    # under a rank still waiting for rank 0, and its DataLoader would raise there (exit 1, not 75).
    run.close()
    stop.stopping = True  # from here on stop signals are absorbed until the process exits (see signals.py)
    if ended == STOPPED:  # inside an evaluation: the resumed run redoes it
        return stop_on_signal(t, ckpt, wants_requeue=evals.vote.requeue and not evals.vote.terminate)
    if (requeue or terminate) and ended != EARLY and pos.step < run.total_steps:  # an early stop is an end
        return stop_on_signal(t, ckpt, wants_requeue=requeue and not terminate)
    if requeue or terminate:  # came during the last save (or with an early stop): the work is done, no requeue
        log.info("stop signal after the last step: the run is finished, its final checkpoint is on disk")
    return _finish(t, ckpt)


def _end_of_epoch(run: Any) -> bool:
    return run.pos.step_in_epoch == run.steps_per_epoch or run.pos.step == run.total_steps


def _close_step(
    t: Training, ckpt: Checkpointer, evals: Evaluations, side: Any, batches: Any, saving: bool
) -> tuple[str, Any]:
    """After a step: its evaluation when due, the epoch's end, its checkpoint (when due, at an epoch's end,
    after a new best, at the end). Returns (NONE, STOPPED or EARLY; the batches to go on with)."""
    run, pos = t.run, t.run.pos
    end_of_epoch = _end_of_epoch(run)
    if end_of_epoch:
        side.epoch_end(t)
    outcome = evals.run(end_of_epoch)
    if outcome == STOPPED:  # nothing of the evaluation kept: the checkpoint of this step says it is still due
        return STOPPED, batches
    if end_of_epoch:
        pos.next_epoch()
        batches = run.batches.epoch(pos.epoch, 0)
    last = pos.step >= run.total_steps or outcome == EARLY
    if saving or end_of_epoch or last or outcome == IMPROVED:
        save(t, ckpt, finished=last, urgent=last)
    if end_of_epoch and not last:
        side.epoch_start(t)
    return (EARLY if outcome == EARLY else NONE), batches


def save(t: Training, ckpt: Checkpointer, finished: bool = False, urgent: bool = False) -> None:
    """Checkpoint the state after this step (a collective; ``urgent``: the process waits for it next)."""
    run = t.run
    path = ckpt.save(finished, t.elapsed(), urgent=urgent)  # every registered part (checkpoint/parts.py)
    t.metrics.event("checkpoint", run.pos.step, run.pos.epoch, t.elapsed(), background=path is None)


def _start(t: Training, backend: str, resumed: bool, warm: dict[str, Any]) -> None:
    """The run's ``start`` line and the one log line that says what this launch is."""
    run, pos, env = t.run, t.run.pos, t.run.env
    t.metrics.write(
        "start",
        pos.step,
        pos.epoch,
        t.elapsed(),
        resumed=resumed,
        restart_count=env.restart_count,
        world_size=env.world_size,
        launcher=env.launcher,
        task=run.cfg.task,
        job_id=env.job_id,
        **warm,
        best_metric=run.task.best_metric,
        higher_is_better=run.task.higher_is_better,
        percent_metrics=None if run.task.percent_metrics is None else list(run.task.percent_metrics),
        launch=t.metrics.launch,
        steps_per_epoch=run.steps_per_epoch,
        restart_in_allocation=restarts.step_restart(os.environ),  # the batch script's relaunch (supervise.py)
        accumulate=accumulation(run.cfg, env.world_size),  # train.micro_batch_size: chosen for this world size
        strategy=run.strategy.name,
        precision=run.cfg.train.precision,
    )
    log.info(
        "%s run %s: world size %d on %d node(s) via %s, backend %s, device %s, %s %s, %s",
        "resuming" if resumed else "starting",
        run.cfg.run_dir,
        env.world_size,
        env.num_nodes,
        env.launcher,
        backend,
        run.device,
        run.strategy.name,
        run.cfg.train.precision,
        logs.resumed_from(pos.step, t.metrics.launch, env) if resumed else "fresh start",
    )


def _finish(t: Training, ckpt: Checkpointer) -> int:
    run, pos = t.run, t.run.pos
    name = run.task.best_metric
    ckpt.wait()  # the final checkpoint is durable before the run says it ended
    t.metrics.write("end", pos.step, pos.epoch, t.elapsed(), **({f"best_{name}": pos.best} if name else {}))
    t.metrics.close()
    best = (
        f", best test {logs.metric(name, pos.best, t.run.task.percent_metrics)}"
        if name and pos.best is not None
        else ""
    )
    log.info("finished: %d steps%s, %.1f s; run directory %s", pos.step, best, t.elapsed(), run.cfg.run_dir)
    return EXIT_OK


def stop_on_signal(t: Training, ckpt: Checkpointer, wants_requeue: bool) -> int:
    """Checkpoint (unless this step is already on disk), wait until it is durable, requeue if asked to,
    and say how to continue: never an exit (or a requeue) before the newest checkpoint is whole.

    SIGTERM (Slurm preemption, scancel, torchrun shutting down) never requeues from here: a preempting
    Slurm requeues the job itself, and a cancelled job should stay cancelled.
    """
    pos, env, cfg, host = t.run.pos, t.run.env, t.run.cfg, t.run.groups.host
    if ckpt.saved_step != pos.step:
        save(t, ckpt, urgent=True)
    ckpt.wait()
    t.metrics.write("stop", pos.step, pos.epoch, t.elapsed(), requeue=wants_requeue)
    t.metrics.close()
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
        # scontrol requeue, or a chained successor; without the nodes named slow (slurm.exclude_slow)
        avoid = (lambda: badnodes.excluded(cfg.run_dir, slow=True)) if cfg.slurm.exclude_slow else list
        on_rank0(env, lambda: chain.continue_job(cfg, env, exclude=avoid()), host)
    # Every rank waits for rank 0's requeue and line: under srun --kill-on-bad-exit, the first rank to exit
    # 75 ends the step, and rank 0 must not be killed before them.
    on_rank0(
        env,
        lambda: log.info(
            "stopped on signal at step %d with a checkpoint; resume with: %s (exit %d)",
            pos.step,
            relaunch.resume_command(cfg.run_dir),
            EXIT_STOPPED,
        ),
        host,
    )
    return EXIT_STOPPED
