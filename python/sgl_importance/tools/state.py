"""Module-level state in the package: names that change after the module imported.

``python -m sgl_importance.tools.state`` prints one line per finding; ``--check``
exits 1 if any is outside :data:`ALLOWED` (the runtime registry).

Found, by reading the source (no import):
- a ``global`` statement (a function rebinds a module name);
- a module attribute assigned from outside (``module.NAME = ...``);
- a module-level container (dict, list, set, their ``collections`` and ``weakref``
  kinds) that any function mutates: item assignment or deletion, or a mutating
  method (``append``, ``update``, ``setdefault``, ...);
- a module-level instance of a class of the package that is not frozen
  (``@dataclass(frozen=True)``, ``NamedTuple``, ``Enum``): its fields can change.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

from sgl_importance.tools.imports import ROOT, module_names

# The one place state may live at module level: the registry of the process's runtime.
ALLOWED = {("sgl_importance.runtime", "_current")}

_CONTAINERS = {
    "dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter",
    "WeakKeyDictionary", "WeakValueDictionary", "WeakSet",
}  # fmt: skip
_MUTATORS = {
    "append", "extend", "insert", "remove", "pop", "popitem", "clear", "update",
    "setdefault", "add", "discard", "difference_update", "intersection_update",
    "appendleft", "popleft", "__setitem__",
}  # fmt: skip


@dataclass(frozen=True)
class Finding:
    module: str
    name: str
    line: int
    why: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} {self.name}: {self.why}"


def _callee(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _is_container(value: ast.expr) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    return isinstance(value, ast.Call) and _callee(value) in _CONTAINERS


def _frozen(cls: ast.ClassDef) -> bool:
    for deco in cls.decorator_list:
        if isinstance(deco, ast.Call) and any(
            k.arg == "frozen" and isinstance(k.value, ast.Constant) and k.value.value for k in deco.keywords
        ):
            return True
    return any(_callee(base) in {"NamedTuple", "Enum", "IntEnum", "str"} for base in cls.bases)


def _module_bindings(tree: ast.Module) -> dict[str, ast.expr]:
    bound = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.value is not None:
            for target in node.targets:
                if isinstance(target, ast.Name):
                    bound[target.id] = node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None and isinstance(node.target, ast.Name):
            bound[node.target.id] = node.value
    return bound


def _mutated_names(tree: ast.AST) -> dict[str, int]:
    """Names (or ``module.NAME`` attributes, by NAME) mutated inside functions."""
    found: dict[str, int] = {}

    def base_name(node: ast.expr) -> str:
        if isinstance(node, ast.Name):
            return node.id
        return node.attr if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) else ""

    for func in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for node in ast.walk(func):
            targets: list[ast.expr] = []
            if isinstance(node, (ast.Assign, ast.Delete)):
                targets = node.targets
            elif isinstance(node, ast.AugAssign):
                targets = [node.target]
            for target in targets:
                if isinstance(target, ast.Subscript) and base_name(target.value):
                    found.setdefault(base_name(target.value), node.lineno)
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in _MUTATORS
                and base_name(node.func.value)
            ):
                found.setdefault(base_name(node.func.value), node.lineno)
    return found


def findings(root: Path = ROOT) -> list[Finding]:
    """Every piece of module-level state in the package under ``root``."""
    modules = module_names(root)
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in modules.items()}
    classes = {
        node.name: _frozen(node) for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
    }
    mutated: dict[str, tuple[str, int]] = {}
    for name, tree in trees.items():
        for var, line in _mutated_names(tree).items():
            mutated.setdefault(var, (name, line))
    out = []
    for name, tree in trees.items():
        bound = _module_bindings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                out += [Finding(name, var, node.lineno, "rebound by a `global` statement") for var in node.names]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Assign) and any(
                        isinstance(t, ast.Attribute)
                        and isinstance(t.value, ast.Name)
                        and f"{t.value.id}" in {m.rpartition(".")[2] for m in modules}
                        and t.attr.isupper()
                        for t in inner.targets
                    ):
                        out.append(Finding(name, "module attribute", inner.lineno, "assigned from outside its module"))
        for var, value in bound.items():
            if _is_container(value) and var in mutated:
                where, line = mutated[var]
                out.append(Finding(name, var, value.lineno, f"container mutated at {where}:{line}"))
            elif isinstance(value, ast.Call) and classes.get(_callee(value)) is False:
                out.append(Finding(name, var, value.lineno, f"instance of {_callee(value)}, not frozen"))
    return sorted(set(out), key=lambda f: (f.module, f.line, f.name))


def outside_registry(found: list[Finding]) -> list[Finding]:
    return [f for f in found if (f.module, f.name) not in ALLOWED]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sgl_importance.tools.state", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 on state outside the runtime registry")
    args = parser.parse_args(argv)
    found = findings()
    for finding in found:
        print(finding)
    bad = outside_registry(found)
    print(f"{len(found)} module-level state finding(s), {len(bad)} outside the runtime registry")
    return 1 if args.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
