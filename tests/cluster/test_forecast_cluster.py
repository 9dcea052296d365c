"""``python -m ddp_slurm.bench forecast`` inside a real allocation: one rank per node via ``srun``.

No timing assertions (the nodes share this machine's cores): the forecast must measure across the
nodes, report once (rank 0), and produce a table whose rows follow the model.
"""

from __future__ import annotations

import json
import sys

from ddp_slurm.bench import forecast

ARGS = ["--model", "mlp", "--batch", "16", "--steps", "2", "--windows", "1", "--sizes-kib", "4,64", "--threads", "1"]


def test_forecast_measures_across_two_nodes_and_reports_once(slurm_cluster, tmp_path) -> None:
    out = tmp_path / "f2.json"
    cmd = ["srun", "-N2", "--ntasks-per-node=1", "--export=ALL,OMP_NUM_THREADS=1", sys.executable]
    cmd += ["-m", "ddp_slurm.bench", "forecast", *ARGS]
    cp = slurm_cluster.run([*cmd, "--max-nodes", "16", "--json", str(out)], cwd=tmp_path, timeout=300)
    assert cp.returncode == 0, cp.stdout + cp.stderr + slurm_cluster.log_tail()
    assert cp.stdout.count("forecast for mlp") == 1, cp.stdout  # rank 0 reports, rank 1 does not
    p = json.loads(out.read_text())
    m = p["measured"]
    assert (m["world_size"], m["nodes"], m["ranks_per_node"], m["backend"]) == (2, 2, 1, "gloo")
    assert m["alpha_s"] > 0 and m["beta_s_per_byte"] >= 0 and m["measured_step_s"] > 0
    assert [r["nodes"] for r in p["forecast"]] == [1, 2, 4, 8, 16]
    for row in p["forecast"]:
        assert row["step_s"] == forecast.step_s(row["ranks"], m)[0]
    assert p["check"]["world_size"] == 2 and "all-reduce measured over 2 ranks on 2 node(s)" in cp.stdout
