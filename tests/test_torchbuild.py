"""``python -m ddp_slurm.tools.torchbuild``: the line the install ends with, loud when the build is not the one asked for."""

from __future__ import annotations

import subprocess
import sys

import torch
from conftest import base_env

from ddp_slurm.tools import torchbuild


def test_cpu_asked_and_got_says_so_quietly() -> None:
    line, warning = torchbuild.verdict("cpu", "2.5.1+cpu", None)
    assert line == "installed torch 2.5.1+cpu: the CPU-only build" and warning is None
    assert torchbuild.verdict("", "2.5.1", "12.4") == ("installed torch 2.5.1: the CUDA 12.4 build", None)


def test_cpu_asked_but_pip_fell_back_to_the_cuda_build_warns_with_what_to_do() -> None:
    line, warning = torchbuild.verdict("cpu", "2.5.1", "12.4")
    assert "CUDA 12.4" in line
    assert warning is not None and "TORCH=cpu" in warning and "rm -rf .venv && make run TORCH=cpu" in warning
    assert "runs/ is kept" in warning


def test_default_asked_but_cpu_build_present_warns() -> None:
    _, warning = torchbuild.verdict("", "2.5.1+cpu", None)
    assert warning is not None and "runs no GPU" in warning


def test_the_command_names_this_environment_s_build() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "ddp_slurm.tools.torchbuild", "cpu"], env=base_env(), capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    assert f"installed torch {torch.__version__}" in res.stderr
    assert ("WARNING" in res.stderr) == (torch.version.cuda is not None), res.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "ddp_slurm.tools.torchbuild", "gpu"], env=base_env(), capture_output=True, text=True
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "'gpu'" in bad.stderr


def test_an_index_that_cannot_be_reached_fails_the_cpu_install_at_once(capsys) -> None:
    """Where the CPU wheel index is blocked (common on login nodes), pip retried it for every package for
    minutes, then took PyPI's CUDA build: ``make ... TORCH=cpu`` probes it first and stops in one line."""
    import socket

    with socket.socket() as closed:  # a port on this machine that nobody listens on: refused at once
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/whl/cpu/torch/"
    assert torchbuild.main(["--reach", url]) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"ERROR TORCH=cpu: {url} cannot be reached (") and "`make run`" in line
