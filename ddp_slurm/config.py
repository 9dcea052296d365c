"""Typed run configuration: dataclasses, YAML files and dotted ``KEY=VALUE`` overrides.

Every field has a type and a docstring. ``load`` checks the whole config before any work starts:
an unknown key (with a "did you mean" hint), a wrong type or an invalid value raises ``ConfigError``
whose message names the key, the file and what was expected. The entry points turn it into exit 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A config file, override or value that cannot be used. The message is one line."""


@dataclass
class RunConfig:
    name: str = "mnist-sample"
    """Run name; the run directory is ``<output_root>/<name>``. Relaunching the same name resumes it."""
    output_root: str = "runs"
    """Directory holding run directories (relative paths are relative to the working directory)."""
    seed: int = 0
    """Seed for model initialisation and the per-epoch data order (identical on every rank)."""


@dataclass
class DataConfig:
    source: Literal["sample", "mnist"] = "sample"
    """``sample``: the 5,000/5,000 MNIST subset bundled with the package (offline); ``mnist``: full MNIST."""
    root: str = "data"
    """Where full MNIST lives (``<root>/MNIST/raw``); unused for ``sample``."""
    download: bool = True
    """For ``mnist``: rank 0 downloads missing files (others wait). Off on compute nodes without internet."""


@dataclass
class ModelConfig:
    name: Literal["mlp", "cnn"] = "cnn"
    """``mlp``: 784-100-10 as in the seed documents; ``cnn``: a small, fast convnet."""


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
    precision: Literal["fp32", "bf16"] = "fp32"
    """``bf16`` runs forward/backward under CUDA bf16 autocast; on CPU it is refused (no speed-up there)."""


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
    time_min: int = 60
    """Time limit in minutes."""
    signal: Literal["USR1", "USR2", "TERM", "INT", "HUP", "URG"] = "USR2"
    """Signal that means "checkpoint, requeue and stop" (Slurm's ``--signal``); SIGTERM always stops too."""
    signal_delay_s: int = 120
    """Seconds before the time limit at which Slurm sends ``signal``."""
    requeue: bool = True
    """On ``signal`` inside a Slurm job, rank 0 requeues the job after the checkpoint is on disk."""
    max_requeues: int = 20
    """Cap on requeues (``SLURM_RESTART_COUNT``); beyond it the job stops with a message instead of looping."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_root) / self.run.name

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Sections of ``{key: value}``, keyed as in YAML (``checkpoint.async``, not ``async_save``)."""
        return {
            s.name: {_key(f): getattr(getattr(self, s.name), f.name) for f in dataclasses.fields(getattr(self, s.name))}
            for s in dataclasses.fields(self)
        }


# Value checks beyond the type: key -> (predicate, what was expected).
_CHECKS: dict[str, tuple[typing.Callable[[Any], bool], str]] = {
    "run.name": (lambda v: bool(v) and "/" not in v and v not in (".", ".."), "a non-empty name without '/'"),
    "run.output_root": (bool, "a non-empty path"),
    "train.epochs": (lambda v: v >= 1, "an integer >= 1"),
    "train.global_batch_size": (lambda v: v >= 1, "an integer >= 1"),
    "train.lr": (lambda v: v > 0, "a number > 0"),
    "train.weight_decay": (lambda v: v >= 0, "a number >= 0"),
    "train.max_steps": (lambda v: v is None or v >= 1, "null or an integer >= 1"),
    "train.log_every_steps": (lambda v: v >= 1, "an integer >= 1"),
    "train.log_every_s": (lambda v: v > 0, "a number > 0"),
    "checkpoint.every_steps": (lambda v: v >= 0, "an integer >= 0"),
    "checkpoint.keep": (lambda v: v >= 1, "an integer >= 1"),
    "dist.timeout_s": (lambda v: v > 0, "a number > 0"),
    "slurm.nodes": (lambda v: v >= 1, "an integer >= 1"),
    "slurm.gpus_per_node": (lambda v: v >= 0, "an integer >= 0"),
    "slurm.tasks_per_node": (lambda v: v is None or v >= 1, "null or an integer >= 1"),
    "slurm.cpus_per_task": (lambda v: v >= 1, "an integer >= 1"),
    "slurm.time_min": (lambda v: v >= 1, "an integer >= 1 (minutes)"),
    "slurm.signal_delay_s": (lambda v: v >= 0, "an integer >= 0 (seconds)"),
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
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


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
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeError
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string; it is the number the user meant.
            try:
                return float(value)
            except ValueError:
                pass
        raise TypeError
    if tp is str:
        if isinstance(value, str):
            return value
        raise TypeError
    raise TypeError


def _suggest(key: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def _apply(cfg: Config, key: str, value: Any, where: str) -> None:
    sections = _sections()
    section, _, name = key.partition(".")
    all_keys = [f"{s}.{_key(f)}" for s, cls in sections.items() for f in dataclasses.fields(cls)]
    if section not in sections:
        hint = _suggest(key, all_keys) or f" (sections are {', '.join(sections)})"
        raise ConfigError(f"unknown config section {section!r} (key {key!r}) in {where}{hint}")
    if not name:
        raise ConfigError(f"unknown config key {key!r} in {where}{_suggest(key, all_keys)}")
    cls = sections[section]
    hints = typing.get_type_hints(cls)
    if name not in _field_names(cls):
        raise ConfigError(f"unknown config key {key!r} in {where}{_suggest(key, all_keys)}")
    name = _field_names(cls)[name]
    try:
        coerced = _coerce(value, hints[name])
    except TypeError:
        raise ConfigError(f"{key} in {where}: expected {_describe(hints[name])}, got {value!r}") from None
    check = _CHECKS.get(key)
    if check and not check[0](coerced):
        raise ConfigError(f"{key} in {where}: expected {check[1]}, got {value!r}")
    setattr(getattr(cfg, section), name, coerced)


def _flatten(data: Any, where: str) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{where}: expected a mapping of sections (run:, data:, train:, ...), got {type(data).__name__}"
        )
    flat: dict[str, Any] = {}
    for section, body in data.items():
        if not isinstance(body, Mapping):
            if str(section) in _sections():
                raise ConfigError(f"section {section!r} in {where}: expected a mapping of keys, got {body!r}")
            raise ConfigError(f"unknown config section {section!r} in {where}{_suggest(str(section), _sections())}")
        for name, value in body.items():
            flat[f"{section}.{name}"] = value
    return flat


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.lr=1e-3"`` -> ``("train.lr", 0.001)``; the value is read as a YAML scalar."""
    import yaml  # lazy: keeps `import ddp_slurm.config` cheap

    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or "." not in key:
        raise ConfigError(f"bad override {text!r}: expected KEY=VALUE with a dotted key, e.g. train.epochs=3")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        raise ConfigError(f"bad override {text!r}: the value is not a YAML scalar") from None
    if isinstance(value, (dict, list)):
        raise ConfigError(f"bad override {text!r}: the value must be a scalar, not a {type(value).__name__}")
    return key, value


def from_dict(data: Mapping[str, Any], where: str = "<dict>") -> Config:
    cfg = Config()
    for key, value in _flatten(data, where).items():
        _apply(cfg, key, value, where)
    return cfg


def load(path: str | Path | None = None, overrides: Iterable[str] = ()) -> Config:
    """Defaults, then the YAML file at ``path`` (if given), then ``KEY=VALUE`` overrides in order."""
    import yaml

    cfg = Config()
    if path is not None:
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ConfigError(
                f"config file {path} not found (configs ship under jobs/, e.g. jobs/mnist_sample.yaml)"
            ) from None
        except OSError as exc:
            raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or "invalid YAML"
            raise ConfigError(f"config file {path} is not valid YAML{at}: {problem}") from None
        for key, value in _flatten(data, str(path)).items():
            _apply(cfg, key, value, str(path))
    for text in overrides:
        key, value = parse_override(text)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and _wants_text(key):
            value = text.partition("=")[2].strip()  # run.name=2024 means the name "2024", not an error
        _apply(cfg, key, value, "the command line")
    return cfg


def _wants_text(key: str) -> bool:
    """True when ``key`` is a string field (possibly optional): a number typed for it is its text."""
    section, _, name = key.partition(".")
    cls = _sections().get(section)
    tp = typing.get_type_hints(cls).get(_field_names(cls).get(name, "")) if cls else None
    return tp is str or (typing.get_origin(tp) is not Literal and str in typing.get_args(tp))


def dump(cfg: Config, path: Path) -> None:
    """Write the resolved config as YAML (atomically: a reader never sees half a file)."""
    import yaml

    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    tmp.replace(path)


def read_resolved(path: Path) -> Config:
    """Read a run directory's ``config.yaml`` back."""
    import yaml

    return from_dict(yaml.safe_load(path.read_text()) or {}, str(path))


# Keys that may differ between the launches of one run: they change how it runs, not what it computes.
RESUMABLE_CHANGES = (
    "run.output_root",
    "data.root",
    "data.download",
    "train.log_every_steps",
    "train.log_every_s",
    "checkpoint.",
    "dist.",
    "slurm.",
)


def incompatible_changes(old: Config, new: Config) -> list[str]:
    """Keys whose values differ in a way that would make a resumed run compute something else."""
    a, b = _flatten(old.to_dict(), ""), _flatten(new.to_dict(), "")
    return [f"{k}: {a[k]!r} -> {b[k]!r}" for k in a if a[k] != b[k] and not k.startswith(RESUMABLE_CHANGES)]
