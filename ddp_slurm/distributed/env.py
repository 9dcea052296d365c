"""Work out where this process sits in a distributed job, for ``torch.distributed`` to set up.

:meth:`DistEnv.from_environ` reads the launcher's environment variables (torchrun, a Slurm
``srun`` step, or none: a single process) into a :class:`DistEnv`; it is a pure function of
the mapping it is given. :func:`~ddp_slurm.distributed.group.init_distributed` /
:func:`~ddp_slurm.distributed.group.distributed` then join the process group (``group.py``, which
imports ``torch`` inside those functions only). This module never imports ``torch``: it stays cheap.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ddp_slurm import errors

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

# Derived ports stay below Linux's default ephemeral range (32768-60999), so they cannot
# clash with the source ports of outgoing connections on the node.
PORT_BASE = 20000
PORT_SPAN = 12000
_MAX_RANGE = 1 << 16  # a typo such as node[1-99999999] must fail, not eat the memory
# The launchers' variables, named once (the submitit job and the benchmarks clear them for a child).
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")  # torchrun sets all four or none
TORCHRUN_LAYOUT_VARS = (*TORCHRUN_VARS, "GROUP_RANK", "GROUP_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")
RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT")
# Step ids >= this are Slurm's pseudo-steps (batch, extern, interactive), not srun steps.
_FIRST_SPECIAL_STEP = 0xFFFFFFF0
_SPECIAL_STEP_NAMES = {"batch", "extern", "interactive"}


class BootstrapError(errors.UsageError, ValueError):
    """The environment does not describe a usable distributed layout (exit 2: nothing started)."""


class RendezvousError(errors.Error, RuntimeError):
    """The ranks did not manage to form a process group."""


Var = tuple[str, int]  # (variable name, value), kept together for error messages


def _get(environ: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """The first of ``names`` set to a non-blank value, as (name, value)."""
    for name in names:
        value = environ.get(name, "").strip()
        if value:  # `export X=` in a script means "unset", not "empty value"
            return name, value
    return None


def _int(environ: Mapping[str, str], *names: str, minimum: int = 0) -> Var | None:
    found = _get(environ, *names)
    if found is None:
        return None
    name, raw = found
    # Bounded (Slurm ids are 32-bit): 10**30 is a typo that would overflow later, not a rank or a size.
    if not re.fullmatch(r"[+-]?[0-9]{1,10}", raw) or not minimum <= int(raw) < 2**32:
        raise BootstrapError(f"{name}={raw[:40]!r} is not an integer >= {minimum} (and < 2**32)")
    return name, int(raw)


def _need(environ: Mapping[str, str], *names: str, minimum: int = 0, why: str = "required") -> Var:
    found = _int(environ, *names, minimum=minimum)
    if found is None:
        raise BootstrapError(f"{why}, but {' / '.join(names)} is not set")
    return found


def _below(small: Var, big: Var) -> None:
    if small[1] >= big[1]:
        raise BootstrapError(f"{small[0]}={small[1]} but {big[0]}={big[1]}: {small[0]} must be smaller than {big[0]}")


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm host list (``gpu-a[001-003,010],gpu-b7``) like ``scontrol show hostnames``.

    Supports ranges with zero padding (the width of the lower bound), single values and
    comma lists inside brackets, several bracket groups per name (cartesian product, first
    group varying slowest) and commas or whitespace between names. Order and duplicates are
    kept. Raises :class:`BootstrapError` on malformed or empty input.
    """
    tokens, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth not in (0, 1):
            raise BootstrapError(f"malformed Slurm host list {text!r}: unbalanced or nested '[' ']'")
        if depth == 0 and (char == "," or char.isspace()):
            tokens.append(text[start:i])
            start = i + 1
    if depth:
        raise BootstrapError(f"malformed Slurm host list {text!r}: unclosed '['")
    tokens.append(text[start:])
    hosts: list[str] = []
    for token in filter(None, tokens):
        hosts += _expand_name(token, text)
        if len(hosts) > _MAX_RANGE:
            raise BootstrapError(f"malformed Slurm host list {text[:80]!r}...: more than {_MAX_RANGE} hosts")
    if not hosts:
        raise BootstrapError(f"empty Slurm host list {text!r}")
    return hosts


def _expand_name(token: str, text: str) -> list[str]:
    # re.split with a group alternates literal, bracket body, literal, ..., literal.
    parts = re.split(r"\[([^\]]*)\]", token)
    if len(parts) > 1 and parts[-1]:
        # scontrol rejects text after the last bracket group ("a[1-2]b"): do the same.
        raise BootstrapError(f"malformed Slurm host list {text!r}: text after ']' in {token!r}")
    choices: list[list[str]] = []
    count = 1
    for i, part in enumerate(parts):
        choices.append(_expand_range(part, text) if i % 2 else [part])
        count *= len(choices[-1])
        if count > _MAX_RANGE:  # n[0-9999][0-9999] is 10^8 names: refuse before building them
            raise BootstrapError(f"malformed Slurm host list {text!r}: {token!r} names more than {_MAX_RANGE} hosts")
    return ["".join(combo) for combo in itertools.product(*choices)]


def _expand_range(body: str, text: str) -> list[str]:
    values = []
    for item in body.split(","):
        match = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", item)
        if not match:
            raise BootstrapError(f"malformed Slurm host list {text!r}: bad range {item!r}")
        low, high = int(match[1]), int(match[2] or match[1])
        if high < low or high - low >= _MAX_RANGE:
            raise BootstrapError(f"malformed Slurm host list {text!r}: bad range {item!r}")
        values += [f"{n:0{len(match[1])}d}" for n in range(low, high + 1)]
    return values


def tasks_per_node(name: str, text: str) -> list[int]:
    """Parse Slurm's compact tasks-per-node syntax: ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"([0-9]+)(?:\(x([0-9]+)\))?", item.strip())
        if not match:
            raise BootstrapError(f"{name}={text!r} is not Slurm's tasks-per-node syntax (e.g. '2(x3),1')")
        repeat = int(match[2] or 1)
        if len(counts) + repeat > _MAX_RANGE:  # 2(x999999999999) would take the memory, not describe a job
            raise BootstrapError(f"{name}={text[:80]!r} describes more than {_MAX_RANGE} nodes")
        counts += [int(match[1])] * repeat
    return counts


def derive_port(job_id: str, array_task_id: str | None = None) -> int:
    """A rendezvous port computed from the job id, the same on every rank without talking.

    For array tasks pass the array job id and the task id, so tasks of one array that share
    a node get different ports. Uses SHA-256 because Python's ``hash()`` is salted per process.
    """
    key = job_id if array_task_id is None else f"{job_id}_{array_task_id}"
    digest = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return PORT_BASE + digest % PORT_SPAN


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job. Build it with :meth:`from_environ`.

    ``restart_count`` is ``SLURM_RESTART_COUNT`` (the requeue count) whenever the process
    runs inside a Slurm job, even under torchrun; otherwise ``TORCHELASTIC_RESTART_COUNT``.
    ``master_port`` 0 means no TCP rendezvous is needed (one process outside Slurm).
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    job_id: str | None
    restart_count: int
    launcher: str  # "torchrun", "slurm" or "single"
    array_job_id: str | None = None
    array_task_id: str | None = None
    cpus_per_task: int | None = None
    in_slurm_job: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def slurm_job_ref(self) -> str | None:
        """The id ``scontrol requeue`` takes: ``<array job>_<task>`` for array tasks."""
        if self.array_job_id and self.array_task_id:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> DistEnv:
        """Read the layout from ``environ`` (pass ``os.environ``); never touches anything else.

        torchrun's variables win over Slurm's (``srun torchrun`` sets both); an ``srun`` step
        is recognised by ``SLURM_STEP_ID`` together with ``SLURM_PROCID``. Raises
        :class:`BootstrapError` naming the variables when the environment is partial or
        contradictory, or when a multi-task Slurm allocation is used without ``srun``.
        """
        job = _get(environ, "SLURM_JOB_ID", "SLURM_JOBID")
        job_id = job[1] if job else None
        array_job = _get(environ, "SLURM_ARRAY_JOB_ID")
        array_task = _get(environ, "SLURM_ARRAY_TASK_ID")
        if job_id is not None:
            restart = _int(environ, "SLURM_RESTART_COUNT")
            cpus = _int(environ, "SLURM_CPUS_PER_TASK", minimum=1)
        else:
            restart, cpus = _int(environ, "TORCHELASTIC_RESTART_COUNT"), None
        if _get(environ, *TORCHRUN_VARS):
            layout = _torchrun_layout(environ)
        elif _in_srun_step(environ):
            layout = _slurm_layout(environ)
        else:
            layout = ("single", 0, 0, 1, 1, 0, 1)
            tasks = _int(environ, "SLURM_NTASKS", "SLURM_NPROCS", minimum=1)
            if job_id is not None and tasks is not None and tasks[1] > 1:
                raise BootstrapError(
                    f"{tasks[0]}={tasks[1]} but this process is not in a job step: launch with "
                    "`srun python -m ddp_slurm.train ...` (or run one task per job)"
                )
        launcher, rank, local_rank, world, local_world, node_rank, num_nodes = layout
        derived: int | None = None
        if array_job and array_task:
            derived = derive_port(array_job[1], array_task[1])
        elif job_id is not None:
            derived = derive_port(job_id)
        master_addr = _master_addr(environ, launcher, num_nodes)
        master_port = _master_port(environ, derived, world)
        return cls(
            rank=rank,
            local_rank=local_rank,
            world_size=world,
            local_world_size=local_world,
            node_rank=node_rank,
            num_nodes=num_nodes,
            master_addr=master_addr,
            master_port=master_port,
            job_id=job_id,
            restart_count=restart[1] if restart else 0,
            launcher=launcher,
            array_job_id=array_job[1] if array_job else None,
            array_task_id=array_task[1] if array_task else None,
            cpus_per_task=cpus[1] if cpus else None,
            in_slurm_job=job_id is not None,
        )


Layout = tuple[str, int, int, int, int, int, int]


def _master_addr(environ: Mapping[str, str], launcher: str, num_nodes: int) -> str:
    addr = _get(environ, "MASTER_ADDR")
    nodelist = _get(environ, "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
    if addr is not None:
        return addr[1]
    if launcher != "single" and nodelist is not None:
        return expand_hostlist(nodelist[1])[0]  # srun puts task 0 on the step's first node
    if num_nodes == 1:
        return "127.0.0.1"
    raise BootstrapError(f"{num_nodes} nodes but neither MASTER_ADDR nor a Slurm node list is set")


def _master_port(environ: Mapping[str, str], derived: int | None, world: int) -> int:
    port = _int(environ, "MASTER_PORT", minimum=1)
    if port is not None:
        if port[1] > 65535:
            raise BootstrapError(f"MASTER_PORT={port[1]} is not a TCP port (1-65535)")
        return port[1]
    if derived is not None:
        return derived
    if world == 1:
        return 0
    raise BootstrapError(
        f"WORLD_SIZE={world} but MASTER_PORT is not set and there is no SLURM_JOB_ID to derive one from"
    )


def _in_srun_step(environ: Mapping[str, str]) -> bool:
    step = _get(environ, "SLURM_STEP_ID", "SLURM_STEPID")
    if step is None or _get(environ, "SLURM_PROCID") is None:
        return False
    if step[1].lower() in _SPECIAL_STEP_NAMES:
        return False
    # Older Slurm printed the pseudo-step ids as negative numbers.
    return 0 <= _need(environ, step[0], minimum=-(1 << 31))[1] < _FIRST_SPECIAL_STEP


def _torchrun_layout(environ: Mapping[str, str]) -> Layout:
    missing = [name for name in TORCHRUN_VARS if _get(environ, name) is None]
    if missing:
        present = [name for name in TORCHRUN_VARS if name not in missing]
        raise BootstrapError(
            f"{', '.join(present)} set but {', '.join(missing)} missing: "
            "torchrun sets all of RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE"
        )
    rank, local_rank = _need(environ, "RANK"), _need(environ, "LOCAL_RANK")
    world = _need(environ, "WORLD_SIZE", minimum=1)
    local_world = _need(environ, "LOCAL_WORLD_SIZE", minimum=1)
    _below(rank, world)
    _below(local_rank, local_world)
    if local_world[1] > world[1]:
        raise BootstrapError(
            f"LOCAL_WORLD_SIZE={local_world[1]} but WORLD_SIZE={world[1]}: a node cannot hold more ranks than the job"
        )
    nodes = _int(environ, "GROUP_WORLD_SIZE", minimum=1)
    if nodes is None:
        if world[1] % local_world[1]:
            raise BootstrapError(
                f"WORLD_SIZE={world[1]} is not a multiple of LOCAL_WORLD_SIZE="
                f"{local_world[1]} and GROUP_WORLD_SIZE is not set"
            )
        nodes = ("WORLD_SIZE/LOCAL_WORLD_SIZE", world[1] // local_world[1])
    node = _int(environ, "GROUP_RANK") or ("RANK/LOCAL_WORLD_SIZE", rank[1] // local_world[1])
    _below(node, nodes)
    return "torchrun", rank[1], local_rank[1], world[1], local_world[1], node[1], nodes[1]


def _slurm_layout(environ: Mapping[str, str]) -> Layout:
    why = "in an srun step (SLURM_STEP_ID and SLURM_PROCID set)"
    rank = _need(environ, "SLURM_PROCID", why=why)
    world = _need(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS", minimum=1, why=why)
    local_rank = _need(environ, "SLURM_LOCALID", why=why)
    node = _need(environ, "SLURM_NODEID", why=why)
    nodes = _int(environ, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", minimum=1)
    per_node_var = _get(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    _below(rank, world)
    if per_node_var is None:
        if nodes is not None and nodes[1] != 1:
            raise BootstrapError(f"{nodes[0]}={nodes[1]} but SLURM_STEP_TASKS_PER_NODE is not set")
        per_node_var, nodes = (world[0], str(world[1])), nodes or ("SLURM_NNODES", 1)
    counts = tasks_per_node(*per_node_var)
    nodes = nodes or (per_node_var[0], len(counts))
    if len(counts) != nodes[1] or sum(counts) != world[1]:
        raise BootstrapError(
            f"{per_node_var[0]}={per_node_var[1]!r} disagrees with {nodes[0]}={nodes[1]} and {world[0]}={world[1]}"
        )
    _below(node, nodes)
    local_world = (f"{per_node_var[0]}[{node[1]}]", counts[node[1]])
    _below(local_rank, local_world)
    return "slurm", rank[1], local_rank[1], world[1], local_world[1], node[1], nodes[1]


def free_port(taken: set[int] | None = None) -> int:
    """A free local TCP port below the ephemeral range (outgoing connections cannot take it meanwhile),
    not in ``taken``, which it joins. For local rendezvous: submit's local jobs, the benchmarks, tests."""
    import random
    import socket

    taken = set() if taken is None else taken
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(PORT_BASE, PORT_BASE + PORT_SPAN)
        with socket.socket() as s:
            if port in taken:
                continue
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        taken.add(port)
        return port
    raise RuntimeError("no free TCP port found for the local rendezvous")
