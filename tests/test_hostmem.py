"""hostmem: malloc keeps freed memory, so a step's large temporaries stop costing page faults."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import base_env

from ddp_slurm import hostmem

FAULTS = textwrap.dedent("""
    import json, os, resource, sys
    import torch
    import helpers
    from ddp_slurm import config
    from ddp_slurm.train import loader
    from ddp_slurm.tasks.mnist import data
    from ddp_slurm.train.optim import make_optimizer, make_scheduler
    from ddp_slurm import hostmem
    from ddp_slurm.tasks.mnist import models

    kept = hostmem.keep_freed_memory(os.environ) if sys.argv[1] == "keep" else False
    torch.set_num_threads(1)
    cfg = config.load(overrides=["model.name=cnn"])
    train = data.load_sample(train=True)
    model = models.build("cnn")
    optimizer = make_optimizer(cfg.train, model.parameters(), torch.device("cpu"))
    step = helpers.mnist_step(model, optimizer, make_scheduler(cfg.train, optimizer, 100), train)
    perm = loader.epoch_permutation(len(train), 0, 0)
    for i in range(3):  # warm-up: the first steps fault in any case
        step(perm[loader.rank_slice(i, 128, 0, 1)])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(3, 23):
        step(perm[loader.rank_slice(i, 128, 0, 1)])
    print(json.dumps({"kept": kept, "faults_per_step": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20}))
""")


@pytest.mark.parametrize(
    "environ, chosen",
    [
        ({}, None),
        ({"PATH": "/usr/bin", "OMP_NUM_THREADS": "2"}, None),
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_"),
        ({"MALLOC_ARENA_MAX": "2"}, "MALLOC_ARENA_MAX"),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES"),
        ({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"}, None),
        ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "LD_PRELOAD"),
        ({"LD_PRELOAD": "libtcmalloc_minimal.so.4"}, "LD_PRELOAD"),
    ],
)
def test_a_users_own_malloc_settings_are_left_alone(environ: dict[str, str], chosen: str | None) -> None:
    assert hostmem.user_chose_allocator(environ) == chosen


def test_nothing_is_changed_when_the_user_chose() -> None:
    assert hostmem.keep_freed_memory({"MALLOC_TOP_PAD_": "0"}) is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_freed_memory_is_reused_without_page_faults(tmp_path) -> None:
    def run(mode: str) -> dict:
        env = {k: v for k, v in base_env().items() if not k.startswith("MALLOC_")}
        res = subprocess.run([sys.executable, "-c", FAULTS, mode], env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout.strip().splitlines()[-1])

    default, kept = run("default"), run("keep")
    assert kept["kept"] is True
    print(f"page faults per cnn step (batch 128): default {default['faults_per_step']}, kept {kept['faults_per_step']}")
    assert default["faults_per_step"] > 500, default  # the activations' pages, mapped afresh every step
    assert kept["faults_per_step"] < 0.1 * default["faults_per_step"], (kept, default)


# -- how much memory a rank may pin: MemAvailable, the cgroup's headroom, the ranks of the node ---------------

MEMINFO = "MemTotal:       65536000 kB\nMemFree:         1000000 kB\nMemAvailable:   32768000 kB\n"
GIB = 2**30


def test_memavailable_and_the_own_cgroup_are_read_from_their_files_text() -> None:
    assert hostmem.meminfo_available(MEMINFO) == 32768000 * 1024
    assert hostmem.meminfo_available("MemTotal: 1 kB\n") is None and hostmem.meminfo_available("") is None
    v2 = "0::/system.slice/slurmstepd.scope/job_7/step_0/user/task_0\n"
    assert hostmem.cgroup_dir(v2) == "/system.slice/slurmstepd.scope/job_7/step_0/user/task_0"
    hybrid = "4:memory:/slurm/uid_0/job_7\n1:cpu:/\n0::/\n"  # v1 controllers beside an empty unified tree
    assert hostmem.cgroup_dir(hybrid) == "/"
    assert hostmem.cgroup_dir("4:memory:/slurm/uid_0/job_7\n") is None  # cgroup v1 only: no v2 path


def test_the_tightest_cgroup_limit_above_the_process_bounds_it() -> None:
    """Slurm limits the job's and the step's cgroups; the task's own says "max". The least headroom wins."""
    limits = {
        "/job_7/step_0/user/task_0": ("max", str(3 * GIB)),
        "/job_7/step_0": (str(16 * GIB), str(4 * GIB)),
        "/job_7": (str(12 * GIB), str(4 * GIB)),  # 8 GiB left: the tightest
    }
    assert hostmem.cgroup_headroom(limits) == 8 * GIB
    assert hostmem.cgroup_headroom({"/": ("max", "123")}) is None and hostmem.cgroup_headroom({}) is None
    assert hostmem.cgroup_headroom({"/job": (str(GIB), str(2 * GIB))}) == 0  # over its limit: nothing left


def test_each_rank_gets_its_share_of_the_smaller_of_memavailable_and_the_cgroups_headroom() -> None:
    avail = hostmem.meminfo_available(MEMINFO)  # 31.25 GiB
    assert hostmem.share(avail, None, 8) == avail // 8
    assert hostmem.share(avail, 8 * GIB, 8) == GIB  # the job's limit, not the host's memory
    assert hostmem.share(None, 8 * GIB, 2) == 4 * GIB and hostmem.share(None, None, 8) is None
    assert hostmem.share(avail, 64 * GIB, 1) == avail  # a cgroup roomier than the host: the host bounds it
    assert hostmem.available_memory() is None or hostmem.available_memory() > 0  # this machine's, through the files
