"""What ``bench`` and ``doctor`` take from their flags: the checked argparse types (ddp_slurm/argtypes.py),
the bounds that depend on the host (CPUs, available memory), and the JSON file written whole, never
through a symlink. Each bad flag is also a row of the one-line refusal table (tests/bad_inputs.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from bad_inputs import SAVED_FORECAST
from conftest import base_env

from ddp_slurm import argtypes


def run(cwd: Path, *argv: str, module: str = "ddp_slurm.bench") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *argv], cwd=cwd, env=base_env(), capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e400", "-1", "0", "11", "", "x", "1,2", "\n"])
def test_number_is_finite_and_in_range(text: str) -> None:
    parse = argtypes.number(0, 10, above=True)
    with pytest.raises(argparse.ArgumentTypeError, match="expected a number > 0 and <= 10"):
        parse(text)


def test_number_keeps_what_is_in_range() -> None:
    assert argtypes.number(0, 10, above=True)("10") == 10.0
    assert argtypes.number(0, 1)("0") == 0.0 and argtypes.number(0, 1)("1e-300") == 1e-300


@pytest.mark.parametrize("text", ["1.5", "1e3", "nan", str(10**30), "-1", "0", "", "2 3"])
def test_integer_is_whole_and_in_range(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected an integer from 1 to 100 \(why\)"):
        argtypes.integer(1, 100, "why")(text)
    assert argtypes.integer(1, 100)("100") == 100


def test_integer_lists() -> None:
    parse = argtypes.integers(1, 8, unique=True)
    assert parse("1,2,8") == [1, 2, 8]
    for text, says in (("1,9", "got '9'"), ("1,,2", "got ''"), ("1,1", "repeats"), (",".join(["1"] * 1001), "1000")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            parse(text)


def test_one_line_parser_escapes_control_characters(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argtypes.OneLineParser(prog="tool")
    parser.add_argument("--n", type=argtypes.integer(1, 3))
    with pytest.raises(SystemExit) as done:
        parser.parse_args(["--n", "1", "a\nb\x1b[31m"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err == "tool: error: unrecognized arguments: a\\nb\\x1b[31m\n"


def test_output_file_is_checked_without_leaving_anything(tmp_path: Path) -> None:
    assert argtypes.output_file(str(tmp_path / "new.json")) == tmp_path / "new.json"
    assert list(tmp_path.iterdir()) == []  # the probe file is gone
    with pytest.raises(argparse.ArgumentTypeError, match="cannot write '/proc/x.json'"):
        argtypes.output_file("/proc/x.json")  # a folder that exists and takes no new file, even from root
    (tmp_path / "d").mkdir()
    with pytest.raises(argparse.ArgumentTypeError, match="is a directory"):
        argtypes.output_file(str(tmp_path / "d"))
    (tmp_path / "f").write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match="is not a directory"):
        argtypes.output_dir(str(tmp_path / "f"))
    with pytest.raises(argparse.ArgumentTypeError, match="does not exist"):
        argtypes.output_dir(str(tmp_path / "nowhere"))
    assert argtypes.output_dir(str(tmp_path / "d")) == tmp_path / "d" and list((tmp_path / "d").iterdir()) == []


def test_state_mb_times_ranks_is_bounded_by_available_memory(tmp_path: Path) -> None:
    """--state-mb alone fits, but every rank holds the state: at 2 ranks it would not, and nothing starts."""
    limit_mib, _ = argtypes.memory_mib()
    state = round(0.75 * limit_mib)  # 1.5 x the limit at world size 2 (MemAvailable drifts far less than that)
    res = run(tmp_path, "checkpoint", "--state-mb", str(state), "--worlds", "1,2")
    assert res.returncode == 2 and res.stdout == "", res.stderr
    [line] = res.stderr.splitlines()
    assert f"--state-mb {state}" in line and "at world size 2" in line and "available memory" in line
    assert list(tmp_path.iterdir()) == []


def test_json_is_written_whole_and_never_through_a_symlink(tmp_path: Path) -> None:
    """--json FILE where FILE is a symlink (to another user's file, say): the link is replaced by the
    JSON, the file it pointed to is untouched."""
    (tmp_path / "f.json").write_bytes(SAVED_FORECAST)
    victim = tmp_path / "victim.txt"
    victim.write_text("another user's file\n")
    (tmp_path / "out.json").symlink_to(victim)
    res = run(tmp_path, "forecast", "--from", "f.json", "--max-nodes", "2", "--json", "out.json")
    assert res.returncode == 0, res.stderr
    assert victim.read_text() == "another user's file\n"
    assert not (tmp_path / "out.json").is_symlink()
    written = json.loads((tmp_path / "out.json").read_text())
    assert written["command"] == "forecast" and [r["nodes"] for r in written["forecast"]] == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json", "out.json", "victim.txt"]
