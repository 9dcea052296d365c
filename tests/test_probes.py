"""The doctor's verdict on slow nodes and links (ddp_slurm/tools/probes.py), from rows as the ranks report
them: judged against the median of the others, never against a fixed number."""

from __future__ import annotations

from typing import Any

from ddp_slurm.tools.probes import judge


def rows(compute: list[float], prev: list[float], nxt: list[float]) -> list[dict[str, Any]]:
    """One rank per node ``node1..N``: its compute seconds and the seconds to receive from each ring neighbour."""
    return [
        {"rank": r, "node": f"node{r + 1}", "compute_s": c, "links": {"from_prev": p, "from_next": n}}
        for r, (c, p, n) in enumerate(zip(compute, prev, nxt))
    ]


def test_a_quiet_cluster_names_nobody() -> None:
    assert judge(rows([0.10, 0.12, 0.11, 0.13], [0.01, 0.012, 0.011, 0.01], [0.011, 0.01, 0.012, 0.01]), 3.0, 8) == []


def test_a_node_short_of_cpu_is_named_and_its_slow_links_are_not_blamed_on_the_network() -> None:
    # node2 (rank 1) computes 8x slower, and its gloo copies make its links slow too.
    found = judge(rows([0.1, 0.8, 0.1, 0.1], [0.01, 0.2, 0.2, 0.01], [0.2, 0.2, 0.01, 0.01]), 3.0, 8)
    assert [where for where, _ in found] == ["node2"]
    assert "computes 8.0x slower than the other nodes' median (800 ms vs 100 ms" in found[0][1]


def test_a_node_whose_every_link_is_slow_is_named_instead_of_its_links() -> None:
    # Ring 1 -> 2 -> 3 -> 4 -> 1 and back: every link to or from node2 takes 1 s, the others 0.01 s.
    prev = [0.01, 1.0, 1.0, 0.01]  # rank r receives from r-1: node1->node2 and node2->node3 slow
    nxt = [1.0, 1.0, 0.01, 0.01]  # rank r receives from r+1: node2->node1 and node3->node2 slow
    found = judge(rows([0.1] * 4, prev, nxt), 3.0, 8)
    assert [where for where, _ in found] == ["node2"]
    assert "every link to and from it is slow (down to 8.4 MB/s, the links' median" in found[0][1]


def test_one_slow_link_is_named_as_a_link() -> None:
    prev = [0.01, 0.01, 0.5, 0.01]  # node2 -> node3 only
    found = judge(rows([0.1] * 4, prev, [0.01] * 4), 3.0, 8)
    assert found == [("link node2 -> node3", "16.8 MB/s, the links' median 838.9 MB/s")]


def test_one_host_or_one_rank_is_compared_with_nothing() -> None:
    same_host = [{"rank": r, "node": "node1", "compute_s": 0.1 * (r + 1), "links": {}} for r in range(3)]
    assert judge(same_host, 3.0, 8) == []
    assert judge([{"rank": 0, "node": "node1", "compute_s": 1.0, "links": {}}], 3.0, 8) == []
