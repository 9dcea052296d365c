"""Where a rank is, and what is wrong with where it is: the checks ``doctor`` runs before and around the
rendezvous.

``describe`` is one rank's view of itself (host, ranks, launcher, device, rendezvous address, the
interface and address it will use, visible GPUs); ``local_checks`` finds what this rank alone can see
is wrong; ``rendezvous_failure`` and ``stuck_rendezvous`` turn a process group that never formed into
one verdict. Each problem is a ``Failure`` with a fixed cause word and what to do.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from ddp_slurm.distributed.env import BootstrapError, DistEnv


class Failure(Exception):
    """A diagnosed problem: ``cause`` is one of a few fixed words, ``detail`` says what and what to do."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause, self.detail = cause, detail


@dataclass
class Report:
    """One rank's view of itself; gathered to rank 0 for the table."""

    rank: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    world_size: int
    launcher: str
    host: str
    node: str  # SLURMD_NODENAME under Slurm, else the host name
    host_address: str | None  # what the host name resolves to (gloo advertises it unless an interface is set)
    host_loopback: bool
    master_addr: str
    master_ip: str | None
    master_port: int
    ifname: str | None
    if_address: str | None
    cuda_count: int
    gpu: str | None  # the GPU this rank takes as its task sees it (a CUDA_VISIBLE_DEVICES entry or an index)
    gpu_id: str | None = None  # that GPU's identity on the node: its UUID (else its PCI bus id)
    device: str = "?"
    backend: str = "?"
    slurm_tasks: int | None = None  # tasks (srun) or agents (srun torchrun) in the Slurm step

    def where(self) -> str:
        return f"rank {self.rank} on {self.node}"


def resolve_host(name: str) -> str | None:
    """The IPv4 address ``name`` resolves to here, None when it does not resolve."""
    try:
        return socket.gethostbyname(name)
    except OSError:
        return None


def _is_loopback(ip: str | None) -> bool:
    return ip is not None and ipaddress.ip_address(ip).is_loopback


def _interfaces() -> dict[str, str]:
    """Interface name -> its IPv4 address (Linux ioctl SIOCGIFADDR; empty where that is unavailable)."""
    try:
        import fcntl
        import struct
    except ImportError:
        return {}
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on this interface
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def gpu_identity(index: int) -> str | None:
    """The physical identity of visible GPU ``index``: ``GPU-<uuid>`` as nvidia-smi prints it, else its
    PCI address. Names like "GPU 0" say nothing: with per-task device cgroups every task's GPU is "0"."""
    import torch

    props = torch.cuda.get_device_properties(index)
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid:
        return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    return f"{getattr(props, 'pci_domain_id', 0):08x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"


def describe(env: DistEnv, environ: Mapping[str, str]) -> Report:
    """This rank's report, before any network traffic. Call after ``fix_loopback_ifname``."""
    import torch

    host = socket.gethostname()
    host_ip = resolve_host(host)
    nics = _interfaces()
    ifname = environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0] or None
    if ifname:  # gloo binds to this interface's address
        if_address = nics.get(ifname)
    else:  # gloo binds to whatever the host name resolves to
        if_address, ifname = host_ip, next((name for name, ip in nics.items() if ip == host_ip), None)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu = gpu_id = None
    if count:
        visible = [v for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        index = env.local_rank % count  # what distributed.group.pick_device_and_backend chooses
        gpu = visible[index] if index < len(visible) else str(index)
        gpu_id = gpu_identity(index)
    step = environ.get("SLURM_STEP_ID", "")
    in_step = step.isdigit() and int(step) < 0xFFFFFFF0  # not the batch/extern pseudo-steps
    tasks = environ.get("SLURM_STEP_NUM_TASKS") if in_step else None
    return Report(
        rank=env.rank,
        local_rank=env.local_rank,
        local_world_size=env.local_world_size,
        node_rank=env.node_rank,
        num_nodes=env.num_nodes,
        world_size=env.world_size,
        launcher=env.launcher,
        host=host,
        node=environ.get("SLURMD_NODENAME") or host,
        host_address=host_ip,
        host_loopback=_is_loopback(host_ip),
        master_addr=env.master_addr,
        master_ip=resolve_host(env.master_addr),
        master_port=env.master_port,
        ifname=ifname,
        if_address=if_address,
        cuda_count=count,
        gpu=gpu,
        gpu_id=gpu_id,
        slurm_tasks=int(tasks) if tasks and tasks.isdigit() else None,
    )


def local_checks(rep: Report, environ: Mapping[str, str]) -> tuple[list[Failure], list[str]]:
    """Problems this rank can see alone, before the rendezvous: (certain failures, suspicions).

    A suspicion only becomes the verdict if the rendezvous then fails (two agents on one host may
    legitimately use a loopback MASTER_ADDR, for instance).
    """
    fails, suspects = [], []
    if rep.launcher == "torchrun" and rep.slurm_tasks is not None:
        if environ.get("TORCHELASTIC_RUN_ID"):  # real torchrun agents, one per srun task
            if rep.slurm_tasks != rep.num_nodes:
                fails.append(
                    Failure(
                        "mismatched world size",
                        (
                            f"srun started {rep.slurm_tasks} torchrun agents but torchrun formed a group of "
                            f"{rep.num_nodes} node(s): under a multi-node srun use --nnodes {rep.slurm_tasks} with a "
                            "shared --rdzv-endpoint, not --standalone"
                        ),
                    )
                )
        elif rep.slurm_tasks != rep.world_size:  # RANK/WORLD_SIZE set by hand from Slurm's variables
            fails.append(
                Failure(
                    "mismatched world size",
                    (
                        f"the Slurm step has {rep.slurm_tasks} tasks but WORLD_SIZE={rep.world_size}: derive "
                        "WORLD_SIZE from SLURM_NTASKS (or drop RANK/WORLD_SIZE and let srun's variables be used)"
                    ),
                )
            )
    if rep.cuda_count > 1 and rep.local_world_size > rep.cuda_count:
        fails.append(
            Failure(
                "CUDA device count vs tasks per node",
                (
                    f"{rep.local_world_size} tasks on {rep.node} but {rep.cuda_count} visible GPUs: "
                    "ask Slurm for one GPU per task (--gpus-per-task=1 or --ntasks-per-node = GPUs per node)"
                ),
            )
        )
    agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if rep.world_size > 1 and rep.rank == 0 and not agent_store and rep.master_ip:
        fails += _check_master_here(rep)
    if rep.num_nodes > 1 and _is_loopback(rep.master_ip):
        suspects.append(
            f"loopback address: MASTER_ADDR={rep.master_addr} is a loopback address but the job "
            f"spans {rep.num_nodes} nodes: set it to the first node's host name"
        )
    if rep.num_nodes > 1 and rep.host_loopback and not environ.get("GLOO_SOCKET_IFNAME"):
        suspects.append(
            f"loopback address: host name {rep.host} resolves to {rep.host_address} and no "
            "interface routes to MASTER_ADDR: set GLOO_SOCKET_IFNAME to the cluster interface"
        )
    return fails, suspects


def _check_master_here(rep: Report) -> list[Failure]:
    """Rank 0 hosts the rendezvous: MASTER_ADDR must be one of its addresses and the port must be free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((rep.master_ip, 0))
        except OSError:
            return [
                Failure(
                    "wrong MASTER_ADDR",
                    (
                        f"rank 0 runs on {rep.host} but MASTER_ADDR={rep.master_addr} ({rep.master_ip}) is not one of its "
                        "addresses: point MASTER_ADDR at the host of rank 0 (the first node of the job)"
                    ),
                )
            ]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store does: TIME_WAIT is fine
        try:
            sock.bind(("", rep.master_port))
        except OSError as exc:
            return [
                Failure(
                    "port in use",
                    (
                        f"port {rep.master_port} on {rep.host} is taken ({exc.strerror}): another job or program holds "
                        "it; set MASTER_PORT to a free port (under Slurm the default is derived from the job id)"
                    ),
                )
            ]
    return []


def rendezvous_failure(exc: Exception, rep: Report, timeout_s: float, suspects: list[str]) -> Failure:
    """Name the likely cause of a failed ``init_distributed`` from torch's own error."""
    text = str(exc)
    cause_text = str(exc.__cause__ or "").splitlines()[0] if exc.__cause__ else ""
    at = f"{rep.master_addr}:{rep.master_port}"
    if isinstance(exc, BootstrapError) and "cannot be resolved" in text:
        return Failure("unresolvable host", f"{text} on {rep.host}: check MASTER_ADDR (or the Slurm node list)")
    if suspects:
        cause, _, detail = suspects[0].partition(": ")
        return Failure(cause, f"{detail} (rendezvous at {at} failed: {cause_text or text})")
    if "already in use" in text:
        return Failure("port in use", text)
    if "does not answer as rank 0's" in text:  # distributed/meet.py: a foreign program on MASTER_PORT
        return Failure("port in use", text)
    if re.search(r"expected \d+ ranks, \d+ arrived", text) and "secret" not in text:  # meet.py: ranks missing
        return Failure(
            "rank missing", f"{text}: a rank did not start, crashed, or has another MASTER_ADDR/PORT or WORLD_SIZE"
        )
    if "clients joined" in cause_text:
        return Failure(
            "rank missing",
            f"{text}: a rank did not start, crashed, or has another MASTER_ADDR/PORT "
            "or WORLD_SIZE (see the other ranks' lines)",
        )
    if "wait timeout" in cause_text or "waiting for clients" in cause_text:
        return Failure(
            "rank missing",
            f"reached rank 0 at {at} but the group of {rep.world_size} was not complete "
            f"within {timeout_s:g} s: a rank is missing or has another WORLD_SIZE",
        )
    if "connect" in cause_text.lower() or "timed out" in text:
        return Failure(
            "rank 0 unreachable",
            f"no rendezvous at {at} within {timeout_s:g} s: rank 0 did not start "
            "or failed (see its line), or MASTER_ADDR/MASTER_PORT point elsewhere",
        )
    return Failure("rendezvous failed", text)


def stuck_rendezvous(rep: Report, waited_s: float) -> Failure:
    """The rendezvous outlived its timeout (torch's store client can wait forever on a foreign server)."""
    at = f"{rep.master_addr}:{rep.master_port}"
    try:
        with socket.create_connection((rep.master_ip or rep.master_addr, rep.master_port), timeout=3):
            answering = True
    except OSError:
        answering = False
    if answering and rep.rank != 0:
        return Failure(
            "port in use",
            f"something at {at} accepts connections but never answered as rank 0's "
            f"rendezvous ({waited_s:.0f} s): another program holds the port; "
            "set MASTER_PORT to a free port",
        )
    return Failure("rank 0 unreachable", f"no rendezvous at {at} after {waited_s:.0f} s")
