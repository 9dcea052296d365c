"""``ddp_slurm.exitcodes``: the codes, and ``exit_now`` leaving with its code, flushed, without finalizing."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from ddp_slurm.exitcodes import EXIT_STOPPED, ExitCode


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)


def test_exit_now_leaves_with_its_code_after_flushing_and_before_finalization() -> None:
    done = _run(
        """
        import atexit, logging, sys
        from ddp_slurm.exitcodes import exit_now
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        atexit.register(lambda: print("finalized", flush=True))  # runs in finalization: must not
        sys.stdout.write("unterminated stdout")  # buffered, no newline: exit_now must flush it
        logging.getLogger("x").info("logged before leaving")
        exit_now(75)
        """
    )
    assert done.returncode == EXIT_STOPPED == 75, done.stderr
    assert done.stdout == "unterminated stdout"  # flushed, and the atexit handler never ran
    assert "logged before leaving" in done.stderr


def test_exitcodes_imports_no_torch_so_launchers_stay_light() -> None:
    done = _run(
        """
        import sys
        import ddp_slurm.exitcodes
        sys.exit(3 if "torch" in sys.modules else 0)
        """
    )
    assert done.returncode == 0, "importing ddp_slurm.exitcodes imported torch"


def test_exit_now_is_public_api() -> None:
    import ddp_slurm
    from ddp_slurm.exitcodes import exit_now

    assert ddp_slurm.exit_now is exit_now


def test_the_codes_are_the_contracts() -> None:
    assert [int(c) for c in ExitCode] == [0, 1, 2, 3, 65, 75]
