"""``srun python -m ddp_slurm.doctor``: preflight of an allocation before a long job starts.

Every rank describes where it is (host, ranks, launcher, device, rendezvous address, the network
interface and address it will use, whether its host name resolves to loopback, visible GPUs), joins
the process group with a short timeout, checks one all-reduce and times all-reduce latency and
bandwidth. Rank 0 prints a table (a row per rank) and a verdict. A group that never formed cannot
be gathered, so each rank also diagnoses its own failure and prints a one-line verdict itself.
Every wait is bounded: a watchdog ends a rank that is stuck past its deadline, with a verdict.

Exit status: 0 OK, 1 something is wrong (the FAIL lines say what), 2 usage error.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ddp_slurm import bootstrap, text
from ddp_slurm.bootstrap import BootstrapError, DistEnv, RendezvousError
from ddp_slurm.exitcodes import EXIT_FAILURE as EXIT_FAIL
from ddp_slurm.exitcodes import EXIT_OK
from ddp_slurm.train import logs


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


def _resolve(name: str) -> str | None:
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
    host_ip = _resolve(host)
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
        index = env.local_rank % count  # what bootstrap.pick_device_and_backend chooses
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
        master_ip=_resolve(env.master_addr),
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


class Watchdog:
    """Ends this process with a verdict when a phase outlives its deadline: the doctor never hangs."""

    def __init__(self, say) -> None:
        self._say = say
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def arm(self, seconds: float, on_expiry, code: int = EXIT_FAIL) -> None:
        """In ``seconds`` print ``on_expiry()`` and exit with ``code``, unless disarmed first."""
        self.disarm()
        timer = threading.Timer(seconds, self._fire, args=(on_expiry, code))
        timer.daemon = True
        with self._lock:
            self._timer = timer
        timer.start()

    def disarm(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = None

    def _fire(self, on_expiry, code: int) -> None:
        self._say(on_expiry())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # a thread stuck in C++ cannot be interrupted any other way


def measure(device: Any, rank: int, world_size: int, size_mb: float, iters: int, phase) -> dict[str, Any]:
    """One all-reduce checked for correctness, then median latency (4 bytes) and bus bandwidth."""
    import torch
    import torch.distributed as dist

    def timed(tensor: torch.Tensor, repeats: int) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            dist.all_reduce(tensor)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    with phase("the all-reduce check"):
        values = torch.arange(4096, dtype=torch.float32, device=device) + rank
        dist.all_reduce(values)
        expected = torch.arange(4096, dtype=torch.float32) * world_size + world_size * (world_size - 1) / 2
        correct = bool(torch.equal(values.cpu(), expected))
    with phase("the latency test"):
        small = torch.zeros(1, device=device)
        timed(small, 3)  # warm-up: the first collectives set up connections and buffers
        latency_s = timed(small, 20)
    with phase("the bandwidth test"):
        big = torch.ones(max(1, int(size_mb * 2**20) // 4), device=device)
        timed(big, 1)
        seconds = timed(big, iters)
    # Bus bandwidth (as nccl-tests reports it): what each link carries in a ring all-reduce.
    bus = big.numel() * 4 * 2 * (world_size - 1) / world_size / seconds if world_size > 1 else None
    return {
        "correct": correct,
        "latency_ms": 1e3 * latency_s,
        "bus_gbps": bus / 1e9 if bus else None,
        "bandwidth_s": seconds,
    }


def cross_checks(rows: list[dict[str, Any]]) -> list[tuple[str, Failure]]:
    """Problems only visible with every rank's report side by side: (where, failure)."""
    problems: list[tuple[str, Failure]] = []
    sizes = {r["world_size"] for r in rows}
    if len(sizes) > 1 or len(rows) not in sizes:
        problems.append(
            (
                "all ranks",
                Failure(
                    "mismatched world size", (f"{len(rows)} ranks joined but they report world sizes {sorted(sizes)}")
                ),
            )
        )
    hosts_of_node: dict[int, set[str]] = defaultdict(set)
    local_ranks: dict[tuple[str, int], list[int]] = defaultdict(list)
    gpu_users: dict[tuple[str, str], list[int]] = defaultdict(list)
    for r in rows:
        hosts_of_node[r["node_rank"]].add(r["host"])
        local_ranks[(r["host"], r["node_rank"])].append(r["local_rank"])
        if r["gpu"] is not None:  # the same physical device, not the same name: every task's may be "0"
            gpu_users[(r["node"], r.get("gpu_id") or r["gpu"])].append(r["rank"])
        if not r["correct"]:
            problems.append(
                (
                    f"rank {r['rank']} on {r['node']}",
                    Failure(
                        "all-reduce wrong",
                        ("the sum of a test tensor came back wrong: a faulty GPU, driver or network card"),
                    ),
                )
            )
    for node, hosts in sorted(hosts_of_node.items()):
        if len(hosts) > 1:
            problems.append(
                (
                    f"node rank {node}",
                    Failure(
                        "duplicate ranks",
                        (
                            f"node rank {node} is claimed by hosts {', '.join(sorted(hosts))}: every node needs its own "
                            "node rank (torchrun --node_rank, or a shared --rdzv-endpoint)"
                        ),
                    ),
                )
            )
    for (host, node), locals_ in sorted(local_ranks.items()):
        if len(set(locals_)) < len(locals_):
            problems.append(
                (
                    f"{host}",
                    Failure(
                        "duplicate ranks",
                        (f"local ranks {sorted(locals_)} on node rank {node}: two processes share a local rank"),
                    ),
                )
            )
    for (node, _), ranks in sorted(gpu_users.items()):
        if len(ranks) > 1:
            first = next(r for r in rows if r["rank"] == ranks[0])
            count = first["cuda_count"]
            gpu = first["gpu"] + (f" ({first['gpu_id']})" if first.get("gpu_id") else "")
            problems.append(
                (
                    f"{node}",
                    Failure(
                        "CUDA device count vs tasks per node",
                        (
                            f"ranks {', '.join(map(str, ranks))} share GPU {gpu} ({count} visible per task): ask Slurm "
                            "for one GPU per task (--gpus-per-task=1) or fewer tasks per node"
                        ),
                    ),
                )
            )
    return problems


def table(rows: list[dict[str, Any]]) -> str:
    """A row per rank, columns padded to fit."""
    head = [
        "rank",
        "local",
        "node",
        "host",
        "device",
        "backend",
        "iface",
        "address",
        "loopback",
        "gpus",
        "latency ms",
        "bus GB/s",
    ]
    body = [
        [
            str(r["rank"]),
            f"{r['local_rank']}/{r['local_world_size']}",
            f"{r['node_rank']}/{r['num_nodes']}",
            r["host"] if r["node"] == r["host"] else f"{r['host']} ({r['node']})",
            r["device"],
            r["backend"],
            r["ifname"] or "?",
            r["if_address"] or "?",
            "yes" if r["host_loopback"] else "no",
            str(r["cuda_count"]) + (f" (uses {r['gpu']})" if r["gpu"] is not None else ""),
            f"{r['latency_ms']:.3f}",
            f"{r['bus_gbps']:.2f}" if r["bus_gbps"] is not None else "-",
        ]
        for r in sorted(rows, key=lambda r: r["rank"])
    ]
    return "\n".join(text.columns([head, *body]))


def summary(rows: list[dict[str, Any]], size_mb: float) -> str:
    first = rows[0]
    nodes = len({r["node"] for r in rows})
    bus = [r["bus_gbps"] for r in rows if r["bus_gbps"] is not None]
    rendezvous = f"{first['master_addr']}:{first['master_port']}" if first["world_size"] > 1 else "none (one process)"
    if first["world_size"] > 1 and first["master_ip"] and first["master_ip"] != first["master_addr"]:
        rendezvous += f" ({first['master_ip']})"
    text = (
        f"{len(rows)} rank(s) on {nodes} host(s), launcher {first['launcher']}, rendezvous {rendezvous}\n"
        f"all-reduce: {'correct' if all(r['correct'] for r in rows) else 'WRONG'}; latency (4 B) "
        f"{max(r['latency_ms'] for r in rows):.3f} ms (slowest rank)"
    )
    if bus:
        text += f"; bus bandwidth ({size_mb:g} MiB) {min(bus):.2f} GB/s (slowest rank)"
    return text


def fail_line(where: str, failure: Failure) -> str:
    return f"doctor: FAIL {where}: {failure.cause}: {failure.detail}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_slurm.doctor",
        description=(
            "Preflight of a distributed allocation: run it the way the training will run "
            "(srun, torchrun or one process). Exit 0 only when everything is OK."
        ),
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds the rendezvous and each collective may take (default 30)",
    )
    parser.add_argument(
        "--size-mb",
        type=float,
        default=64.0,
        metavar="MIB",
        help="message size of the bandwidth test in MiB (default 64)",
    )
    parser.add_argument("--iters", type=int, default=5, help="timed repeats of the bandwidth test (default 5)")
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    args = parser.parse_args(argv)
    if args.timeout <= 0 or args.size_mb <= 0 or args.iters < 1:
        parser.error("--timeout and --size-mb must be positive and --iters at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # torch's C++ store retries and stack dumps would bury the one line that says what is wrong.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

    def say(line: str) -> None:
        print(line, flush=True)

    host = socket.gethostname()
    try:
        env = DistEnv.from_environ(os.environ)
    except BootstrapError as exc:
        mismatch = any(word in str(exc) for word in ("must be smaller", "disagrees", "cannot hold more"))
        rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "?"
        say(
            fail_line(
                f"rank {rank} on {host}",
                Failure("mismatched world size" if mismatch else "launcher environment", str(exc)),
            )
        )
        return EXIT_FAIL
    logs.setup(env.rank, host)
    if _resolve(env.master_addr):  # an unresolvable name is diagnosed by the rendezvous below
        bootstrap.fix_loopback_ifname(env, os.environ)
    rep = describe(env, os.environ)
    fails, suspects = local_checks(rep, os.environ)
    for failure in fails:
        say(fail_line(rep.where(), failure))
    if fails:
        return EXIT_FAIL

    watchdog = Watchdog(say)
    grace = max(10.0, args.timeout / 2)  # torch's own timeout fires first and names the cause better
    watchdog.arm(args.timeout + grace, lambda: fail_line(rep.where(), stuck_rendezvous(rep, args.timeout + grace)))
    try:
        device, backend = bootstrap.init_distributed(env, args.backend, args.timeout)
    except (BootstrapError, RendezvousError) as exc:
        watchdog.disarm()
        failure = (
            rendezvous_failure(exc, rep, args.timeout, suspects)
            if isinstance(exc, RendezvousError) or "cannot be resolved" in str(exc)
            else Failure("setup", str(exc))
        )
        say(fail_line(rep.where(), failure))
        return EXIT_FAIL
    finally:
        watchdog.disarm()
    rep.device, rep.backend = str(device), backend
    try:
        code = _after_init(args, env, rep, device, watchdog, say, grace)
    except Exception as exc:  # a collective failed: a peer died or timed out
        gist = logs.collective_failure(exc) or (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        failure = Failure("collective failed", f"{gist} (another rank probably failed: see its line)")
        say(fail_line(rep.where(), failure))
        code = EXIT_FAIL
    # Leaving the group must not hang either; the verdict is already out, so keep its exit status.
    watchdog.arm(args.timeout + grace, lambda: f"doctor: {rep.where()}: leaving the process group hung", code)
    bootstrap.shutdown()
    watchdog.disarm()
    return code


def _after_init(
    args: argparse.Namespace, env: DistEnv, rep: Report, device: Any, watchdog: Watchdog, say, grace: float
) -> int:
    import contextlib

    import torch.distributed as dist

    @contextlib.contextmanager
    def phase(what: str) -> Iterator[None]:
        # gloo raises when a collective outlives --timeout, and that error names the cause best; NCCL's own
        # watchdog instead kills the process at --timeout, before any verdict: there the doctor's comes first.
        limit = 0.8 * args.timeout if rep.backend == "nccl" else args.timeout + grace
        watchdog.arm(
            limit,
            lambda: fail_line(
                rep.where(),
                Failure(
                    "collective stuck",
                    f"{what} did not finish within {limit:.0f} s: a rank stopped answering "
                    "(see the other ranks' lines)",
                ),
            ),
        )
        try:
            yield
        finally:
            watchdog.disarm()

    row = {**asdict(rep), **measure(device, env.rank, env.world_size, args.size_mb, args.iters, phase)}
    rows: list[Any] = [None] * env.world_size
    with phase("gathering the reports"):
        dist.all_gather_object(rows, row)
    verdict = [EXIT_OK]
    if env.rank == 0:
        problems = cross_checks(rows)
        say(f"doctor: {summary(rows, args.size_mb)}\n{table(rows)}")
        if problems:
            say(f"doctor: verdict FAIL ({len(problems)} problem(s)):")
            for where, failure in problems:
                say(fail_line(where, failure))
            verdict[0] = EXIT_FAIL
        else:
            say("doctor: verdict OK")
    with phase("sharing the verdict"):
        dist.broadcast_object_list(verdict, src=0)
    return int(verdict[0])


if __name__ == "__main__":
    sys.exit(main())
