"""`python -m ddp_slurm.report RUN_DIR` on a real run that was stopped by a signal, crashed after a
checkpoint (so some steps were redone) and resumed to the end; and on a run still being written."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import helpers
import pytest
from conftest import base_env

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ARGS = [
    "model.name=mlp",
    "train.global_batch_size=64",
    "train.epochs=2",
    "train.log_every_steps=5",
    "checkpoint.every_steps=20",
    "run.name=r",
]

HARNESS = helpers.INJECTING_HARNESS


def launch(cwd: Path, **env: str) -> int:
    harness = cwd / "harness.py"
    harness.write_text(HARNESS)
    res = subprocess.run(
        [sys.executable, str(harness), *ARGS], cwd=cwd, env=base_env(**env), capture_output=True, text=True, timeout=600
    )
    return res.returncode


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory) -> Path:
    """156 steps in 3 launches: SIGUSR2 at step 30 (exit 75); a crash at step 55 with the last checkpoint
    at 40, so steps 41-55 run twice; then to the end."""
    cwd = tmp_path_factory.mktemp("report")
    assert launch(cwd, STOP_AT="30") == 75
    assert launch(cwd, CRASH_AT="25") == 1  # steps 31..54 done, crashes in step 55
    assert launch(cwd) == 0
    return cwd / "runs" / "r"


def report(run_dir: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddp_slurm.report", str(run_dir)],
        cwd=cwd,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def expected(path: Path) -> dict:
    """The summary figures, straight from the metrics file: the latest launch wins for redone steps."""
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    for row in rows:
        if row["kind"] == "start":
            for seen in (train, evals):
                for step in [s for s in seen if s > row["step"]]:
                    del seen[step]
        elif row["kind"] == "train":
            train[row["step"]] = row
        elif row["kind"] == "eval":
            evals[row["step"]] = row
    accs = [evals[s]["accuracy"] for s in sorted(evals)]
    return {
        "final": accs[-1] if accs else None,
        "best": max(accs) if accs else None,
        "starts": sum(r["kind"] == "start" for r in rows),
        "stops": sum(r["kind"] == "stop" for r in rows),
        "time": rows[-1]["time_s"],
        "windows": len(train),
        "mean": statistics.fmean(r["samples_per_s"] for r in train.values()),
    }


def check_png(path: Path) -> None:
    from matplotlib.image import imread

    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 20_000
    image = imread(path)
    assert 600 <= image.shape[0] <= 2000 and 600 <= image.shape[1] <= 2000, image.shape
    assert image[..., :3].std() > 0.05  # not a blank canvas


def test_report_of_a_resumed_run(resumed_run, tmp_path):
    metrics = resumed_run / "metrics.jsonl"
    raw_steps = [json.loads(l)["step"] for l in metrics.read_text().splitlines() if '"kind": "train"' in l]
    assert len(raw_steps) > len(set(raw_steps)), "the crash should have made some steps run twice"
    res = report(resumed_run, tmp_path)
    assert res.returncode == 0, res.stderr
    check_png(resumed_run / "report.png")
    want = expected(metrics)
    assert want["starts"] == 3 and want["stops"] == 1
    out = res.stdout
    assert f"run {resumed_run}: finished at step 156, world size 1" in out
    assert f"test accuracy: final {100 * want['final']:.2f}% (step 156), best {100 * want['best']:.2f}%" in out, out
    assert (
        f"wall time: {want['time']:.1f} s of training; 3 launch(es), 2 restart(s) (0 inside the allocation after a lost node), 0 Slurm requeue(s), 1 stop signal(s)"
    ) in out, out
    assert f"throughput: mean {want['mean']:,.0f} samples/s over {want['windows']} logged windows" in out, out
    assert want["windows"] == 156 // 5
    assert f"plots: {resumed_run / 'report.png'}" in out


def test_report_of_a_run_still_going(resumed_run, tmp_path):
    """What a reader sees while the second launch is writing: complete lines, then half of one."""
    live = tmp_path / "live"
    live.mkdir()
    shutil.copy(resumed_run / "config.yaml", live / "config.yaml")
    lines = (resumed_run / "metrics.jsonl").read_text().splitlines(keepends=True)
    second = [i for i, l in enumerate(lines) if '"kind": "start"' in l][1]
    upto = second + 4  # the second launch's start and three train lines
    (live / "metrics.jsonl").write_text("".join(lines[:upto]) + lines[upto][:25])
    res = report(live, tmp_path)
    assert res.returncode == 0, res.stderr
    check_png(live / "report.png")
    last = json.loads(lines[upto - 1])
    assert f"running or interrupted, last line at step {last['step']}" in res.stdout
    assert "test accuracy: no evaluation yet" in res.stdout
    assert (
        "2 launch(es), 1 restart(s) (0 inside the allocation after a lost node), 0 Slurm requeue(s), 1 stop signal(s)"
        in res.stdout
    )


def test_report_needs_a_run_directory(tmp_path):
    res = report(tmp_path / "nope", tmp_path)
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "metrics.jsonl does not exist" in res.stderr


def test_report_shows_metrics_as_the_task_declared_them(tmp_path: Path) -> None:
    """A task declaring ``percent_metrics = ()`` (its accuracy is already in percent): the report reads the
    declaration from the start line and shows ``97.5``, not ``9750.00%``; a file without it keeps the default."""
    from ddp_slurm.tools import history, report

    run_dir = tmp_path / "pct"
    run_dir.mkdir()
    start = {"kind": "start", "step": 0, "epoch": 0, "time_s": 0.0, "best_metric": "accuracy"}
    rows = [
        {**start, "higher_is_better": True, "percent_metrics": []},
        {"kind": "eval", "step": 10, "epoch": 0, "time_s": 1.0, "accuracy": 97.5, "test_samples": 100},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = report.summary(history.read_history(run_dir))
    assert "final 97.5 " in text and "%" not in text, text
    rows[0].pop("percent_metrics")
    rows[1]["accuracy"] = 0.975
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "final 97.50% " in report.summary(history.read_history(run_dir))


def test_control_characters_in_a_metrics_file_are_shown_escaped(tmp_path: Path) -> None:
    """Metric names and reasons from metrics.jsonl once reached the terminal raw (an escape sequence recoloured
    it, a newline forged a line of the report): every string the report shows has its controls escaped."""
    run_dir = tmp_path / "ctl"
    run_dir.mkdir()
    evil = "acc\x1b[31m\nrun forged: finished at step 999\x07"
    rows = [
        {"kind": "start", "step": 0, "epoch": 0, "time_s": 0.0, "best_metric": evil, "higher_is_better": True},
        {"kind": "eval", "step": 10, "epoch": 0, "time_s": 1.0, evil: 0.5, "loss\r": 0.25, "test_samples": 100},
        {"kind": "early_stop", "step": 10, "epoch": 0, "time_s": 1.0, "reason": "patience\x1b]0;title\x07"},
        {"kind": "end", "step": 10, "epoch": 0, "time_s": 1.0},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = report(run_dir, tmp_path)
    assert res.returncode == 0, res.stderr
    assert not [c for c in res.stdout if c != "\n" and (ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F)], repr(res.stdout)
    assert "\\x1b[31m" in res.stdout and "\\x07" in res.stdout, res.stdout
    assert not any(line.startswith("run forged") for line in res.stdout.splitlines())


def test_a_task_with_many_metrics_is_drawn_in_bounded_panels(tmp_path: Path) -> None:
    """300 metrics on one eval line once took 140 s and 776 MB (a panel each): the figure draws the first
    ``MAX_METRIC_PANELS`` (the tracked one first), and the summary says how many it left out."""
    from ddp_slurm.tools import figures, history, report

    run_dir = tmp_path / "many"
    run_dir.mkdir()
    names = [f"m{i:03d}" for i in range(40)]
    rows = [
        {"kind": "start", "step": 0, "epoch": 0, "time_s": 0.0, "best_metric": "m039", "higher_is_better": True},
        {"kind": "train", "step": 5, "epoch": 0, "time_s": 0.5, "loss": 1.0, "samples_per_s": 10.0},
        {"kind": "eval", "step": 10, "epoch": 0, "time_s": 1.0, **{n: 0.5 for n in names}, "test_samples": 100},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = history.read_history(run_dir)
    fig = figures.build_run(run, "many")
    titles = [ax.get_title() for ax in fig.axes if ax.get_title().startswith("test m")]
    assert len(titles) == figures.MAX_METRIC_PANELS and titles[0] == "test m039", titles
    text = report.summary(run)
    assert f"the first {figures.MAX_METRIC_PANELS} of 40 eval metrics" in text, text
    assert f"and {39 - report.MAX_LISTED} more" in text, text


def test_report_of_a_stopped_run_names_the_command_that_resumes_it(tmp_path: Path) -> None:
    from ddp_slurm.tools import history, report

    run_dir = tmp_path / "stopped"
    run_dir.mkdir()
    rows = [
        {"kind": "start", "step": 0, "epoch": 0, "time_s": 0.0, "world_size": 2},
        {"kind": "stop", "step": 40, "epoch": 0, "time_s": 3.0, "requeue": True},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = report.summary(history.read_history(run_dir))
    assert f"stopped on a signal at step 40 (resume: ddp-slurm resume {run_dir})" in text, text


def test_an_early_stop_and_the_best_evaluation_are_shown(tmp_path: Path) -> None:
    """A run that early stopping ended: the summary says so and why, the plot marks the best evaluation (the
    best checkpoint's) and the early stop, and a sweep's table shows it instead of plain 'finished'."""
    from ddp_slurm.launch import sweep
    from ddp_slurm.tools import figures, history, report

    run_dir = tmp_path / "early"
    run_dir.mkdir()
    at = {"epoch": 0, "time_s": 1.0}
    why = "no improvement of mse by more than eval.min_delta=0 in 2 evaluations"
    rows = [
        {"kind": "start", "step": 0, **at, "best_metric": "mse", "higher_is_better": False},
        *({"kind": "train", "step": s, **at, "loss": 1.0 / s} for s in (2, 4, 6, 8, 10, 12)),
        *({"kind": "eval", "step": s, **at, "mse": v, "test_samples": 100} for s, v in ((4, 0.5), (8, 0.2), (12, 0.3))),
        {"kind": "early_stop", "step": 12, **at, "reason": why, "best": 0.2, "best_step": 8},
        {"kind": "end", "step": 12, **at},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = history.read_history(run_dir)
    text = report.summary(run)
    assert f"stopped early at step 12 ({why})" in text and "best 0.2 (step 8; lower is better)" in text, text
    fig = figures.build_run(run, "early")
    labels = {line.get_label() for ax in fig.axes for line in ax.get_lines()}
    assert {"best (step 8)", "early stop"} <= labels, labels
    summary = sweep.summarize(run_dir)
    assert (summary.status, summary.early_stop, summary.best) == ("finished", 12, 0.2)
    assert "stopped early at 12" in sweep.format_table([summary])


def guarded_run(run_dir: Path, verdict: dict) -> Path:
    """A guarded run's metrics.jsonl as the guard writes it: a spike flagged at step 9, rolled back to the
    checkpoint of step 5, replayed to step 9 (`verdict`: the replay line's own fields), and on to step 12.
    Step 8 is logged by the first pass (its loss already rising), by the replay and, after a skip, once more;
    the first pass evaluated at step 8 too."""
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("train:\n  global_batch_size: 32\n")
    at = {"epoch": 0, "time_s": 0.6}
    why = "loss 7.501e+05 is 27016029.6 deviations above its running mean 0.7619"
    rows = [
        {"kind": "start", "step": 0, **at, "best_metric": "loss", "higher_is_better": False},
        *({"kind": "train", "step": s, **at, "loss": 1.0 / s} for s in range(1, 8)),
        {"kind": "train", "step": 8, **at, "loss": 500.0},
        {"kind": "eval", "step": 8, **at, "loss": 400.0, "test_samples": 100},
        {"kind": "rollback", "step": 9, **at, "to": 5, "why": why, "suspect": [9, 9], "rollback": 1},
        *({"kind": "train", "step": s, **at, "loss": 2.0 / s} for s in (6, 7, 8)),
        {"kind": "replay", "step": 9, **at, "suspect": [9, 9], "first": "d36f", "replay": "d36f", "steps": 4} | verdict,
    ]
    if verdict["verdict"] == "reproduced":  # back to step 5 again; step 9 is skipped: no line of its own
        rows.append({"kind": "skip", "step": 9, **at, "steps": [9, 9], "samples": [256, 288]})
        rows += ({"kind": "train", "step": s, **at, "loss": 3.0 / s} for s in (6, 7, 8, 10, 11, 12))
    else:  # the replay's values stand: on from step 9
        rows += ({"kind": "train", "step": s, **at, "loss": 3.0 / s} for s in (9, 10, 11, 12))
    rows.append({"kind": "end", "step": 12, **at})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_a_rollback_whose_replay_reproduced_it(tmp_path: Path) -> None:
    """Bad data: the summary names the rollback, the replay's verdict and the steps (and samples) skipped; the
    lines a rollback or a skip superseded are gone (step 8 three times: the latest stands); the figure marks the rollback and shades the skipped step, once in its legend."""
    from ddp_slurm.tools import figures, history, report

    run_dir = guarded_run(tmp_path / "bad-data", {"verdict": "reproduced"})
    run = history.read_history(run_dir)
    text = report.summary(run)
    assert (
        "rollback 1 at step 9 (loss 7.501e+05 is 27016029.6 deviations above its running mean 0.7619): back to "
        "step 5; replay reproduced it: skipped step 9 (samples 256-287)"
    ) in text.splitlines(), text
    losses = {r["step"]: r["loss"] for r in run.train}
    assert losses[8] == 3.0 / 8 and losses[5] == 1.0 / 5, losses  # step 5: the checkpoint gone back to
    assert sorted(losses) == [s for s in range(1, 13) if s != 9]
    assert run.evals == []  # step 8's evaluation belonged to the pass the rollback undid
    fig = figures.build_run(run, "bad data")
    ax_loss = fig.axes[0]
    labels = [h.get_label() for h in ax_loss.get_legend_handles_labels()[0]]
    assert labels.count("guard rollback") == 1 and labels.count("skipped steps") == 1, labels
    (marker,) = [line for line in ax_loss.get_lines() if line.get_label() == "guard rollback"]
    assert list(marker.get_xdata()) == [run.samples(9)]
    (span,) = [p for p in ax_loss.patches if p.get_label() == "skipped steps"]
    xs = span.get_patch_transform().transform(span.get_path().vertices)[:, 0]  # a Polygon or a Rectangle
    assert (min(xs), max(xs)) == (run.samples(8), run.samples(9))  # step 9's whole batch
    figures.plot_run(run, run_dir / "report.png", "bad data")
    check_png(run_dir / "report.png")


def test_a_rollback_whose_replay_did_not_reproduce_it(tmp_path: Path) -> None:
    """A faulty rank: the summary names it and its host; nothing was skipped, the replay's values stand."""
    from ddp_slurm.tools import figures, history, report

    verdict = {"verdict": "not reproduced", "ranks": [1], "hosts": ["node2"], "at": 12}
    run = history.read_history(guarded_run(tmp_path / "fault", verdict))
    text = report.summary(run)
    assert (
        "rollback 1 at step 9 (loss 7.501e+05 is 27016029.6 deviations above its running mean 0.7619): back to "
        "step 5; replay did not reproduce it: rank 1 (host node2) computed differently at step 12"
    ) in text.splitlines(), text
    losses = {r["step"]: r["loss"] for r in run.train}
    assert losses[8] == 2.0 / 8 and losses[6] == 2.0 / 6, losses  # the replay's line, not the first pass's
    fig = figures.build_run(run, "fault")
    labels = [h.get_label() for h in fig.axes[0].get_legend_handles_labels()[0]]
    assert "guard rollback" in labels and "skipped steps" not in labels, labels
    figures.plot_run(run, run.run_dir / "report.png", "fault")
    check_png(run.run_dir / "report.png")


def test_a_rollback_without_a_verdict_and_a_guard_line_of_another_program(tmp_path: Path) -> None:
    """A run stopped during its replay says so; a rollback line without the step it went back to is refused
    with the line that shows it (the history could not be resolved without it)."""
    from ddp_slurm.tools import history, report

    run_dir = tmp_path / "stopped"
    run_dir.mkdir()
    rows = [
        {"kind": "start", "step": 0, "epoch": 0, "time_s": 0.0},
        {"kind": "rollback", "step": 9, "epoch": 0, "time_s": 0.6, "to": 5, "why": "loss is nan", "rollback": 2},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert (
        "rollback 2 at step 9 (loss is nan): back to step 5; no replay verdict (still replaying, or stopped "
        "before the replay's end)"
    ) in report.summary(history.read_history(run_dir))
    rows[1].pop("to")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(history.ReportError, match=r"metrics.jsonl line 2: 'to' is None, expected an integer"):
        history.read_history(run_dir)


def test_a_relaunch_inside_the_allocation_is_counted(resumed_run, tmp_path):
    """The batch script's supervisor relaunched the step after a lost node: its start line says so."""
    moved = tmp_path / "moved"
    shutil.copytree(resumed_run, moved)
    lines = (moved / "metrics.jsonl").read_text().splitlines()
    second = [i for i, line in enumerate(lines) if '"kind": "start"' in line][1]
    lines[second] = json.dumps(json.loads(lines[second]) | {"restart_in_allocation": 1})
    (moved / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    res = report(moved, tmp_path)
    assert res.returncode == 0, res.stderr
    assert "2 restart(s) (1 inside the allocation after a lost node)" in res.stdout, res.stdout
