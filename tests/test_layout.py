"""The package's shape: no import cycle between files, and the runtime never names a task.

Imports are read from the source (``ast``), every one of them: at the top, inside functions and under
``TYPE_CHECKING``. A cycle found only at run time (an import inside a function) is still two modules
that cannot be understood, tested or moved one without the other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import ddp_slurm

PACKAGE = Path(ddp_slurm.__file__).parent
TASKS = "ddp_slurm.tasks"
# Modules outside the tasks that are about the built-in MNIST task by design, not the runtime: the
# contract's ``python -m ddp_slurm.data download`` (its data) and the benchmarks, which measure it.
USES_THE_BUILT_IN_TASK = ("ddp_slurm.data", "ddp_slurm.bench")


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root`` (a package's ``__init__.py`` is the package)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """``(module, line)`` for every import of a module of the package in the file ``path``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def known(dotted: str) -> str | None:  # the longest prefix that is a module of the package
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [known(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [known(f"{base}.{alias.name}") for alias in node.names]
        else:
            continue
        for target in targets:
            if target is not None and target != name:
                yield target, node.lineno


def graph(root: Path) -> dict[str, set[str]]:
    modules = module_names(root)
    return {name: {target for target, _ in imports(name, path, modules)} for name, path in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_graph_sees_imports_inside_functions_and_type_checking(tmp_path: Path) -> None:
    """The reader itself: a cycle through a function-level and a TYPE_CHECKING import is found."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import X\n")
    (pkg / "c.py").write_text("from . import a\nimport os\n")
    assert graph(pkg) == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}}
    assert cycles(graph(pkg)) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_no_import_cycle_between_files() -> None:
    assert cycles(graph(PACKAGE)) == []


def test_the_runtime_never_imports_a_task() -> None:
    """The runtime, launchers and tools run any task: they may name the default one only as a string
    (``taskref.DEFAULT``), never import it. A task's own errors reach them as ``errors.TaskError``."""
    modules = module_names(PACKAGE)
    offenders = [
        f"{name}:{line} imports {target}"
        for name, path in modules.items()
        if not any(within(name, home) for home in (TASKS, *USES_THE_BUILT_IN_TASK))
        for target, line in imports(name, path, modules)
        if within(target, TASKS)
    ]
    assert offenders == []


def test_nothing_below_the_launchers_imports_them() -> None:
    """The launchers (``submit``, the local launcher) sit on top: the config, training, the distributed
    runtime, the Slurm job and the tools never import them (what both sides need lives below, e.g. the sweep
    manifest in ``tools/sweeps.py``, a worker's exit record in ``exits.py``)."""
    modules = module_names(PACKAGE)
    below = ("ddp_slurm.config", "ddp_slurm.train", "ddp_slurm.distributed", "ddp_slurm.slurmjob", "ddp_slurm.tools")
    offenders = [
        f"{name}:{line} imports {target}"
        for name, path in modules.items()
        if any(within(name, home) for home in below)
        for target, line in imports(name, path, modules)
        if within(target, "ddp_slurm.launch")
    ]
    assert offenders == []
