"""A loss spike, judged on the host one step late from the mean loss the stop vote already carries.

The running statistics are an exponential mean of the loss and of its absolute deviation from that mean
(robust to the heavy right tail a minibatch loss has, unlike a variance), over about ``guard.window`` steps.
After ``guard.warmup`` steps, a loss above ``mean + guard.spike * max(deviation, 1% of |mean|)`` is a spike;
a spike (and a non-finite loss) does not enter the statistics. The floor on the deviation keeps a loss that
has flattened out from calling its first wobble a spike.

The statistics are a checkpoint part of their own (``checkpoint.standard.GuardState``), in every checkpoint: a resumed run, and
a run rolled back, judge each later step exactly as the run left alone would.
"""

from __future__ import annotations

import math
from typing import Any

FLOOR = 0.01  # the deviation is at least this share of |mean|


def fresh() -> dict[str, Any]:
    """The guard's state before the first step: no statistics, no skipped steps, no rollbacks."""
    return {"mean": None, "dev": 0.0, "seen": 0, "skips": [], "rollbacks": 0, "samples": []}


def limit(state: dict[str, Any], k: float | None, warmup: int) -> float | None:
    """The loss above which a step is a spike now (None: none is, yet or with ``guard.spike`` off)."""
    mean = state["mean"]
    if mean is None or k is None or state["seen"] < warmup:
        return None
    return mean + k * max(state["dev"], FLOOR * abs(mean))


def observe(state: dict[str, Any], loss: float, k: float | None, warmup: int, window: int) -> str:
    """Take the step's mean ``loss`` into ``state`` (in place); why it is a spike ("" when it is not).
    ``k``: ``guard.spike`` (None: never a spike)."""
    if not math.isfinite(loss):
        return ""  # the non-finite flag says so, with its own line
    mean, dev = state["mean"], state["dev"]
    above = limit(state, k, warmup)
    if above is not None and loss > above:
        scale = max(dev, FLOOR * abs(mean))
        return f"loss {loss:.4g} is {(loss - mean) / scale:.1f} deviations above its running mean {mean:.4g}"
    alpha = 2.0 / (window + 1)
    if mean is None:
        state["mean"] = loss
    else:
        state["dev"] = (1 - alpha) * dev + alpha * abs(loss - mean)
        state["mean"] = (1 - alpha) * mean + alpha * loss
    state["seen"] += 1
    return ""
