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
