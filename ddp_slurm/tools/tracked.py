"""Which evaluation metric a run tracks, which way is better, and how to show it: one home for the tools.

Training writes the task's ``best_metric`` and ``higher_is_better`` into every ``start`` line of
metrics.jsonl; ``report``, ``submit --summary``, sweep tables and ``submit``'s closing line read them
from there (no task import, no torch). A run written before those fields existed tracks ``accuracy``
(higher is better) when its evaluations have one, as it always did.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# Fields of an eval line that are not metrics.
_POSITION = frozenset({"kind", "step", "epoch", "time_s", "test_samples"})


@dataclass(frozen=True)
class Tracked:
    """The metric a run is judged by: ``name`` (None: the task tracks none) and its direction."""

    name: str | None
    higher_is_better: bool = True

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


def is_percent(name: str) -> bool:
    """Fractions shown as percentages: the accuracy-like metrics (as the training log shows them)."""
    return "accuracy" in name


def show(name: str, value: float | None) -> str:
    """``97.50%`` for an accuracy, ``0.0003142`` for the rest, ``-`` for nothing."""
    if value is None:
        return "-"
    return f"{100 * value:.2f}%" if is_percent(name) else f"{value:.4g}"


def axis_label(name: str) -> str:
    return f"{name} (%)" if is_percent(name) else name


def scale(name: str, value: float) -> float:
    """The value as plotted (accuracies in percent)."""
    return 100 * value if is_percent(name) else value


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
            name = start["best_metric"]
            return Tracked(name if isinstance(name, str) else None, start.get("higher_is_better") is not False)
    return Tracked("accuracy" if "accuracy" in eval_metrics(evals) else None)
