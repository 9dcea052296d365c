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


# The compatibility modules at the package's top keep the contract's import paths and ``python -m`` names
# working for users; the package itself imports the real homes, so that they can stay thin forever.
COMPATIBILITY = (
    "ddp_slurm.bootstrap",
    "ddp_slurm.checkpoint",
    "ddp_slurm.doctor",
    "ddp_slurm.report",
    "ddp_slurm.submit",
)


def test_no_package_module_imports_a_compatibility_module() -> None:
    modules = module_names(PACKAGE)
    offenders = [
        f"{name}:{line} imports {target}"
        for name, path in modules.items()
        if name not in COMPATIBILITY
        for target, line in imports(name, path, modules)
        if target in COMPATIBILITY
    ]
    assert offenders == []


# The layers, top to bottom: a module imports its own layer or those below it, never one above (an arrow
# running back up: the runtime writing into a launcher's module, a tool reading a launcher's file).
LAYERS = [
    ("ddp_slurm.launch", "ddp_slurm.bench", "ddp_slurm.__main__", "ddp_slurm.cli", "ddp_slurm.resume", "ddp_slurm.data")
    + ("ddp_slurm.export",)
    + COMPATIBILITY,
    ("ddp_slurm.tools",),
    ("ddp_slurm.train", "ddp_slurm.tasks", "ddp_slurm.shards"),
    ("ddp_slurm.distributed", "ddp_slurm.slurmjob"),
    ("ddp_slurm.config",),
]


def layer(module: str) -> int:
    """A module's layer (0: the top); the torch-free base (errors, safefs, runpaths, ...) is the bottom."""
    for depth, homes in enumerate(LAYERS):
        if any(within(module, home) for home in homes):
            return depth
    return len(LAYERS)


def test_no_arrow_runs_back_up_the_layers() -> None:
    modules = module_names(PACKAGE)
    offenders = [
        f"{name}:{line} imports {target}"
        for name, path in modules.items()
        if name != "ddp_slurm"
        for target, line in imports(name, path, modules)
        if layer(target) < layer(name)
    ]
    assert offenders == []


def test_the_strategy_is_decided_in_one_place() -> None:
    """``dist.strategy`` is compared in ``train/strategy.py`` alone (``of``); everything else asks the Strategy
    object. A comparison with "ddp" or "fsdp" anywhere else is a second place that decides it."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ("train/strategy.py",) or rel.startswith("bench/"):  # bench compares strategies by design
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare):
                texts = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)]
                attrs = [n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)]
                if {"ddp", "fsdp"} & set(texts) or "strategy" in attrs:
                    found.append(f"{rel}:{node.lineno}")
    assert found == []


MAX_MODULE_LINES = 450


def test_no_module_is_over_450_lines() -> None:
    """A module longer than this holds more than one concern: split it by concern into a sibling module (the
    names its importers use re-exported where they expect them)."""
    offenders = [
        f"{path.relative_to(PACKAGE.parent).as_posix()} ({count} lines)"
        for path in sorted(PACKAGE.rglob("*.py"))
        if (count := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert offenders == []


MAX_POSITIONAL = 6


def positional_counts(path: Path) -> Iterator[tuple[str, int]]:
    """``(qualified name, positional parameters)`` of every function in ``path``, methods and nested functions
    included (``Class.method``, ``outer.inner``)."""

    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = [a.arg for a in child.args.posonlyargs + child.args.args]
                if params[:1] in (["self"], ["cls"]):
                    params = params[1:]
                yield prefix + child.name, len(params)
                yield from visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.")
            else:
                yield from visit(child, prefix)

    yield from visit(ast.parse(path.read_text(), str(path)), "")


def test_the_reader_of_positional_parameters(tmp_path: Path) -> None:
    """What counts: positional-only and positional-or-keyword parameters, not ``self``/``cls``, not ``*args``
    and not keyword-only ones; methods and nested functions are named by their place."""
    source = tmp_path / "m.py"
    source.write_text(
        "def f(a, b, /, c, *args, d, **kw):\n    def g(x): pass\n"
        "class C:\n    def m(self, a, b): pass\n    @classmethod\n    def k(cls, *, a): pass\n"
    )
    assert dict(positional_counts(source)) == {"f": 3, "f.g": 1, "C.m": 2, "C.k": 0}


def test_no_function_of_the_training_runtime_takes_more_than_6_positional_parameters() -> None:
    """In ``ddp_slurm/train/`` (recursively) a function takes at most 6 positional parameters, ``self`` and
    ``cls`` not counted (positional-only and positional-or-keyword ones; keyword-only ones after ``*`` are
    free): a seventh argument passed by position is one a caller can silently swap with its neighbour
    (``evaluate(..., precision, groups)``), so those past the sixth are keyword-only. Offenders are named
    ``module:function (N)``. Last in this file: the others run whatever it finds."""
    modules = module_names(PACKAGE)
    offenders = [
        f"{name}:{function} ({count})"
        for name, path in modules.items()
        if within(name, "ddp_slurm.train")
        for function, count in positional_counts(path)
        if count > MAX_POSITIONAL
    ]
    assert offenders == []
