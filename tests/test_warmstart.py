"""Warm start (``run.init_from``, ``run.init_optimizer``) and extending a finished run, as real processes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import Launcher

from ddp_slurm.train import checkpoint

FAST = ["model.name=mlp", "train.epochs=1", "train.max_steps=6", "train.log_every_steps=2", "checkpoint.every_steps=3"]


def start_line(run_dir: Path) -> dict:
    return next(json.loads(line) for line in (run_dir / "metrics.jsonl").open() if '"start"' in line)


def one_line_error(res) -> str:
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if "error" in line.lower()]
    assert len(lines) == 1, res.stderr
    return lines[0]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Launcher:
    """A finished 6-step run ``runs/base`` to warm-start from."""
    launcher = Launcher(tmp_path_factory.mktemp("warm"))
    launcher.run(launcher.cmd_train(*FAST, "run.name=base"), check=True)
    return launcher


def test_warm_start_from_a_run_directory_takes_its_newest_weights_and_records_the_file(base: Launcher) -> None:
    source = checkpoint.load_latest(base.cwd / "runs" / "base")
    res = base.run(
        base.cmd_train(*FAST, "train.max_steps=2", "train.lr=1e-9", "run.name=warm", "run.init_from=runs/base"),
        check=True,
    )
    assert "warm start from runs/base/checkpoints/step-6.pt (step 6)" in res.stderr
    run = base.cwd / "runs" / "warm"
    start = start_line(run)
    assert start["init_from"] == "runs/base/checkpoints/step-6.pt" and start["init_step"] == 6
    assert start["step"] == 0 and start["init_optimizer"] is False
    assert yaml.safe_load((run / "config.yaml").read_text())["run"]["init_from"] == start["init_from"]
    # two steps at lr 1e-9 moved the source's weights by at most 2e-9 (Adam's step is at most lr); a fresh
    # start would differ from them by the source's 6 steps of training
    warm = checkpoint.load_latest(run)
    assert warm["step"] == 2
    w0, w1 = source["model"]["1.weight"], warm["model"]["1.weight"]
    assert (w1 - w0).abs().max() < 1e-7 and not torch.equal(w0, w1)


def test_warm_start_with_optimizer_takes_the_moments_but_keeps_its_own_schedule(base: Launcher) -> None:
    source = checkpoint.load_latest(base.cwd / "runs" / "base")
    ckpt = "runs/base/checkpoints/step-6.pt"
    base.run(
        base.cmd_train(
            *FAST,
            "train.max_steps=1",
            "train.lr=1e-3",
            "run.name=warmopt",
            f"run.init_from={ckpt}",
            "run.init_optimizer=true",
        ),
        check=True,
    )
    state = checkpoint.load_latest(base.cwd / "runs" / "warmopt")
    assert start_line(base.cwd / "runs" / "warmopt")["init_optimizer"] is True
    # Adam's step count went on from the source's 6; the peak lr is this run's, not the source's 4e-3
    assert state["optimizer"]["state"][0]["step"].item() == source["optimizer"]["state"][0]["step"].item() + 1
    assert state["optimizer"]["param_groups"][0]["max_lr"] == pytest.approx(1e-3)


def test_a_resume_ignores_init_from_its_own_checkpoint_wins(base: Launcher) -> None:
    args = [*FAST, "run.name=own", "checkpoint.every_steps=2"]
    base.run(base.cmd_train(*args), check=True)
    own = checkpoint.load_latest(base.cwd / "runs" / "own")
    res = base.run(base.cmd_train(*args, "run.init_from=runs/base"), check=True)
    assert "already finished" in res.stderr and "warm start" not in res.stderr
    assert torch.equal(checkpoint.load_latest(base.cwd / "runs" / "own")["model"]["1.weight"], own["model"]["1.weight"])


# One rank of training in this child process, through ``loop.train`` itself: the config it was given, before
# and after, and the run's own config it was told of once the run was named.
IN_PROCESS = """
import json, os, sys
from ddp_slurm import config
from ddp_slurm.distributed import group
from ddp_slurm.distributed.env import DistEnv
from ddp_slurm.exitcodes import exit_now
from ddp_slurm.train import loop
from ddp_slurm.train.entry import check_task
from ddp_slurm.train.signals import StopFlag
loaded = config.load(None, sys.argv[1:])
before = loaded.to_dict()
env = DistEnv.from_environ(os.environ)
named = []
with group.distributed(env, "gloo", loaded.dist.timeout_s) as (device, backend):
    code = loop.train(loaded, check_task(loaded, env), env, device, backend, stop=StopFlag(), named=named.append)
result = {"code": code, "before": before, "after": loaded.to_dict(), "named": [c.to_dict() for c in named]}
print("RESULT " + json.dumps(result), flush=True)
exit_now(0)
"""


def test_train_writes_nothing_into_the_config_it_is_given(base: Launcher) -> None:
    """A new run (no ``run.name``) warm-started from a run directory: ``loop.train`` chooses the run's name and
    locates the checkpoint file, and both go into the run's own copy of the config (config.yaml and its
    checkpoints record them), never into the config it was given."""
    res = base.run(
        [sys.executable, "-c", IN_PROCESS, *FAST, "train.max_steps=2", "run.init_from=runs/base"], check=True
    )
    result = json.loads(next(line for line in res.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT ") :])
    assert result["code"] == 0
    assert result["after"] == result["before"]
    assert result["before"]["run"]["name"] is None and result["before"]["run"]["init_from"] == "runs/base"
    [own] = result["named"]
    name = own["run"]["name"]
    assert name and name.startswith("mnist-")
    run = base.cwd / "runs" / name
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    assert recorded["run"]["name"] == name
    assert recorded["run"]["init_from"] == "runs/base/checkpoints/step-6.pt"  # the very file, as before
    assert checkpoint.load_latest(run)["config"]["run"] == recorded["run"]
    assert start_line(run)["init_from"] == recorded["run"]["init_from"]


@pytest.mark.parametrize(
    "spec, says",
    [
        ("runs/nothing", "no such run directory or checkpoint file"),
        ("runs/base/config.yaml", "not a usable checkpoint"),
    ],
)
def test_a_bad_source_is_one_line_exit_2_and_creates_nothing(base: Launcher, spec: str, says: str) -> None:
    res = base.run(base.cmd_train(*FAST, "run.name=bad", f"run.init_from={spec}"))
    assert says in one_line_error(res)
    assert not (base.cwd / "runs" / "bad").exists()


def test_another_model_is_refused_before_training(base: Launcher) -> None:
    res = base.run(base.cmd_train(*FAST, "model.name=cnn", "run.name=cnn", "run.init_from=runs/base"))
    assert "another model" in one_line_error(res) and "runs/base/checkpoints/step-6.pt" in res.stderr
    assert not (base.cwd / "runs" / "cnn").exists()


def test_extending_a_finished_run_points_to_a_warm_start(base: Launcher) -> None:
    """Raising train.epochs of a finished run would change its one-cycle schedule midway: refused, with
    the way to train on (a new run from its weights) and the way to resume (its own config)."""
    res = base.run(base.cmd_train(*FAST, "train.max_steps=12", "run.name=base"))
    line = one_line_error(res)
    assert "train.max_steps: 6 -> 12" in line
    assert "ddp-slurm resume runs/base" in line and "--config runs/base/config.yaml" in line
    assert "run.init_from=runs/base" in line


GROUPED = '''
import torch
from ddp_slurm.tasks.mnist.task import MNIST


class Grouped(MNIST):
    """The built-in task with its optimizer in two parameter groups (weights, the rest)."""

    def configure_optimizer(self, model):
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        others = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        return torch.optim.Adam([{"params": weights}, {"params": others}], lr=1e-3)
'''


def test_init_optimizer_from_an_optimizer_of_another_grouping_is_refused(base: Launcher) -> None:
    """Audit break 6: the moments of a differently grouped optimizer crashed the fused kernels (exit 134 or
    SIGSEGV, no message, every launch). The source's optimizer must fit this run's, as a resume's does."""
    (base.cwd / "grouped.py").write_text(GROUPED)
    args = [*FAST, "task=grouped.py:Grouped", "run.name=grouped", "run.init_from=runs/base", "run.init_optimizer=true"]
    res = base.run(base.cmd_train(*args))
    line = one_line_error(res)
    assert "its optimizer has 1 parameter group(s), this run's 2" in line and "runs/base/checkpoints" in line
    assert not (base.cwd / "runs" / "grouped").exists()


@pytest.fixture(scope="module")
def sharded_base(base: Launcher) -> Path:
    """A finished 6-step fsdp run ``runs/fbase``: its checkpoints are folders of shards."""
    base.run(base.cmd_train(*FAST, "dist.strategy=fsdp", "run.name=fbase"), check=True)
    return base.cwd / "runs" / "fbase"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_warm_start_from_an_fsdp_run_into_either_strategy(base: Launcher, sharded_base: Path, strategy: str) -> None:
    """Audit break 15 (and what fine-tuning a large model needs): a warm start from a run of sharded
    checkpoints, under ddp ("no checkpoint in that run directory" before) and under fsdp ("ddp only in this
    version" before), with its optimizer's moments too."""
    source = checkpoint.load_latest(sharded_base)
    name = f"from-fsdp-{strategy}"
    args = [*FAST, f"dist.strategy={strategy}", "train.max_steps=2", "train.lr=1e-9", f"run.name={name}"]
    res = base.run(base.cmd_train(*args, "run.init_from=runs/fbase", "run.init_optimizer=true"), check=True)
    assert "warm start from runs/fbase/checkpoints/step-6 (step 6) with its optimizer state" in res.stderr
    warm = checkpoint.load_latest(base.cwd / "runs" / name)
    assert warm["step"] == 2 and start_line(base.cwd / "runs" / name)["init_step"] == 6
    w0, w1 = source["model"]["1.weight"], warm["model"]["1.weight"]
    assert (w1 - w0).abs().max() < 1e-7 and not torch.equal(w0, w1)
    steps = warm["optimizer"]["state"]["1.weight" if strategy == "fsdp" else 0]["step"]
    assert steps.item() == source["optimizer"]["state"]["1.weight"]["step"].item() + 2  # Adam's count went on
