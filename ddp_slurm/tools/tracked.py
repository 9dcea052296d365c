"""Which evaluation metric a run tracks, which way is better, and how to show it: one home for the tools.

Training writes the task's ``best_metric`` and ``higher_is_better`` into every ``start`` line of
metrics.jsonl; ``report``, ``submit --summary``, sweep tables and ``submit``'s closing line read them
from there (no task import, no torch). A run written before those fields existed tracks ``accuracy``
(higher is better) when its evaluations have one, as it always did.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from ddp_slurm import text

# Fields of an eval line that are not metrics.
_POSITION = frozenset({"kind", "step", "epoch", "time_s", "test_samples"})


@dataclass(frozen=True)
class Tracked:
    """The metric a run is judged by: ``name`` (None: the task tracks none) and its direction."""

    name: str | None
    higher_is_better: bool = True
    percent: tuple[str, ...] | None = None
    """The task's ``percent_metrics`` (None: it declared none, the default rule applies; ``text.is_percent``)."""

    def best(self, rows: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
        """The row with the best value of the metric (the earliest on a tie), or None."""
        scored = [r for r in rows if self.name and is_number(r.get(self.name))]
        if not scored:
            return None
        pick = max if self.higher_is_better else min
        return pick(scored, key=lambda r: r[self.name])

    def sort_key(self, value: float | None) -> tuple[int, float]:
        """Best first, runs without a value last: ``sorted(runs, key=lambda r: t.sort_key(r.best))``."""
        if value is None:
            return (1, 0.0)
        return (0, -value if self.higher_is_better else value)

    @property
    def direction(self) -> str:
        return "higher is better" if self.higher_is_better else "lower is better"


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def show(name: str, value: float | None, percent: Collection[str] | None = None) -> str:
    """``97.50%`` for a fraction shown as a percentage, ``0.0003142`` for the rest, ``-`` for nothing (the
    training log's rule: ``text.metric_value``)."""
    return "-" if value is None else text.metric_value(name, value, percent)


def axis_label(name: str, percent: Collection[str] | None = None) -> str:
    return f"{name} (%)" if text.is_percent(name, percent) else name


def scale(name: str, value: float, percent: Collection[str] | None = None) -> float:
    """The value as plotted (fractions shown as percentages x100)."""
    return 100 * value if text.is_percent(name, percent) else value


def eval_metrics(evals: Iterable[dict[str, Any]]) -> list[str]:
    """Every metric the eval lines carry, in the order first seen."""
    names: dict[str, None] = {}
    for row in evals:
        names.update({k: None for k, v in row.items() if k not in _POSITION and is_number(v)})
    return list(names)


def from_rows(starts: Iterable[dict[str, Any]], evals: Iterable[dict[str, Any]]) -> Tracked:
    """The latest start line's ``best_metric``; for older files ``accuracy`` when the evals have one."""
    for start in reversed(list(starts)):
        if "best_metric" in start:
            name, percent = start["best_metric"], start.get("percent_metrics")
            if not (isinstance(percent, list) and all(isinstance(p, str) for p in percent)):
                percent = None  # a file from before the field (or not this program's): the default rule
            return Tracked(
                name if isinstance(name, str) else None,
                start.get("higher_is_better") is not False,
                tuple(percent) if percent is not None else None,
            )
    return Tracked("accuracy" if "accuracy" in eval_metrics(evals) else None)
