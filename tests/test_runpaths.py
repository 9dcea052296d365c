"""The run directory's layout (ddp_slurm/runpaths.py): named once, used everywhere."""

from __future__ import annotations

import ast
from pathlib import Path

import ddp_slurm
from ddp_slurm.runpaths import RunPaths

PACKAGE = Path(ddp_slurm.__file__).parent


def test_every_file_of_a_run_directory_has_its_contract_name(tmp_path: Path) -> None:
    paths = RunPaths(str(tmp_path), shared=True)
    assert paths.root == tmp_path and paths.shared
    assert paths.config == tmp_path / "config.yaml" and paths.metrics == tmp_path / "metrics.jsonl"
    assert paths.checkpoints == tmp_path / "checkpoints"
    assert paths.checkpoint(12) == tmp_path / "checkpoints" / "step-12.pt"
    assert paths.lock == tmp_path / ".lock" and paths.report == tmp_path / "report.png"
    assert paths.tensorboard == tmp_path / "tensorboard" and paths.submitit == tmp_path / "submitit"
    assert paths.lost_nodes == tmp_path / "lost_nodes" and paths.sweep == tmp_path / "sweep.json"
    assert paths.chain_script("41") == tmp_path / "chain" / "41.sh"
    assert not paths.is_run()
    paths.metrics.write_text("")
    assert paths.is_run()


def test_no_other_module_spells_a_run_directory_file_name() -> None:
    """A string that is exactly one of the names (a path being built), outside runpaths.py, is a second home."""
    names = {"config.yaml", "metrics.jsonl", "checkpoints", ".lock", "report.png", "lost_nodes", "sweep.json"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "runpaths.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value!r}")
    assert not found, found
