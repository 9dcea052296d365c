"""The successor job of a chain asks for what this job has (real `scontrol show job -o` text of the test
cluster); the chain on the real cluster: tests/cluster/test_faults_cluster.py."""

from __future__ import annotations

from test_allocation import JOB

from ddp_slurm.distributed import chain, jobinfo


def test_the_successor_asks_for_the_same_resources_and_log() -> None:
    opts = chain.resources(jobinfo.parse_job(JOB))
    assert opts == [
        "--nodes=2",
        "--ntasks=4",
        "--ntasks-per-node=2",
        "--cpus-per-task=1",
        "--time=1-00:05:00",
        "--partition=debug",
        "--gpus-per-node=1",
        "--job-name=s.sh",
        "--output=/tmp/x/slurm-3.out",
        "--open-mode=append",
        "--chdir=/tmp/x",
    ]


def test_the_chain_counts_its_links(monkeypatch) -> None:
    monkeypatch.delenv(chain.ENV, raising=False)
    assert chain.links() == 0
    monkeypatch.setenv(chain.ENV, "3")
    assert chain.links() == 3
