"""The command line: `ddp-slurm <command>` / `python -m ddp_slurm`, `--version`, `--help` of every entry
point without importing torch, `train --print-config [--explain]`, and `launch --help`.

How long `--help` takes is measured by `python -m ddp_slurm.bench`-style timing in the report, not
asserted here; what makes it fast is asserted: no torch module is imported before the arguments are read.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, base_env

from ddp_slurm import __version__, config
from ddp_slurm.config import Config
from ddp_slurm.config.doc import field_docs

ENTRY_POINTS = [
    ["-m", "ddp_slurm"],
    *[
        ["-m", "ddp_slurm", c]
        for c in ("train", "submit", "doctor", "report", "export", "bench", "data", "init", "launch")
    ],
    *[["-m", f"ddp_slurm.{m}"] for m in ("train", "submit", "doctor", "report", "export", "bench", "data", "launch")],
]


def py(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd or REPO, env=base_env(), capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda e: " ".join(e[1:]))
def test_help_imports_no_torch(entry: list[str]) -> None:
    res = py("-X", "importtime", *entry, "--help")
    assert res.returncode == 0, res.stderr
    assert "usage:" in res.stdout
    imported = {line.split("|")[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}
    assert imported, "no -X importtime output"
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "matplotlib", "submitit", "tensorboard"))
    assert not heavy, f"{' '.join(entry)} --help imports {heavy[:5]}"


def test_top_level_usage_lists_every_command() -> None:
    res = py("-m", "ddp_slurm", "--help")
    for command in ("train", "submit", "doctor", "report", "export", "bench", "data", "init", "launch"):
        assert f"  {command} " in res.stdout


def test_version() -> None:
    for args in (["-m", "ddp_slurm", "--version"], ["-m", "ddp_slurm.train", "--version"]):
        res = py(*args)
        assert res.returncode == 0 and res.stdout.strip() == f"ddp_slurm {__version__}", res


def test_unknown_command_and_no_command(tmp_path: Path) -> None:
    res = py("-m", "ddp_slurm", "trian", cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "unknown command 'trian'" in res.stderr and "train" in res.stderr
    res = py("-m", "ddp_slurm", cwd=tmp_path)
    assert res.returncode == 2 and "usage: ddp-slurm" in res.stdout
    assert list(tmp_path.iterdir()) == []


def test_print_config_is_the_resolved_config_and_creates_nothing(tmp_path: Path) -> None:
    args = ["--config", str(REPO / "jobs" / "mnist.yaml"), "train.epochs=2", "slurm.time=2-00:00", "run.name=x"]
    res = py("-m", "ddp_slurm", "train", "--print-config", *args, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert list(tmp_path.iterdir()) == [], "printing the config must not create a run directory"
    printed = tmp_path.parent / f"{tmp_path.name}-printed.yaml"
    printed.write_text(res.stdout)
    assert config.load(printed) == config.load(args[1], args[2:])
    assert "download: false" in res.stdout and "max_steps: null" in res.stdout  # YAML, not Python's False/None


def test_print_config_explain_carries_every_docstring(tmp_path: Path) -> None:
    res = py("-m", "ddp_slurm.train", "--print-config", "--explain", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    for section in Config().sections().values():  # the runtime's sections and the built-in task's
        docs = field_docs(type(section))
        assert set(docs) == {f.name for f in dataclasses.fields(section)}
        for doc in docs.values():
            assert " ".join(doc.split()[:6]) in " ".join(res.stdout.replace("  # ", " ").split())
    assert yaml.safe_load(res.stdout) == Config().to_dict()
    assert "True" not in res.stdout and "None" not in res.stdout.replace("none", "")


def test_print_config_bad_override_is_one_line_exit_2(tmp_path: Path) -> None:
    res = py("-m", "ddp_slurm.train", "--print-config", "train.epochz=3", cwd=tmp_path)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "train.epochz" in res.stderr and "did you mean 'train.epochs'" in res.stderr


def test_launch_help_says_what_it_adds_to_torchrun() -> None:
    res = py("-m", "ddp_slurm.launch", "--help")
    assert res.returncode == 0
    for words in ("SIGUSR2", "75", "torchrun --help", "--rdzv-id"):
        assert words in res.stdout
    # The training module's own --help is not the launcher's: it reaches torchrun (and training).
    from ddp_slurm.launch.torchrun import wants_help

    assert wants_help(["--nproc-per-node", "2", "--help"])
    assert not wants_help(["--nproc-per-node", "2", "-m", "ddp_slurm.train", "--help"])
    assert not wants_help(["train.py", "-h"])


def test_bench_subcommand_help_still_lists_its_options() -> None:
    res = py("-m", "ddp_slurm", "bench", "startup", "--help")
    assert res.returncode == 0 and "--json" in res.stdout and "--threads" in res.stdout
