"""The package's import graph, and the circles in it.

``python -m sgl_importance.tools.imports`` prints one line per module that imports
another module of the package; ``--check`` prints each circle (a strongly connected
group of two or more modules) and exits 1 if there is one.

Every import counts: module-level, inside a function (a lazy import hides a circle
from Python, not from a reader) and under ``if TYPE_CHECKING:`` (a type a module
names is a dependency of its reader). ``from pkg import name`` counts as importing ``pkg.name`` when
that is a module, else ``pkg``.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import Iterable

PACKAGE = "sgl_importance"
ROOT = Path(__file__).resolve().parents[1]


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package under ``root``, by dotted name."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imports(tree: ast.AST) -> Iterable[ast.Import | ast.ImportFrom]:
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` (at ``path``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for target in targets:
            # `import a.b.c` imports a.b.c; the nearest enclosing module of ours.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target.split(".")[0] == PACKAGE:
                found.add(target)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module → the package modules it imports."""
    modules = module_names(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(start: str) -> None:
        # Iterative: the graph is small, but recursion depth is not ours to spend.
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(found)


def upward_imports(graph: dict[str, set[str]], package: str, parts: list[str], shared: set[str]) -> list[str]:
    """Imports in ``package`` that break its layering: a module of a part (a subpackage,
    ``parts`` lower first) may import modules of its own part, of a lower one, and the
    ``shared`` modules of ``package`` (leaves); none above it nor the package's others."""
    rank = {f"{package}.{part}": i for i, part in enumerate(parts)}

    def part_of(module: str) -> str | None:
        return next((p for p in rank if module == p or module.startswith(p + ".")), None)

    found = []
    for name in sorted(graph):
        own = part_of(name)
        if own is None:
            continue
        for target in sorted(graph[name]):
            if not target.startswith(package + ".") or target in shared:
                continue
            other = part_of(target)
            if other is None or rank[other] > rank[own]:
                found.append(f"{name} -> {target}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sgl_importance.tools.imports", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="print the circles; exit 1 if there is one")
    args = parser.parse_args(argv)
    graph = import_graph()
    if not args.check:
        for name in sorted(graph):
            if graph[name]:
                print(f"{name}: {' '.join(sorted(graph[name]))}")
        return 0
    found = circles(graph)
    for group in found:
        inside = {m: sorted(graph[m] & set(group)) for m in group}
        print("circle: " + "; ".join(f"{m} -> {', '.join(t)}" for m, t in inside.items()))
    print(f"{len(found)} import circle(s) in {len(graph)} modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
