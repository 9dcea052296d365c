"""Config files: a small UTF-8 YAML file read safely, written atomically, and read back from a run.

Why a module of its own: what a config file may be (a plain file of at most ``MAX_CONFIG_BYTES``, not a FIFO
or a device; YAML without base-60 numbers or a key given twice; an override's value a scalar) is one rule
for the job file a user gives, the run directory's ``config.yaml`` and ``KEY=VALUE`` text, and none of it
needs to know what the keys mean (``loading.py`` does). Reading a run's config here (``read_saved``)
imports nothing.
"""

from __future__ import annotations

import os
import re
import reprlib
import stat
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddp_slurm.config.schema import ConfigError

if TYPE_CHECKING:
    from ddp_slurm.config.schema import Config

MAX_CONFIG_BYTES = 1 << 20  # a config file is a few hundred bytes; more is a mistake (or /dev/zero)

_SHOW = reprlib.Repr()
_SHOW.maxstring, _SHOW.maxother, _SHOW.maxlist, _SHOW.maxdict, _SHOW.maxlevel = 60, 60, 4, 4, 2


def _show(value: Any) -> str:
    """``repr`` for an error line, kept short: a YAML alias bomb must not become a 350 MB message."""
    return _SHOW.repr(value)


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


def dump(cfg: Config, path: Path) -> None:
    """Write the resolved config as YAML, atomically and durably (exclusive temporary file, fsync, rename,
    fsync of the directory: a reader, or a relaunch after a crash, never sees half a file), never
    through a symlink (``safefs.write_atomic``)."""
    import yaml

    from ddp_slurm import safefs

    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False).encode()
    safefs.write_atomic(Path(path), lambda f: f.write(text), cfg.run.shared)


def damaged(exc: ConfigError) -> ConfigError:
    """The one-line refusal of a run directory's config that cannot be read back, with the way out."""
    return ConfigError(
        f"the run directory's config is damaged ({exc}); move the run directory away or choose another run.name"
    )


def read_saved(path: Path) -> dict[str, Any]:
    """A run directory's ``config.yaml`` as the mapping it holds, importing nothing and checking no value; a
    damaged one (empty, not a mapping, a directory, a FIFO, not YAML) is one ConfigError line naming it and the
    way out. ``loading.read_resolved`` checks the runtime's keys too; ``relaunch.changes_from`` compares it."""
    try:
        data = parse_yaml_file(Path(path))
        if not isinstance(data, Mapping) or not data:
            raise ConfigError(f"{path}: expected the mapping of sections this program writes, got {_show(data)}")
    except ConfigError as exc:
        raise damaged(exc) from None
    return dict(data)
