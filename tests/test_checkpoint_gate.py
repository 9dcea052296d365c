"""The gate (``train/checkpoint/gate.py``): every rule a checkpoint must pass, for the whole file and the folder of
shards alike, shown end to end the way the third audit broke them: a run interrupted at step 12 (its task
raises) with checkpoints at steps 5 and 10, its step-10 checkpoint then forged and re-sealed with the project's
own functions (the seal is a checksum, not a signature), and the run launched again. The forged checkpoint must
be skipped with a warning naming why, and the run must resume from step 5 and finish: never a silent resume
somewhere else, a traceback, or code run on load.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Launcher, base_env
from torch.utils.serialization import config as torch_serialization

from ddp_slurm import safefs
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train import checkpoint
from ddp_slurm.train.checkpoint import seal as ckpt_seal
from ddp_slurm.train.checkpoint import sharded
from ddp_slurm.train.checkpoint.gate import backend_of

TASK = '''
import os
from ddp_slurm.tasks.mnist.task import MNIST


class Crash(MNIST):
    """The built-in task, raising at its CRASH_AT-th step (an interrupted run); GROUPS=2 splits the optimizer."""

    calls = 0

    def training_step(self, model, batch):
        Crash.calls += 1
        if Crash.calls == int(os.environ.get("CRASH_AT", "0")):
            raise RuntimeError("the test's crash")
        return super().training_step(model, batch)

    def configure_optimizer(self, model):
        if os.environ.get("GROUPS") != "2":
            return None
        import torch

        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        others = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        return torch.optim.Adam([{"params": weights}, {"params": others}], lr=1e-3)
'''

ARGS = [
    "task=crash.py:Crash",
    "model.name=mlp",
    "train.max_steps=20",
    "train.log_every_steps=5",
    "checkpoint.every_steps=5",
    "checkpoint.keep=10",
    "checkpoint.async=false",
    "run.name=r",
]
STRATEGIES = ["ddp", "fsdp"]


def train(cwd: Path, *extra: str, **env: str) -> subprocess.CompletedProcess:
    launcher = Launcher(cwd)
    return launcher.run(launcher.cmd_train(*ARGS, *extra), env=base_env(**env))


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per strategy, a working directory whose run ``runs/r`` stopped at step 12 with checkpoints at 5 and 10."""
    made = {}
    for strategy in STRATEGIES:
        cwd = tmp_path_factory.mktemp(strategy)
        (cwd / "crash.py").write_text(TASK)
        res = train(cwd, f"dist.strategy={strategy}", CRASH_AT="12")
        assert res.returncode == 1 and "the test's crash" in res.stderr, res.stderr[-2000:]
        made[strategy] = cwd
    return made


@pytest.fixture(params=STRATEGIES)
def run(request: pytest.FixtureRequest, interrupted: dict[str, Path], tmp_path: Path) -> tuple[Path, str]:
    """A copy of the interrupted run of one strategy: (working directory, strategy)."""
    cwd = Path(shutil.copytree(interrupted[request.param], tmp_path / "cwd"))
    paths = RunPaths(cwd / "runs" / "r")
    assert [s for s, _ in backend_of(paths).candidates(paths)] == [10, 5]
    return cwd, request.param


def newest(cwd: Path) -> Path:
    folder = cwd / "runs" / "r" / "checkpoints"
    return folder / "step-10.pt" if (folder / "step-10.pt").exists() else folder / "step-10"


def reseal_commit(folder: Path, record: dict[str, Any]) -> None:
    """Write ``record`` as the folder's commit, sealed the way the writer seals it."""

    def write(f: Any) -> None:
        sink = ckpt_seal.Sink(f)
        with torch_serialization.patch({"save.compute_crc32": False}):
            torch.save(record, sink)
        sink.seal()

    safefs.write_atomic(folder / sharded.COMMIT, write)


def forge(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Change the record of the checkpoint at ``path`` and seal it again (a file or a folder of shards)."""
    if path.is_dir():
        record = sharded.read_commit(path)
        change(record)
        reseal_commit(path, record)
    else:
        state = checkpoint.load(path)
        change(state)
        path.unlink()
        checkpoint.save(path.parents[1], state, keep=10)


def resumed_from(cwd: Path) -> int:
    rows = [json.loads(line) for line in (cwd / "runs" / "r" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "start"][-1]["step"]


FORGERIES: dict[str, Callable[[dict[str, Any]], None]] = {
    "negative epoch": lambda r: r.update(epoch=-3),
    "finished as a string": lambda r: r.update(finished="yes"),
    "negative step in epoch": lambda r: r.update(step_in_epoch=-1),
    "no task state": lambda r: r.pop("task"),
    "a string for the time": lambda r: r.update(elapsed_s="soon"),
    "no RNG streams": lambda r: r.update(rng=[]),
}


@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_forged_but_sealed_record_is_skipped_for_the_one_before(run: tuple[Path, str], forgery: str) -> None:
    """Audit breaks 9 and 10: a sharded commit skipped every position check (``epoch=-3`` resumed silently,
    ``finished='yes'`` said "already finished"), and a missing ``task`` crashed both formats."""
    cwd, strategy = run
    forge(newest(cwd), FORGERIES[forgery])
    res = train(cwd, f"dist.strategy={strategy}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"skipping checkpoint {newest(cwd).relative_to(cwd)}" in res.stderr, res.stderr[-3000:]
    assert resumed_from(cwd) == 5
    assert "Traceback" not in res.stderr


SHARDED_FORGERIES: dict[str, Callable[[dict[str, Any]], None]] = {
    "no files": lambda r: r.pop("files"),
    "files not a mapping": lambda r: r.update(files="x"),
    "a file outside the folder": lambda r: r["files"].update({"../../victim": "0" * 32}),
    "model_shapes not shapes": lambda r: r.update(model_shapes="x"),
    "another model's shapes": lambda r: r["model_shapes"].update({"1.weight": [3, 3]}),
}


@pytest.mark.parametrize("forgery", SHARDED_FORGERIES)
def test_a_commit_whose_own_entries_are_broken_is_skipped(
    interrupted: dict[str, Path], tmp_path: Path, forgery: str
) -> None:
    """Audit break 10: a missing or mistyped ``files`` or ``model_shapes`` gave tracebacks, and the older good
    checkpoints were never tried."""
    cwd = Path(shutil.copytree(interrupted["fsdp"], tmp_path / "cwd"))
    forge(newest(cwd), SHARDED_FORGERIES[forgery])
    res = train(cwd, "dist.strategy=fsdp")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "skipping checkpoint runs/r/checkpoints/step-10" in res.stderr and "Traceback" not in res.stderr
    assert resumed_from(cwd) == 5


class _Plant:
    """A pickle payload: unpickling it creates the file it names."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_a_sharded_index_that_would_run_code_is_never_unpickled(interrupted: dict[str, Path], tmp_path: Path) -> None:
    """Audit break 3: DCP unpickles ``.metadata``; a payload there, re-sealed, ran on resume and in
    ``checkpoint.load_latest``. Now it is refused unread, the checkpoint skipped for the one before."""
    cwd = Path(shutil.copytree(interrupted["fsdp"], tmp_path / "cwd"))
    folder, marker = newest(cwd), tmp_path / "ran"
    (folder / sharded.METADATA).write_bytes(pickle.dumps(_Plant(marker)))
    forge(folder, lambda r: r["files"].update({sharded.METADATA: sharded.file_seal(folder / sharded.METADATA)}))
    assert checkpoint.load_latest(cwd / "runs" / "r")["step"] == 5
    assert not marker.exists()
    res = train(cwd, "dist.strategy=fsdp")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "skipping checkpoint runs/r/checkpoints/step-10: .metadata unreadable" in res.stderr
    assert not marker.exists() and resumed_from(cwd) == 5


def test_a_value_that_would_run_code_is_never_unpickled(tmp_path: Path) -> None:
    """The other unpickling point of DCP: a non-tensor value (an optimizer's hyperparameter) read with
    ``weights_only=False``. Read through ``dcp_safe`` it is refused; nothing runs."""
    import torch.distributed.checkpoint as dcp

    from ddp_slurm.train.checkpoint import dcp_safe

    marker = tmp_path / "ran"
    with pytest.warns(UserWarning):  # "assuming the intent is to save in a single process": it is
        dcp.save({"model": {"w": torch.ones(2)}, "optim": {"lr": _Plant(marker)}}, checkpoint_id=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="Weights only load failed"):
        dcp_safe.load_whole(tmp_path / "c")
    assert not marker.exists()


def test_a_changed_optimizer_grouping_is_refused_in_one_line(run: tuple[Path, str]) -> None:
    """Audit break 5: under fsdp, a resume after the task's ``configure_optimizer`` changed its grouping was a
    raw DCP "Missing key" traceback on every requeue; both strategies now exit 2 naming what does not fit."""
    cwd, strategy = run
    res = train(cwd, f"dist.strategy={strategy}", GROUPS="2")
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "no checkpoint fits this run" in errors[0], res.stderr[-3000:]
    assert "parameter group" in errors[0] and "Traceback" not in res.stderr


def test_an_empty_step_folder_blocks_no_resume(run: tuple[Path, str]) -> None:
    """Audit break 14: an empty junk ``step-N/`` folder in a ddp run blocked resume ("holds dist.strategy=fsdp
    checkpoints"). A folder without a commit record is no checkpoint of either strategy."""
    cwd, strategy = run
    (cwd / "runs" / "r" / "checkpoints" / "step-99").mkdir()
    res = train(cwd, f"dist.strategy={strategy}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert resumed_from(cwd) == 10
    assert (cwd / "runs" / "r" / "checkpoints" / "step-99").is_dir()  # someone's folder: left alone


def test_a_planted_partial_link_is_never_written_through(interrupted: dict[str, Path], tmp_path: Path) -> None:
    """Audit break 2: a planted ``.step-N.partial`` symlink survived the stale-partial cleanup, DCP wrote into
    it and the commit chmod-ed everything there (a private key went 0600 -> 0660)."""
    cwd = Path(shutil.copytree(interrupted["fsdp"], tmp_path / "cwd"))
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "key").write_text("secret")
    os.chmod(victim / "key", 0o600)
    for step in (15, 20):  # the next writes of the resumed run
        os.symlink(victim, RunPaths(cwd / "runs" / "r").partial(step))
    res = train(cwd, "dist.strategy=fsdp", "checkpoint.async=true")
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in victim.iterdir()) == ["key"]
    assert (victim / "key").stat().st_mode & 0o777 == 0o600 and (victim / "key").read_text() == "secret"
    assert checkpoint.load_latest(cwd / "runs" / "r")["step"] == 20


def test_another_runs_committed_folder_is_neither_counted_nor_pruned(
    interrupted: dict[str, Path], tmp_path: Path
) -> None:
    """Audit break 4: sharded pruning counted another run's committed folder (no config check): with keep=2 the
    run's own checkpoints were deleted. Pruning now counts only what a resume of this run would accept."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "crash.py").write_text(TASK)
    res = train(other, "dist.strategy=fsdp", "train.lr=0.5", "train.max_steps=30", "checkpoint.every_steps=30")
    assert res.returncode == 0, res.stderr[-3000:]
    cwd = Path(shutil.copytree(interrupted["fsdp"], tmp_path / "cwd"))
    planted = cwd / "runs" / "r" / "checkpoints" / "step-30"
    shutil.copytree(other / "runs" / "r" / "checkpoints" / "step-30", planted)
    res = train(cwd, "dist.strategy=fsdp", "checkpoint.keep=2")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "written by a run with another config" in res.stderr and "train.lr: 0.5 -> 0.004" in res.stderr
    assert [s for s, _ in sharded.list_sharded(RunPaths(cwd / "runs" / "r"))] == [30, 20, 15]
    assert sharded.read_commit(planted)["config"]["train"]["lr"] == 0.5
