"""Training from parsed values: ``train`` (under ``python -m ddp_slurm.train``, whose command line
``cli`` reads) and ``run`` (``ddp_slurm.run``, the Python API).

Exit codes (``ddp_slurm.exitcodes``): 0 finished (or already finished); 2 usage or config error, nothing
started; 75 stopped on a signal after writing a checkpoint (launch again to resume; inside Slurm with
requeue on, the job is already requeued); 3 the requeue cap was reached; 1 any other failure, reason in
the log.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from ddp_slurm import config, errors
from ddp_slurm.config import Config
from ddp_slurm.distributed.env import DistEnv
from ddp_slurm.exitcodes import EXIT_FAILURE
from ddp_slurm.train import loggers
from ddp_slurm.train.hooks import syncdebug
from ddp_slurm.train.signals import StopFlag, parse_signal

log = logging.getLogger("ddp_slurm")


def check_task(cfg: Config, env: DistEnv, cls: type | None = None) -> type:
    """The task class (``cls``, or the one ``task`` names), after its own checks of the config for this
    world size (ConfigError: exit 2)."""
    import torch

    from ddp_slurm.train.run import make_task

    cls = cls or config.task_class(cfg.task)
    make_task(cfg, cls, env, torch.device("cpu")).check()
    return cls


def check_graphs(cfg: Config, env: DistEnv, task_cls: type) -> None:
    """train.cuda_graphs where it cannot hold (CPU, several ranks, a strategy it cannot capture, a task
    with state of its own): ConfigError before anything starts."""
    if cfg.train.cuda_graphs:
        import torch

        from ddp_slurm.train import graphs, strategy

        graphs.check(cfg, strategy.of(cfg.dist.strategy), env.world_size, torch.cuda.is_available(), task_cls)


def run(task: type | str | None = None, overrides: Iterable[str] = (), config_file: str | Path | None = None) -> int:
    """Train ``task`` (a Task class or an import path) in this process, as one rank of whatever launched
    it (torchrun, srun, submitit, or nothing: one process). Returns the exit code; never exits.

    ``ddp_slurm.run(Digits, ["train.epochs=2", "run.name=digits"])`` in a notebook trains on one
    process; the same call inside a submitit job or under torchrun trains one rank of many.
    """
    overrides = list(overrides)
    if isinstance(task, str):
        overrides.append(f"task={task}")
        task = None
    return train(Path(config_file) if config_file else None, overrides, task=task)


def train(
    config_file: Path | None, overrides: Iterable[str], stop: StopFlag | None = None, task: type | None = None
) -> int:
    """Train one rank; returns the exit code.

    ``stop``: a StopFlag the caller already installed for ``slurm.signal`` (the submitit callable does,
    before anything else runs, so that no stop signal reaches submitit's own handlers); train then
    leaves installing and restoring it to the caller. ``task``: a Task class given by the Python API.
    """
    own_stop = stop is None
    try:
        cfg = config.load(config_file, overrides, task=task)
        env = DistEnv.from_environ(os.environ)
        config.check_world_size(cfg, env.world_size)
        syncdebug.mode_from(os.environ)  # DDP_SLURM_SYNC_DEBUG: a bad value refused before anything exists
        loggers.require(cfg)
        task_cls = check_task(cfg, env, task)
        check_graphs(cfg, env, task_cls)
        if stop is None:
            stop = StopFlag(parse_signal(cfg.slurm.signal))
        else:  # installed early for every candidate signal: now only slurm.signal requeues
            stop.configure(parse_signal(cfg.slurm.signal))
    except errors.Error as exc:  # a config or environment that cannot be used: nothing was started
        print(f"ddp_slurm.train: error: {exc}", file=sys.stderr)
        return exc.exit_code
    from ddp_slurm.train import logs

    logs.setup(env.rank)
    if own_stop:
        stop.install()  # before the rendezvous: a signal at any time from here on is a clean stop
    try:
        return _train_rank(cfg, task_cls, env, stop)
    finally:
        if own_stop:
            stop.close()  # a stopping rank ignores further stop signals until it has exited (see signals.py)


def _train_rank(cfg: Config, task_cls: type, env: DistEnv, stop: StopFlag) -> int:
    from ddp_slurm.distributed import group, stall, watchdog
    from ddp_slurm.slurmjob import chain
    from ddp_slurm.train import logs, loop

    # The run's own config once loop.train has named the run (it never writes into ``cfg``): the hosts of a
    # lost peer are recorded in that run's directory.
    own = {"cfg": cfg}
    try:
        with (
            group.distributed(env, cfg.dist.backend, cfg.dist.timeout_s, lambda: stop.requested) as (device, backend),
            # names a lost or stuck rank before the backend's own timeout ends the job, and records its host
            # before this rank exits; an error whose message says it all (errors.Error) is this rank's own
            watchdog.watch(
                env,
                ignore=(errors.Error,),
                after_beat=stall.checker(
                    stall.deadline_s(cfg.dist.timeout_s),
                    before_exit=lambda lost: chain.after_peer_lost(own["cfg"], env, lost),
                ),
            ) as dog,
        ):
            return loop.train(
                cfg, task_cls, env, device, backend, stop=stop, dog=dog, named=lambda chosen: own.update(cfg=chosen)
            )
    except errors.Stopped as exc:  # nothing started: a clean stop, as documented for exit 75
        stop.stopping = True  # a second signal (torchrun's TERM) must not turn it into death by signal
        log.warning("%s", exc)
        return exc.exit_code
    except errors.Error as exc:  # its one line says it all (a task's own errors among them)
        log.error("%s", exc)
        if isinstance(exc, watchdog.PeerLost):  # a node named: recorded, and the job requeued without it
            chain.after_peer_lost(own["cfg"], env, exc)
        return exc.exit_code
    except Exception as exc:
        gist = logs.collective_failure(exc)
        if gist:  # a consequence: the rank that failed first has logged the traceback that matters
            log.error("training failed: another rank stopped answering (its log says why): %s", gist)
        else:
            log.exception("training failed")
        return EXIT_FAILURE
