"""Reading the package's source for the group each collective names (tests/test_groups_roles.py).

A collective's group is followed back to where it comes from: ``groups.host`` or ``groups.train``, a
parameter (the function then carries that role: each of its calls is followed in turn), a name or an
attribute set from one, a group made on the spot. Only the package's own source is read; nothing runs.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import ddp_slurm

PACKAGE = Path(ddp_slurm.__file__).parent
ROOT = PACKAGE.parent

# torch.distributed's collectives (and what makes or takes a group): where each takes its group.
GROUP_ARG: dict[str, tuple[str, int]] = {
    "all_reduce": ("group", 2),
    "broadcast": ("group", 2),
    "all_gather": ("group", 2),
    "all_gather_into_tensor": ("group", 2),
    "all_gather_object": ("group", 2),
    "broadcast_object_list": ("group", 2),
    "reduce": ("group", 3),
    "gather": ("group", 3),
    "gather_object": ("group", 3),
    "scatter": ("group", 3),
    "scatter_object_list": ("group", 3),
    "reduce_scatter": ("group", 3),
    "reduce_scatter_tensor": ("group", 3),
    "all_to_all": ("group", 2),
    "all_to_all_single": ("group", 4),
    "barrier": ("group", 0),
    "monitored_barrier": ("group", 0),
    "send": ("group", 2),
    "recv": ("group", 2),
    "isend": ("group", 2),
    "irecv": ("group", 2),
    "P2POp": ("group", 3),
    "new_group": ("", -1),  # makes a group: a collective of every rank
    # Distributed Checkpoint, DDP, FSDP2's mesh (checkpoint.save / async_save / load; DeviceMesh.from_group)
    "save": ("process_group", 99),
    "async_save": ("process_group", 99),
    "load": ("process_group", 99),
    "DistributedDataParallel": ("process_group", 99),
    "from_group": ("group", 0),
    "init_device_mesh": ("", -1),  # over the default group
}
# torch.distributed's names that take no group: no collective, or one over what another argument brings
NOT_COLLECTIVE = {
    "init_process_group", "destroy_process_group", "is_initialized", "is_available", "get_rank",
    "get_world_size", "get_backend", "get_process_group_ranks", "is_nccl_available", "is_gloo_available",
    "is_torchelastic_launched", "ReduceOp", "Backend", "ProcessGroup", "TCPStore", "HashStore", "PrefixStore",
    "FileStore", "DistError", "DistBackendError", "DistNetworkError", "DistStoreError",
    "batch_isend_irecv",  # its ops are P2POp, each naming its group
    "run", "parse_args",  # torchrun's own entry point (the launcher)
    "checkpoint",  # torch.distributed._composable.checkpoint: activation checkpointing, no collective
    "fully_shard", "MixedPrecisionPolicy",  # over the mesh, made by from_group or init_device_mesh
    "get_state_dict", "set_state_dict", "get_optimizer_state_dict", "set_model_state_dict",
    "set_optimizer_state_dict", "StateDictOptions",  # over the model's own mesh
    "StagingOptions", "DefaultStager", "StorageMeta", "set_element",
    "_load_state_dict",  # no_dist=True: one process reads a whole checkpoint
}  # fmt: skip

HOST, TRAIN, DEFAULT, MADE = "host", "train", "default", "made"


@dataclass(frozen=True)
class Table:
    """What the test says of the package (see tests/test_groups_roles.py)."""

    roles: dict[tuple[str, str, str], list[str]]  # (file, function, collective): each call's role, in order
    default_is_train: set[tuple[str, str, str]]  # (file, function, carrier): calls that may name no group
    no_timeout_yet: set[tuple[str, str]]  # (file, function): groups made without the run's timeout


@dataclass
class Module:
    """One source file of the package: its tree, what its imports bind, each node's parent."""

    rel: str
    dotted: str
    tree: ast.Module
    imports: dict[str, str] = field(default_factory=dict)
    parent: dict[ast.AST, ast.AST] = field(default_factory=dict)
    calls: list[ast.Call] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path, text: str | None = None) -> Module:
        rel = path.relative_to(PACKAGE).as_posix()
        dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        mod = cls(rel, dotted, ast.parse(path.read_text() if text is None else text, str(path)))
        for node in ast.walk(mod.tree):
            for child in ast.iter_child_nodes(node):
                mod.parent[child] = node
            if isinstance(node, ast.Call):
                mod.calls.append(node)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        mod.imports[alias.asname] = alias.name
                    else:  # import a.b binds a
                        mod.imports.setdefault(alias.name.split(".")[0], alias.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                if node.level:  # relative: from . import x
                    base = ".".join(dotted.split(".")[: -node.level] + [node.module])
                for alias in node.names:
                    mod.imports[alias.asname or alias.name] = f"{base}.{alias.name}"
        mod.calls.sort(key=lambda c: (c.lineno, c.col_offset))  # the order they appear in
        return mod

    def scopes(self, node: ast.AST) -> list[ast.AST]:
        """The functions and classes around ``node``, innermost first."""
        out = []
        while node in self.parent:
            node = self.parent[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.append(node)
        return out

    def qualname(self, node: ast.AST) -> str:
        return ".".join(s.name for s in reversed(self.scopes(node))) or "<module>"  # type: ignore[attr-defined]

    def dotted_name(self, expr: ast.expr) -> str | None:
        """``a.b.c`` with ``a`` replaced by what the import bound it to; None for anything else."""
        if isinstance(expr, ast.Name):
            return self.imports.get(expr.id, expr.id)
        if isinstance(expr, ast.Attribute):
            base = self.dotted_name(expr.value)
            return f"{base}.{expr.attr}" if base else None
        return None


@functools.cache
def _modules() -> dict[str, Module]:
    return {m.rel: m for m in (Module.read(p) for p in sorted(PACKAGE.rglob("*.py")))}


def modules() -> dict[str, Module]:
    """The package's source files, parsed once per session (a test's changes go into a copy)."""
    return dict(_modules())


def torch_name(mod: Module, call: ast.Call) -> str | None:
    """The name under torch.distributed (or DDP) that ``call`` calls, if it calls one."""
    name = mod.dotted_name(call.func)
    if name is None:
        return None
    if name.endswith(".DistributedDataParallel") and name.startswith("torch."):
        return "DistributedDataParallel"
    if name.startswith("torch.distributed."):
        return name.rsplit(".", 1)[1]
    return None


def passed(call: ast.Call, keyword: str, index: int) -> ast.expr | None:
    """The argument ``call`` passes for a parameter (keyword, positional index); None where it passes none."""
    for kw in call.keywords:
        if kw.arg == keyword:
            return kw.value
    return call.args[index] if 0 <= index < len(call.args) else None


Role = str | tuple[str, ast.AST, str]  # a role, or ("param", function, parameter name)


def params(func: ast.AST) -> list[str]:
    a = func.args  # type: ignore[attr-defined]
    return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]


def assigned(scope: ast.AST, target: str) -> Iterator[ast.expr]:
    """The values ``scope`` assigns to ``target`` (a name, or ``self.x``), tuples unpacked."""
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign):
            pairs = [(t, node.value) for t in node.targets]
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            pairs = [(node.target, node.value)]
        else:
            continue
        for tgt, value in pairs:
            if isinstance(tgt, ast.Tuple) and isinstance(value, ast.Tuple) and len(tgt.elts) == len(value.elts):
                pairs.extend(zip(tgt.elts, value.elts))
            elif ast.unparse(tgt) == target:
                yield value


def resolve(mod: Module, expr: ast.expr | None, at: ast.AST) -> Role:
    """Where the group ``expr`` (an argument at node ``at``) comes from."""
    if expr is None or (isinstance(expr, ast.Constant) and expr.value is None):
        return DEFAULT
    if isinstance(expr, ast.Attribute) and expr.attr in (HOST, TRAIN):
        holder = ast.unparse(expr.value)
        if holder.split(".")[-1] == "groups" or holder.startswith("Groups.make("):
            return expr.attr
    if isinstance(expr, ast.Call):
        made = mod.dotted_name(expr.func) or ""
        if made.endswith(("new_group", "gloo_group")):
            return MADE
    scopes = mod.scopes(at)
    text = ast.unparse(expr)
    if isinstance(expr, ast.Name):
        for func in (s for s in scopes if not isinstance(s, ast.ClassDef)):  # a closure reads its outer scopes
            if expr.id in params(func):
                return ("param", func, expr.id)
            for value in assigned(func, expr.id):
                return resolve(mod, value, value)
    if text.startswith("self.") and text.count(".") == 1:
        classes = [s for s in scopes if isinstance(s, ast.ClassDef)]
        if classes:
            for value in assigned(classes[0], text):
                return resolve(mod, value, value)
    return f"unknown ({text})"


@dataclass(frozen=True)
class Carrier:
    """A function (or class, through ``__init__``) whose parameter ``name`` is a group of ``role``."""

    module: str
    qualname: str
    name: str
    index: int  # positional, as callers pass it (``self`` left out)
    role: str
    required: int  # the positional parameters without a default: a call with fewer arguments is another's


def carrier_of(mod: Module, func: ast.AST, name: str, role: str) -> Carrier:
    names = params(func)
    scopes = mod.scopes(func)
    method = bool(scopes) and isinstance(scopes[0], ast.ClassDef)
    index = names.index(name) - (1 if method else 0)
    qual = mod.qualname(func) + "." + func.name  # type: ignore[attr-defined]
    qual = qual.removeprefix("<module>.")
    if method and func.name == "__init__":  # type: ignore[attr-defined]
        qual = qual.removesuffix(".__init__")
    a = func.args  # type: ignore[attr-defined]
    required = len(a.posonlyargs + a.args) - len(a.defaults) - (1 if method else 0)
    return Carrier(mod.rel, qual, name, index, role, required)


def calls_of(mods: dict[str, Module], carrier: Carrier) -> Iterator[tuple[Module, ast.Call]]:
    """Every call of ``carrier`` in the package: by the name its module or an import binds, or (a method)
    by its name on any object."""
    target = mods[carrier.module].dotted + "." + carrier.qualname
    method = "." in carrier.qualname and not carrier.qualname.split(".")[0][:1].islower()
    leaf = carrier.qualname.rsplit(".", 1)[-1]
    for mod in mods.values():
        for node in mod.calls:
            name = mod.dotted_name(node.func)
            local = f"{mod.dotted}.{name}" if isinstance(node.func, ast.Name) and name == node.func.id else None
            if target in (name, local):
                yield mod, node
            elif method and isinstance(node.func, ast.Attribute) and node.func.attr == leaf:
                module_function = name and name.split(".")[0] in mod.imports and not name.startswith("ddp_slurm")
                if not module_function and len(node.args) + len(node.keywords) >= carrier.required:
                    yield mod, node  # a method of that name, called with as many arguments as it needs


def made(mod: Module, call: ast.Call, found: Findings, no_timeout_yet: set[tuple[str, str]]) -> None:
    """A group made here: a gloo group (host memory, whatever the default group is) that waits as long as
    the default group (``groups.default_timeout``), not torch's 30 minutes."""
    given = {kw.arg: ast.unparse(kw.value) for kw in call.keywords}
    where = f"{mod.rel}:{call.lineno} new_group"
    if given.get("backend") not in ("'gloo'", '"gloo"'):
        found.wrong.append(f"{where} names no gloo backend (it would inherit the default group's, NCCL)")
    if "timeout" not in given and (mod.rel, mod.qualname(call)) not in no_timeout_yet:
        found.wrong.append(f"{where} names no timeout (torch's 30 minutes): timeout=groups.default_timeout()")
    if "timeout" in given and (mod.rel, mod.qualname(call)) in no_timeout_yet:
        found.wrong.append(f"{where} names its timeout now: take it out of NO_TIMEOUT_YET")


@dataclass
class Findings:
    wrong: list[str] = field(default_factory=list)
    sites: dict[tuple[str, str, str], list[str]] = field(default_factory=dict)
    carriers: set[Carrier] = field(default_factory=set)


def check(mods: dict[str, Module], table: Table) -> Findings:
    """Every torch collective against ``table.roles``, then every call of a carrier against its role."""
    found = Findings()
    pending: list[Carrier] = []

    def judge(mod: Module, call: ast.Call, got: Role, want: str, what: str) -> None:
        where = f"{mod.rel}:{call.lineno} ({mod.qualname(call)}) {what}"
        if isinstance(got, tuple):
            carrier = carrier_of(mod, got[1], got[2], want)
            if carrier not in found.carriers:
                found.carriers.add(carrier)
                pending.append(carrier)
        elif got != want and not (got == MADE and want == HOST):  # a gloo group made here carries host tensors
            named = "names no group" if got == DEFAULT else f"names the {got} group"
            found.wrong.append(f"{where} {named}, but carries the {want} role's")

    for mod in mods.values():
        for node in mod.calls:
            name = torch_name(mod, node)
            if name is None or name in NOT_COLLECTIVE:
                continue
            key = (mod.rel, mod.qualname(node), name)
            if name not in GROUP_ARG:
                found.wrong.append(f"{mod.rel}:{node.lineno} torch.distributed.{name} is not known to this test")
                continue
            keyword, index = GROUP_ARG[name]
            got = (
                MADE
                if name == "new_group"
                else DEFAULT
                if not keyword
                else resolve(mod, passed(node, keyword, index), node)
            )
            found.sites.setdefault(key, []).append(got if isinstance(got, str) else "param")
            wants = table.roles.get(key, [])
            nth = len(found.sites[key]) - 1
            if nth >= len(wants):
                found.wrong.append(
                    f"{mod.rel}:{node.lineno} {name} in {key[1]} is not in ROLES (which group must it name?)"
                )
                continue
            judge(mod, node, got, wants[nth], name)
            if name == "new_group":
                made(mod, node, found, table.no_timeout_yet)
    while pending:
        carrier = pending.pop()
        for mod, call in calls_of(mods, carrier):
            arg = passed(call, carrier.name, carrier.index)
            got = resolve(mod, arg, call)
            key = (mod.rel, mod.qualname(call), carrier.qualname.rsplit(".", 1)[-1])
            if got == DEFAULT and carrier.role == TRAIN and key in table.default_is_train:
                continue
            judge(mod, call, got, carrier.role, f"{carrier.qualname}({carrier.name}=...)")
    for key, wants in table.roles.items():
        if len(found.sites.get(key, [])) < len(wants):
            found.wrong.append(
                f"ROLES lists {key} {len(wants)} time(s), the source has {len(found.sites.get(key, []))}"
            )
    return found


def planted(rel: str, old: str, new: str) -> dict[str, Module]:
    """The package's source with one change made to one file, in memory (nothing is written)."""
    mods = modules()
    path = PACKAGE / rel
    text = path.read_text()
    assert text.count(old) == 1, f"{rel} no longer holds {old!r} once: update the planted mistake"
    mods[rel] = Module.read(path, text.replace(old, new))
    return mods
