"""The flight-recorder dump (``distributed/flightrec.py``): a rank killed while it writes its dump leaves
nothing named like a dump anywhere in the folder (torch's analyser walks it, subfolders included, and reads
every file whose name holds the prefix: it once failed on a half-written ``.123.0-rank3.tmp-...``, beside the
dumps and then in the scratch folder)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from ddp_slurm.distributed import flightrec

WRITER = """
import pickle, sys, time
from ddp_slurm.distributed import flightrec

def slow(obj, f):
    f.write(b"half a dump")
    f.flush()
    print("writing", flush=True)
    time.sleep(60)

flightrec.pickle.dump = slow
flightrec.dump(3, {"verdict": "test"}, {flightrec.PREFIX_VARS[0]: sys.argv[1]})
"""


def test_a_rank_killed_mid_dump_leaves_no_file_named_like_a_dump(tmp_path: Path) -> None:
    prefix = tmp_path / "traces" / "123.0-rank"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(prefix)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert [p.name for p in (tmp_path / "traces").iterdir()] == [".partial"]
    assert len(list((tmp_path / "traces" / ".partial").iterdir())) == 1  # the killed writer's temporary, out of the way

    path = flightrec.dump(1, {"verdict": "whole"}, {flightrec.PREFIX_VARS[0]: str(prefix)})
    assert path == Path(f"{prefix}1") and path.stat().st_size > 0
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [".partial", "123.0-rank1"]
    # what torch's analyser takes: os.walk over the folder, every file name holding the prefix
    taken = [name for _, _, files in os.walk(tmp_path / "traces") for name in files if prefix.name in name]
    assert taken == ["123.0-rank1"]
