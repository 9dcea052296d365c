"""Loading a config: defaults, then a YAML file, then dotted ``KEY=VALUE`` overrides, each value checked.

``load`` checks the whole config before any work starts: an unknown key (with a "did you mean" hint),
a wrong type or an invalid value raises ``ConfigError`` whose message names the key, the file and what
was expected. The entry points turn it into exit 2. Also the way back: ``dump`` writes the resolved
config into a run directory, ``read_resolved`` reads it again.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import reprlib
import stat
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from ddp_slurm import taskref
from ddp_slurm.config.schema import Config, ConfigError, _field_types, _fields, _keys

CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # never in a config string: they reach job scripts
MAX_CONFIG_BYTES = 1 << 20  # a config file is a few hundred bytes; more is a mistake (or /dev/zero)
_INT_LIMIT = 1 << 62  # larger integers overflow the int64s they end up in (torch, timedelta, Slurm)


def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if args and type(None) in args:
        return "null or " + " or ".join(_describe(a) for a in args if a is not type(None))
    if len(args) > 1:
        return " or ".join(_describe(a) for a in args)
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
    if len(args) > 1 and origin is not Literal:  # bool | str: the first type that takes the value
        for choice in args:
            try:
                return _coerce(value, choice)
            except TypeError:
                continue
        raise TypeError
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
        if isinstance(value, str) and not CONTROL.search(value):
            return value
        raise TypeError
    raise TypeError


def _suggest(key: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


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
    check = _fields(target)[name].metadata.get("check")
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


def check_world_size(cfg: Config, world: int, how: str = "") -> None:
    """The global batch must split evenly over the ranks (train and submit both check it before any work)."""
    g = cfg.train.global_batch_size
    if g % world:
        raise ConfigError(
            f"train.global_batch_size={g} is not divisible by the world size {world}{how}: choose a multiple of {world}"
        )
    n = cfg.train.accumulate
    if g % (world * n):
        raise ConfigError(
            f"train.global_batch_size={g} does not split into {world} rank(s) x train.accumulate={n} micro-batches"
            f"{how}: choose a multiple of {world * n}"
        )
