"""Compatibility home of the bootstrap names: ``DistEnv``/``expand_hostlist`` live in ``ddp_slurm.distributed.env``,
joining the process group in ``ddp_slurm.distributed.group``."""

from ddp_slurm.distributed.env import *  # noqa: F403
from ddp_slurm.distributed.env import BootstrapError, DistEnv, RendezvousError, derive_port, expand_hostlist  # noqa: F401
from ddp_slurm.distributed.group import *  # noqa: F403
from ddp_slurm.distributed.group import (  # noqa: F401
    _rendezvous_error,
    configure_threads,
    distributed,
    fix_loopback_ifname,
    init_distributed,
    pick_device_and_backend,
    route_ifname,
    shutdown,
)
