"""`python -m ddp_slurm.doctor`: one process, torchrun, and rendezvous faults injected on this machine.

Every fault must end in the rank's own one-line verdict and a non-zero exit, never a hang (the
subprocess timeouts are generous for a loaded machine; the doctor's own bound is --timeout plus grace).
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest
from conftest import base_env

from ddp_slurm.distributed.env import DistEnv, free_port
from ddp_slurm.tools import doctor

DOCTOR = [sys.executable, "-m", "ddp_slurm.doctor", "--timeout", "5", "--size-mb", "1", "--iters", "2"]
WAIT = 300


def rank_env(rank: int, world: int, port: int, addr: str = "127.0.0.1") -> dict[str, str]:
    """The variables torchrun would set for ``rank`` of ``world`` ranks on this one host."""
    return base_env(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
    )


def start(cwd, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(DOCTOR, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=WAIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the doctor hung (killed after {WAIT} s):\n{out}\n{err}")
    return proc.returncode, out, err


def fail_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("doctor: FAIL")]


def table_rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if re.match(r"\d+\s+\d+/\d+\s+\d+/\d+\s", line)]


def test_one_process_is_ok(launcher):
    res = launcher.run(DOCTOR, timeout=WAIT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "doctor: verdict OK" in res.stdout
    assert "1 rank(s) on 1 host(s), launcher single" in res.stdout
    assert "all-reduce: correct" in res.stdout
    rows = table_rows(res.stdout)
    assert len(rows) == 1 and rows[0][:5] == ["0", "0/1", "0/1", socket.gethostname(), "cpu"], res.stdout


def test_torchrun_two_ranks_ok_table(launcher):
    res = launcher.run(
        launcher.cmd_torchrun(2, "--timeout", "60", "--size-mb", "1", "--iters", "2", module="ddp_slurm.doctor"),
        timeout=WAIT,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("doctor: verdict OK") == 1  # rank 0 alone prints the table and verdict
    assert "2 rank(s) on 1 host(s), launcher torchrun" in res.stdout
    assert "bus bandwidth (1 MiB)" in res.stdout
    rows = table_rows(res.stdout)
    assert [r[0] for r in rows] == ["0", "1"] and [r[1] for r in rows] == ["0/2", "1/2"], res.stdout
    assert all(r[5] == "gloo" for r in rows)
    assert not fail_lines(res.stdout)
    assert "compute ms: 100 products of two 256x256 matrices" in res.stdout  # the column says what it is


def test_unresolvable_master_addr(tmp_path):
    code, out, _ = finish(start(tmp_path, rank_env(0, 2, free_port(), addr="no-such-host.invalid")))
    assert code == 1
    [line] = fail_lines(out)
    assert line.startswith("doctor: FAIL rank 0 on ") and "unresolvable host" in line
    assert "no-such-host.invalid" in line


def test_port_taken(tmp_path):
    """A program already listens on MASTER_PORT: rank 0 finds the port taken; rank 1 reaches that program,
    which never answers as a rendezvous, and the watchdog ends it with its own verdict."""
    with socket.create_server(("", 0)) as taker:
        port = taker.getsockname()[1]
        ranks = [start(tmp_path, rank_env(r, 2, port)) for r in (0, 1)]
        results = [finish(p) for p in ranks]
    for rank, (code, out, err) in enumerate(results):
        assert code == 1, out + err
        [line] = fail_lines(out)
        assert line.startswith(f"doctor: FAIL rank {rank} on ") and "port in use" in line, line
    assert f"port {port} on {socket.gethostname()} is taken" in results[0][1]
    assert f"127.0.0.1:{port}" in results[1][1]


def test_missing_rank(tmp_path):
    code, out, err = finish(start(tmp_path, rank_env(0, 2, free_port())))
    assert code == 1, out + err
    [line] = fail_lines(out)
    assert "rank missing" in line and "expected 2 ranks, 1 arrived" in line, line


def test_rank_zero_missing(tmp_path):
    code, out, err = finish(start(tmp_path, rank_env(1, 2, free_port())))
    assert code == 1, out + err
    [line] = fail_lines(out)
    assert line.startswith("doctor: FAIL rank 1 on ") and "rank 0 unreachable" in line, line


def test_rank_outside_the_world(launcher):
    res = launcher.run(DOCTOR, env=rank_env(1, 2, free_port()) | {"RANK": "3"}, timeout=WAIT)
    assert res.returncode == 1
    [line] = fail_lines(res.stdout)
    assert "mismatched world size" in line and "RANK=3" in line


def test_usage_error(launcher):
    """One line (no usage block), exit 2, before any rendezvous; more values in tests/bad_inputs.py."""
    res = launcher.run([sys.executable, "-m", "ddp_slurm.doctor", "--timeout", "0"], timeout=WAIT)
    assert res.returncode == 2 and res.stdout == "", res.stderr
    [line] = res.stderr.splitlines()
    assert "argument --timeout" in line and "got '0'" in line


def test_exclude_slow_names_a_run_directory_and_says_only_what_it_recorded(launcher, tmp_path):
    """``--exclude-slow`` once created a mistyped run directory to record into, and said "recorded" for names
    it dropped: a folder that is not a run directory is refused before anything runs, and the line names
    only what went into ``slow_nodes``."""
    from ddp_slurm.slurmjob import badnodes
    from ddp_slurm.tools import doctor

    typo = tmp_path / "runs" / "mnsit"
    res = launcher.run([sys.executable, "-m", "ddp_slurm.doctor", "--exclude-slow", str(typo)], timeout=WAIT)
    assert res.returncode == 2 and res.stdout == "", res.stderr
    [line] = res.stderr.splitlines()
    assert "--exclude-slow" in line and "does not exist" in line and not (tmp_path / "runs").exists()
    run = tmp_path / "runs" / "mnist"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    said = doctor._record_slow(run, ["node2", "link node1->node2", "bad;name"])
    assert said.startswith("doctor: recorded node2 in ") and "not recorded" in said and "bad;name" in said, said
    assert badnodes.excluded(run, slow=True) == ["node2"]


def _row(rank: int, host: str, node_rank: int, local_rank: int, gpu: str | None = None) -> dict:
    """A gathered report as rank 0 sees it (what measure() and describe() produce)."""
    return {
        "rank": rank,
        "host": host,
        "node": host,
        "node_rank": node_rank,
        "local_rank": local_rank,
        "world_size": 4,
        "gpu": gpu,
        "cuda_count": 1 if gpu else 0,
        "correct": True,
    }


def test_cross_checks_find_duplicates_and_shared_gpus():
    good = [_row(0, "a", 0, 0, "0"), _row(1, "a", 0, 1, "1"), _row(2, "b", 1, 0, "0"), _row(3, "b", 1, 1, "1")]
    assert doctor.cross_checks(good) == []
    # two hosts both believe they are node 0 (a misconfigured static torchrun launch)
    dup = [_row(0, "a", 0, 0), _row(1, "a", 0, 1), _row(2, "b", 0, 0), _row(3, "b", 0, 1)]
    causes = [f.cause for _, f in doctor.cross_checks(dup)]
    assert causes == ["duplicate ranks"]
    # --gpus-per-task missing: every task on a node sees the same single GPU
    shared = [_row(0, "a", 0, 0, "0"), _row(1, "a", 0, 1, "0"), _row(2, "b", 1, 0, "0"), _row(3, "b", 1, 1, "1")]
    [(where, failure)] = doctor.cross_checks(shared)
    assert where == "a" and failure.cause == "CUDA device count vs tasks per node" and "ranks 0, 1" in failure.detail
    wrong = good[:3] + [{**good[3], "correct": False}]
    assert [f.cause for _, f in doctor.cross_checks(wrong)] == ["all-reduce wrong"]


UUIDS = [f"GPU-5b1e0c7a-1111-2222-3333-44445555666{i}" for i in range(4)]


def _gpu_rows(names: list[str], uuids: list[str]) -> list[dict]:
    """Four ranks, two per node (a, b), with the GPU names their tasks see and the GPUs' UUIDs."""
    return [{**_row(r, "ab"[r // 2], r // 2, r % 2, names[r]), "gpu_id": uuids[r]} for r in range(4)]


def test_gpus_are_compared_by_uuid_not_by_visible_name():
    """Per-task device cgroups (--gpus-per-task=1): every task calls its GPU "0", but the UUIDs differ, so
    nothing is shared; the same UUID under two names is shared. The UUIDs are fabricated (no GPU here)."""
    assert doctor.cross_checks(_gpu_rows(["0"] * 4, UUIDS)) == []
    [(where, failure)] = doctor.cross_checks(_gpu_rows(["0", "1", "0", "1"], [UUIDS[0], UUIDS[0], UUIDS[2], UUIDS[3]]))
    assert where == "a" and failure.cause == "CUDA device count vs tasks per node"
    assert f"ranks 0, 1 share GPU 0 ({UUIDS[0]})" in failure.detail, failure.detail
    # The same UUID on two nodes cannot be one device: compared per node (PCI bus ids repeat across nodes).
    assert doctor.cross_checks(_gpu_rows(["0"] * 4, [UUIDS[0], UUIDS[1], UUIDS[0], UUIDS[1]])) == []


class _Props:
    """What torch.cuda.get_device_properties returns, for the fields the doctor reads."""

    def __init__(self, uuid: str, bus: int) -> None:
        self.uuid, self.pci_domain_id, self.pci_bus_id, self.pci_device_id = uuid, 0, bus, 0


@pytest.mark.parametrize(
    ("uuid", "expected"), [(UUIDS[1][4:], UUIDS[1]), (UUIDS[1], UUIDS[1]), ("", "00000000:3b:00.0")]
)
def test_describe_reports_the_uuid_of_the_gpu_the_rank_takes(monkeypatch, uuid, expected):
    """torch.cuda is monkeypatched (no GPU here): two visible GPUs, local rank 1 takes index 1."""
    import torch

    props = [_Props(UUIDS[0][4:], 0x17), _Props(uuid, 0x3B)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props[index])
    env = DistEnv.from_environ(
        {
            "RANK": "1",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
        }
    )
    rep = doctor.describe(env, {"CUDA_VISIBLE_DEVICES": "4,6"})
    assert (rep.gpu, rep.gpu_id) == ("6", expected)
