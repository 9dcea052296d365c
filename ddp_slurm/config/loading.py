"""Loading a config: defaults, then a YAML file, then dotted ``KEY=VALUE`` overrides, each value checked.

``load`` checks the whole config before any work starts: an unknown key (with a "did you mean" hint),
a wrong type or an invalid value raises ``ConfigError`` whose message names the key, the file and what
was expected. The entry points turn it into exit 2.

The task is imported only when asked for: ``load`` (training), ``resolve`` (a real ``submit``, once) and
``from_dict`` resolve it; ``load(..., resolve=False)``, ``from_dict(..., resolve=False)`` and
``read_resolved`` (a run's config.yaml read back) keep its sections unchecked (``unchecked.py``), so that a
command that only reads a run never runs the file its config names.
"""

from __future__ import annotations

import copy
import difflib
import math
import re
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from ddp_slurm import taskref
from ddp_slurm.config.files import _show, damaged, parse_override, parse_yaml_file, read_saved
from ddp_slurm.config.schema import RUNTIME_SECTIONS, Config, ConfigError, _field_types, _fields, _keys, _type_hints
from ddp_slurm.config.unchecked import Given, Unchecked
from ddp_slurm.text import CONTROL

_INT_LIMIT = 1 << 62  # larger integers overflow the int64s they end up in (torch, timedelta, Slurm)
_SCALARS = (str, int, float, bool, type(None))
NODE_RANGE = re.compile(r"\s*(\d{1,6})\s*-\s*(\d{1,6})\s*")  # slurm.nodes=2-4: min_nodes 2, nodes 4


def _node_range(value: Any, where: str) -> tuple[int, int] | None:
    """``slurm.nodes`` given as ``MIN-MAX``: (MIN, MAX); None for anything else (checked as an integer)."""
    span = NODE_RANGE.fullmatch(value) if isinstance(value, str) else None
    if span is None:
        return None
    lo, hi = int(span[1]), int(span[2])
    if not 1 <= lo <= hi:
        raise ConfigError(f"slurm.nodes in {where}: expected MIN-MAX with 1 <= MIN <= MAX, got {value!r}")
    return lo, hi


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


def _wants_text(tp: Any) -> bool:
    """True for a string field (possibly optional, not a choice): a number typed for it is its text."""
    return tp is str or (typing.get_origin(tp) is not Literal and str in typing.get_args(tp))


class _Unfit(Exception):
    """A value a field does not take: ``expected`` (what it takes), ``got`` (what came) and, where the field's
    check said it, ``why``."""

    def __init__(self, expected: str, got: Any, why: str | None = None) -> None:
        super().__init__(expected)
        self.expected, self.got, self.why = expected, got, why


def _typed(target: Any, name: str, value: Any, text: str | None = None) -> Any:
    """``value`` as field ``name`` of the section ``target`` takes it: its type, then its own check; else _Unfit.
    ``text``: what was typed on a command line, the value of a string field (``run.name=2024`` is "2024")."""
    tp = _field_types(target)[name]
    if text is not None and isinstance(value, (int, float)) and not isinstance(value, bool) and _wants_text(tp):
        value = text
    try:
        coerced = _coerce(value, tp)
    except TypeError:
        raise _Unfit(_describe(tp), value) from None
    check = _fields(target)[name].metadata.get("check")
    try:
        fits = not check or check[0](coerced)
    except ValueError as exc:  # a check that says why (slurm.time: "'0' is no time at all")
        raise _Unfit(check[1], value, str(exc)) from None
    if not fits:
        raise _Unfit(check[1], value)
    return coerced


def _apply(cfg: Config, key: str, value: Any, where: str, text: str | None = None) -> None:
    if key == "slurm.time_min":  # the old spelling (minutes): still read, run directories hold it
        key = "slurm.time"
    if key == "slurm.time" and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # `time: 90` in YAML: minutes, as sbatch reads a bare number
    if key == "slurm.nodes" and (span := _node_range(value, where)):  # a range: two keys
        _apply(cfg, "slurm.min_nodes", span[0], where)
        _apply(cfg, "slurm.nodes", span[1], where)
        return
    section, _, name = key.partition(".")
    if not cfg.resolved and section not in RUNTIME_SECTIONS:
        _keep(cfg.task_config, key, value, where, text)
        return
    sections = cfg.sections()
    if section not in sections:
        hint = _suggest(key, _all_keys(cfg)) or f" (sections are {', '.join(sections)})"
        raise ConfigError(f"unknown config section {section!r} (key {key!r}) in {where}{hint}")
    target = sections[section]
    if not name or name not in _keys(target):
        raise ConfigError(f"unknown config key {key!r} in {where}{_suggest(key, _all_keys(cfg))}")
    name = _keys(target)[name]
    try:
        coerced = _typed(target, name, value, text)
    except _Unfit as bad:
        raise ConfigError(f"{key} in {where}: expected {bad.expected}, got {_show(bad.got)}") from None
    setattr(target, name, coerced)


def _keep(unchecked: Unchecked, key: str, value: Any, where: str, text: str | None) -> None:
    """A task's key while the task is not imported: kept as given, once it has the shape every key has."""
    section, _, name = key.partition(".")
    if not section.isidentifier() or section == "task" or not name:
        runtime = ", ".join(RUNTIME_SECTIONS)
        raise ConfigError(
            f"unknown config section {section!r} (key {key!r}) in {where} (sections are {runtime} and the task's own)"
        )
    if not isinstance(value, _SCALARS) or (isinstance(value, str) and CONTROL.search(value)):
        raise ConfigError(
            f"{key} in {where}: expected a scalar (a string without control characters, a number, true, false "
            f"or null), got {_show(value)}"
        )
    unchecked.values.pop(key, None)  # a later value wins, and takes the later place
    unchecked.values[key] = Given(value, where, text)


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


def _new(task: str | type | None, where: str) -> Config:
    """Defaults for ``task`` (a path, a Task class, or None for the default task): imports the task."""
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


def _start(task: str | type | None, where: str, resolve: bool) -> Config:
    """Defaults for ``task``: imported (``resolve``, or a Task class given from Python), else unchecked."""
    if resolve or isinstance(task, type):
        return _new(task, where)
    return Config(task=task or taskref.DEFAULT, task_config=Unchecked(where))


def from_dict(
    data: Mapping[str, Any], where: str = "<dict>", task: str | type | None = None, resolve: bool = True
) -> Config:
    """A config from a mapping shaped like the YAML files (``task`` from the mapping unless given).
    ``resolve=False``: the task is not imported and its sections stay as given (a saved config read back)."""
    spec, flat = _split(data, where)
    cfg = _start(task if task is not None else spec, where, resolve)
    for key, value in flat.items():
        _apply(cfg, key, value, where)
    return cfg


def load(
    path: str | Path | None = None, overrides: Iterable[str] = (), task: type | None = None, resolve: bool = True
) -> Config:
    """Defaults, then the YAML file at ``path`` (if given), then ``KEY=VALUE`` overrides in order.

    The task (``task:`` in the file, ``task=...`` on the command line, or the ``task`` class given by the
    Python API) is imported first: its sections are then checked like the runtime's. ``resolve=False``
    (``submit --dry-run``): the task is not imported, its keys are kept unchecked; ``resolve`` does the rest.
    """
    where = str(path) if path is not None else "the command line"
    spec, flat = _split(parse_yaml_file(Path(path)), str(path)) if path is not None else (None, {})
    parsed = [(text, *parse_override(text)) for text in overrides]
    for _, key, value in parsed:
        if key == "task":
            spec, where = value, "the command line"
    cfg = _start(task if task is not None else spec, where, resolve)
    for key, value in flat.items():
        _apply(cfg, key, value, str(path))
    for text, key, value in parsed:
        if key != "task":
            _apply(cfg, key, value, "the command line", text.partition("=")[2].strip())
    return cfg


def with_overrides(cfg: Config, overrides: Iterable[str]) -> Config:
    """A copy of ``cfg`` with ``KEY=VALUE`` overrides applied, each checked as ``load`` checks it (a resolved
    config's task keys too): one run of a submission derived from its config, without reading it again."""
    out = copy.deepcopy(cfg)
    for text in overrides:
        key, value = parse_override(text)
        if key == "task":
            if not isinstance(value, str) or taskref.absolute(value) != cfg.task:
                raise ConfigError(f"bad override {text!r}: the task is chosen once, for the whole submission")
            continue
        _apply(out, key, value, "the command line", text.partition("=")[2].strip())
    return out


def resolve(cfg: Config, task: type | None = None) -> Config:
    """``cfg`` with its task imported (``task``: a Task class given from Python instead) and its task sections
    checked by the task's own ``Config``: the step that runs the task's code, for training and a real
    ``submit``. ``cfg`` itself when it is resolved already."""
    if cfg.resolved:
        return cfg
    return _filled(cfg, _new(task if task is not None else cfg.task, cfg.task_config.task_where))


def checked_with(cfg: Config, task_config: type) -> Config:
    """``cfg``'s unchecked task sections checked by ``task_config`` (the Config dataclass of the same task,
    imported already by whoever holds it): a saved config compared with a live one imports nothing."""
    if cfg.resolved:
        return cfg
    return _filled(cfg, Config(task=cfg.task, task_config=task_config()))


def _filled(cfg: Config, fresh: Config) -> Config:
    """``fresh`` (a resolved config's defaults) with ``cfg``'s runtime sections and its task keys, each checked."""
    for name in RUNTIME_SECTIONS:
        setattr(fresh, name, copy.deepcopy(getattr(cfg, name)))
    for key, given in cfg.task_config.values.items():
        _apply(fresh, key, given.value, given.where, given.text)
    return fresh


def value_of(key: str, text: str) -> Any:
    """What ``text``, typed on a command line, means for the runtime key ``key`` (``"slurm.nodes", "4"`` -> 4),
    by the rule every file and override follows (a string key takes the text as typed): ConfigError
    "expected ..., got ..." (or the check's own reason) when it does not fit. ``submit``'s resource flags are read with it."""
    section, _, name = key.partition(".")
    target = _type_hints(Config)[section]()
    name = _keys(target)[name]
    value: Any = text
    if key == "slurm.nodes" and _node_range(text, "--nodes"):
        return text.strip()  # MIN-MAX, split into slurm.min_nodes and slurm.nodes when applied
    if not _wants_text(_field_types(target)[name]):
        value = parse_override(f"{key}={text}")[1]
    try:
        return _typed(target, name, value)
    except _Unfit as bad:
        raise ConfigError(bad.why or f"expected {bad.expected}, got {_show(bad.got)}") from None


def read_resolved(path: Path) -> Config:
    """A run directory's ``config.yaml`` read back as a Config: its runtime keys checked, its task sections as
    written (the task is never imported: ``Config.resolved`` is False). A damaged file (empty, not a mapping, a
    directory, invalid values) is one ConfigError line naming it and the way out."""
    data = read_saved(path)
    try:
        return from_dict(data, str(path), resolve=False)
    except ConfigError as exc:
        raise damaged(exc) from None


def accumulation(cfg: Config, world: int, how: str = "") -> int:
    """Micro-batches per optimizer step at world size ``world``: ``train.accumulate``, or with
    ``train.micro_batch_size`` the count that keeps the global batch; ConfigError (exit 2) when the global
    batch does not split so. The one home of the rule (train, submit, the batch script's relaunch)."""
    g, micro, n = cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.train.accumulate
    if micro is not None:
        if n != 1:
            raise ConfigError(
                f"train.micro_batch_size={micro} chooses the accumulation: leave train.accumulate at 1, not {n}"
            )
        if g % (world * micro):
            raise ConfigError(
                f"train.global_batch_size={g} does not split into {world} rank(s) x micro-batches of "
                f"train.micro_batch_size={micro}{how}: choose a global batch that is a multiple of {world * micro}"
            )
        return g // (world * micro)
    return n


def check_world_size(cfg: Config, world: int, how: str = "") -> None:
    """The global batch must split evenly over the ranks (train and submit both check it before any work)."""
    g = cfg.train.global_batch_size
    if g % world:
        raise ConfigError(
            f"train.global_batch_size={g} is not divisible by the world size {world}{how}: choose a multiple of {world}"
        )
    n = accumulation(cfg, world, how)
    if g % (world * n):
        raise ConfigError(
            f"train.global_batch_size={g} does not split into {world} rank(s) x train.accumulate={n} micro-batches"
            f"{how}: choose a multiple of {world * n}"
        )


def _micro_batches(g: int, counts: range, tasks_per_node: int) -> list[int]:
    """The per-rank micro-batches that split a global batch ``g`` at every node count, largest first."""
    return [m for m in range(g, 0, -1) if all(g % (n * tasks_per_node * m) == 0 for n in counts)]


def check_node_range(cfg: Config, tasks_per_node: int) -> None:
    """Every node count the job may start on (``slurm.min_nodes`` to ``slurm.nodes``) keeps the global batch with
    one per-rank micro-batch (``train.micro_batch_size``): ConfigError naming the first count that does not, and
    a value that fits every count. ``submit`` checks it before the job queues. The counts are those that train:
    ``slurm.spare_nodes`` of the allocation wait (the supervisor's rule, ``slurmjob/restarts.py``)."""
    lo, hi = cfg.slurm.node_span
    if lo > hi:
        raise ConfigError(
            f"slurm.min_nodes={lo} is more than slurm.nodes={hi}: ask for --nodes MIN-MAX with MIN <= MAX"
        )
    spare = cfg.slurm.spare_nodes
    if spare and lo - spare < 1:
        raise ConfigError(
            f"slurm.spare_nodes={spare} leaves none of {lo} node(s) to train on: ask for {lo + 1}-{hi + spare} "
            "node(s), or fewer spares"
        )
    if spare and lo == hi:
        train = (hi - spare) * tasks_per_node
        check_world_size(
            cfg, train, f" ({hi - spare} of {hi} node(s) train, {spare} spare, x {tasks_per_node} task(s))"
        )
        return
    lo, hi = lo - spare, hi - spare  # the nodes that train: the spares wait until one is lost
    g = cfg.train.global_batch_size
    counts = range(lo, hi + 1)
    if lo < hi and cfg.train.micro_batch_size is None:
        fits = _micro_batches(g, counts, tasks_per_node)
        if fits:
            fix = f"set train.micro_batch_size={fits[0]}"
        else:  # both keys at once: one try, not two (a global batch that splits, then a micro-batch for it)
            step = math.lcm(*counts) * tasks_per_node
            bigger = -(-g // step) * step
            fix = (
                f"set train.global_batch_size={bigger} and train.micro_batch_size="
                f"{_micro_batches(bigger, counts, tasks_per_node)[0]} (a global batch of {g} does not split over "
                f"{', '.join(str(n) for n in counts)} node(s) x {tasks_per_node} task(s))"
            )
        raise ConfigError(
            f"--nodes {lo}-{hi} changes the world size, and train.accumulate={cfg.train.accumulate} would change the "
            f"per-rank micro-batch with it: {fix} (each launch then chooses its accumulation)"
        )
    if lo == hi:
        check_world_size(cfg, hi * tasks_per_node, f" ({hi} node(s) x {tasks_per_node} task(s))")
        return
    m = cfg.train.micro_batch_size
    for n in counts:
        try:
            check_world_size(cfg, n * tasks_per_node)  # the rule training refuses a world size with
        except ConfigError:
            raise ConfigError(
                f"train.global_batch_size={g} does not split into micro-batches of train.micro_batch_size={m} on {n} "
                f"node(s) x {tasks_per_node} task(s), one of --nodes {lo}-{hi}: make it a multiple of "
                f"{math.lcm(*counts) * tasks_per_node * m}, or narrow the range"
            ) from None
