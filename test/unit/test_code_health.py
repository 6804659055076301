"""The shape of the package: no import circles, no module state outside the runtime
registry, a plugin.py that stays a table, no module too long to read."""

from __future__ import annotations

from pathlib import Path

from sgl_importance.tools.imports import ROOT, circles, import_graph, upward_imports
from sgl_importance.tools.state import findings, outside_registry

LONGEST_MODULE = 500
LONGEST_PLUGIN = 200


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_two_modules_of_the_package_import_each_other_even_through_others():
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_a_circle_through_three_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


HOT_SET = "sgl_importance.hot_set"
HOT_SET_PARTS = ["pages", "guard", "plan", "graph"]  # lower first: a part imports only those before it


def test_the_hot_sets_parts_import_only_the_parts_below_them():
    shared = {f"{HOT_SET}.params"}
    assert upward_imports(import_graph(), HOT_SET, HOT_SET_PARTS, shared) == []


def test_the_layering_check_finds_a_part_importing_a_higher_part_or_the_package_above():
    graph = {
        "p.low.a": {"p.high.b", "p.low.c", "p.leaf"},
        "p.low.c": set(),
        "p.high.b": {"p.low.a", "p.top"},
        "p.top": {"p.high.b"},
    }
    assert upward_imports(graph, "p", ["low", "high"], {"p.leaf"}) == ["p.high.b -> p.top", "p.low.a -> p.high.b"]


def test_no_module_level_state_lives_outside_the_runtime_registry():
    assert [str(f) for f in outside_registry(findings())] == []


def test_the_state_finder_sees_a_global_a_mutated_container_and_a_live_instance(tmp_path):
    package = tmp_path / "sgl_importance"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "bad.py").write_text(
        "class Box:\n    pass\n\n"
        "BOX = Box()\n_seen = {}\n_count = 0\n\n"
        "def note(key):\n    global _count\n    _count += 1\n    _seen[key] = True\n"
    )
    found = {(f.name, f.why.split(" ")[0]) for f in findings(package)}
    assert found == {("BOX", "instance"), ("_seen", "container"), ("_count", "rebound")}


def test_plugin_py_stays_a_table_of_at_most_200_lines():
    assert _lines(ROOT / "plugin.py") <= LONGEST_PLUGIN


def test_no_module_is_longer_than_500_lines():
    long = {str(p.relative_to(ROOT)): _lines(p) for p in ROOT.rglob("*.py") if _lines(p) > LONGEST_MODULE}
    assert long == {}
