"""The opt-in loggers (ddp_slurm/train/loggers): MLflow and W&B (offline) for real, and CSV.

A run stopped by a real SIGUSR2 and launched again is ONE MLflow run and ONE W&B run holding the metrics
of both launches; a logger that cannot start is one warning and training still ends 0; the CSV files hold
the run's history, redone steps dropped. A tracking server that accepts the connection and never answers
costs a bounded wait at the end and one warning, nothing more, and a stop signal still stops; a link
planted where a logger writes is refused, the victim's files untouched.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Launcher, base_env, skip_or_fail
from tasks_helpers import LINE_RUN, LINE_TASK

# The docs' Line task (8 steps per epoch with LINE_RUN), and the same task sending itself a real SIGUSR2
# at this launch's STOP_AT-th training step.
STOPPING = (
    LINE_TASK
    + """

class StoppingLine(Line):
    calls = 0

    def training_step(self, model, batch):
        import os
        import signal

        if getattr(model, "module", model).training:
            type(self).calls += 1
            if type(self).calls == int(os.environ.get("STOP_AT", "0")):
                os.kill(os.getpid(), signal.SIGUSR2)
        return super().training_step(model, batch)
"""
)
LOGGERS = ["log.mlflow=true", "log.wandb=ddp-slurm-test", "log.csv=true", "checkpoint.every_steps=6"]


def train(tmp_path: Path, *overrides: str, stop_at: int = 0, **env: str) -> Any:
    (tmp_path / "line_task.py").write_text(STOPPING)
    cmd = Launcher(tmp_path).cmd_train("task=line_task.py:StoppingLine", *LINE_RUN, *overrides)
    return Launcher(tmp_path).run(cmd, timeout=600, env=base_env(WANDB_MODE="offline", STOP_AT=str(stop_at), **env))


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of an offline ``run-ID.wandb`` file: W&B's 7-byte header, then LevelDB's log format
    (32 KiB blocks of chunks, each ``crc32 | length u16 | type u8``; FULL=1, FIRST=2, MIDDLE=3, LAST=4)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def wandb_history(run_file: Path) -> tuple[str, list[dict[str, Any]]]:
    """(run id, history rows) of one offline launch."""
    run_id, rows = "", []
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
        elif kind == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return run_id, rows


@pytest.fixture(scope="module")
def two_launches(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with every logger on, stopped by SIGUSR2 at step 10 (epoch 2), then launched again to the end."""
    for package in ("mlflow", "wandb"):  # the test extra installs both (mlflow-skinny, wandb)
        if importlib.util.find_spec(package) is None:
            skip_or_fail(f"{package} is not installed: pip install -e '.[test]'")
    tmp = tmp_path_factory.mktemp("loggers")
    first = train(tmp, "run.name=both", *LOGGERS, stop_at=10)
    assert first.returncode == 75, first.stderr
    second = train(tmp, "run.name=both", *LOGGERS)
    assert second.returncode == 0, second.stderr
    for res in (first, second):
        assert "WARNING" not in res.stderr, res.stderr
    return tmp / "runs" / "both"


def jsonl(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def stopped_at(run_dir: Path) -> int:
    """The step the first launch stopped at (the ranks agree on a stop one step after the signal)."""
    (stop,) = [r["step"] for r in jsonl(run_dir) if r["kind"] == "stop"]
    assert 10 <= stop < 16, stop  # inside the second epoch: both launches log train and eval lines
    return stop


def test_two_launches_are_one_mlflow_run(two_launches: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the logger sets it: MLflow 3 asks for it

    ids = json.loads((two_launches / "loggers.json").read_text())
    client = MlflowClient(tracking_uri=ids["mlflow"]["tracking_uri"])
    experiment = client.get_experiment_by_name("ddp_slurm")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [ids["mlflow"]["run_id"]]  # one run, the one the file names
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert (
        run.data.params["train.lr"] == "0.5"
        and run.data.params["task"] == f"{two_launches.parent.parent}/line_task.py:StoppingLine"
    )
    logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    expected = {r["step"]: r["loss"] for r in jsonl(two_launches) if r["kind"] == "train"}
    assert logged == pytest.approx(expected) and min(logged) == 4 and max(logged) == 24  # both launches
    assert [m.step for m in client.get_metric_history(run.info.run_id, "events/start")] == [0, stopped_at(two_launches)]
    assert len(client.get_metric_history(run.info.run_id, "eval/mse")) == 3
    for key in ("train/lr", "train/samples_per_s", "events/checkpoint", "events/stop", "events/end"):
        assert client.get_metric_history(run.info.run_id, key), key


def test_two_launches_are_one_wandb_run(two_launches: Path) -> None:
    run_files = sorted((two_launches / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 2, run_files  # one offline directory per launch
    (id1, first), (id2, second) = (wandb_history(f) for f in run_files)
    assert id1 == id2 == json.loads((two_launches / "loggers.json").read_text())["wandb"]["id"]
    losses = {r["global_step"]: r["train/loss"] for r in first + second if "train/loss" in r}
    assert sorted(losses) == [4, 8, 12, 16, 20, 24]
    stop = stopped_at(two_launches)
    assert max(r["global_step"] for r in first) == stop and min(r["global_step"] for r in second) == stop
    assert [r["eval/mse"] for r in first + second if "eval/mse" in r] == pytest.approx(
        [r["mse"] for r in jsonl(two_launches) if r["kind"] == "eval"]
    )
    assert any("events/stop" in r for r in first) and any("events/end" in r for r in second)


def test_csv_files_hold_the_run_history(two_launches: Path) -> None:
    def table(name: str) -> list[dict[str, str]]:
        with open(two_launches / "csv" / f"{name}.csv", newline="") as f:
            return list(csv.DictReader(f))

    rows = jsonl(two_launches)
    train_rows = table("train")
    assert [int(r["step"]) for r in train_rows] == [4, 8, 12, 16, 20, 24]
    assert [float(r["loss"]) for r in train_rows] == pytest.approx([r["loss"] for r in rows if r["kind"] == "train"])
    assert {"epoch", "time_s", "samples_per_s", "lr", "world_size"} <= set(train_rows[0])
    evals = table("eval")
    assert [(int(r["step"]), float(r["mse"])) for r in evals] == [
        (r["step"], pytest.approx(r["mse"])) for r in rows if r["kind"] == "eval"
    ]
    events = [(r["kind"], int(r["step"])) for r in table("events")]
    stop = stopped_at(two_launches)
    assert events[0] == ("start", 0) and ("stop", stop) in events and ("start", stop) in events
    assert events[-1] == ("end", 24) and ("checkpoint", 6) in events


def test_a_broken_logger_is_one_warning_and_training_finishes(tmp_path: Path) -> None:
    """MLflow pointed at a store it cannot create (its parent is a file), W&B not importable (a module
    named wandb that raises ImportError, as a missing package does): one warning each, exit 0."""
    (tmp_path / "not-a-dir").write_text("")
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "wandb.py").write_text("raise ImportError('No module named wandb')\n")
    uri = (tmp_path / "not-a-dir" / "mlruns").as_uri()
    env = base_env()
    res = train(
        tmp_path, "run.name=broken", f"log.mlflow={uri}", "log.wandb=true", PYTHONPATH=f"{shadow}:{env['PYTHONPATH']}"
    )
    assert res.returncode == 0, res.stderr
    warnings = [line for line in res.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 2, res.stderr
    warnings.sort(key=lambda w: "log.wandb" in w)  # each logger opens in its own thread: either may say it first
    assert "log.mlflow: could not start" in warnings[0] and "log.wandb: could not start" in warnings[1], warnings
    assert all("training goes on without this logger" in w for w in warnings)
    assert jsonl(tmp_path / "runs" / "broken")[-1]["kind"] == "end"


def test_a_run_that_fails_ends_its_mlflow_run_as_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The task raises at its 10th training step: training exits 1, and the MLflow run is not left RUNNING
    forever: it ends FAILED, holding the losses logged before the error."""
    if importlib.util.find_spec("mlflow") is None:
        skip_or_fail("mlflow is not installed: pip install -e '.[test]'")
    from mlflow.tracking import MlflowClient

    (tmp_path / "line_task.py").write_text(
        LINE_TASK
        + """

class FailingLine(Line):
    calls = 0

    def training_step(self, model, batch):
        type(self).calls += 1
        if type(self).calls == 10:
            raise RuntimeError("the task's own bug")
        return super().training_step(model, batch)
"""
    )
    cmd = Launcher(tmp_path).cmd_train("task=line_task.py:FailingLine", *LINE_RUN, "log.mlflow=true", "run.name=fails")
    res = Launcher(tmp_path).run(cmd, timeout=600, env=base_env())
    assert res.returncode == 1 and "the task's own bug" in res.stderr, res.stderr
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    ids = json.loads((tmp_path / "runs" / "fails" / "loggers.json").read_text())
    client = MlflowClient(tracking_uri=ids["mlflow"]["tracking_uri"])
    run = client.get_run(ids["mlflow"]["run_id"])
    assert run.info.status == "FAILED", run.info
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [4, 8]


@contextlib.contextmanager
def silent_server() -> Iterator[tuple[int, list[socket.socket]]]:
    """A TCP server on 127.0.0.1 that accepts every connection and never sends a byte (a tracking server
    hung mid-request): yields its port and the connections it accepted."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    accepted: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                accepted.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], accepted
    finally:
        done.set()
        thread.join()
        for conn in accepted:
            conn.close()
        server.close()


def test_a_tracking_server_that_never_answers_does_not_stop_training(tmp_path: Path) -> None:
    """Two runs log to a server that accepts and never answers (MLflow's own timeout set to 10 minutes, as
    a client that waits forever): one runs to its end, one gets a real SIGUSR2 mid-run. Both end within
    their close timeout (the stopped one's is the short one) with their real exit codes (0, 75) and one
    warning; the CSV files, the other logger, are complete: the stuck one held neither training nor them."""
    from ddp_slurm.train.loggers.boundary import CLOSE_TIMEOUT_S, STOP_CLOSE_TIMEOUT_S

    (tmp_path / "line_task.py").write_text(STOPPING)
    deadline = 60 + 3 * CLOSE_TIMEOUT_S  # two processes starting on a busy machine, then the close
    results: dict[str, tuple[int, str]] = {}
    with silent_server() as (port, accepted):
        procs = {}
        for name, stop_at in (("ends", 0), ("stopped", 10)):
            cmd = Launcher(tmp_path).cmd_train(
                "task=line_task.py:StoppingLine",
                *LINE_RUN,
                f"run.name={name}",
                f"log.mlflow=http://127.0.0.1:{port}",
                "log.csv=true",
            )
            env = base_env(STOP_AT=str(stop_at), MLFLOW_HTTP_REQUEST_TIMEOUT="600")
            procs[name] = subprocess.Popen(
                cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        start = time.monotonic()
        try:
            for name, proc in procs.items():
                _, err = proc.communicate(timeout=max(1.0, deadline - (time.monotonic() - start)))
                results[name] = (proc.returncode, err)
        except subprocess.TimeoutExpired:
            pytest.fail(f"training still running after {deadline:.0f} s: held by the logger")
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
        assert accepted, "the client never reached the server: nothing was tested"
    for name, code, waited in (("ends", 0, CLOSE_TIMEOUT_S), ("stopped", 75, STOP_CLOSE_TIMEOUT_S)):
        returncode, err = results[name]
        assert returncode == code, err
        warnings = [line for line in err.splitlines() if "WARNING" in line]
        assert len(warnings) == 1, err
        assert f"log.mlflow: still busy {waited:g} s after the last record" in warnings[0], warnings
        assert "abandoned, training goes on without this logger" in warnings[0], warnings
        rows = jsonl(tmp_path / "runs" / name)
        assert rows[-1]["kind"] == ("end" if code == 0 else "stop")
        with open(tmp_path / "runs" / name / "csv" / "train.csv", newline="") as f:
            logged = [int(r["step"]) for r in csv.DictReader(f)]
        assert logged and logged == [r["step"] for r in rows if r["kind"] == "train"]


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` and its bytes (a victim's files, to compare before and after)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_links_planted_where_loggers_write_are_refused(tmp_path: Path) -> None:
    """A co-tenant plants ``csv`` and ``mlruns`` as symlinks to a victim's folders and ``loggers.json`` as one
    to the victim's id file: each logger is refused with one warning, training ends 0, and the victim's
    files are byte-identical; W&B did not log into the victim's run id."""
    victim = tmp_path / "victim"
    (victim / "tables").mkdir(parents=True)
    (victim / "tables" / "train.csv").write_text("step,loss\r\n1,0.5\r\n")
    (victim / "store" / "0").mkdir(parents=True)
    (victim / "store" / "0" / "meta.yaml").write_text("name: theirs\n")
    (victim / "loggers.json").write_text(json.dumps({"wandb": {"id": "victimid", "project": "ddp_slurm"}}))
    before = tree(victim)
    run_dir = tmp_path / "runs" / "planted"
    run_dir.mkdir(parents=True, mode=0o750)
    (run_dir / "csv").symlink_to(victim / "tables")
    (run_dir / "mlruns").symlink_to(victim / "store")
    (run_dir / "loggers.json").symlink_to(victim / "loggers.json")
    res = train(tmp_path, "run.name=planted", "log.csv=true", "log.mlflow=true", "log.wandb=true")
    assert res.returncode == 0, res.stderr
    assert tree(victim) == before
    assert not list(run_dir.glob("wandb/*victimid*"))
    warnings = sorted(line for line in res.stderr.splitlines() if "WARNING" in line)
    assert len(warnings) == 3, res.stderr
    for key, path in zip(("log.csv", "log.mlflow", "log.wandb"), ("csv", "mlruns", "loggers.json"), strict=True):
        (line,) = [w for w in warnings if f"{key}: could not start (UnsafePath: " in w]
        assert f"runs/planted/{path} is a symlink" in line, line
    assert jsonl(run_dir)[-1]["kind"] == "end"


def test_a_csv_file_swapped_for_a_link_mid_run_is_not_appended_through(tmp_path: Path) -> None:
    """The CSV logger appends to its files (``safefs.append_owned``, never a plain ``open(..., "a")``): a
    file replaced by a symlink after the header was read is refused, the victim's file untouched."""
    from ddp_slurm.runpaths import RunPaths
    from ddp_slurm.safefs import UnsafePath
    from ddp_slurm.train.loggers.csv_logger import CsvSink

    victim = tmp_path / "victim.csv"
    victim.write_text("theirs\n")
    paths = RunPaths(tmp_path / "run")
    sink = CsvSink(paths)
    sink.write("train", 4, 0, 0.1, loss=0.5)
    (paths.csv / "train.csv").unlink()
    (paths.csv / "train.csv").symlink_to(victim)
    with pytest.raises(UnsafePath, match="is a symlink"):
        sink.write("train", 8, 0, 0.2, loss=0.25)
    assert victim.read_text() == "theirs\n"
