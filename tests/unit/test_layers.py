"""The layers of the code base, checked on the source: topology < neocomm < collectives < embedding.

A module imports only from its own layer or layers below, and no set of
modules imports itself round in a cycle. Every import counts: at module
level, inside functions, under ``if TYPE_CHECKING``. ``import a.b.c`` is an
edge to ``a.b.c``; ``from a.b import c`` is an edge to ``a.b.c`` when that is
a module, else to ``a.b``. Python runs the packages ``a`` and ``a.b`` before
``a.b.c``, so they are edges as well, except the importer's own enclosing
packages (loaded before it anyway). A package's ``__init__`` importing its
own submodules is an ordinary edge.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: lowest first; a layer imports only from itself and the layers before it
LAYERS = ("topology", "neocomm", "collectives", "embedding")
RANK = {name: i for i, name in enumerate(LAYERS)}


@dataclass(frozen=True)
class Edge:
    source: str  # importing module
    target: str  # imported module
    path: str  # file of the importing module, relative to the repository
    line: int
    implied: bool = False  # a package run on the way to the named module

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source} imports {self.target}"


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package) for every module of the four layers."""
    out: dict[str, tuple[Path, bool]] = {}
    for top in LAYERS:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            package = parts[-1] == "__init__"
            if package:
                parts.pop()
            out[".".join(parts)] = (path, package)
    return out


def _resolve(name: str, modules) -> str | None:
    """The project module ``name`` names, or its longest prefix that is one; None outside."""
    parts = name.split(".")
    if parts[0] not in RANK:
        return None
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _imports(module: str, path: Path, package: bool, modules) -> list[tuple[str, int]]:
    """(imported project module, line) for every import statement of one module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name, modules)
                if target:
                    found.append((target, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            for alias in node.names:
                target = _resolve(f"{name}.{alias.name}", modules) if alias.name != "*" else None
                if target != f"{name}.{alias.name}":  # a name defined in ``name``, not a module
                    target = _resolve(name, modules)
                if target:
                    found.append((target, node.lineno))
    return found


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph() -> list[Edge]:
    """Every import edge between the project's own modules.

    Importing ``a.b.c`` runs the packages ``a`` and ``a.b`` first, so they are
    edges too, except the importer's own enclosing packages (always loaded
    before it). Self-imports are left out; one edge per (module, target, line).
    """
    modules = _modules()
    edges: dict[tuple[str, str, int], Edge] = {}
    for module, (path, package) in modules.items():
        rel = str(path.relative_to(ROOT))
        own = set(_ancestors(module)) | {module}
        for target, line in _imports(module, path, package, modules):
            for t in [target] + [a for a in _ancestors(target) if a not in own]:
                if t != module:
                    edges.setdefault((module, t, line), Edge(module, t, rel, line, t != target))
    return list(edges.values())


def _layer(module: str) -> str:
    return module.split(".", 1)[0]


def upward_edges(edges: list[Edge]) -> list[Edge]:
    """Imports of a module of a higher layer (as written: not the packages run on the way)."""
    return [e for e in edges
            if not e.implied and RANK[_layer(e.target)] > RANK[_layer(e.source)]]


def cycles(edges: list[Edge]) -> list[tuple[list[str], list[Edge]]]:
    """For every strongly connected set of modules: its members and one cycle through them."""
    graph: dict[str, dict[str, Edge]] = {}
    for e in edges:
        graph.setdefault(e.source, {}).setdefault(e.target, e)
    # Tarjan's strongly connected components, iterative
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, {})))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    found = []
    for component in components:
        # shortest way back to the first module, by breadth-first search inside the component
        first = min(component)
        previous: dict[str, str] = {}
        frontier = [first]
        while frontier and first not in previous:
            following = []
            for node in frontier:
                for nxt in sorted(graph.get(node, {})):
                    if nxt in component and nxt not in previous:
                        previous[nxt] = node
                        following.append(nxt)
            frontier = following
        path = [first]
        while True:
            path.append(previous[path[-1]])
            if path[-1] == first:
                break
        path.reverse()
        found.append((sorted(component), [graph[a][b] for a, b in zip(path, path[1:])]))
    return found


def test_graph_sees_the_packages():
    edges = import_graph()
    sources = {_layer(e.source) for e in edges}
    assert sources == set(LAYERS), f"import graph covers {sorted(sources)}, expected {LAYERS}"


def test_the_checks_find_a_planted_upward_import_and_cycle(tmp_path, monkeypatch):
    """On a small tree of the four packages: an import of a higher layer hidden in a
    function, and two modules importing each other, are both reported with their lines;
    imports downwards and the packages run on the way are not."""
    files = {
        "topology/__init__.py": "",
        "topology/probe.py": "def late():\n    from embedding import model\n",
        "neocomm/__init__.py": "import topology.probe\n",
        "collectives/__init__.py": "from . import a\n",
        "collectives/a.py": "from collectives import b\n",
        "collectives/b.py": "import numpy\nfrom .a import thing\n",
        "embedding/__init__.py": "",
        "embedding/model.py": "from collectives.a import thing\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    edges = import_graph()
    assert [str(e) for e in upward_edges(edges)] == [
        "topology/probe.py:2: topology.probe imports embedding.model"]
    found = cycles(edges)
    assert [members for members, _ in found] == [["collectives.a", "collectives.b"]]
    assert sorted(str(e) for e in found[0][1]) == [
        "collectives/a.py:1: collectives.a imports collectives.b",
        "collectives/b.py:2: collectives.b imports collectives.a"]


def test_no_module_imports_a_higher_layer():
    bad = upward_edges(import_graph())
    if bad:
        pytest.fail(
            f"{len(bad)} import(s) into a higher layer (layers, lowest first: "
            f"{' < '.join(LAYERS)}); move the piece down or register it through an entry "
            "point:\n" + "\n".join(f"  {e}" for e in sorted(bad, key=lambda e: (e.path, e.line))),
            pytrace=False)


def test_no_import_cycles():
    found = cycles(import_graph())
    lines = []
    for members, cycle in found:
        lines.append("  " + " -> ".join([cycle[0].source] + [e.target for e in cycle]))
        lines.extend(f"      {e}" for e in cycle)
        if len(members) > len(cycle):
            lines.append(f"      (one of the cycles among {', '.join(members)})")
    if found:
        pytest.fail(f"{len(found)} set(s) of modules importing each other in a cycle, one path "
                    "each:\n" + "\n".join(lines), pytrace=False)


@pytest.mark.parametrize("module", LAYERS + ("neocomm.cli", "topology.cli.topo",
                                              "topology.cli.fabric", "collectives.cli.bench"))
def test_import_alone_loads_no_higher_layer(module):
    code = (f"import json, sys; import {module}; "
            f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    if done.returncode != 0:
        pytest.fail(f"`import {module}` alone failed:\n{done.stderr}", pytrace=False)
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    higher = [p for p in LAYERS[RANK[_layer(module)] + 1:] if p in loaded]
    if higher:
        pytest.fail(f"`import {module}` in a fresh interpreter also loaded the higher "
                    f"layer(s) {higher}", pytrace=False)
