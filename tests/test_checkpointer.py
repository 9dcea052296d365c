"""``python -m ddp_slurm.train ... checkpoint.async=true`` end to end: a stop signal while a background
write is in flight, exit 75, the stop step is the newest valid checkpoint, and the resumed run ends
bit-identical to one left alone, at world size 1 (plain process) and 2 (torchrun, gloo).
The log line "written in the background" tells that the loop checkpoints through
checkpoint.Checkpointer and its background writer.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from pathlib import Path

import helpers
import pytest
import torch
from conftest import Launcher

from ddp_slurm import config
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.tasks.mnist import models
from ddp_slurm.train import checkpoint
from ddp_slurm.train.checkpoint.backends import WholeFile
from ddp_slurm.train.optim import make_optimizer, make_scheduler

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


# --------------------------------------------------------------------------- the section's owner, alone
def checkpointer(tmp_path: Path, *overrides: str, shared: bool = False) -> checkpoint.Checkpointer:
    """A Checkpointer over a real mlp, its optimizer and schedule, as the loop registers them (rank 0 of 1)."""
    cfg = config.load(None, [f"run.output_root={tmp_path}", "run.name=c", "model.name=mlp", *overrides])
    model = models.build("mlp")
    optimizer = make_optimizer(cfg.train, model.parameters(), torch.device("cpu"))
    run = helpers.run_objects(model, optimizer, make_scheduler(cfg.train, optimizer, 100))
    cfg.run_dir.mkdir(parents=True)  # taken by rundir.take before any save, in a real run
    return checkpoint.Checkpointer(cfg.checkpoint, RunPaths(cfg.run_dir, shared), WholeFile(), run, cfg)


def save_at(ckpt: checkpoint.Checkpointer, step: int, urgent: bool = False) -> Path | None:
    ckpt.run.pos.step = step
    return ckpt.save(False, 1.0, {"config": ckpt.cfg.to_dict()}, urgent=urgent)


@pytest.mark.parametrize(
    ("every", "due"),
    [(0, {4: False, 5: False, 10: False}), (5, {4: False, 5: True, 10: True, 11: False})],
)
def test_cadence_is_every_steps_and_every_epoch_end(tmp_path: Path, every: int, due: dict[int, bool]) -> None:
    ckpt = checkpointer(tmp_path, f"checkpoint.every_steps={every}")
    assert {step: ckpt.due(step, end_of_epoch=False) for step in due} == due
    assert all(ckpt.due(step, end_of_epoch=True) for step in due)


def test_sync_save_returns_the_path_and_keeps_the_newest(tmp_path: Path) -> None:
    ckpt = checkpointer(tmp_path, "checkpoint.async=false", "checkpoint.keep=2")
    paths = [save_at(ckpt, step) for step in (10, 20, 30)]
    assert paths == [ckpt.paths.checkpoint(s) for s in (10, 20, 30)]
    assert [s for s, _ in checkpoint.list_checkpoints(ckpt.paths.root)] == [30, 20]
    assert not ckpt.in_flight and ckpt.wait() is None


def test_async_save_is_durable_after_wait_with_the_run_s_file_modes(tmp_path: Path) -> None:
    ckpt = checkpointer(tmp_path, "checkpoint.async=true", shared=True)
    old = os.umask(0o002)  # a group project area's umask: the mode is the writer's choice
    try:
        assert save_at(ckpt, 7, urgent=True) is None  # handed to the writer
        assert ckpt.wait() == ckpt.paths.checkpoint(7) and not ckpt.failed
    finally:
        os.umask(old)
    assert stat.S_IMODE(ckpt.paths.checkpoint(7).stat().st_mode) == 0o660  # run.shared
    assert checkpoint.latest(ckpt.paths.root, shared=True)[1]["step"] == 7  # a team run trusts the group
    ckpt.close()
