"""The guard's lines in metrics.jsonl as ``report`` shows them: each rollback, its replay's verdict and
the steps it skipped.

In one process the guard writes ``rollback`` (the flagged step, why, the step gone back to), then, once
the replay reaches the flagged step, ``replay`` (its verdict) and, when the replay reproduced the flag,
``skip`` (the steps never trained on again and their samples of the data order), all three at the
flagged step. A run stopped or killed during the replay leaves a rollback without a verdict.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Rollback:
    """A ``rollback`` line with the ``replay`` and ``skip`` lines that followed it (None: none yet)."""

    row: dict[str, Any]
    replay: dict[str, Any] | None = None
    skip: dict[str, Any] | None = None

    @property
    def skipped(self) -> tuple[int, int] | None:
        """The steps skipped after the replay, first and last (inclusive)."""
        return (self.skip["steps"][0], self.skip["steps"][1]) if self.skip is not None else None


def collect(rollbacks: list[Rollback], row: dict[str, Any]) -> None:
    """Adds a ``rollback``, ``replay`` or ``skip`` line to the rollbacks read so far. A verdict belongs to
    the latest rollback of the same step (the guard writes it at the flagged step, in the same process);
    one that matches none is not drawn, as nothing says what it judged."""
    kind, latest = row["kind"], rollbacks[-1] if rollbacks else None
    if kind == "rollback":
        rollbacks.append(Rollback(row))
    elif latest is None or latest.row["step"] != row["step"]:
        return
    elif kind == "replay" and latest.replay is None:
        latest.replay = row
    elif kind == "skip" and latest.skip is None and latest.replay is not None:
        latest.skip = row


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


def describe(rollback: Rollback) -> str:
    """``rollback 1 at step 9 (why): back to step 5; replay reproduced it: skipped step 9 (samples 256-287)``,
    or ``...; replay did not reproduce it: rank 1 (host node2) computed differently at step 12``."""
    row, replay = rollback.row, rollback.replay
    why = f" ({row['why']})" if row.get("why") else ""
    text = f"rollback {row.get('rollback', '?')} at step {row['step']}{why}: back to step {row['to']}"
    if replay is None:
        return text + "; no replay verdict (still replaying, or stopped before the replay's end)"
    if replay.get("verdict") == "reproduced":
        text += "; replay reproduced it"
        if rollback.skip is not None:
            first, last = rollback.skip["steps"]
            samples, bad = rollback.skip.get("samples"), rollback.skip.get("bad_samples")
            # The line holds [start, end) of the data order; people count the samples they name inclusively.
            shown = f" (samples {samples[0]}-{samples[1] - 1})" if samples else ""
            if bad:  # the samples found bad (by name for shards, else by dataset index): left out from then on
                names = rollback.skip.get("bad_names") or [str(i) for i, _ in bad]
                shown = f" (bad sample(s) {', '.join(names)}, left out of later epochs)"
            text += f": skipped {_steps(first, last)}{shown}"
        return text
    if replay.get("verdict") != "not reproduced":  # one this reader does not know: shown as it is
        return text + f"; replay verdict: {replay.get('verdict')}"
    ranks, hosts = replay.get("ranks") or [], replay.get("hosts") or []
    if len(hosts) == len(ranks):
        who = ", ".join(f"rank {r} (host {h})" for r, h in zip(ranks, hosts))
    else:  # the hosts not said for every rank: the ranks alone, not paired wrongly
        who = ", ".join(f"rank {r}" for r in ranks)
    at = f" at step {replay['at']}" if replay.get("at") is not None else ""
    return text + f"; replay did not reproduce it: {who or 'a rank'} computed differently{at}"


def draw(ax: Any, rollbacks: list[Rollback], x: Callable[[int], float]) -> None:
    """On the loss axes: a triangle at the top edge above each rollback's step and a shaded span over each
    skipped range of steps, each in the legend once. The triangle is not at the flagged loss: that value
    was superseded by the replay, or its step skipped, so it is not in the plotted history."""
    if not rollbacks:
        return
    ax.plot(
        [x(r.row["step"]) for r in rollbacks],
        [0.94] * len(rollbacks),
        "v",
        color="tab:red",
        markersize=9,
        transform=ax.get_xaxis_transform(),  # x in steps (or samples), y in axes units: clear of any loss scale
        clip_on=False,
        label="guard rollback",
    )
    spans = [r.skipped for r in rollbacks if r.skipped is not None]
    for i, (first, last) in enumerate(spans):
        # Step s trains the batch after x(s - 1): the span covers each skipped step's whole batch.
        ax.axvspan(x(first - 1), x(last), color="tab:red", alpha=0.15, label="skipped steps" if i == 0 else None)
