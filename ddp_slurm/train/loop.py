"""``python -m ddp_slurm.train [--config FILE] [KEY=VALUE ...]``: one rank of a DDP run (or all of a 1-rank one).

Exit codes: 0 finished (or already finished); 2 usage or config error, nothing started; 75 stopped
on a signal after writing a checkpoint (launch again to resume; inside Slurm with requeue on, the
job is already requeued); 3 the requeue cap was reached; 1 any other failure, reason in the log.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_slurm import bootstrap, config
from ddp_slurm.bootstrap import BootstrapError, DistEnv
from ddp_slurm.config import Config, ConfigError
from ddp_slurm.dist import slurm, watchdog
from ddp_slurm.exitcodes import EXIT_FAILURE, EXIT_OK, EXIT_REQUEUE_CAP, EXIT_STOPPED, EXIT_USAGE  # noqa: F401
from ddp_slurm.tasks.mnist import data, models
from ddp_slurm.train import checkpoint, logs
from ddp_slurm.train import step as engine
from ddp_slurm.train.cli import parse_args
from ddp_slurm.train.metrics import MetricsWriter
from ddp_slurm.train.rundir import RunLock, RunLocked
from ddp_slurm.train.signals import StopFlag, parse_signal

log = logging.getLogger("ddp_slurm")


class UsageError(RuntimeError):
    """A usage problem found once the ranks are up (run directory busy or holding another config): exit 2."""


class RunDirError(RuntimeError):
    """The run directory cannot be written (read-only or full file system, permissions)."""


class NonFiniteLoss(RuntimeError):
    """The loss or the weights became NaN/inf: stop before anything is saved."""


# Errors whose message says it all: logged as one line, no traceback.
EXPECTED_ERRORS = (
    checkpoint.CheckpointError,
    data.DataError,
    NonFiniteLoss,
    BootstrapError,
    RunLocked,
    bootstrap.RendezvousError,
    watchdog.PeerLost,
    RunDirError,
)


def check_world(cfg: Config, env: DistEnv) -> None:
    """Config errors that depend on the world size, found before anything starts."""
    g, ws = cfg.train.global_batch_size, env.world_size
    if g % ws:
        raise ConfigError(
            f"train.global_batch_size={g} is not divisible by the world size {ws}: choose a multiple of {ws}"
        )
    size = data.TRAIN_SIZES[cfg.data.source]
    if g > size:
        raise ConfigError(f"train.global_batch_size={g} is larger than the {cfg.data.source} training set ({size})")


def on_rank0(env: DistEnv, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 and hand its result (or its exception) to every rank."""
    result: list[Any] = [None]
    if env.rank == 0:
        try:
            result[0] = ("ok", fn())
        except Exception as exc:  # re-raised on every rank below, so all exit the same way
            result[0] = ("error", exc)
    if env.world_size > 1:
        dist.broadcast_object_list(result, src=0)
    status, value = result[0]
    if status == "error":
        raise value
    return value


def log_placement(env: DistEnv) -> None:
    """Rank 0 logs once which host each rank runs on, grouped by host: the other ranks log only
    warnings, and the rank map is the first thing to check when a multi-node job misbehaves."""
    host = socket.gethostname()
    hosts = [host] * env.world_size
    if env.world_size > 1:
        dist.all_gather_object(hosts, host)
    if env.rank == 0:
        log.info("ranks by host (%d ranks, %d hosts): %s", env.world_size, len(set(hosts)), logs.rank_map(hosts))


def prepare_run_dir(cfg: Config, lock: RunLock) -> tuple[Path, dict[str, Any]] | None:
    """Rank 0: refuse a run directory holding another config or another live launch, take the lock,
    write the resolved config, and find the checkpoint to resume from (None: fresh start)."""
    run_dir, saved = cfg.run_dir, cfg.run_dir / "config.yaml"
    if saved.exists():
        diffs = config.incompatible_changes(config.read_resolved(saved), cfg)
        if diffs:
            raise UsageError(
                f"run directory {run_dir} holds a run with another config ({'; '.join(diffs)}): "
                "launch with the same settings to resume it, or choose another run.name"
            )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock.acquire()
        checkpoint.remove_stale_temporaries(run_dir)
        found = checkpoint.latest(run_dir)
        config.dump(cfg, saved)
    except RunLocked as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:  # a read-only or full file system, no permission: one line, not a traceback
        raise RunDirError(
            f"cannot write the run directory {run_dir}: {exc.strerror or exc} ({exc.filename}); "
            "make it writable or choose another run.output_root"
        ) from None
    return found


@dataclass
class Position:
    """Where training stands; restored exactly from a checkpoint."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    elapsed_s: float = 0.0
    best_accuracy: float = 0.0
    last_saved: int = -1


def rng_state(device: torch.device) -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    cfg: Config,
    env: DistEnv,
    model,
    optimizer,
    scheduler,
    pos: Position,
    finished: bool,
    device: torch.device,
    t0: float,
) -> None:
    """Rank 0 writes; the result is shared so that no rank continues (or exits) before the file is in place."""

    def write() -> None:
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            raise NonFiniteLoss(
                f"weights are not finite at step {pos.step}: not saving them; "
                "the last good checkpoint is kept (lower train.lr?)"
            )
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "step": pos.step,
            "epoch": pos.epoch,
            "samples_in_epoch": pos.step_in_epoch * cfg.train.global_batch_size,
            "finished": finished,
            "elapsed_s": pos.elapsed_s + time.monotonic() - t0,
            "best_accuracy": pos.best_accuracy,
            "rng": rng_state(device),
            "config": cfg.to_dict(),
            "world_size": env.world_size,
            "restart_count": env.restart_count,
        }
        path = checkpoint.save(cfg.run_dir, state, keep=cfg.checkpoint.keep)
        log.info("checkpoint %s", path)

    on_rank0(env, write)
    pos.last_saved = pos.step


def train(cfg: Config, env: DistEnv, device: torch.device, backend: str, stop: StopFlag) -> int:
    t0 = time.monotonic()
    if cfg.train.precision == "bf16" and device.type != "cuda":
        raise UsageError("train.precision=bf16 needs CUDA; use train.precision=fp32 on CPU")
    log_placement(env)
    lock = RunLock(cfg.run_dir)
    try:
        found = on_rank0(env, lambda: prepare_run_dir(cfg, lock))
        return _train(cfg, env, device, backend, stop, found, t0)
    finally:
        lock.release()


def _train(
    cfg: Config,
    env: DistEnv,
    device: torch.device,
    backend: str,
    stop: StopFlag,
    found: tuple[Path, dict[str, Any]] | None,
    t0: float,
) -> int:
    state = None
    if found is not None:  # rank 0 already holds it; the others read the same file
        state = found[1] if env.rank == 0 else checkpoint.load(found[0])
        if state["finished"]:
            log.info(
                "run %s already finished at step %d (best test accuracy %.2f%%); nothing to do",
                cfg.run_dir,
                state["step"],
                100 * state.get("best_accuracy", 0.0),
            )
            return EXIT_OK
    if env.in_slurm_job and env.restart_count > cfg.slurm.max_requeues:
        log.error(
            "requeue cap reached: restart %d > slurm.max_requeues=%d; not training. Raise the cap or "
            "launch again outside this job to resume",
            env.restart_count,
            cfg.slurm.max_requeues,
        )
        return EXIT_REQUEUE_CAP

    # Data: full MNIST is fetched by rank 0 only; the others wait for it.
    if cfg.data.source == "mnist":
        on_rank0(env, lambda: data.ensure_mnist(Path(cfg.data.root), cfg.data.download, True))
    train_set = data.load_split(cfg.data.source, cfg.data.root, train=True).to(device)
    test_set = data.load_split(cfg.data.source, cfg.data.root, train=False).to(device)
    G, ws = cfg.train.global_batch_size, env.world_size
    steps_per_epoch = data.steps_per_epoch(len(train_set), G)
    total_steps = cfg.train.epochs * steps_per_epoch
    if cfg.train.max_steps is not None:
        total_steps = min(total_steps, cfg.train.max_steps)

    torch.manual_seed(cfg.run.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    model = models.build(cfg.model.name).to(device)
    optimizer = engine.make_optimizer(cfg.train, model.parameters(), device)
    scheduler = engine.make_scheduler(cfg.train, optimizer, total_steps)
    pos = Position()
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"], device)
        pos = Position(
            step=state["step"],
            epoch=state["epoch"],
            step_in_epoch=state["samples_in_epoch"] // G,
            elapsed_s=state["elapsed_s"],
            best_accuracy=state["best_accuracy"],
            last_saved=state["step"],
        )
    ddp = engine.wrap_ddp(model, device, ws)  # the bare model for one process: nothing to all-reduce
    step_fn = engine.make_step(ddp, optimizer, scheduler, train_set.images, train_set.labels, cfg.train.precision)

    metrics = MetricsWriter(cfg.run_dir / "metrics.jsonl" if env.rank == 0 else None)
    elapsed = lambda: pos.elapsed_s + time.monotonic() - t0  # noqa: E731
    metrics.write(
        "start",
        pos.step,
        pos.epoch,
        elapsed(),
        resumed=state is not None,
        restart_count=env.restart_count,
        world_size=ws,
        launcher=env.launcher,
    )
    log.info(
        "%s run %s: world size %d on %d node(s) via %s, backend %s, device %s, %s",
        "resuming" if state else "starting",
        cfg.run_dir,
        ws,
        env.num_nodes,
        env.launcher,
        backend,
        device,
        f"from step {pos.step} (restart {env.restart_count})" if state else "fresh start",
    )

    save = lambda finished=False: save_checkpoint(cfg, env, model, optimizer, scheduler, pos, finished, device, t0)  # noqa: E731
    progress = logs.Progress(env.rank == 0, cfg.train.log_every_s)
    votes = engine.StopVote(stop, ws, device)
    loss_sum, loss_n, window_t, window_step = torch.zeros((), device=device), 0, time.monotonic(), pos.step
    last_loss = last_rate = None
    perm = data.epoch_permutation(len(train_set), cfg.run.seed, pos.epoch).to(device)  # batches index on the device
    # this epoch's steps for the progress display: fewer than a full epoch where train.max_steps ends it early
    epoch_steps = lambda: min(steps_per_epoch, pos.step_in_epoch + total_steps - pos.step)  # noqa: E731
    progress.start_epoch(pos.epoch, cfg.train.epochs, epoch_steps(), pos.step_in_epoch)

    requeue, terminate, _ = votes.exchange(None, pos.step, wait=True)  # a signal that came before the first step
    while not (requeue or terminate) and pos.step < total_steps:
        loss = step_fn(data.rank_batch(perm, pos.step_in_epoch, G, env.rank, ws))
        pos.step += 1
        pos.step_in_epoch += 1
        loss_sum += loss
        loss_n += 1
        end_of_epoch = pos.step_in_epoch == steps_per_epoch or pos.step == total_steps
        saving = end_of_epoch or bool(cfg.checkpoint.every_steps and pos.step % cfg.checkpoint.every_steps == 0)
        # The ranks agree on stopping one step late, without waiting for each other (engine.StopVote);
        # before an evaluation or a save they wait, so that nothing non-finite is evaluated or saved.
        requeue, terminate, bad = votes.exchange(loss, pos.step, wait=saving)
        if bad:
            raise NonFiniteLoss(
                f"{votes.bad} (epoch {pos.epoch + 1}): stopping; nothing non-finite was saved "
                "(lower train.lr and start a new run.name)"
            )

        if pos.step % cfg.train.log_every_steps == 0:  # the only per-window host sync for the loss
            mean = loss_sum / loss_n
            if ws > 1:
                dist.all_reduce(mean)
                mean /= ws
            now = time.monotonic()
            last_loss, last_rate = mean.item(), (pos.step - window_step) * G / (now - window_t)
            metrics.write(
                "train", pos.step, pos.epoch, elapsed(), loss=last_loss, samples_per_s=last_rate, world_size=ws
            )
            loss_sum.zero_()
            loss_n, window_t, window_step = 0, now, pos.step
        eta = (total_steps - pos.step) * G / last_rate if last_rate else None
        progress.update(pos.step, pos.epoch, pos.step_in_epoch, epoch_steps(), last_loss, last_rate, eta)

        if end_of_epoch:
            progress.end_epoch()
            accuracy, images, test_loss = engine.evaluate(model, test_set, env.rank, ws, cfg.train.precision)
            pos.best_accuracy = max(pos.best_accuracy, accuracy)
            metrics.write(
                "eval", pos.step, pos.epoch, elapsed(), accuracy=accuracy, test_samples=images, loss=test_loss
            )
            log.info(
                "epoch %d/%d: train loss %s, test accuracy %.2f%% (%d images), %s samples/s",
                pos.epoch + 1,
                cfg.train.epochs,
                f"{last_loss:.4f}" if last_loss is not None else "n/a",
                100 * accuracy,
                images,
                f"{last_rate:,.0f}" if last_rate else "n/a",
            )
            pos.epoch, pos.step_in_epoch = pos.epoch + 1, 0
            perm = data.epoch_permutation(len(train_set), cfg.run.seed, pos.epoch).to(device)
            save(finished=pos.step >= total_steps)
            if pos.step < total_steps:
                progress.start_epoch(pos.epoch, cfg.train.epochs, epoch_steps(), 0)
        elif saving:
            save()
        if saving:  # a signal that came during the evaluation or the save stops here: this step is on disk
            requeue, terminate, _ = votes.exchange(None, pos.step, wait=True)

    votes.settle()  # the last step's flags, when a signal ended the loop: no collective left in flight
    progress.end_epoch()
    if (requeue or terminate) and pos.step < total_steps:
        stop.stopping = True  # keep absorbing stop signals until the process exits (see signals.py)
        return stop_on_signal(cfg, env, pos, requeue and not terminate, save, metrics, elapsed())
    if requeue or terminate:  # came during the last step or the final evaluation: the work is done, no requeue
        log.info("stop signal after the last step: the run is finished, its final checkpoint is on disk")
    # The work is done: a stop signal during the shutdown (Slurm's time-limit warning can land in it)
    # must be absorbed, not kill a rank that has finished and turn a completed job into a failed one.
    stop.stopping = True
    metrics.write("end", pos.step, pos.epoch, elapsed(), best_accuracy=pos.best_accuracy)
    metrics.close()
    log.info(
        "finished: %d steps, best test accuracy %.2f%%, %.1f s; run directory %s",
        pos.step,
        100 * pos.best_accuracy,
        elapsed(),
        cfg.run_dir,
    )
    return EXIT_OK


def stop_on_signal(
    cfg: Config, env: DistEnv, pos: Position, wants_requeue: bool, save, metrics: MetricsWriter, elapsed: float
) -> int:
    """Checkpoint (unless this step is already on disk), requeue if asked to, and say how to continue.

    SIGTERM (Slurm preemption, scancel, torchrun shutting down) never requeues from here: a preempting
    Slurm requeues the job itself, and a cancelled job should stay cancelled.
    """
    if pos.last_saved != pos.step:
        save()
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


def main(argv: list[str] | None = None, stop: StopFlag | None = None) -> int:
    """Train one rank; returns the exit code.

    ``stop``: a StopFlag the caller already installed for ``slurm.signal`` (the submitit callable does,
    before anything else runs, so that no stop signal reaches submitit's own handlers); main then
    leaves installing and restoring it to the caller.
    """
    args = parse_args(argv)
    own_stop = stop is None
    try:
        cfg = config.load(args.config, args.overrides)
        env = DistEnv.from_environ(os.environ)
        check_world(cfg, env)
        if stop is None:
            stop = StopFlag(parse_signal(cfg.slurm.signal))
    except (ConfigError, BootstrapError) as exc:
        print(f"ddp_slurm.train: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    logs.setup(env.rank)
    if own_stop:
        stop.install()  # before the rendezvous: a signal at any time from here on is a clean stop
    try:
        with (
            bootstrap.distributed(env, cfg.dist.backend, cfg.dist.timeout_s) as (device, backend),
            watchdog.watch(env, ignore=EXPECTED_ERRORS + (UsageError,)),
        ):  # names a lost rank if one vanishes
            return train(cfg, env, device, backend, stop)
    except UsageError as exc:
        log.error("%s", exc)
        return EXIT_USAGE
    except EXPECTED_ERRORS as exc:
        log.error("%s", exc)
        return EXIT_FAILURE
    except Exception as exc:
        gist = logs.collective_failure(exc)
        if gist:  # a consequence: the rank that failed first has logged the traceback that matters
            log.error("training failed: another rank stopped answering (its log says why): %s", gist)
        else:
            log.exception("training failed")
        return EXIT_FAILURE
    finally:
        if own_stop:
            stop.close()  # a stopping rank ignores further stop signals until it has exited (see signals.py)


def exit_now(code: int) -> None:
    """Leave the process without interpreter finalization, once everything is flushed.

    With torch's gloo backend, finalization can meet a gloo worker thread that still needs the GIL;
    Python then ends that thread, which aborts the whole process ("terminate called without an
    active exception", exit 134) in a few percent of runs that had finished cleanly, turning a
    completed Slurm job into a failed one. Nothing is lost by skipping it: the metrics file, the
    checkpoints and the run lock are closed by the time ``main`` returns. It also saves the seconds
    that tearing down torch takes in every rank.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
