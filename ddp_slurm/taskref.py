"""``task=...``: from an import path to a Task class, checked before anything starts (the config layer).

``package.module:Name`` is imported like any module (the working directory and PYTHONPATH are searched);
``path/to/file.py:Name`` imports that file, the way a user's script is run; a relative one is recorded
absolute (``absolute``), so that a run directory's config.yaml names its task wherever it is read from. Every failure is a one-line
``TaskError`` (a ``ConfigError``: exit 2, nothing created). Torch-free; the Task base class lives in
``ddp_slurm.train.task`` and is recognised here by name, so that this layer never imports the runtime.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import stat
import sys
from pathlib import Path
from typing import Any

from ddp_slurm import errors

DEFAULT = "ddp_slurm.tasks.mnist:MNIST"
"""The task that runs when ``task`` is not set."""


class TaskError(errors.UsageError, ValueError):
    """A task path that cannot be used (bad import path, not a Task, a broken Config). One line."""


def _is_task_class(obj: Any) -> bool:
    return isinstance(obj, type) and any(
        c.__name__ == "Task" and c.__module__ == "ddp_slurm.train.task" for c in obj.__mro__[1:]
    )


def _import_file(path: Path) -> Any:
    """Import a ``.py`` file as a module named after it (the way a user's script is imported)."""
    name = f"ddp_slurm_task_{path.stem}"
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TaskError(f"task file {path} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _where(module_name: str) -> str:
    """The task's file as the user knows it: the path given, or the file a module name was found in."""
    if module_name.endswith(".py"):
        return module_name
    found = sys.modules.get(module_name) or _spec_origin(module_name)
    origin = getattr(found, "__file__", None) or (found if isinstance(found, str) else None)
    return f"{module_name!r} ({origin})" if origin else repr(module_name)


def _spec_origin(module_name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(module_name)
    except (Exception, SystemExit):  # its package failed to import too: the name is all there is
        return None
    return spec.origin if spec is not None else None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or "(no message)"


def absolute(spec: str) -> str:
    """``spec`` with a relative task file made absolute from the working directory (``line.py:Line`` ->
    ``/home/me/proj/line.py:Line``); an import path, or a file given absolute, unchanged. What a run records:
    resuming it then imports the same file from any directory. No import, no file read (the path is not
    resolved through links either: it names the file the user named)."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name.endswith(".py") or os.path.isabs(module_name):
        return spec
    return f"{os.path.abspath(module_name)}:{attr}"


def same(a: str, b: str) -> bool:
    """Whether two task specs name the same task for a relaunch: the same import path, or a task file of the
    same name and class wherever it lies (a project copied or moved with its runs, relaunched with
    ``task=file.py:Name`` from its new place). Which code runs is the spec given now; the gate still checks
    the model against the checkpoint."""
    a, b = absolute(a), absolute(b)
    if a == b:
        return True
    (file_a, _, name_a), (file_b, _, name_b) = a.rpartition(":"), b.rpartition(":")
    is_file = file_a.endswith(".py") and file_b.endswith(".py")
    return is_file and name_a == name_b and os.path.basename(file_a) == os.path.basename(file_b)


TRUST = "DDP_SLURM_TRUST_TASK_FILE"
"""A task file's absolute path: import it although someone else owns it (asked for by name, once per file)."""


def check_code_owner(path: Path, spec: str) -> None:
    """One trust rule for code a config names by file: it is imported only when it is yours (or root's) and
    no other user can change it (the file, and its folder unless sticky), or when ``DDP_SLURM_TRUST_TASK_FILE``
    names it. A run directory's owner says nothing of the code its config names: a ``cp -r`` of someone's run
    makes the folder yours while its config still names her task file by its absolute path."""
    if os.environ.get(TRUST) == str(path):
        return
    me = os.geteuid()
    fix = f"copy it into a folder of your own and name the copy (task=copy.py:Name), or set {TRUST}={path}"
    for item in (path, path.parent):
        st = os.stat(item)
        what = "task file" if item == path else "folder of the task file"
        if st.st_uid not in (me, 0):
            raise TaskError(
                f"task={spec!r}: the {what} {item} is owned by uid {st.st_uid}, not by you: importing it would "
                f"run someone else's code as you; {fix}"
            )
        sticky = item != path and st.st_mode & stat.S_ISVTX
        if st.st_mode & stat.S_IWOTH and not sticky:  # a group's write is a team's (run.shared's rule)
            raise TaskError(
                f"task={spec!r}: the {what} {item} is writable by every user: anyone could change the code that "
                f"runs as you; `chmod o-w {item}`, or {fix}"
            )


def task_path(cls: type) -> str:
    """The import path the config records for a task class: ``package.module:Name``."""
    return f"{cls.__module__}:{cls.__qualname__}"


def resolve(spec: str) -> type:
    """``"package.module:Name"`` or ``"path/to/file.py:Name"`` -> the Task subclass, or TaskError."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise TaskError(
            f"task={spec!r} is not an import path: expected package.module:ClassName or path/to/file.py:ClassName"
        )
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).resolve()
            if not path.is_file():
                raise TaskError(
                    f"task={spec!r}: file {module_name} not found (paths are relative to the working directory)"
                )
            check_code_owner(path, spec)
            module = _import_file(path)
        else:
            module = importlib.import_module(module_name)
    except TaskError:
        raise
    except ImportError as exc:
        raise TaskError(
            f"task={spec!r}: cannot import {module_name!r} ({exc}); install it or put its folder on PYTHONPATH"
        ) from None
    except SystemExit as exc:  # a script without a __main__ guard: exit 0 here would report a run that never trained
        raise TaskError(
            f"task={spec!r}: importing {_where(module_name)} called sys.exit({exc.code!r}); a task file must not "
            'run anything at import: put its script part under `if __name__ == "__main__":`'
        ) from None
    except Exception as exc:  # the module itself raised: its own bug, named in one line
        raise TaskError(
            f"task={spec!r}: importing {_where(module_name)} raised {type(exc).__name__}: {_one_line(exc)}"
        ) from None
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise TaskError(f"task={spec!r}: {module_name!r} has no {attr!r}")
    return validate_class(obj, spec)


def validate_class(obj: Any, spec: str) -> type:
    """``obj`` as a Task subclass with a usable Config, or TaskError naming what is wrong."""
    if not _is_task_class(obj):
        raise TaskError(f"task={spec!r} is not a ddp_slurm.Task subclass (got {obj!r})")
    cfg = obj.Config
    if not dataclasses.is_dataclass(cfg):
        raise TaskError(f"task={spec!r}: {obj.__name__}.Config must be a dataclass of config sections")
    for f in dataclasses.fields(cfg):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise TaskError(f"task={spec!r}: section {f.name!r} of {obj.__name__}.Config needs a default")
    base = next(c for c in obj.__mro__ if c.__name__ == "Task" and c.__module__ == "ddp_slurm.train.task")
    percent = obj.percent_metrics
    if percent is not None and not (isinstance(percent, tuple) and all(isinstance(p, str) for p in percent)):
        raise TaskError(
            f"task={spec!r}: {obj.__name__}.percent_metrics must be a tuple of metric names (or None), got {percent!r}"
        )
    for name in ("build_model", "train_data", "training_step"):
        if getattr(obj, name) is getattr(base, name):
            raise TaskError(f"task={spec!r}: {obj.__name__} does not define {name}()")
    return obj
