"""The layers of the code base, checked on the source: topology < neocomm < collectives < embedding.

A module imports only from its own layer or layers below, and no set of
modules imports itself round in a cycle. Nor does it reach a higher layer at
run time: it reads no entry-point group whose providers (``pyproject.toml``)
live in a higher layer, and names no higher layer's module in a string
(``import_module("embedding.x")``, ``"collectives.settings"``). Only the
``neocomm`` program's dispatcher loads other layers' code by name
(:data:`PLUGIN_LOADERS`). Every import counts: at module
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
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: lowest first; a layer imports only from itself and the layers before it
LAYERS = ("topology", "neocomm", "collectives", "embedding")
RANK = {name: i for i, name in enumerate(LAYERS)}
#: the modules that load other layers' code by name, on purpose: the ``neocomm`` program's
#: dispatcher, which finds every layer's commands, ``neocomm info`` lines and settings
#: modules through their entry points (it runs above every layer, as the program itself)
PLUGIN_LOADERS = {
    "neocomm.cli": "the dispatcher: commands (neocomm.commands), settings (neocomm.settings)",
    "neocomm.cli.info": "`neocomm info`: the lines of the layers above (neocomm.info)",
}


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


@dataclass(frozen=True)
class Reach:
    source: str  # the reaching module
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source} {self.what}"


def entry_point_groups() -> dict[str, set[str]]:
    """Entry-point group -> the layers of the modules registered in it (``pyproject.toml``)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f).get("project", {})
    return {group: {v.split(":")[0].strip().split(".")[0] for v in eps.values()} & set(RANK)
            for group, eps in project.get("entry-points", {}).items()}


#: a dotted module path of the project, optionally ``:attr`` (as entry points write them)
_MODULE_NAME = re.compile(r"(%s)(\.[A-Za-z_]\w*)+(:[A-Za-z_][\w.]*)?" % "|".join(LAYERS))
#: calls that import a module named by their first argument
_IMPORTERS = {"import_module", "__import__", "find_spec", "run_module"}


def _call_name(func) -> str:
    return func.id if isinstance(func, ast.Name) else (
        func.attr if isinstance(func, ast.Attribute) else "")


def reach_ups() -> list[Reach]:
    """Run-time reaches into a higher layer, outside :data:`PLUGIN_LOADERS`:
    ``entry_points(group=G)`` where a higher layer provides G (or G is not a string the
    check can read), an import by a string naming a higher layer, and any other string
    (docstrings aside) that is the dotted name of a higher layer's module."""
    modules = _modules()
    groups = entry_point_groups()
    found: list[Reach] = []
    for module, (path, _package) in modules.items():
        if module in PLUGIN_LOADERS:
            continue
        rank = RANK[_layer(module)]
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text(), filename=str(path))
        consts = {t.id: n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                  and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                  for t in n.targets if isinstance(t, ast.Name)}

        def text(node):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                return node.value
            return consts.get(node.id) if isinstance(node, ast.Name) else None

        def higher(name: str) -> bool:
            top = name.split(":")[0].split(".")[0]
            return top in RANK and RANK[top] > rank

        # docstrings, and the names already reported as imported by name
        skip = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)
                and isinstance(n.value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = _call_name(node.func)
                args = list(node.args)
                if name == "entry_points":
                    given = [k.value for k in node.keywords if k.arg == "group"] or args[:1]
                    if not given:
                        continue
                    group = text(given[0])
                    if group is None:
                        found.append(Reach(module, rel, node.lineno, "reads entry points of a "
                                           "group not written as a string"))
                        continue
                    up = sorted(g for g in groups.get(group, ()) if RANK[g] > rank)
                    if up:
                        found.append(Reach(module, rel, node.lineno, f"reads entry points of "
                                           f"{group!r}, provided by the higher layer(s) {up}"))
                elif name in _IMPORTERS and args:
                    target = text(args[0])
                    skip.add(id(args[0]))
                    if target is not None and higher(target):
                        found.append(Reach(module, rel, node.lineno,
                                           f"imports {target!r} by name ({name})"))
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and id(node) not in skip and _MODULE_NAME.fullmatch(node.value)
                  and higher(node.value)
                  and _resolve(node.value.split(":")[0], modules) == node.value.split(":")[0]):
                found.append(Reach(module, rel, node.lineno,
                                   f"names the higher layer's module {node.value!r}"))
    unique = {(r.path, r.line, r.what): r for r in found}
    return sorted(unique.values(), key=lambda r: (r.path, r.line, r.what))


def test_graph_sees_the_packages():
    edges = import_graph()
    sources = {_layer(e.source) for e in edges}
    assert sources == set(LAYERS), f"import graph covers {sorted(sources)}, expected {LAYERS}"


def _plant(tmp_path, monkeypatch, files: dict) -> None:
    """Write ``files`` (path -> text) under ``tmp_path`` and check that tree instead."""
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)


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
    _plant(tmp_path, monkeypatch, files)
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


def test_the_check_finds_planted_reaches_up_at_run_time(tmp_path, monkeypatch):
    """On a small tree: a lower layer reading an entry-point group that a higher layer
    provides (by a constant or a literal), importing a higher module by name, or naming
    one in a string is reported with its line; the dispatcher, docstrings, downward
    names and groups provided below are not."""
    files = {
        "pyproject.toml": (
            '[project.entry-points."neocomm.runtime"]\nworld = "neocomm.world:init"\n'
            '[project.entry-points."neocomm.settings"]\ntrain = "embedding.progress"\n'
            '[project.entry-points."neocomm.commands"]\nbench = "collectives.bench"\n'
            '[project.entry-points."topology.probes"]\nsmi = "topology.smi"\n'),
        "topology/__init__.py": "",
        "topology/smi.py": "",
        "topology/topo.py": (
            '"""Mentions neocomm.world in its docstring."""\n'
            'GROUP = "neocomm.runtime"\n'
            "def world():\n"
            "    from importlib.metadata import entry_points\n"
            "    return entry_points(group=GROUP, name='world')\n"
            "def probes():\n"
            "    from importlib.metadata import entry_points\n"
            "    return entry_points(group='topology.probes')\n"),
        "neocomm/__init__.py": "",
        "neocomm/world.py": "def init():\n    pass\n",
        "neocomm/config.py": (
            "import importlib\n"
            "from importlib import metadata\n"
            "def load():\n"
            "    metadata.entry_points(group='neocomm.settings')\n"
            "    importlib.import_module('embedding.progress')\n"
            "    return 'topology.smi'\n"
            "HOOK = 'collectives.bench:run'\n"),
        "neocomm/cli/__init__.py": (
            "from importlib.metadata import entry_points\n"
            "def commands():\n"
            "    return entry_points(group='neocomm.commands'), 'embedding.progress'\n"),
        "collectives/__init__.py": "",
        "collectives/bench.py": "",
        "embedding/__init__.py": "",
        "embedding/progress.py": "",
    }
    _plant(tmp_path, monkeypatch, files)
    assert [str(r) for r in reach_ups()] == [
        "neocomm/config.py:4: neocomm.config reads entry points of 'neocomm.settings', provided "
        "by the higher layer(s) ['embedding']",
        "neocomm/config.py:5: neocomm.config imports 'embedding.progress' by name "
        "(import_module)",
        "neocomm/config.py:7: neocomm.config names the higher layer's module "
        "'collectives.bench:run'",
        "topology/topo.py:5: topology.topo reads entry points of 'neocomm.runtime', provided "
        "by the higher layer(s) ['neocomm']",
    ]


def test_no_module_reaches_a_higher_layer_at_run_time():
    found = reach_ups()
    if found:
        pytest.fail(
            f"{len(found)} reach(es) into a higher layer at run time (layers, lowest first: "
            f"{' < '.join(LAYERS)}); let the higher layer hand the values down or register "
            "into the lower one:\n" + "\n".join(f"  {r}" for r in found), pytrace=False)


@pytest.mark.parametrize("module", LAYERS + ("neocomm.cli", "neocomm.cli.topo",
                                              "neocomm.cli.fabric", "topology.cli.sources",
                                              "collectives.cli.bench"))
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
