"""The package-level import graph of mrl's code (not its tests): import circles and upward imports.

    python tools/import_graph.py            # summary, then every circle and every upward import
    python tools/import_graph.py --edges    # also every package edge with the file that makes it

A unit is a package (a folder with `__init__.py`); a top-level module of `mrl/` (`mrl/cli.py`) is a unit of its
own. Every `import` counts, at module level or inside a function, except those under `if TYPE_CHECKING:`.
LAYERS orders the units bottom-up: an import from a unit to a unit of a higher layer is "upward".
tests/unit/test_import_graph.py holds the tree to no circle and at most MAX_UPWARD upward imports.
"""

from __future__ import annotations

import argparse
import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("mrl", "bridges", "rollout_adapters")
MAX_UPWARD = 3

# Bottom-up; a unit takes the layer of its longest listed prefix. Units of one layer may import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("mrl", "mrl._compat", "mrl.utils", "mrl.controller"),  # plumbing: no RL, no configuration
    ("mrl.config",),  # the typed configuration, engine fields and capabilities, model shapes
    ("mrl.data", "mrl.models"),
    ("mrl.algo", "mrl.reward"),
    ("bridges",),
    ("mrl.engine",),
    ("mrl.weight_sync",),
    ("rollout_adapters",),
    ("mrl.rollout",),
    ("mrl.workers",),
    ("mrl.config.startup",),  # loading a recipe and the start-up rules: they check every component's names
    ("mrl.trainer",),
    ("mrl.tools", "mrl.cli", "mrl.demo"),
)


@dataclass(frozen=True)
class Edge:
    src: str  # unit
    dst: str  # unit
    where: str  # file:line of the import


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(module: str) -> bool:
    return (ROOT / module.replace(".", "/") / "__init__.py").exists()


def _is_module(module: str) -> bool:
    return (ROOT / (module.replace(".", "/") + ".py")).exists() or _is_package(module)


def unit_of(module: str) -> str:
    """The package holding `module` (the package itself for a package); top-level mrl modules stand alone."""
    if _is_package(module) or (module.count(".") == 1 and module.startswith("mrl.")):
        return module
    return module.rsplit(".", 1)[0]


def layer_of(unit: str) -> int:
    best, layer = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (unit == p or unit.startswith(p + ".")) and len(p) > best:
                best, layer = len(p), i
    if layer < 0:
        raise KeyError(f"{unit} has no layer in tools/import_graph.py LAYERS")
    return layer


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_pkg: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_pkg else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    # `from pkg import mod` imports pkg.mod when it is a module, else a name of pkg
    out = []
    for a in node.names:
        sub = f"{base}.{a.name}"
        out.append(sub if _is_module(sub) else base)
    return out


def edges() -> list[Edge]:
    out = []
    for top in TOP:
        for path in sorted((ROOT / top).rglob("*.py")):
            module = _module_name(path)
            tree = ast.parse(path.read_text(), str(path))
            skip = _type_checking_lines(tree)
            src = unit_of(module)
            for node in ast.walk(tree):
                if not isinstance(node, (ast.Import, ast.ImportFrom)) or node.lineno in skip:
                    continue
                for target in _targets(node, module, path.name == "__init__.py"):
                    if target.split(".")[0] not in TOP:
                        continue
                    while target and not _is_module(target):
                        target = target.rpartition(".")[0]
                    edge = Edge(src, unit_of(target), f"{path.relative_to(ROOT)}:{node.lineno}")
                    if edge.dst != src and edge not in out:  # `from a import b, c`: one import
                        out.append(edge)
    return out


def circles(all_edges: list[Edge]) -> list[list[str]]:
    """Strongly connected sets of more than one unit (Tarjan)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for e in all_edges:
        graph[e.src].add(e.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    for v in sorted(set(graph) | {e.dst for e in all_edges}):
        if v not in index:
            visit(v)
    return found


def upward(all_edges: list[Edge]) -> list[Edge]:
    return [e for e in all_edges if layer_of(e.src) < layer_of(e.dst)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--edges", action="store_true", help="print every package edge")
    args = ap.parse_args()
    all_edges = edges()
    found, up = circles(all_edges), upward(all_edges)
    units = {e.src for e in all_edges} | {e.dst for e in all_edges}
    print(
        f"{len(units)} units, {len({(e.src, e.dst) for e in all_edges})} package edges, "
        f"{len(found)} circles ({', '.join(str(len(c)) for c in found) or 'none'} units), "
        f"{len(up)} upward imports"
    )
    for c in found:
        print("circle:", " ".join(c))
    for e in up:
        print(f"upward: {e.src} -> {e.dst}  ({e.where})")
    if args.edges:
        for e in sorted(all_edges, key=lambda e: (e.src, e.dst, e.where)):
            print(f"edge: {e.src} -> {e.dst}  ({e.where})")


if __name__ == "__main__":
    main()
