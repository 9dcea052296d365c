"""The submitit callable's process exit (launch/job.py), with real interpreter finalization."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# An object torn down with __main__ says so: it speaks only when the interpreter finalizes, the stage
# where a thread still inside torch's C++ aborts the process (see job._leave_before_finalizing).
SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    from ddp_slurm.launch import job

    class Teardown:
        def __del__(self):
            sys.stderr.write("finalized\\n")

    keep = Teardown()
    if sys.argv[1] == "guarded":
        atexit.register(job._leave_before_finalizing, {"code": int(sys.argv[2])})
    """
)


def run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60)


def test_without_the_guard_the_interpreter_finalizes() -> None:
    res = run(SCRIPT, "bare")
    assert res.returncode == 0 and "finalized" in res.stderr, (res.returncode, res.stderr[-2000:])


@pytest.mark.parametrize("code", [0, 75])
def test_a_job_process_leaves_with_its_code_before_finalizing(code: int) -> None:
    """The atexit guard TrainJob registers in a submitit worker: the job's own code (0 done, 75 stopped)."""
    res = run(SCRIPT, "guarded", str(code))
    assert res.returncode == code and "finalized" not in res.stderr, (res.returncode, res.stderr[-2000:])


def test_an_exception_after_a_successful_job_still_fails_the_process() -> None:
    """submitit could not write the result after training succeeded: the traceback is printed, exit 1."""
    res = run(SCRIPT + "raise OSError('disk full')\n", "guarded", "0")
    assert res.returncode == 1 and "finalized" not in res.stderr, (res.returncode, res.stderr[-2000:])
    assert "OSError: disk full" in res.stderr
