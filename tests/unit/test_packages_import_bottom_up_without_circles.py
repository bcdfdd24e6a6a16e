"""The code's packages import bottom-up (tools/import_graph.py): no import circle between packages, at most
MAX_UPWARD imports from a lower layer to a higher one, and mrl/config, at the bottom, small files that import
nothing above it."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
graph = importlib.util.module_from_spec(_spec)
sys.modules["import_graph"] = graph  # its dataclass looks its module up
_spec.loader.exec_module(graph)


def test_no_package_circle_and_few_upward_imports():
    edges = graph.edges()
    assert graph.circles(edges) == []
    up = graph.upward(edges)
    assert len(up) <= graph.MAX_UPWARD, "\n".join(f"{e.src} -> {e.dst} ({e.where})" for e in up)


def test_the_configuration_imports_nothing_above_it():
    assert [e for e in graph.edges() if e.src == "mrl.config" and graph.layer_of(e.dst) > graph.layer_of(e.src)] == []
    longest = max((ROOT / "mrl" / "config").rglob("*.py"), key=lambda p: len(p.read_text().splitlines()))
    assert len(longest.read_text().splitlines()) < 600, longest


def test_a_circle_and_an_upward_import_are_found():
    edges = [graph.Edge("mrl.config", "mrl.algo", "a.py:1"), graph.Edge("mrl.algo", "mrl.config", "b.py:1"),
             graph.Edge("mrl.config", "mrl.utils", "c.py:1")]
    assert graph.circles(edges) == [["mrl.algo", "mrl.config"]]
    assert graph.upward(edges) == [edges[0]]


def test_lazy_relative_and_type_only_imports():
    # a function-level import counts; `from . import x` resolves; an import under TYPE_CHECKING does not count
    found = {(e.src, e.dst) for e in graph.edges()}
    assert ("bridges.families", "bridges") in found  # relative or absolute, from the families to the registry
    assert graph.unit_of("mrl.config.startup.validate") == "mrl.config.startup"
    assert graph.unit_of("mrl.cli") == "mrl.cli" and graph.unit_of("mrl.rollout.agent_loop") == "mrl.rollout.agent_loop"
