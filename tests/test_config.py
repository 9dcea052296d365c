"""Config: defaults, the shipped job files, KEY=VALUE overrides, and every kind of bad input.

Most error cases run in-process through ``config.load`` (cheap); a representative set runs as real
``python -m ddp_slurm.train`` processes to check what users see: exit 2, exactly one line on
stderr, and no run directory created.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, Launcher, base_env

from ddp_slurm import config
from ddp_slurm.config import Config, ConfigError, doc
from ddp_slurm.distributed.env import free_port

JOBS = REPO / "jobs"


# --------------------------------------------------------------------------- loading


def test_defaults_without_a_file() -> None:
    cfg = config.load()
    assert cfg == Config()
    assert cfg.data.source == "sample"
    assert cfg.model.name == "cnn"
    assert (cfg.train.epochs, cfg.train.global_batch_size, cfg.train.lr) == (4, 64, 4e-3)
    assert (cfg.train.optimizer, cfg.train.schedule, cfg.train.max_steps) == ("adam", "onecycle", None)
    assert (cfg.run.output_root, cfg.run.name) == ("runs", None)  # each launch names a new run directory


def test_sample_job_file_is_the_defaults() -> None:
    """jobs/mnist_sample.yaml says it is the built-in defaults; keep the two from drifting apart."""
    assert config.load(JOBS / "mnist_sample.yaml") == config.load()


def test_full_mnist_job_file() -> None:
    cfg = config.load(JOBS / "mnist.yaml")
    assert cfg.data.source == "mnist"
    assert cfg.data.download is False  # compute nodes have no internet: fail at once, not after a timeout
    assert cfg.slurm.nodes >= 1
    assert cfg.train.global_batch_size % (cfg.slurm.nodes * max(cfg.slurm.gpus_per_node, 1)) == 0


def test_every_field_has_a_docstring() -> None:
    """Each field carries its meaning in a docstring right below it: one per field, none missing."""
    import ast
    import inspect

    from ddp_slurm.tasks.mnist import task as mnist_task

    documented: set[str] = set()
    # the runtime's sections (schema.py puts together those of sections.py and placement.py) and the built-in task's
    for module in (config.sections, config.placement, config.schema, mnist_task):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.ClassDef):
                body = node.body
                for a, b in zip(body, body[1:]):
                    if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                        documented.add(f"{node.name}.{a.target.id}")
    for name, section in Config().sections().items():
        cls = type(section)
        for f in dataclasses.fields(cls):
            assert f"{cls.__name__}.{f.name}" in documented, f"{name}.{f.name} has no docstring"


@pytest.mark.parametrize(
    "override, key, expected",
    [
        ("train.epochs=3", ("train", "epochs"), 3),
        ("train.lr=1e-3", ("train", "lr"), 0.001),  # YAML 1.1 reads 1e-3 as a string; it is the number meant
        ("train.lr=0.5", ("train", "lr"), 0.5),
        ("train.lr=2", ("train", "lr"), 2.0),  # int -> float is lossless
        ("train.max_steps=null", ("train", "max_steps"), None),
        ("train.max_steps=50", ("train", "max_steps"), 50),
        ("data.source=sample", ("data", "source"), "sample"),
        ("data.download=false", ("data", "download"), False),
        ("model.name=mlp", ("model", "name"), "mlp"),
        ("run.name=my-run_2", ("run", "name"), "my-run_2"),
        ("slurm.partition=gpu", ("slurm", "partition"), "gpu"),
    ],
)
def test_override_values_are_yaml_scalars(override: str, key: tuple[str, str], expected: object) -> None:
    cfg = config.load(None, [override])
    value = getattr(getattr(cfg, key[0]), key[1])
    assert value == expected and type(value) is type(expected)


def test_overrides_apply_after_the_file_and_in_order(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("train:\n  epochs: 9\n  lr: 1.0e-2\n")
    cfg = config.load(path, ["train.epochs=2", "train.epochs=4"])
    assert cfg.train.epochs == 4  # the last override wins
    assert cfg.train.lr == 0.01  # the file's value where nothing overrides it
    assert cfg.train.global_batch_size == 64  # the default where neither says anything


def test_empty_file_is_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing here\n")
    assert config.load(path) == Config()


# --------------------------------------------------------------------------- errors


def _error(path: Path | None = None, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        config.load(path, overrides)
    message = str(info.value)
    assert "\n" not in message, f"not one line: {message!r}"
    return message


@pytest.mark.parametrize(
    "override, must_say",
    [
        ("train.epoch=3", ["'train.epoch'", "the command line", "did you mean", "train.epochs"]),
        ("train.learning_rate=0.1", ["'train.learning_rate'", "the command line"]),
        ("trian.epochs=3", ["'trian'", "the command line", "did you mean", "train.epochs"]),
        ("bogus.key=1", ["'bogus'", "section", "the command line", "train"]),
        ("train.epochs=abc", ["train.epochs", "the command line", "an integer", "'abc'"]),
        ("train.epochs=2.5", ["train.epochs", "the command line", "an integer", "2.5"]),
        ("train.epochs=true", ["train.epochs", "the command line", "an integer"]),
        ("data.download=maybe", ["data.download", "the command line", "true or false", "maybe"]),
        ("train.lr=fast", ["train.lr", "the command line", "a number", "fast"]),
        ("train.epochs=0", ["train.epochs", "the command line", ">= 1", "0"]),
        ("train.global_batch_size=-1", ["train.global_batch_size", "the command line", ">= 1", "-1"]),
        ("train.lr=0", ["train.lr", "the command line", "> 0"]),
        ("train.max_steps=0", ["train.max_steps", "the command line", "null or an integer >= 1"]),
        ("checkpoint.keep=0", ["checkpoint.keep", "the command line", ">= 1"]),
        ("model.name=resnet", ["model.name", "the command line", "'mlp'", "'cnn'", "resnet"]),
        ("data.source=cifar", ["data.source", "the command line", "'sample'", "'mnist'", "cifar"]),
        ("run.name=a/b", ["run.name", "the command line", "without '/'"]),
        ("dist.backend=mpi", ["dist.backend", "the command line", "'gloo'"]),
        ("train.epochs", ["bad override", "'train.epochs'", "KEY=VALUE"]),
        ("epochs=3", ["bad override", "'epochs=3'", "dotted"]),
        ("train.epochs=[1, 2]", ["bad override", "scalar"]),
    ],
)
def test_bad_override(override: str, must_say: list[str]) -> None:
    message = _error(overrides=(override,))
    for text in must_say:
        assert text in message, f"{text!r} missing from {message!r}"


@pytest.mark.parametrize(
    "body, must_say",
    [
        ("train:\n  epoch: 3\n", ["'train.epoch'", "did you mean", "train.epochs"]),
        ("trainn:\n  epochs: 3\n", ["'trainn'", "did you mean", "train.epochs"]),
        ("optimizer:\n  lr: 3\n", ["'optimizer'", "section"]),
        ("train:\n  epochs: three\n", ["train.epochs", "an integer", "three"]),
        ("train:\n  epochs: 0\n", ["train.epochs", ">= 1"]),
        ("checkpoint:\n  keep: 0\n", ["checkpoint.keep", ">= 1"]),
        ("model:\n  name: resnet\n", ["model.name", "'cnn'", "resnet"]),
        ("train: 3\n", ["'train'", "a mapping of keys"]),
        ("- run\n- train\n", ["a mapping of sections", "list"]),
        ("just a string\n", ["a mapping of sections", "str"]),
    ],
)
def test_bad_file_names_key_and_file(tmp_path: Path, body: str, must_say: list[str]) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(body)
    message = _error(path)
    assert str(path) in message, f"the file is not named in {message!r}"
    for text in must_say:
        assert text in message, f"{text!r} missing from {message!r}"


def test_malformed_yaml_gives_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("run:\n  name: x\ntrain:\n  epochs: 3\n   lr: 0.1\n")  # line 5 is mis-indented
    message = _error(path)
    assert str(path) in message and "not valid YAML" in message
    assert "line 5" in message and "column" in message, message


def test_unclosed_bracket_yaml(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("train:\n  lr: [1,\n")
    message = _error(path)
    assert str(path) in message and "line " in message and "column " in message, message


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    message = _error(path)
    assert str(path) in message and "not found" in message


def test_directory_instead_of_file(tmp_path: Path) -> None:
    message = _error(tmp_path)
    assert str(tmp_path) in message and "cannot be read" in message


def test_file_error_is_found_before_overrides_are_read(tmp_path: Path) -> None:
    """The file is checked first, so its error is reported even with an override for the same key."""
    path = tmp_path / "job.yaml"
    path.write_text("train:\n  epochs: 0\n")
    message = _error(path, ("train.epochs=3",))
    assert str(path) in message and "train.epochs" in message


# --------------------------------------------------------------------------- resolved config


def test_dump_and_read_resolved_roundtrip(tmp_path: Path) -> None:
    cfg = config.load(
        JOBS / "mnist.yaml",
        [
            "train.lr=1e-3",
            "train.max_steps=77",
            "slurm.partition=gpu",
            "run.name=roundtrip",
            "slurm.tasks_per_node=null",
        ],
    )
    path = tmp_path / "config.yaml"
    config.dump(cfg, path)
    assert not list(tmp_path.glob("*.tmp")), "the temporary file of the atomic write was left behind"
    again = config.read_resolved(path)
    assert again == cfg
    assert yaml.safe_load(path.read_text())["train"]["lr"] == 0.001  # a plain YAML number, readable by people
    config.dump(again, path)  # overwriting an existing file works too
    assert config.read_resolved(path) == cfg


def test_read_resolved_rejects_a_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("train:\n  epochs: -3\n")
    with pytest.raises(ConfigError, match="train.epochs"):
        config.read_resolved(path)


def test_incompatible_changes() -> None:
    old = config.load()
    # Keys that change how a run goes, not what it computes, may differ between launches.
    same = config.load(
        None,
        [
            "checkpoint.every_steps=7",
            "checkpoint.keep=9",
            "dist.timeout_s=5",
            "slurm.nodes=4",
            "data.download=false",
            "train.log_every_steps=3",
            "run.output_root=elsewhere",
        ],
    )
    assert config.incompatible_changes(old, same) == []
    assert config.incompatible_changes(old, old) == []
    changed = config.load(None, ["train.lr=0.1", "model.name=mlp", "run.seed=5"])
    diffs = config.incompatible_changes(old, changed)
    assert len(diffs) == 3
    joined = "; ".join(diffs)
    assert "train.lr: 0.004 -> 0.1" in joined
    assert "model.name: 'cnn' -> 'mlp'" in joined
    assert "run.seed: 0 -> 5" in joined


def test_a_saved_config_is_read_back_without_importing_its_task(tmp_path: Path) -> None:
    """config.yaml names a task file that does not even exist: read, typed for the runtime's keys, its task
    sections kept as written (unchecked), dumped again unchanged; only ``resolve`` would import it."""
    path = tmp_path / "config.yaml"
    body = {"task": "nowhere.py:Missing", "train": {"epochs": 2}, "model": {"name": "mlp", "width": 3}}
    path.write_text(yaml.safe_dump(body))
    saved = config.read_resolved(path)
    assert not saved.resolved and saved.task == "nowhere.py:Missing" and saved.train.epochs == 2
    assert saved.model.name == "mlp" and saved.to_dict()["model"] == {"name": "mlp", "width": 3}
    assert config.read_saved(path) == body
    config.dump(saved, tmp_path / "again.yaml")
    assert yaml.safe_load((tmp_path / "again.yaml").read_text()) == saved.to_dict()
    for explain in (False, True):  # --print-config's YAML reads back the same
        assert config.from_dict(yaml.safe_load(doc.render(saved, explain)), resolve=False) == saved
    with pytest.raises(ConfigError, match=r"nowhere.py.* not found .*in " + str(path)):
        config.resolve(saved)


def test_an_unresolved_config_keeps_the_tasks_keys_and_resolve_checks_them_as_load_does(tmp_path: Path) -> None:
    given = ["model.name=mlp", "data.root=2024", "train.epochs=2"]
    unchecked = config.load(None, given, resolve=False)
    assert not unchecked.resolved and unchecked.to_dict()["model"] == {"name": "mlp"}
    resolved = config.resolve(unchecked)
    assert resolved == config.load(None, given) and resolved.data.root == "2024"  # typed text stays text
    assert config.resolve(resolved) is resolved
    for bad, says in (
        ("model.name=resnet", "model.name in the command line: expected one of"),
        ("trian.epochs=3", "unknown config section 'trian' (key 'trian.epochs') in the command line (did you mean"),
        ("model.nmae=cnn", "unknown config key 'model.nmae' in the command line (did you mean 'model.name'?)"),
    ):
        cfg = config.load(None, [bad], resolve=False)  # kept: nothing says what the task's keys are
        with pytest.raises(ConfigError, match=re.escape(says)):
            config.resolve(cfg)
    path = tmp_path / "job.yaml"
    for body, says in (("1:\n  a: 2\n", "unknown config section '1'"), ("model:\n  name: [1]\n", "expected a scalar")):
        path.write_text(body)
        with pytest.raises(ConfigError, match=re.escape(says)):
            config.load(path, resolve=False)  # the shape every key has is checked even unresolved


def test_changes_from_checks_the_same_tasks_sections_with_the_live_class() -> None:
    cfg = config.load()
    saved = config.load(None, ["model.name=mlp", "train.lr=0.1", "checkpoint.keep=9"]).to_dict()
    assert config.changes_from(saved, cfg, "checkpoint step-3.pt") == [
        "train.lr: 0.1 -> 0.004",
        "model.name: 'mlp' -> 'cnn'",
    ]
    assert config.changes_from(cfg.to_dict(), cfg, "checkpoint step-3.pt") == []
    other = {"task": "elsewhere.py:Other", "model": {"name": "resnet", "depth": 50}}
    assert config.changes_from(other, cfg, "x") == [
        f"task: 'elsewhere.py:Other' -> {cfg.task!r}"  # another task: its sections are not checked by ours
    ]
    for bad in (
        [1, 2],
        {},
        {"train": {"epochs": -1}},
        {"task": 3},
        {"model": {"name": "resnet"}},
        {"model": {"nmae": "cnn"}},
        {"train": 7},
    ):
        with pytest.raises(ConfigError) as err:
            config.changes_from(bad, cfg, "checkpoint step-3.pt")
        assert "checkpoint step-3.pt" in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_each_runtime_key_is_declared_once_on_its_field() -> None:
    """Check, resumability and YAML key live on the field (``checked``) or its section (``RESUMABLE``):
    the keys a relaunch may change are exactly the ones that change how a run goes, not what it computes."""
    cfg = config.load()
    resumable = {
        f"{section}.{key}"
        for section in config.RUNTIME_SECTIONS
        for key in cfg.to_dict()[section]
        if config.relaunch._resumable(cfg, f"{section}.{key}")
    }
    # guard: turned on, widened or given skipped steps between launches (a manual restart skips bad data)
    sections = ("checkpoint", "guard", "dist", "slurm", "log")
    whole = {f"{s}.{k}" for s in sections for k in cfg.to_dict()[s]}
    assert "checkpoint.async" in whole and whole <= resumable
    assert resumable - whole == {
        "run.name",
        "run.output_root",
        "run.init_from",  # a warm start's source: read only by a run's first launch (config.yaml records the file)
        "run.init_optimizer",
        "train.log_every_steps",
        "train.log_every_s",
        "train.workers",
        "train.prefetch",
        "train.eval_batch_size",
        "train.activation_checkpoint",  # recomputes each unit's forward: memory, not the result
    }
    assert not hasattr(config, "_CHECKS") and not hasattr(config, "RESUMABLE_CHANGES")
    with pytest.raises(ConfigError, match=r"checkpoint.keep in the command line: expected an integer >= 1, got 0"):
        config.load(None, ["checkpoint.keep=0"])


# --------------------------------------------------------------------------- as real processes


def _assert_usage_error(res, launcher: Launcher, *must_say: str) -> None:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, f"exit {res.returncode}, stderr:\n{res.stderr}"
    assert len(lines) == 1, f"expected exactly one line on stderr, got:\n{res.stderr}"
    for text in must_say:
        assert text in lines[0], f"{text!r} missing from {lines[0]!r}"
    assert res.stdout == ""
    assert not (launcher.cwd / "runs").exists(), "a run directory was created for a command that was refused"


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, must_say",
    [
        (["train.epoch=3"], ["train.epoch", "the command line", "did you mean", "train.epochs"]),
        (["train.epochs=abc"], ["train.epochs", "the command line", "an integer"]),
        (["data.download=maybe"], ["data.download", "the command line", "true or false"]),
        (["train.epochs=0", "model.name=mlp"], ["train.epochs", "the command line", ">= 1"]),
        (["model.name=resnet"], ["model.name", "the command line", "'mlp'"]),
        (["notakeyvalue"], ["bad override", "KEY=VALUE"]),
        (["--config", "missing.yaml"], ["missing.yaml", "not found"]),
        (["train.global_batch_size=6000"], ["train.global_batch_size", "6000", "5000"]),
    ],
)
def test_cli_usage_errors(launcher: Launcher, args: list[str], must_say: list[str]) -> None:
    res = launcher.run(launcher.cmd_train(*args), timeout=300)
    _assert_usage_error(res, launcher, "ddp_slurm.train: error:", *must_say)


@pytest.mark.slow
def test_cli_malformed_file(launcher: Launcher) -> None:
    path = launcher.cwd / "job.yaml"
    path.write_text("train:\n  epochs: 3\n   lr: 0.1\n")
    res = launcher.run(launcher.cmd_train(config=str(path)), timeout=300)
    _assert_usage_error(res, launcher, str(path), "line 3", "column")


@pytest.mark.slow
def test_batch_not_divisible_refused_by_every_rank(launcher: Launcher) -> None:
    """Each rank of a 2-rank world (torchrun's variables, set by hand so every rank surely gets that far)
    refuses a global batch of 127 on its own: exit 2, one line, before any rendezvous."""
    import subprocess

    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = base_env(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        procs.append(
            subprocess.Popen(
                launcher.cmd_train("train.global_batch_size=127", "model.name=mlp"),
                cwd=launcher.cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        res = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        _assert_usage_error(res, launcher, "train.global_batch_size=127", "not divisible by the world size 2")


@pytest.mark.slow
def test_batch_not_divisible_under_torchrun(launcher: Launcher) -> None:
    """The same under a real torchrun. torchrun stops the other worker as soon as one exits, so only
    the first one's exit code is certain to be 2; every worker that wrote anything wrote the one line."""
    logs = launcher.cwd / "torchrun-logs"
    cmd = launcher.cmd_torchrun(2, "train.global_batch_size=127", "model.name=mlp")
    cmd[3:3] = ["--log-dir", str(logs), "--redirects", "2"]  # each worker's stderr to its own file
    res = launcher.run(cmd, timeout=600)
    assert res.returncode == 1, res.stderr  # torchrun's own code for "a worker failed"
    assert "exitcode  : 2" in res.stderr, res.stderr
    worker_logs = sorted(logs.rglob("stderr.log"))
    assert len(worker_logs) == 2, worker_logs
    written = [p.read_text().strip().splitlines() for p in worker_logs]
    assert any(written), "no worker said why it stopped"
    for lines in written:
        if lines:
            assert len(lines) == 1 and "not divisible by the world size 2" in lines[0], lines
    assert not (launcher.cwd / "runs").exists()


def test_a_number_typed_for_a_string_key_is_its_text() -> None:
    cfg = config.load(None, ["run.name=2024", "slurm.partition=007"])
    assert cfg.run.name == "2024"
    assert cfg.slurm.partition == "007"
    with pytest.raises(config.ConfigError, match="model.name"):
        config.load(None, ["model.name=3"])


def test_explain_speaks_to_users_not_to_the_project_s_history() -> None:
    """``--explain`` is read by users: no "as in the seed documents" (a phrase of the project's brief)."""
    res = subprocess.run(
        [sys.executable, "-m", "ddp_slurm.train", "--print-config", "--explain"],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "784-100-10" in res.stdout and "seed document" not in res.stdout


def test_a_node_range_is_two_keys_and_every_count_in_it_must_keep_the_micro_batch() -> None:
    cfg = config.load(None, ["slurm.nodes=2-4", "train.global_batch_size=96", "train.micro_batch_size=8"])
    assert (cfg.slurm.min_nodes, cfg.slurm.nodes, cfg.slurm.node_span, cfg.slurm.nodes_text) == (2, 4, (2, 4), "2-4")
    config.check_node_range(cfg, 1)
    assert [config.accumulation(cfg, n) for n in (2, 3, 4)] == [6, 4, 3]
    with pytest.raises(
        config.ConfigError, match=r"on 4 node\(s\) x 2 task\(s\), one of --nodes 2-4: make it a multiple of 192"
    ):
        config.check_node_range(cfg, 2)
    with pytest.raises(config.ConfigError, match="slurm.min_nodes=5 is more than slurm.nodes=4"):
        config.check_node_range(config.with_overrides(cfg, ["slurm.min_nodes=5"]), 1)
    with pytest.raises(config.ConfigError, match="expected MIN-MAX with 1 <= MIN <= MAX, got '0-4'"):
        config.load(None, ["slurm.nodes=0-4"])
    assert config.load(None, ["slurm.nodes=3"]).slurm.node_span == (3, 3)


def test_a_node_range_the_default_batch_does_not_split_over_names_both_keys_at_once() -> None:
    """``submit --nodes 2-4`` with the default config once needed two failed tries (a global batch that is a
    multiple of 12, then a micro-batch): one line now names a value for each, and they fit every count."""
    cfg = config.load(None, ["slurm.nodes=2-4"])
    with pytest.raises(config.ConfigError) as refused:
        config.check_node_range(cfg, 4)
    said = str(refused.value)
    assert "set train.global_batch_size=96 and train.micro_batch_size=2" in said, said
    fixed = config.with_overrides(cfg, ["train.global_batch_size=96", "train.micro_batch_size=2"])
    config.check_node_range(fixed, 4)  # the values named fit every count of the range
