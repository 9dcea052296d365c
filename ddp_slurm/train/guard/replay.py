"""Telling bad data from a faulty rank: what each rank keeps of its steps, and the verdict of a replay.

Every rank keeps, per step, its own loss (before any collective) and a fingerprint of its gradients (the sum
of their squares: the local shard under fsdp) as device tensors: nothing waits for the device, and reading
them is left to the verdict. A replay of the same steps from the same checkpoint is deterministic (the data
order is addressed by position, every RNG stream is restored): on sound hardware every rank computes the very
same bits again. So after the replay each rank compares the two records of the steps both hold (their xxhash
digests travel to rank 0 as the evidence):

- every rank's records equal: the spike **reproduced**, the data did it, and its steps are skipped;
- some differ: **not reproduced**, a fault. The rank named is the one whose own loss differs first (a rank
  computing wrongly); where only gradients differ, those ranks are named (the exchange between ranks);
- every rank of several differs (``nobody_to_blame``): no node explains that. A nondeterministic kernel does
  (atomics, cuDNN's weight gradients, with ``train.deterministic`` off): after DDP's all-reduce the gradients
  of every rank differ. The verdict names no host.
"""

from __future__ import annotations

import struct
from collections import deque
from typing import Any

import torch
import xxhash
from torch import nn

NONDETERMINISTIC = "not reproduced on any rank"  # the replay line's verdict when every rank differs
LIMIT = 10_000  # steps a trace keeps (two small tensors each, on the device): docs/guard.md, "Limits"


def fingerprint(model: nn.Module) -> torch.Tensor:
    """The sum of squares of this rank's gradients, on the device (no host sync)."""
    grads = [
        g.to_local() if hasattr(g, "to_local") else g for g in (p.grad for p in model.parameters()) if g is not None
    ]
    if not grads:
        return torch.zeros((), device=next(model.parameters()).device)
    return torch.stack(torch._foreach_norm(grads)).float().square().sum()


class Trace:
    """This rank's record of its steps: ``(step, loss, gradient fingerprint)``, on the device."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.entries: deque[tuple[int, torch.Tensor, torch.Tensor]] = deque(maxlen=limit)

    def add(self, step: int, loss: torch.Tensor, model: nn.Module) -> None:
        self.entries.append((step, loss.detach().float().reshape(()), fingerprint(model)))

    def since(self, step: int) -> Trace:
        """The entries after ``step`` (a rollback's first pass, frozen)."""
        out = Trace(self.entries.maxlen or LIMIT)
        out.entries.extend(e for e in self.entries if e[0] > step)
        return out

    def values(self) -> dict[int, tuple[float, float]]:
        """``{step: (loss, fingerprint)}`` on the host: one read of the device for the whole trace."""
        if not self.entries:
            return {}
        steps = [e[0] for e in self.entries]
        both = torch.stack([torch.stack((e[1], e[2])) for e in self.entries]).double().cpu().tolist()
        return {s: (v[0], v[1]) for s, v in zip(steps, both)}


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)  # NaN compares equal to itself by its bits, not by ==


def compare(first: Trace, replay: Trace) -> dict[str, Any]:
    """This rank's side of the verdict: the first step whose loss, and whose gradients, differ between the
    two passes (None: none), the steps compared, and each pass's digest."""
    a, b = first.values(), replay.values()
    common = sorted(set(a) & set(b))
    loss_at = next((s for s in common if _bits(a[s][0]) != _bits(b[s][0])), None)
    grad_at = next((s for s in common if _bits(a[s][1]) != _bits(b[s][1])), None)

    def digest(values: dict[int, tuple[float, float]]) -> str:
        h = xxhash.xxh64()
        for s in common:
            h.update(struct.pack("<q", s) + _bits(values[s][0]) + _bits(values[s][1]))
        return h.hexdigest()

    return {"loss_at": loss_at, "grad_at": grad_at, "steps": len(common), "first": digest(a), "replay": digest(b)}


def judge(reports: list[dict[str, Any]]) -> tuple[bool, list[int], int | None]:
    """Rank 0, from every rank's ``compare`` (with its ``rank``): (reproduced, the ranks named, the first
    step that differs)."""
    firsts = [s for r in reports for s in (r["loss_at"], r["grad_at"]) if s is not None]
    if not firsts:
        return True, [], None
    at = min(firsts)
    named = [r["rank"] for r in reports if r["loss_at"] == at]
    if not named:
        named = [r["rank"] for r in reports if r["grad_at"] == at]
    return False, named, at


def nobody_to_blame(named: list[int], world_size: int) -> bool:
    """Whether the verdict names every rank of several: nothing to blame on a node (``judge``'s ranks)."""
    return world_size > 1 and set(named) >= set(range(world_size))
