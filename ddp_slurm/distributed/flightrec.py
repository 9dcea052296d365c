"""The flight-recorder file of a rank that the stall check ends: what NCCL's watchdog would have dumped.

Why: the batch scripts promise a file per rank (``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``, torch's newer name
``TORCH_FR_DUMP_TEMP_FILE``: ``<prefix><rank>``) with each rank's last collectives, the evidence of who
stopped where. torch writes it only when NCCL's own watchdog fires at ``dist.timeout_s``; the stall check
ends a waiting rank long before that (``os._exit``: no Python handler, no torch dump). So the rank writes
it itself, just before it exits, in torch's own format (a pickled dict that torch's analyser
``python -m torch.distributed.flight_recorder.fr_trace -p PREFIX DIR`` reads: ``version``, ``entries``,
``pg_config``):

* on NCCL, torch's NCCL flight recorder (``_dump_nccl_trace``); elsewhere its generic one, which records
  gloo collectives too (``_dump_fr_trace``; both need ``TORCH_FR_BUFFER_SIZE`` or the older
  ``TORCH_NCCL_TRACE_BUFFER_SIZE``, set by the batch scripts, else their ``entries`` are empty);
* plus, under ``ddp_slurm``, what the runtime knows and torch does not: the verdict, this rank's last step,
  where its training thread stood, and on the rank that judged, every rank's last heartbeat (its step).

Without either variable nothing is written (a run outside the batch scripts asked for no trace).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import time
from pathlib import Path
from typing import Any

from ddp_slurm import safefs

log = logging.getLogger(__name__)

PREFIX_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")  # torch reads them in this order


def prefix(environ: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """Where torch would dump: ``<prefix><rank>`` (None: not asked for)."""
    return next((environ[name] for name in PREFIX_VARS if environ.get(name)), None)


def torch_trace() -> dict[str, Any]:
    """torch's flight-recorder dump as a dict (NCCL's where an NCCL group exists); an empty one in torch's
    shape where torch has none (an older torch, no process group)."""
    try:
        import torch.distributed as dist
        from torch._C import _distributed_c10d as c10d

        nccl = dist.is_initialized() and "nccl" in str(dist.get_backend()).lower()
        dump = c10d._dump_nccl_trace if nccl and hasattr(c10d, "_dump_nccl_trace") else c10d._dump_fr_trace
        trace = pickle.loads(dump())
        if isinstance(trace, dict):
            if not nccl:
                _name_groups(trace)
            return trace
    except Exception as exc:  # a diagnosis aid: the runtime's own part is still worth writing
        log.debug("no flight-recorder dump from torch: %s", exc)
    return {"version": "ddp_slurm", "entries": [], "pg_config": {}}


def _name_groups(trace: dict[str, Any]) -> None:
    """The generic recorder (torch 2.14) lists only the default group in ``pg_config``, while its entries name
    every group they ran on (the training and host groups): without their ranks torch's analyser stops at the
    first such entry. Add each group this process knows."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    config = trace.setdefault("pg_config", {})
    for group, name in c10d._world.pg_names.items():
        if name not in config:
            desc = getattr(group, "group_desc", "undefined")
            config[name] = {"name": name, "desc": desc, "ranks": str(dist.get_process_group_ranks(group))}


def dump(rank: int, view: dict[str, Any], environ: dict[str, str] | os._Environ[str] = os.environ) -> Path | None:
    """Write ``<prefix><rank>``: torch's trace with ``view`` (the runtime's) under ``ddp_slurm``. The path
    written, or None (not asked for, or the write failed: a warning; the rank is on its way out anyway)."""
    where = prefix(environ)
    if where is None:
        return None
    path = Path(f"{where}{rank}")
    trace = torch_trace()
    trace["ddp_slurm"] = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), **view}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.parent / ".partial"  # torch's analyser reads every name holding the prefix: a rank killed
        safefs.make_dir(scratch, parents=False)  # mid-write would leave it a half file named like the others
        safefs.write_atomic(path, lambda f: pickle.dump(trace, f), scratch=scratch)
    except OSError as exc:
        log.warning("could not write the flight-recorder dump %s: %s", path, exc)
        return None
    return path


def launch_prefix(value: str, launch: int) -> str:
    """The prefix for the ``launch``-th relaunch inside the allocation (0: unchanged), so that a relaunch
    does not overwrite the first launch's traces: ``.../123.0-rank`` becomes ``.../123.0.2-rank``."""
    if not launch:
        return value
    stem, sep, tail = value.rpartition("-rank")
    return f"{stem}.{launch}-rank{tail}" if sep and not tail else f"{value}.{launch}-"
