"""The doctor's rows, one per rank, side by side: the problems only visible that way (``cross_checks``), the
table rank 0 prints and its summary line, and the one line a failure is said in (``fail_line``). No torch
here: the table's legend imports the probes only once a table is made. The command itself, its phases and
its collectives are ``doctor.py``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from ddp_slurm import text
from ddp_slurm.tools.preflight import Failure


def cross_checks(rows: list[dict[str, Any]]) -> list[tuple[str, Failure]]:
    """Problems only visible with every rank's report side by side: (where, failure)."""
    problems: list[tuple[str, Failure]] = []
    sizes = {r["world_size"] for r in rows}
    if len(sizes) > 1 or len(rows) not in sizes:
        problems.append(
            (
                "all ranks",
                Failure(
                    "mismatched world size", (f"{len(rows)} ranks joined but they report world sizes {sorted(sizes)}")
                ),
            )
        )
    hosts_of_node: dict[int, set[str]] = defaultdict(set)
    local_ranks: dict[tuple[str, int], list[int]] = defaultdict(list)
    gpu_users: dict[tuple[str, str], list[int]] = defaultdict(list)
    for r in rows:
        hosts_of_node[r["node_rank"]].add(r["host"])
        local_ranks[(r["host"], r["node_rank"])].append(r["local_rank"])
        if r["gpu"] is not None:  # the same physical device, not the same name: every task's may be "0"
            gpu_users[(r["node"], r.get("gpu_id") or r["gpu"])].append(r["rank"])
        if not r["correct"]:
            problems.append(
                (
                    f"rank {r['rank']} on {r['node']}",
                    Failure(
                        "all-reduce wrong",
                        ("the sum of a test tensor came back wrong: a faulty GPU, driver or network card"),
                    ),
                )
            )
    for node, hosts in sorted(hosts_of_node.items()):
        if len(hosts) > 1:
            problems.append(
                (
                    f"node rank {node}",
                    Failure(
                        "duplicate ranks",
                        (
                            f"node rank {node} is claimed by hosts {', '.join(sorted(hosts))}: every node needs its own "
                            "node rank (torchrun --node_rank, or a shared --rdzv-endpoint)"
                        ),
                    ),
                )
            )
    for (host, node), locals_ in sorted(local_ranks.items()):
        if len(set(locals_)) < len(locals_):
            problems.append(
                (
                    f"{host}",
                    Failure(
                        "duplicate ranks",
                        (f"local ranks {sorted(locals_)} on node rank {node}: two processes share a local rank"),
                    ),
                )
            )
    for (node, _), ranks in sorted(gpu_users.items()):
        if len(ranks) > 1:
            first = next(r for r in rows if r["rank"] == ranks[0])
            count = first["cuda_count"]
            gpu = first["gpu"] + (f" ({first['gpu_id']})" if first.get("gpu_id") else "")
            problems.append(
                (
                    f"{node}",
                    Failure(
                        "CUDA device count vs tasks per node",
                        (
                            f"ranks {', '.join(map(str, ranks))} share GPU {gpu} ({count} visible per task): ask Slurm "
                            "for one GPU per task (--gpus-per-task=1) or fewer tasks per node"
                        ),
                    ),
                )
            )
    return problems


def table(rows: list[dict[str, Any]]) -> str:
    """A row per rank, columns padded to fit."""
    head = [
        "rank",
        "local",
        "node",
        "host",
        "device",
        "backend",
        "iface",
        "address",
        "loopback",
        "gpus",
        "latency ms",
        "bus GB/s",
        "compute ms",
    ]
    body = [
        [
            str(r["rank"]),
            f"{r['local_rank']}/{r['local_world_size']}",
            f"{r['node_rank']}/{r['num_nodes']}",
            r["host"] if r["node"] == r["host"] else f"{r['host']} ({r['node']})",
            r["device"],
            r["backend"],
            r["ifname"] or "?",
            r["if_address"] or "?",
            "yes" if r["host_loopback"] else "no",
            str(r["cuda_count"]) + (f" (uses {r['gpu']})" if r["gpu"] is not None else ""),
            f"{r['latency_ms']:.3f}",
            f"{r['bus_gbps']:.2f}" if r["bus_gbps"] is not None else "-",
            f"{1e3 * r['compute_s']:.0f}" if r.get("compute_s") is not None else "-",
        ]
        for r in sorted(rows, key=lambda r: r["rank"])
    ]
    from ddp_slurm.tools import probes  # torch: only once a table is made, never for --help

    legend = (
        f"compute ms: {probes.COMPUTE_PRODUCTS} products of two {probes.COMPUTE_SIZE}x{probes.COMPUTE_SIZE} matrices "
        f"on the rank's device, the median of {probes.REPEATS} (compared between nodes: the slow-node probe)"
    )
    return "\n".join([*text.columns([head, *body]), legend])


def summary(rows: list[dict[str, Any]], size_mb: float) -> str:
    first = rows[0]
    nodes = len({r["node"] for r in rows})
    bus = [r["bus_gbps"] for r in rows if r["bus_gbps"] is not None]
    rendezvous = f"{first['master_addr']}:{first['master_port']}" if first["world_size"] > 1 else "none (one process)"
    if first["world_size"] > 1 and first["master_ip"] and first["master_ip"] != first["master_addr"]:
        rendezvous += f" ({first['master_ip']})"
    text = (
        f"{len(rows)} rank(s) on {nodes} host(s), launcher {first['launcher']}, rendezvous {rendezvous}\n"
        f"all-reduce: {'correct' if all(r['correct'] for r in rows) else 'WRONG'}; latency (4 B) "
        f"{max(r['latency_ms'] for r in rows):.3f} ms (slowest rank)"
    )
    if bus:
        text += f"; bus bandwidth ({size_mb:g} MiB) {min(bus):.2f} GB/s (slowest rank)"
    return text


def fail_line(where: str, failure: Failure) -> str:
    return f"doctor: FAIL {where}: {failure.cause}: {failure.detail}"
