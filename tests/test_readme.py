"""The README's commands, in order, on a fresh copy of the repository: each exits as the README says.

Every line of a ```bash block is run with bash in the copy's root, one after the other (later lines
use what earlier ones made: `report` plots the runs trained above). The comment after a command says
what it does: `exit N` is the exit status it must have (0 otherwise), and a quoted "text" must appear
in its output. The ```sh blocks need `make`, internet or a Slurm cluster; they are not run here:
`make run`/`make test` are the project's own entry points, `data download` needs internet, and the
sbatch/srun lines are what tests/cluster/test_sbatch.py and test_wheel_cluster.py run on the cluster.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, base_env

pytestmark = pytest.mark.slow

README = REPO / "README.md"


def commands(text: str) -> list[tuple[str, int, list[str]]]:
    """``(command, expected exit status, quoted texts)`` of every line of the ```bash blocks, in order."""
    found = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S):
        for line in block.splitlines():
            if not line.strip():
                continue
            command, _, comment = line.partition("  #")
            code = re.search(r"\bexit (\d+)", comment)
            found.append((command.strip(), int(code[1]) if code else 0, re.findall(r'"([^"]+)"', comment)))
    return found


def test_the_readme_parses() -> None:
    cmds = commands(README.read_text())
    assert len(cmds) >= 8, cmds
    assert ("python -m ddp_slurm.train train.epochz=3", 2, []) in cmds
    assert sum(1 for line in README.read_text().splitlines()) <= 200


def fresh_copy(dest: Path) -> Path:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout: cannot tell the project's files from build outputs")
    for name in filter(None, listed.stdout.split("\0")):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def test_readme_commands_in_order(tmp_path: Path) -> None:
    root = fresh_copy(tmp_path / "repo")
    # `python` and `torchrun` are this environment's; the package is the fresh copy's.
    env = base_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(root))
    for command, code, texts in commands(README.read_text()):
        res = subprocess.run(["bash", "-c", command], cwd=root, env=env, capture_output=True, text=True, timeout=900)
        said = res.stdout + res.stderr
        assert res.returncode == code, f"`{command}` exited {res.returncode}, the README says {code}\n{said[-3000:]}"
        for text in texts:
            assert text in said, f"`{command}`: the README quotes {text!r}, the output does not say it\n{said[-3000:]}"
        if code == 2:
            assert res.stderr.count("\n") == 1, f"`{command}`: a usage error is one line\n{res.stderr}"
    assert (root / "runs" / "report.png").is_file() and (root / "runs" / "lrs" / "report.png").is_file()
