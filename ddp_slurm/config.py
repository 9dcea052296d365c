"""Typed run configuration: dataclasses, YAML files and dotted ``KEY=VALUE`` overrides.

Every field has a type and a docstring. ``load`` checks the whole config before any work starts:
an unknown key (with a "did you mean" hint), a wrong type or an invalid value raises ``ConfigError``
whose message names the key, the file and what was expected. The entry points turn it into exit 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import reprlib
import stat
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ddp_slurm import slurm_time, taskref


class ConfigError(ValueError):
    """A config file, override or value that cannot be used. The message is one line."""


@dataclass
class RunConfig:
    name: str | None = None
    """Run name; the run directory is ``<output_root>/<name>``, and naming an existing one resumes it.
    Unset (null): each launch gets a new one, ``<task>-<date>-<time>``; inside a Slurm job
    ``<task>-<job id>``, so that a requeued job continues in it (``submit`` names it at submission)."""
    output_root: str = "runs"
    """Directory holding run directories (relative paths are relative to the working directory)."""
    seed: int = 0
    """Seed for model initialisation and the per-epoch data order (identical on every rank); 0 to 2**32-1."""
    shared: bool = False
    """A team run several users resume: directories 0770 and files 0660 instead of 0750/0640, and resume
    accepts a run directory or checkpoint writable by the group or owned by a member of it. Off: only
    your own files, not writable by the group, are resumed from (a co-tenant could plant a checkpoint)."""


@dataclass
class TrainConfig:
    epochs: int = 4
    """Passes over the training set."""
    global_batch_size: int = 64
    """Samples per optimizer step over all ranks; each rank takes ``global_batch_size / world_size``."""
    lr: float = 4e-3
    """Peak learning rate (the one-cycle schedule's maximum; the constant rate otherwise)."""
    optimizer: Literal["adam", "adamw", "sgd"] = "adam"
    """Optimizer; SGD uses Nesterov momentum 0.9."""
    weight_decay: float = 0.0
    """Weight decay (decoupled for ``adamw``)."""
    schedule: Literal["onecycle", "constant"] = "onecycle"
    """Learning-rate schedule over the whole run (``onecycle`` warms up then anneals)."""
    max_steps: int | None = None
    """Cap on optimizer steps (null: none). Reaching it ends training as if it were the last step."""
    log_every_steps: int = 20
    """Steps between ``train`` lines in metrics.jsonl (the loss is averaged over them and over ranks)."""
    log_every_s: float = 30.0
    """Seconds between plain progress lines when stderr is not a terminal (batch logs)."""
    workers: int = 2
    """DataLoader worker processes per rank for a task whose data is a Dataset (0: load in the training process)."""
    prefetch: int = 2
    """Batches each worker prepares ahead (Dataset path)."""
    eval_batch_size: int = 256
    """Samples per evaluation batch on each rank."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """``bf16`` runs forward/backward under CUDA bf16 autocast; refused on CPU (no speed-up there) and on GPUs
    older than compute capability 8.0 (no bf16 tensor cores)."""
    deterministic: bool = False
    """GPU runs repeat bit-for-bit and resume bit-identically: deterministic cuDNN/cuBLAS kernels (somewhat
    slower); an op without one raises. CPU runs are bit-exact either way. Guarantees: docs/determinism.md."""


@dataclass
class CheckpointConfig:
    every_steps: int = 100
    """Steps between checkpoints (0: only at epoch ends, the end of training and on a stop signal)."""
    keep: int = 3
    """How many of the newest checkpoints to keep."""
    async_save: bool = field(default=True, metadata={"key": "async"})
    """``checkpoint.async`` (YAML key ``async``; ``async_save`` only in Python, where ``async`` is a
    keyword): rank 0 copies the state to host memory and a background thread writes it, so training
    pauses only for the copy. Stop signals, the end of training and exit wait for the write to be
    durable. Falls back to synchronous saving when a copy of the state would not fit in memory."""


@dataclass
class DistConfig:
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """``auto``: nccl with CUDA, gloo without."""
    timeout_s: float = 300.0
    """Seconds a rendezvous or collective may wait for missing ranks before failing with a message."""


@dataclass
class SlurmConfig:
    nodes: int = 1
    """Nodes ``submit`` asks for."""
    gpus_per_node: int = 0
    """GPUs per node ``submit`` asks for (0: a CPU job)."""
    tasks_per_node: int | None = None
    """Ranks per node (null: one per GPU, 1 without GPUs)."""
    cpus_per_task: int = 2
    """CPU cores per rank; torch uses this many threads."""
    partition: str | None = None
    """Partition (null: the cluster's default)."""
    account: str | None = None
    """Account to charge (null: your default)."""
    qos: str | None = None
    """Quality of service (null: the default)."""
    constraint: str | None = None
    """Node feature constraint (null: none)."""
    time: str = "01:00:00"
    """Time limit in Slurm's syntax: ``MM``, ``HH:MM:SS``, ``D-HH:MM``, ... (``time_min=N`` still means N minutes)."""
    mem: str | None = None
    """Memory per node, as sbatch's ``--mem`` (``64G``; null: the cluster's default)."""
    mem_per_gpu: str | None = None
    """Memory per GPU, as sbatch's ``--mem-per-gpu`` (null: not asked for)."""
    exclusive: bool = False
    """Ask for whole nodes (sbatch's ``--exclusive``): no other job shares them."""
    signal: Literal["USR1", "USR2", "TERM", "INT", "HUP", "URG"] = "USR2"
    """Signal that means "checkpoint, requeue and stop" (Slurm's ``--signal``); SIGTERM always stops too."""
    signal_delay_s: int = 120
    """Seconds before the time limit at which Slurm sends ``signal``."""
    requeue: bool = True
    """On ``signal`` inside a Slurm job, rank 0 requeues the job after the checkpoint is on disk."""
    max_requeues: int = 20
    """Cap on requeues (``SLURM_RESTART_COUNT``); beyond it the job stops with a message instead of looping."""


RUNTIME_SECTIONS = ("run", "train", "checkpoint", "dist", "slurm", "log")
"""Sections every task shares; a task's own sections are the fields of its ``Config`` dataclass."""


@dataclass
class LogConfig:
    tensorboard: bool = False
    """Also write TensorBoard event files to ``<run dir>/tensorboard`` (needs ``pip install ddp_slurm[tensorboard]``)."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    log: LogConfig = field(default_factory=LogConfig)
    task: str = taskref.DEFAULT
    """Which task trains: ``package.module:Name`` or ``path/to/file.py:Name`` (unset: built-in MNIST)."""
    task_config: Any = None
    """The task's own sections (an instance of its ``Config``); None: the task's defaults."""

    def __post_init__(self) -> None:
        if self.task_config is None:
            self.task_config = task_class(self.task).Config()

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: the task's sections read like the runtime's (cfg.data.root).
        task_config = self.__dict__.get("task_config")
        if task_config is not None and name in _field_names(task_config):
            return getattr(task_config, name)
        raise AttributeError(f"config has no section {name!r}")

    @property
    def run_dir(self) -> Path:
        if self.run.name is None:
            raise ValueError("run.name is not chosen yet (ddp_slurm.train.runname names new runs)")
        return Path(self.run.output_root) / self.run.name

    def sections(self) -> dict[str, Any]:
        """Every section by name: the runtime's, then the task's."""
        own = {name: getattr(self, name) for name in RUNTIME_SECTIONS}
        return own | {name: getattr(self.task_config, name) for name in _field_names(self.task_config)}

    def to_dict(self) -> dict[str, Any]:
        """``task`` and sections of ``{key: value}``, keyed as in YAML (``checkpoint.async``, not ``async_save``)."""
        return {"task": self.task} | {
            name: {_key(f): getattr(sec, f.name) for f in dataclasses.fields(sec)}
            for name, sec in self.sections().items()
        }


def _field_names(obj: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)]


def _key(f: dataclasses.Field) -> str:
    """A field's key in YAML and on the command line: its name, or ``metadata["key"]`` where the
    key is a Python keyword (``checkpoint.async`` is the field ``async_save``)."""
    return f.metadata.get("key", f.name)


def _keys(obj: Any) -> dict[str, str]:
    """``{key: field name}`` of a section."""
    return {_key(f): f.name for f in dataclasses.fields(obj)}


def task_class(spec: str) -> type:
    """The Task class named by ``spec``; ConfigError (exit 2) when it cannot be used."""
    try:
        cls = taskref.resolve(spec)
    except taskref.TaskError as exc:
        raise ConfigError(str(exc)) from None
    clash = set(_field_names(cls.Config)) & {*RUNTIME_SECTIONS, "task", "log"}
    if clash:
        raise ConfigError(
            f"task={spec!r}: its Config reuses the runtime's section name(s) {sorted(clash)}: rename them"
        )
    return cls


def checked(
    default: Any = dataclasses.MISSING,
    *,
    check: Callable[[Any], bool] | None = None,
    expected: str = "",
    resumable: bool = False,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A config field with a value check and/or marked resumable (may change between launches of one run)::

    lr: float = checked(1e-3, check=lambda v: v > 0, expected="a number > 0")
    root: str = checked("data", resumable=True)
    """
    meta = {"check": (check, expected)} if check else {}
    if resumable:
        meta["resumable"] = True
    return field(default=default, default_factory=default_factory, metadata=meta)


# A run name becomes a directory, a Slurm job name and part of the job script: a safe character set.
RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+=,-]{0,199}")
# Slurm partition/account/QOS names: no whitespace or shell-special characters.
SLURM_WORD = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._,:-]{0,199}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
MAX_CONFIG_BYTES = 1 << 20  # a config file is a few hundred bytes; more is a mistake (or /dev/zero)
_INT_LIMIT = 1 << 62  # larger integers overflow the int64s they end up in (torch, timedelta, Slurm)


def _slurm_word(v: str | None) -> bool:
    return v is None or bool(SLURM_WORD.fullmatch(v))


# Value checks beyond the type: key -> (predicate, what was expected).
_CHECKS: dict[str, tuple[typing.Callable[[Any], bool], str]] = {
    "run.name": (
        lambda v: v is None or bool(RUN_NAME.fullmatch(v)),
        "null, or a name without '/' or spaces: letters, digits and . _ + = , - (not starting with . or -, "
        "at most 200)",
    ),
    "run.output_root": (bool, "a non-empty path"),
    "run.seed": (lambda v: 0 <= v < 2**32, "an integer from 0 to 4294967295"),
    "train.epochs": (lambda v: v >= 1, "an integer >= 1"),
    "train.global_batch_size": (lambda v: v >= 1, "an integer >= 1"),
    "train.lr": (lambda v: v > 0, "a number > 0"),
    "train.weight_decay": (lambda v: v >= 0, "a number >= 0"),
    "train.max_steps": (lambda v: v is None or v >= 1, "null or an integer >= 1"),
    "train.log_every_steps": (lambda v: v >= 1, "an integer >= 1"),
    "train.workers": (lambda v: v >= 0, "an integer >= 0"),
    "train.prefetch": (lambda v: v >= 1, "an integer >= 1"),
    "train.eval_batch_size": (lambda v: v >= 1, "an integer >= 1"),
    "train.log_every_s": (lambda v: v > 0, "a number > 0"),
    "checkpoint.every_steps": (lambda v: v >= 0, "an integer >= 0"),
    "checkpoint.keep": (lambda v: v >= 1, "an integer >= 1"),
    "dist.timeout_s": (lambda v: 0 < v <= 1e7, "a number > 0 and <= 10000000 (seconds)"),
    "slurm.nodes": (lambda v: v >= 1, "an integer >= 1"),
    "slurm.gpus_per_node": (lambda v: v >= 0, "an integer >= 0"),
    "slurm.tasks_per_node": (lambda v: v is None or v >= 1, "null or an integer >= 1"),
    "slurm.cpus_per_task": (lambda v: v >= 1, "an integer >= 1"),
    "slurm.time": (slurm_time.is_valid, f"a Slurm time ({slurm_time.FORMATS})"),
    "slurm.mem": (lambda v: v is None or bool(re.fullmatch(r"\d+[KMGT]?B?", v, re.I)), "null or a size like 64G"),
    "slurm.mem_per_gpu": (
        lambda v: v is None or bool(re.fullmatch(r"\d+[KMGT]?B?", v, re.I)),
        "null or a size like 16G",
    ),
    "slurm.signal_delay_s": (lambda v: 0 <= v <= 10**7, "an integer from 0 to 10000000 (seconds)"),
    "slurm.partition": (_slurm_word, "null or a Slurm name (letters, digits, . _ , : -)"),
    "slurm.account": (_slurm_word, "null or a Slurm name (letters, digits, . _ , : -)"),
    "slurm.qos": (_slurm_word, "null or a Slurm name (letters, digits, . _ , : -)"),
    "slurm.constraint": (
        lambda v: v is None or (bool(v) and not re.search(r"[^A-Za-z0-9_.,:|&!*()\[\]-]", v)),
        "null or a Slurm constraint (letters, digits and . _ , : | & ! * ( ) [ ] -)",
    ),
    "slurm.max_requeues": (lambda v: v >= 0, "an integer >= 0"),
}


def _key(f: dataclasses.Field) -> str:
    """A field's key in YAML and on the command line: its name, or ``metadata["key"]`` where the
    key is a Python keyword (``checkpoint.async`` is the field ``async_save``)."""
    return f.metadata.get("key", f.name)


def _field_names(cls: type) -> dict[str, str]:
    """``{key: field name}`` of a section."""
    return {_key(f): f.name for f in dataclasses.fields(cls)}


def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if args and type(None) in args:
        return "null or " + " or ".join(_describe(a) for a in args if a is not type(None))
    return {
        int: "an integer (|n| < 2**62)",
        float: "a number (finite)",
        str: "a string without control characters",
        bool: "true or false",
    }.get(tp, str(tp))


_SHOW = reprlib.Repr()
_SHOW.maxstring, _SHOW.maxother, _SHOW.maxlist, _SHOW.maxdict, _SHOW.maxlevel = 60, 60, 4, 4, 2


def _show(value: Any) -> str:
    """``repr`` for an error line, kept short: a YAML alias bomb must not become a 350 MB message."""
    return _SHOW.repr(value)


def _coerce(value: Any, tp: Any) -> Any:
    """Return ``value`` as type ``tp`` or raise TypeError. Only lossless conversions (int -> float)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        if value in args:
            return value
        raise TypeError
    if args and type(None) in args:  # Optional[X]
        if value is None:
            return None
        return _coerce(value, next(a for a in args if a is not type(None)))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise TypeError
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) < _INT_LIMIT:
            return value
        raise TypeError
    if tp is float:
        number: float | None = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) < 1e300 else math.inf
        elif isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string; it is the number the user meant.
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and math.isfinite(number):
            return number
        raise TypeError
    if tp is str:
        if isinstance(value, str) and not _CONTROL.search(value):
            return value
        raise TypeError
    raise TypeError


def _suggest(key: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _field_types(obj: Any) -> dict[str, Any]:
    return typing.get_type_hints(type(obj))


def _fields(obj: Any) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj)}


def _all_keys(cfg: Config) -> list[str]:
    return ["task"] + [f"{s}.{name}" for s, sec in cfg.sections().items() for name in _keys(sec)]


def _apply(cfg: Config, key: str, value: Any, where: str) -> None:
    if key == "slurm.time_min":  # the old spelling (minutes): still read, run directories hold it
        key = "slurm.time"
    if key == "slurm.time" and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # `time: 90` in YAML: minutes, as sbatch reads a bare number
    sections = cfg.sections()
    section, _, name = key.partition(".")
    if section not in sections:
        hint = _suggest(key, _all_keys(cfg)) or f" (sections are {', '.join(sections)})"
        raise ConfigError(f"unknown config section {section!r} (key {key!r}) in {where}{hint}")
    target = sections[section]
    hints = _field_types(target)
    if not name or name not in _keys(target):
        raise ConfigError(f"unknown config key {key!r} in {where}{_suggest(key, _all_keys(cfg))}")
    name = _keys(target)[name]
    try:
        coerced = _coerce(value, hints[name])
    except TypeError:
        raise ConfigError(f"{key} in {where}: expected {_describe(hints[name])}, got {_show(value)}") from None
    check = _CHECKS.get(key) or _fields(target)[name].metadata.get("check")
    if check and not check[0](coerced):
        raise ConfigError(f"{key} in {where}: expected {check[1]}, got {_show(value)}")
    setattr(target, name, coerced)


def _split(data: Any, where: str) -> tuple[str | None, dict[str, Any]]:
    """A parsed YAML document -> (its ``task``, its other keys flattened to ``section.key``)."""
    if data is None:
        return None, {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{where}: expected a mapping of sections (task:, run:, train:, ...), got {type(data).__name__}"
        )
    task, flat = None, {}
    for section, body in data.items():
        if section == "task":
            if not isinstance(body, str):
                raise ConfigError(f"task in {where}: expected an import path package.module:Name, got {body!r}")
            task = body
            continue
        if not isinstance(body, Mapping):
            raise ConfigError(f"section {_show(section)} in {where}: expected a mapping of keys, got {_show(body)}")
        for name, value in body.items():
            flat[f"{section}.{name}"] = value
    return task, flat


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.lr=1e-3"`` -> ``("train.lr", 0.001)``; the value is read as a YAML scalar."""
    import yaml  # lazy: keeps `import ddp_slurm.config` cheap

    key, sep, raw = text.partition("=")
    key = key.strip()
    if key == "task" and sep:
        return key, raw.strip()
    if not sep or not key or "." not in key:
        raise ConfigError(f"bad override {text!r}: expected KEY=VALUE with a dotted key, e.g. train.epochs=3")
    try:
        value = _yaml(raw, f"override {text!r}") if raw.strip() else None
    except yaml.YAMLError:
        raise ConfigError(f"bad override {text!r}: the value is not a YAML scalar") from None
    if isinstance(value, (dict, list)):
        raise ConfigError(f"bad override {text!r}: the value must be a scalar, not a {type(value).__name__}")
    return key, value


def _loader() -> type:
    """PyYAML's safe loader, refusing a key that appears twice in one mapping (PyYAML keeps the last one
    silently: a user who typed ``lr`` twice would train with the value they did not look at)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    # Without YAML 1.1's base-60 numbers: ``time: 1:30:00`` stays the text Slurm reads, not the integer 5400.
    int_tag, float_tag = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
    Loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in pairs if tag not in (int_tag, float_tag)]
        for first, pairs in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Loader.add_implicit_resolver(
        int_tag,
        re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
        list("-+0123456789"),
    )
    Loader.add_implicit_resolver(
        float_tag,
        re.compile(
            r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
            r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
        ),
        list("-+0123456789."),
    )

    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
        loader.flatten_mapping(node)
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable) and key in seen:
                raise ConfigError(f"key {_show(key)} appears twice (line {key_node.start_mark.line + 1})")
            seen.add(key) if isinstance(key, typing.Hashable) else None
        return loader.construct_mapping(node, deep=True)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return Loader


def _yaml(text: str, where: str) -> Any:
    """Parse YAML text; a duplicate key is a ConfigError naming ``where``. YAMLError passes through."""
    import yaml

    try:
        return yaml.load(text, Loader=_loader())  # noqa: S506 (a SafeLoader subclass)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except RecursionError:  # thousands of nested brackets
        raise ConfigError(f"{where}: nested too deeply") from None


def read_text(path: Path) -> str:
    """A config file's text, refusing what is not a small UTF-8 plain file: a FIFO or a device would
    block or never end (``/dev/zero``), a directory or a binary file gives a traceback otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(
            f"config file {path} not found (configs ship under jobs/, e.g. jobs/mnist_sample.yaml)"
        ) from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "not a plain file (a FIFO, socket or device)"
        raise ConfigError(f"config file {path} cannot be read: it is {kind}; give a YAML file")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path} is larger than {MAX_CONFIG_BYTES} bytes: not a job config")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start}): give a YAML file") from None


def parse_yaml_file(path: Path) -> Any:
    """``read_text`` + YAML, every problem one ConfigError line naming the file."""
    import yaml

    text = read_text(path)
    try:
        return _yaml(text, f"config file {path}")
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"config file {path} is not valid YAML{at}: {problem}") from None


def _new(task: str | type | None, where: str) -> Config:
    """Defaults for ``task`` (a path, a Task class, or None for the default task)."""
    if isinstance(task, type):
        try:
            cls = taskref.validate_class(task, taskref.task_path(task))
        except taskref.TaskError as exc:
            raise ConfigError(str(exc)) from None
        return Config(task=taskref.task_path(cls), task_config=cls.Config())
    try:
        return Config(task=task or taskref.DEFAULT)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (in {where})") from None


def from_dict(data: Mapping[str, Any], where: str = "<dict>", task: str | type | None = None) -> Config:
    """A config from a mapping shaped like the YAML files (``task`` from the mapping unless given)."""
    spec, flat = _split(data, where)
    cfg = _new(task if task is not None else spec, where)
    for key, value in flat.items():
        _apply(cfg, key, value, where)
    return cfg


def load(path: str | Path | None = None, overrides: Iterable[str] = (), task: type | None = None) -> Config:
    """Defaults, then the YAML file at ``path`` (if given), then ``KEY=VALUE`` overrides in order.

    The task (``task:`` in the file, ``task=...`` on the command line, or the ``task`` class given by the
    Python API) is resolved first: its sections are then checked like the runtime's.
    """
    where = str(path) if path is not None else "the command line"
    spec, flat = _split(parse_yaml_file(Path(path)), str(path)) if path is not None else (None, {})
    parsed = [(text, *parse_override(text)) for text in overrides]
    for _, key, value in parsed:
        if key == "task":
            spec, where = value, "the command line"
    cfg = _new(task if task is not None else spec, where)
    for key, value in flat.items():
        _apply(cfg, key, value, str(path))
    for text, key, value in parsed:
        if key == "task":
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and _wants_text(cfg, key):
            value = text.partition("=")[2].strip()  # run.name=2024 means the name "2024", not an error
        _apply(cfg, key, value, "the command line")
    return cfg


def _wants_text(cfg: Config, key: str) -> bool:
    """True when ``key`` is a string field (possibly optional): a number typed for it is its text."""
    section, _, name = key.partition(".")
    target = cfg.sections().get(section)
    tp = _field_types(target).get(_keys(target).get(name, "")) if target is not None else None
    return tp is str or (typing.get_origin(tp) is not Literal and str in typing.get_args(tp))


def dump(cfg: Config, path: Path) -> None:
    """Write the resolved config as YAML, atomically and durably (exclusive temporary file, fsync, rename,
    fsync of the directory: a reader, or a relaunch after a crash, never sees half a file), never
    through a symlink (``safefs.write_atomic``)."""
    import yaml

    from ddp_slurm import safefs

    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False).encode()
    safefs.write_atomic(Path(path), lambda f: f.write(text), cfg.run.shared)


def read_resolved(path: Path) -> Config:
    """Read a run directory's ``config.yaml`` back; a damaged one (empty, not a mapping, a directory,
    invalid values) is one ConfigError line naming it and the way out."""
    try:
        data = parse_yaml_file(path)
        if not isinstance(data, Mapping) or not data:
            raise ConfigError(f"{path}: expected the mapping of sections this program writes, got {_show(data)}")
        return from_dict(data, str(path))
    except ConfigError as exc:
        raise ConfigError(
            f"the run directory's config is damaged ({exc}); move the run directory away or choose another run.name"
        ) from None


# Runtime keys that may differ between the launches of one run: they change how it runs, not what it
# computes. A task marks its own with ``checked(..., resumable=True)``.
RESUMABLE_CHANGES = (
    "run.name",  # a moved or renamed run directory computes the same thing
    "run.output_root",
    "train.log_every_steps",
    "train.log_every_s",
    "train.workers",
    "train.prefetch",
    "train.eval_batch_size",
    "checkpoint.",
    "dist.",
    "slurm.",
    "log.",
)


def _resumable(cfg: Config, key: str) -> bool:
    if key.startswith(RESUMABLE_CHANGES):
        return True
    section, _, name = key.partition(".")
    target = cfg.sections().get(section)
    return target is not None and bool(_fields(target).get(name) and _fields(target)[name].metadata.get("resumable"))


def incompatible_changes(old: Config, new: Config) -> list[str]:
    """Keys whose values differ in a way that would make a resumed run compute something else."""
    if old.task != new.task:
        return [f"task: {old.task!r} -> {new.task!r}"]
    a, b = _flat(old), _flat(new)
    return [f"{k}: {a[k]!r} -> {b.get(k)!r}" for k in a if a[k] != b.get(k) and not _resumable(new, k)]


def _flat(cfg: Config) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, body in cfg.to_dict().items() if s != "task" for k, v in body.items()}


def check_world_size(cfg: Config, world: int, how: str = "") -> None:
    """The global batch must split evenly over the ranks (train and submit both check it before any work)."""
    g = cfg.train.global_batch_size
    if g % world:
        raise ConfigError(
            f"train.global_batch_size={g} is not divisible by the world size {world}{how}: choose a multiple of {world}"
        )
