"""The guard: a run that heals itself from a loss spike or a non-finite loss, in the same job.

The loop asks three things of it (``loop.loop``): ``skipped(step)`` before a step (a skipped step trains
nothing: ``skips.py``), ``stepped(loss)`` after one, and ``check(bad)`` once the ranks agreed on a step,
which returns the batches to go on with when it moved the run (None: go on). With ``guard.rollbacks`` at 0
it only stops the run on a non-finite loss (exit 1), as before; otherwise:

1. **Detect** (``spike.py``): every rank judges the same mean loss over the ranks, which the stop vote
   carries one step late at no cost; and the vote's non-finite flag. No added host sync.
2. **Roll back** (``Checkpointer.go_back``): every rank restores the newest checkpoint before the suspect
   steps (``guard.suspect_steps``, ending at the flagged one), in this process; the newer checkpoints are
   set aside, never deleted. A fresh guarded run saves step 0 first, so there always is one.
3. **Replay** (``replay.py``) the steps from there to the flagged one: the data order is addressed by
   position and every RNG stream restored, so sound hardware computes the same bits again. Each rank
   compares its losses and gradient fingerprints with the first pass.
4. **Verdict**: reproduced: the data did it; its steps are skipped (``skips.py``) and the run goes back
   once more and trains on without them. Not reproduced: a fault; the rank that computed differently is
   named with its host, the host is recorded in ``lost_nodes`` (kept out of the next requeue or submit),
   and training goes on from the replay, which is sound. Where every rank of several computed differently,
   no node is to blame (a nondeterministic kernel: ``train.deterministic`` is off): no host is recorded, the
   line says so and how to make a replay conclusive.

The rollback and the verdict wait for the device at a step that is not a boundary: they run with the
sync-debug watch paused (``hooks/syncdebug.py``), and the hooks start again after them.

Each rollback, verdict and skip is a log line, a metrics.jsonl line (``report`` draws them) and a line of
``<run dir>/guard.jsonl`` (``record.py``); skipped steps and the rollback count are in every checkpoint.
``guard.rollbacks`` rollbacks at most: the next flag ends the run (exit 1) naming its steps. docs/guard.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from ddp_slurm import errors, skips
from ddp_slurm.distributed.group import on_rank0
from ddp_slurm.skips import Skips
from ddp_slurm.slurmjob import badnodes
from ddp_slurm.train.checkpoint.standard import GuardState
from ddp_slurm.train.checkpoint.state import gather
from ddp_slurm.train.guard import culprits, record, replay, spike
from ddp_slurm.train.hooks import syncdebug

log = logging.getLogger("ddp_slurm")


class NonFiniteLoss(errors.Error):
    """The loss became NaN/inf and the guard is off: stop before anything is saved (exit 1)."""


class GuardExhausted(errors.Error):
    """A flagged step with ``guard.rollbacks`` used up, or nothing to go back to (exit 1)."""


class Guard:
    """One per rank and launch; see the module docstring. ``save()``: checkpoint the state now (the loop's)."""

    def __init__(self, t: Any, ckpt: Any, votes: Any, side: Any, save: Callable[[], None]) -> None:
        self.t, self.ckpt, self.votes, self.side, self.save = t, ckpt, votes, side, save
        run = t.run
        self.cfg = run.cfg.guard
        self.on = self.cfg.rollbacks > 0
        self.part = run.parts.of(GuardState)  # the guard's state: a checkpoint part of its own
        state = self.part.value or spike.fresh()
        self.flagged, noted, noted_samples = on_rank0(
            run.env, lambda: (*record.read(run.cfg.paths), record.bad_samples(run.cfg.paths)), run.groups.host
        )
        by_hand = skips.parse(self.cfg.skip) if self.cfg.skip else []
        self.skips = Skips([tuple(r) for r in state["skips"]] + noted + by_hand)
        if run.total_steps and self.skips.covers_all(1, run.total_steps):  # it would "finish" an untrained model
            raise errors.UsageError(
                f"the skipped steps ({skips.show(self.skips.ranges)}: guard.skip and the guard's record) cover every "
                f"step of the run (1-{run.total_steps}): nothing would train; narrow guard.skip"
            )
        state["skips"], state["rollbacks"] = self.skips.as_list(), max(state["rollbacks"], len(self.flagged))
        by_hand = skips.parse_samples(self.cfg.drop) if self.cfg.drop else []
        by_hand_samples = [[_index_of(run, who), epoch] for who, epoch in by_hand]
        state["samples"] = sorted({tuple(p) for p in state.get("samples", []) + noted_samples + by_hand_samples})
        state["samples"] = [list(p) for p in state["samples"]]
        self.part.value = state
        run.batches.skip = self.skips.covers
        if hasattr(run.batches, "drop"):
            run.batches.drop = {i: e for i, e in state["samples"]}  # the bad samples, left out from their epoch on
        self.trace = replay.Trace() if self.on else None
        self.replay: _Replay | None = None

    @property
    def state(self) -> dict[str, Any]:
        return self.part.value

    def start(self) -> None:
        """Before the first step: a fresh guarded run saves step 0, so that a rollback always has a checkpoint."""
        if self.on and self.t.run.pos.step == 0 and self.ckpt.saved_step != 0:
            self.save()

    def skipped(self, step: int) -> bool:
        """Whether ``step``'s batch is skipped (no batch is drawn for it: ``loader.kept_steps``)."""
        return bool(self.skips) and self.skips.covers(step)

    def stepped(self, loss: Any) -> None:
        """After a trained step: this rank's loss and gradient fingerprint, kept on the device."""
        if self.trace is not None and loss is not None:
            trace = self.replay.trace if self.replay is not None else self.trace
            trace.add(self.t.run.pos.step, loss, self.t.run.model)

    def check(self, bad: bool) -> Iterator[Any] | None:
        """Once the ranks agreed on a step: the batches to go on with when the run moved, else None."""
        losses = self.votes.take_losses()
        pos = self.t.run.pos
        if not self.on:
            if bad:
                raise NonFiniteLoss(
                    f"{self.votes.bad} (epoch {pos.epoch + 1}): stopping; nothing non-finite was saved "
                    "(lower train.lr and start a new run.name, or let the guard roll back: guard.rollbacks)"
                )
            return None
        flagged: tuple[int, str] | None = None
        for step, value in losses:
            why = spike.observe(self.state, value, self.cfg.spike, self.cfg.warmup, self.cfg.window)
            if why and flagged is None:
                flagged = (step, why)
        if bad and (flagged is None or self.votes.bad_step <= flagged[0]):
            flagged = (self.votes.bad_step, self.votes.bad.replace(f" at step {self.votes.bad_step}", ""))
        if self.replay is not None and pos.step < self.replay.end:  # a replay judges by its records, not flags
            return None
        if self.replay is None and flagged is None:
            return None
        # Not a boundary: the sync-debug watch is on, and the rollback (a checkpoint loaded) and the verdict
        # (the traces read) wait for the device. The hooks' start comes after, the watch as it should be.
        with syncdebug.paused(self.side):
            if self.replay is not None:
                moved = self._verdict(again=flagged is not None and flagged[0] == self.replay.end)
            else:
                assert flagged is not None
                moved = self._roll_back(*flagged)
        return self._batches() if moved else None

    # -- rollback, replay, verdict --------------------------------------------------------------
    def _roll_back(self, step: int, why: str) -> bool:
        window = (max(1, step - self.cfg.suspect_steps + 1), step)
        used = self.state["rollbacks"]
        again = step in self.flagged  # flagged before this launch, its replay cut short by a stop: the same one
        if used >= self.cfg.rollbacks and not again:
            raise GuardExhausted(
                f"{why} at step {step} (suspect: {_steps(window)}): guard.rollbacks={self.cfg.rollbacks} "
                f"used up; stopping. Resume with a higher guard.rollbacks, or guard.skip={skips.show([window])}"
            )
        number = used if again else used + 1
        self.flagged.add(step)
        to = self._go_back(window[0], number)
        self._say(
            "guard: %s at step %d: rolled back to step %d to replay steps %d-%d (rollback %d of %d)",
            why,
            step,
            to,
            to + 1,
            step,
            number,
            self.cfg.rollbacks,
        )
        self._line("rollback", step, to=to, why=why, suspect=list(window), rollback=number)
        first = self.trace.since(to) if self.trace is not None else replay.Trace()
        self.replay = _Replay(step, window, first)
        return True

    def _verdict(self, again: bool) -> bool:
        """The replay judged on every rank; whether the run went back again (bad data: to skip it).
        ``again``: the replay's own flags already flagged its last step."""
        run, rp = self.t.run, self.replay
        assert rp is not None
        again = self._flagged_at_end(rp.end) or again
        mine = replay.compare(rp.first, rp.trace) | {"rank": run.rank, "host": badnodes.host_name()}
        reports = gather(mine, run.rank, run.world_size, run.groups.host)
        reproduced, named, at = on_rank0(run.env, lambda: replay.judge(reports), run.groups.host)
        hosts = on_rank0(run.env, lambda: [reports[r]["host"] for r in named], run.groups.host)
        digests = {"first": mine["first"], "replay": mine["replay"], "steps": mine["steps"]}
        self.replay = None
        first, last = rp.window
        # Every rank of several differs: no node explains it, a nondeterministic kernel does. The replay's own
        # flag decides then: flagged again, the data (skipped); not flagged, a passing fault nobody is blamed for.
        nobody = not reproduced and replay.nobody_to_blame(named, run.world_size)
        if reproduced or (nobody and again):
            self.skips.add([rp.window])
            g = run.cfg.train.global_batch_size
            self._line("replay", rp.end, verdict="reproduced", exact=reproduced, suspect=list(rp.window), **digests)
            self.trace = replay.Trace()
            self._go_back(first, self.state["rollbacks"])
            bad = self._culprits(rp.end)
            names = [run.batches.name(i) for i in bad] if _sharded(run) else list(map(str, bad))
            named = (
                f"sample(s) {', '.join(names)} ({'shard:key' if _sharded(run) else 'dataset index'}), left out of "
                "every later epoch"
                if bad
                else (f"samples {(first - 1) * g}-{last * g - 1} of the data order; no sample alone explains it")
            )
            self._say(
                "guard: the replay %s step %d%s: the data of %s is bad: %s; skipping it and going back again",
                "reproduced" if reproduced else "flagged",
                rp.end,
                "" if reproduced else f" again, though every rank computed differently ({NONDETERMINISM})",
                _steps(rp.window),
                named,
            )
            found = [[i, (rp.end - 1) // run.steps_per_epoch] for i in bad]
            extra = {"bad_names": names} if _sharded(run) and bad else {}
            self._line(
                "skip", rp.end, steps=[first, last], samples=[(first - 1) * g, last * g], bad_samples=found, **extra
            )
            return True
        self.trace = rp.trace
        if nobody:
            self._say(
                "guard: the replay did not reproduce step %d on any rank: every rank computed differently at "
                "step %s, which no node explains (%s); no host recorded, training goes on from the replay",
                rp.end,
                at,
                NONDETERMINISM,
            )
            self._line("replay", rp.end, verdict=replay.NONDETERMINISTIC, ranks=named, hosts=[], at=at, **digests)
            return False
        who = ", ".join(f"rank {r} (host {h})" for r, h in zip(named, hosts))
        self._say(
            "guard: the replay did not reproduce step %d: %s computed differently at step %s: a fault, not the "
            "data; recorded in %s, training goes on from the replay",
            rp.end,
            who,
            at,
            run.cfg.paths.lost_nodes,
        )
        self._line("replay", rp.end, verdict="not reproduced", ranks=named, hosts=hosts, at=at, **digests)
        if run.rank == 0 and hosts:
            why = f"guard: step {rp.end} not reproduced by a replay; rank(s) {named} computed differently at step {at}"
            env = run.env
            badnodes.record(run.cfg.run_dir, hosts, env.job_id, env.restart_count, why, shared=run.cfg.run.shared)
        return False

    def _culprits(self, step: int) -> list[int]:
        """Every rank, back before the bad step: its culprits (``culprits.py``), left out of the data from the
        epoch they were found in on. None under ``train.cuda_graphs``: a captured step keeps its batch's shape."""
        run = self.t.run
        if run.cfg.train.cuda_graphs or not hasattr(run.batches, "samples"):
            return []
        bad = culprits.find(run, step, spike.limit(self.state, self.cfg.spike, self.cfg.warmup))
        epoch = (step - 1) // run.steps_per_epoch
        self.state["samples"] = sorted({tuple(p) for p in self.state["samples"]} | {(i, epoch) for i in bad})
        self.state["samples"] = [list(p) for p in self.state["samples"]]
        run.batches.drop = {i: e for i, e in self.state["samples"]}
        return bad

    def _flagged_at_end(self, end: int) -> bool:
        """Whether the replay flagged its last step (a spike, a non-finite loss). The vote carries that step's
        loss one step late: it is waited for and judged here, so that it is not judged again after the
        verdict (a replay that flagged the step again would roll back to it for ever)."""
        votes, flagged = self.votes, False
        votes.settle()
        for step, value in votes.take_losses():
            why = spike.observe(self.state, value, self.cfg.spike, self.cfg.warmup, self.cfg.window)
            flagged = flagged or (bool(why) and step == end)
        flagged = flagged or (bool(votes.bad) and votes.bad_step == end)
        votes.reset()
        return flagged

    def _go_back(self, before: int, rollbacks: int) -> int:
        """Every rank: the newest checkpoint before step ``before``, restored; the guard's skipped steps and
        rollbacks carried over (the checkpoint's own predate them). Returns the step gone back to."""
        run = self.t.run
        self.votes.reset()
        samples = list(self.state.get("samples", []))  # the restore below puts the checkpoint's older state back
        restored = self.ckpt.go_back(before)
        if restored is None:
            raise GuardExhausted(
                f"guard: no checkpoint of this run before step {before} to roll back to; stopping (exit 1)"
            )
        # the checkpoint's guard state predates the skips and rollbacks since: they carry over
        carried = {"skips": self.skips.as_list(), "rollbacks": rollbacks, "samples": samples}
        self.part.value = (self.part.value or spike.fresh()) | carried
        return run.pos.step

    def _batches(self) -> Iterator[Any]:
        run = self.t.run
        self.side.start(self.t)  # the hooks' windows count from the step gone back to
        return run.batches.epoch(run.pos.epoch, run.pos.step_in_epoch)

    def _say(self, *args: Any) -> None:
        """A warning on rank 0 (every rank reached the same verdict)."""
        if self.t.run.rank == 0:
            log.warning(*args)

    def _line(self, kind: str, step: int, **fields: Any) -> None:
        """The metrics.jsonl line (and the loggers'), and the run's own record of rollbacks and skips."""
        t = self.t
        t.metrics.write(kind, step, t.run.pos.epoch, t.elapsed(), **fields)
        if kind in ("rollback", "skip") and t.run.rank == 0:
            record.append(t.run.cfg.paths, kind, step=step, **fields)


NONDETERMINISM = (
    "a nondeterministic kernel does that: set train.deterministic=true so that a replay can tell bad data from a fault"
)


def _steps(window: tuple[int, int]) -> str:
    return f"step {window[0]}" if window[0] == window[1] else f"steps {window[0]}-{window[1]}"


class _Replay:
    """A replay under way: to step ``end``; the suspect ``window``; the first pass's trace and its own."""

    def __init__(self, end: int, window: tuple[int, int], first: replay.Trace) -> None:
        self.end, self.window, self.first, self.trace = end, window, first, replay.Trace()


def _sharded(run: Any) -> bool:
    """Whether the run's data names its samples (shards: ``shard.tar:key``); others go by dataset index."""
    return hasattr(getattr(run.batches, "dataset", None), "name")


def _index_of(run: Any, who: int | str) -> int:
    """The dataset index of a sample given by hand (``guard.drop``): an index, or a sharded sample's name."""
    if isinstance(who, int):
        return who
    if not _sharded(run):
        raise errors.UsageError(f"guard.drop={who}: a shard.tar:key name, but this task's data is not Shards")
    return run.batches.dataset.index_of(who)
