"""``python -m ddp_slurm.bench shards`` at a tiny size, and ``benchmarks/throttled_disk.sh --read``.

No timing assertions on the bench (the machines that run the suite are shared and noisy): the JSON's keys,
positive figures, the ratio of the medians, and that both sides read the same samples (their labels are
the samples' numbers, so a whole epoch sums to the same number on both).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, base_env, skip_or_fail


def positive(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_shards_smoke(tmp_path: Path) -> None:
    out, count = tmp_path / "shards.json", 600
    args = ["--count", str(count), "--batch", "100", "--per-shard", "100", "--repeat", "2", "--workers", "1"]
    args += ["--memory", "--memory-reads", "2000", "--dir", str(tmp_path)]
    res = subprocess.run(
        [sys.executable, "-m", "ddp_slurm.bench", "shards", "--json", str(out), *args],
        cwd=tmp_path,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    p = json.loads(out.read_text())
    assert p["command"] == "shards" and p["params"]["shards"] == 6 and p["params"]["samples_per_pass"] == count
    a, b = p["map_samples_per_s"], p["sharded_samples_per_s"]
    assert len(a["values"]) == len(b["values"]) == 2 and all(map(positive, a["values"] + b["values"]))
    assert p["ratio"] == pytest.approx(b["median"] / a["median"], rel=1e-9)
    assert p["ratio_per_round"] == pytest.approx([y / x for x, y in zip(a["values"], b["values"])])
    for side in ("map", "sharded"):
        for one in p["passes"][side]:  # every sample once: the same count and the same labels on both sides
            assert one["samples"] == count and one["label_sum"] == count * (count - 1) // 2, one
            assert one["disk_read_bytes"] is None or one["disk_read_bytes"] >= 0
            assert one["disk_reads"] is None or one["disk_reads"] >= 0
        per = p[f"{side}_disk_bytes_per_sample"]
        assert per is None or per["median"] >= 0
    assert positive(p["write_s"]["files"]) and positive(p["write_s"]["shards"])
    assert isinstance(p["read_throttle"], list)
    m = p["memory"]
    assert [mark["reads"] for mark in m["marks"]] == [200, 2000] and m["shards"] == 200
    assert all(mark["cached_shard_fds"] <= 2 * m["window"] + 2 for mark in m["marks"]), m
    assert all(positive(mark["rss_bytes"]) for mark in m["marks"])
    assert "(b)/(a)" in res.stdout and "map-style" in res.stdout and "Shards.raw" in res.stdout
    assert [x.name for x in tmp_path.iterdir()] == ["shards.json"]  # its data folder was removed


THROTTLED_READ = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
t = time.perf_counter()
while os.read(fd, 1 << 20):
    pass
print(time.perf_counter() - t)
group = next(line.split(":", 2)[2] for line in open("/proc/self/cgroup") if ":blkio:" in line or line.startswith("0::"))
root = "/sys/fs/cgroup/blkio" if ":blkio:" in open("/proc/self/cgroup").read() else "/sys/fs/cgroup"
name = "blkio.throttle.read_bps_device" if root.endswith("blkio") else "io.max"
print(open(root + group.strip() + "/" + name).read().strip())
"""


def test_throttled_disk_limits_the_reads_of_the_command(tmp_path: Path) -> None:
    """``--read``: 32 MiB read from a cold cache take at least the time the limit allows."""
    if os.geteuid() != 0:
        skip_or_fail("benchmarks/throttled_disk.sh needs root (it creates a cgroup)")
    data = tmp_path / "r.bin"
    with open(data, "wb") as f:
        f.write(os.urandom(32 << 20))
        os.fsync(f.fileno())  # dirty pages stay in the cache: the read must go to the disk
    script = REPO / "benchmarks" / "throttled_disk.sh"
    done = subprocess.run(
        [str(script), "--read", "40", str(tmp_path), "--", sys.executable, "-c", THROTTLED_READ, str(data)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    seconds, limit = done.stdout.splitlines()
    assert str(40 << 20) in limit  # "MAJ:MIN 41943040" (v1) or "MAJ:MIN rbps=41943040 ..." (v2)
    assert float(seconds) >= 0.6, f"32 MiB at 40 MiB/s took {seconds} s"
    assert "reads on" in done.stderr and "limited to 40 MiB/s" in done.stderr
    bad = subprocess.run(
        [str(script), "--iops", "many", "40", str(tmp_path), "--", "true"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--iops must be a positive integer" in bad.stderr


def test_shards_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    from ddp_slurm.bench import __main__ as bench_cli

    with pytest.raises(SystemExit) as done:
        bench_cli.parse_args(["shards", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "usage: python -m ddp_slurm.bench shards" in out and "--dir" in out and "`" not in out
