"""``python -m ddp_slurm.train ... checkpoint.async=true`` end to end: a stop signal while a background
write is in flight, exit 75, the stop step is the newest valid checkpoint, and the resumed run ends
bit-identical to one left alone, at world size 1 (plain process) and 2 (torchrun, gloo).
The log line "written in the background" tells that the loop checkpoints through
ckpt_async.AsyncCheckpointer.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import Launcher

from ddp_slurm.train import checkpoint

ARGS = [
    "model.name=mlp",
    "train.epochs=1",
    "train.max_steps=60",
    "train.log_every_steps=5",
    "checkpoint.every_steps=10",
    "checkpoint.keep=100",
    "checkpoint.async=true",
    "run.name=r",
]


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (torchrun's workers), from /proc."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(x) for x in text]
    return found


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    state = checkpoint.load_latest(run_dir)
    assert state is not None and state["finished"]
    return {**{f"model/{k}": v for k, v in state["model"].items()}, "step": torch.tensor(state["step"])}


@pytest.mark.parametrize("nproc", [1, 2])
def test_async_stop_mid_run_exits_75_and_resume_is_bit_identical(tmp_path: Path, nproc: int) -> None:
    whole, parts = Launcher(tmp_path / "whole"), Launcher(tmp_path / "parts")
    for launcher in (whole, parts):
        launcher.cwd.mkdir()

    def cmd(launcher: Launcher) -> list[str]:
        return launcher.cmd_train(*ARGS) if nproc == 1 else launcher.cmd_torchrun(nproc, *ARGS)

    res = whole.run(cmd(whole), timeout=600)
    assert res.returncode == 0, res.stderr
    assert "written in the background" in res.stderr  # the async path ran

    proc = parts.popen(cmd(parts), log=tmp_path / "parts.log")
    folder = parts.cwd / "runs" / "r" / "checkpoints"
    deadline = time.monotonic() + 300
    while not (folder / "step-20.pt").exists() and not list(folder.glob(".step-20.pt.tmp-*")):
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "parts.log").read_text()
        time.sleep(0.005)
    for pid in [proc.pid] if nproc == 1 else children(proc.pid):  # the ranks, as Slurm signals a step's tasks
        os.kill(pid, signal.SIGUSR2)
    code = proc.wait(timeout=300)
    log = (tmp_path / "parts.log").read_text()
    assert code == (75 if nproc == 1 else 1), log  # torchrun reports its workers' 75 as 1
    rows = [json.loads(x) for x in (parts.cwd / "runs" / "r" / "metrics.jsonl").read_text().splitlines()]
    [stop] = [r["step"] for r in rows if r["kind"] == "stop"]
    newest = checkpoint.latest(parts.cwd / "runs" / "r")
    assert newest is not None and newest[1]["step"] == stop and not newest[1]["finished"]
    assert not list(folder.glob(".*tmp*"))

    res = parts.run(cmd(parts), timeout=600)
    assert res.returncode == 0, res.stderr
    a, b = final_state(whole.cwd / "runs" / "r"), final_state(parts.cwd / "runs" / "r")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
