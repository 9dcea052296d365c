"""The doctor's probes for a slow node or link, judged against the median of the others (no absolute
thresholds: a cluster is compared with itself).

- **compute**: every rank times the same matrix products on its device at the same moment; a host is the
  slowest of its ranks. A host slower than ``factor`` times the other hosts' median is named (a node starved
  of CPU, a throttled GPU).
- **links**: every rank sends a buffer to the next rank and receives one from the previous (a ring), then
  the other way round, all at once; each receive times one link between two hosts. A link slower than
  ``factor`` times the other links' median is named, and a host every one of whose links is slow is named
  instead of its links (its network card or cable, not one path). A host named for its compute is left
  out of the links' judgement: its transfers are slow for the same reason.

``judge`` is pure: rows in (one per rank, as the doctor gathers them), findings out.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any

from ddp_slurm.train.clock import slow_ranks

COMPUTE_SIZE = 256  # small enough for a starved CPU to finish in seconds, large enough to time
COMPUTE_PRODUCTS = 100  # about 0.1 s on one CPU core: long enough that scheduling noise averages out
REPEATS = 5


def compute_seconds(device: Any, phase) -> float:
    """Median seconds of ``COMPUTE_PRODUCTS`` products of two ``COMPUTE_SIZE``-square matrices on ``device``."""
    import torch

    a = torch.rand(COMPUTE_SIZE, COMPUTE_SIZE, device=device)
    times = []
    with phase("the compute probe"):
        for _ in range(REPEATS + 1):  # the first is a warm-up (allocation, kernel selection)
            start = time.perf_counter()
            b = a
            for _ in range(COMPUTE_PRODUCTS):
                b = torch.tanh(b @ a)  # tanh keeps the values bounded
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def ring_seconds(device: Any, rank: int, world_size: int, size_mb: float, phase, group: Any = None) -> dict[str, float]:
    """Seconds to receive ``size_mb`` MiB from the previous rank (``from_prev``) and from the next (``from_next``),
    every rank sending and receiving at once (median of ``REPEATS``). Empty with one rank."""
    import torch
    import torch.distributed as dist

    if world_size < 2:
        return {}
    send = torch.ones(max(1, int(size_mb * 2**20) // 4), device=device)
    recv = torch.empty_like(send)
    out = {}
    for name, to, frm in (
        ("from_prev", (rank + 1) % world_size, (rank - 1) % world_size),
        ("from_next", (rank - 1) % world_size, (rank + 1) % world_size),
    ):
        times = []
        with phase(f"the link probe ({name.replace('_', ' ')})"):
            for _ in range(REPEATS + 1):
                dist.barrier(group=group)
                start = time.perf_counter()
                ops = [dist.P2POp(dist.isend, send, to, group), dist.P2POp(dist.irecv, recv, frm, group)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
        out[name] = statistics.median(times[1:])
    return out


def _links(rows: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
    """(from host, to host) -> the slowest seconds measured on it, links between two hosts only."""
    by_rank = {r["rank"]: r for r in rows}
    n = len(rows)
    links: dict[tuple[str, str], float] = {}
    for r in rows:
        for key, peer in (("from_prev", (r["rank"] - 1) % n), ("from_next", (r["rank"] + 1) % n)):
            seconds = r.get("links", {}).get(key)
            src, dst = by_rank[peer]["node"], r["node"]
            if seconds is not None and src != dst:
                links[(src, dst)] = max(seconds, links.get((src, dst), 0.0))
    return links


def judge(rows: list[dict[str, Any]], factor: float, size_mb: float) -> list[tuple[str, str]]:
    """(where, why) for each host computing, or host or link transferring, more than ``factor`` times slower
    than the median of the others."""
    found: list[tuple[str, str]] = []
    compute: dict[str, float] = defaultdict(float)
    for r in rows:
        if r.get("compute_s") is not None:
            compute[r["node"]] = max(compute[r["node"]], r["compute_s"])
    hosts = sorted(compute)
    times = [compute[h] for h in hosts]
    for i in slow_ranks(times, factor):
        others = statistics.median(times[:i] + times[i + 1 :])
        found.append(
            (
                hosts[i],
                f"computes {times[i] / others:.1f}x slower than the other nodes' median "
                f"({1e3 * times[i]:.0f} ms vs {1e3 * others:.0f} ms for the same matrix products): a node short of "
                "CPU or a throttled device",
            )
        )
    starved = {host for host, _ in found}  # slow to compute: slow to send too (gloo's copies run on its CPU)
    links = {k: v for k, v in _links(rows).items() if not starved & set(k)}
    names = sorted(links)
    seconds = [links[k] for k in names]
    slow = {names[i] for i in slow_ranks(seconds, factor)}
    median = statistics.median(seconds) if seconds else 0.0
    rate = lambda s: size_mb * 2**20 / s / 1e6  # noqa: E731  (MB/s)
    touching: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for link in names:
        for host in link:
            touching[host].append(link)
    whole = [h for h, ls in sorted(touching.items()) if len(ls) > 1 and all(link in slow for link in ls)]
    for host in whole:
        worst = max(links[link] for link in touching[host])
        found.append(
            (
                host,
                f"every link to and from it is slow (down to {rate(worst):.1f} MB/s, the links' median "
                f"{rate(median):.1f} MB/s): its network interface, cable or switch port",
            )
        )
    for src, dst in sorted(slow):
        if src not in whole and dst not in whole:
            found.append(
                (
                    f"link {src} -> {dst}",
                    f"{rate(links[(src, dst)]):.1f} MB/s, the links' median {rate(median):.1f} MB/s",
                )
            )
    return found
