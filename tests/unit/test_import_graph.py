"""No import cycles inside the packages, between modules and between folders (issues 21, 34
and 55), the runtime library apart from the research harness (issue 55), and the speed paths
reached through one seam.

The graph is read from the source with :mod:`ast`, without importing anything. How it is
counted:

* every module and package (``__init__.py``) under ``src/tokrag_integrations`` (the runtime
  library) and ``src/tokrag_eval`` (the research harness) is a node: one graph, so a cycle
  inside either package or between them is found;
* every ``import`` / ``from ... import`` statement of a package module is an edge, wherever
  it stands: at module level, and also inside functions, methods and ``try`` blocks (a lazy
  import is still a dependency, and two modules that import each other lazily are one
  module split in two);
* statements under ``if TYPE_CHECKING:`` count too: they do not run, but a module that
  needs another's types to be read is tied to it as much as one that imports it (issue 34);
* ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``;
  ``import a.b.c`` is an edge to ``a.b.c`` only: the parent packages it initialises on the
  way are not counted (otherwise every package whose ``__init__`` re-exports a submodule
  would be a cycle with it);
* an import made at run time is an edge like a statement: ``importlib.import_module(name,
  package)`` and ``__import__(name)`` with a string constant (a relative name resolved against
  ``package``), and any string constant that spells a package module in full
  (``"tokrag_integrations.policies.tokrag"``, or ``"...tokrag:TokRAG"`` as a registry entry
  writes it) — a registry of dotted names is an import as much as a statement is;
* a call to ``importlib.import_module`` / ``__import__`` whose name is not a constant cannot be
  read statically, so it is allowed only where it loads a user's own plugin by name (the
  policy and gate registries); :func:`test_no_import_the_graph_cannot_read` lists the rest.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = "tokrag_integrations"
#: The research harness: it imports the runtime package, never the other way.
HARNESS = "tokrag_eval"
ROOT = Path(__file__).resolve().parents[2] / "src" / PACKAGE
ROOTS = (ROOT, ROOT.parent / HARNESS)


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is_package), both packages."""
    out = {}
    for path in sorted(p for root in ROOTS for p in root.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_package)
    return out


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of ``tree``, those under ``if TYPE_CHECKING:`` included."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def _targets(
    module: str, is_package: bool, node: ast.Import | ast.ImportFrom, modules: dict
) -> list[str]:
    """The package modules one import statement imports (see the module docstring)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source not in modules:
        return []
    out = []
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        out.append(sub if sub in modules else source)
    return out


_DOTTED = re.compile(rf"^(?:{PACKAGE}|{HARNESS})(?:\.\w+)+(?::[\w.]+)?$")


def _is_import_call(node: ast.AST) -> bool:
    """``importlib.import_module(...)``, ``import_module(...)`` or ``__import__(...)``."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    return name in ("import_module", "__import__")


def _runtime_targets(module: str, is_package: bool, tree: ast.AST, modules: dict) -> list[tuple[str, int]]:
    """Edges made at run time: import calls with a constant name, and full dotted names."""
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if _is_import_call(node) and node.args and isinstance(node.args[0], ast.Constant):
            name = str(node.args[0].value)
            if name.startswith("."):
                level = len(name) - len(name.lstrip("."))
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (level - 1)]
                name = ".".join(base + [name.lstrip(".")]).rstrip(".")
            names.append(name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _DOTTED.match(node.value):
            names.append(node.value.split(":")[0])
        for name in names:
            parts = name.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            if parts:
                out.append((".".join(parts), node.lineno))
    return out


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported package module: line of the first such import}."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {}
    for name, (path, is_package) in modules.items():
        edges: dict[str, int] = {}
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _import_nodes(tree):
            for target in _targets(name, is_package, node, modules):
                if target != name:
                    edges.setdefault(target, node.lineno)
        for target, line in _runtime_targets(name, is_package, tree, modules):
            if target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one
    module (Tarjan), each starting from its alphabetically first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)

    cycles = []
    for comp in components:
        start = min(comp)
        # Shortest path back to ``start`` inside the component (breadth first).
        prev: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in prev:
            nxt = []
            for v in frontier:
                for w in sorted(graph.get(v, {})):
                    if w in comp and w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [start]
        v = prev[start]
        while v != start:
            path.append(v)
            v = prev[v]
        cycles.append([start, *reversed(path[1:]), start])
    return sorted(cycles)


def _describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    steps = [
        f"{a} -> {b} (line {graph[a][b]} of {a})" for a, b in zip(cycle, cycle[1:], strict=False)
    ]
    return "import cycle: " + "; ".join(steps)


def test_find_cycles_names_a_cycle_and_accepts_a_tree():
    assert find_cycles({"a": {"b": 1}, "b": {"c": 2}, "c": {}}) == []
    cycles = find_cycles({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}})
    assert cycles == [["a", "b", "c", "a"]]
    assert _describe(cycles[0], {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}}).startswith(
        "import cycle: a -> b (line 1 of a); b -> c (line 2 of b); c -> a (line 3 of c)"
    )


def test_the_walker_sees_module_level_lazy_and_type_checking_imports():
    graph = import_graph()
    p = PACKAGE
    assert f"{p}.policies.base" in graph[f"{p}.engine.loop"]  # module level
    assert f"{p}.engine.scheduler" in graph[f"{p}.gating.gece"]  # inside GECEGate.samples
    assert f"{p}.policies.base" in graph[f"{p}.server.service"]  # under TYPE_CHECKING
    # ContextView is the engine's; the policies' base names it only at run time.
    assert f"{p}.engine.view" not in graph[f"{p}.policies.base"]
    assert f"{p}.policies.base" in graph[f"{p}.engine.view"]


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "\n".join(_describe(c, graph) for c in cycles)


def test_the_graph_holds_both_packages():
    graph = import_graph()
    assert f"{HARNESS}.harness" in graph and f"{PACKAGE}.engine.scheduler" in graph
    # The harness's edges into the runtime are counted (a cycle through them would be found).
    assert f"{PACKAGE}.config" in graph[f"{HARNESS}.cost"]


def test_the_runtime_package_never_imports_the_harness():
    """``tokrag_eval`` imports ``tokrag_integrations``; no runtime module imports
    ``tokrag_eval`` in any form the walker counts (a statement at module level, a lazy one in a
    function, under ``TYPE_CHECKING``, or a run-time import of a constant name). The
    ``tokrag eval`` / ``tokrag bench`` commands reach the CLI through entry points
    (pyproject.toml), not through an import. A bare ``import tokrag_eval`` is counted too."""
    graph = import_graph()
    bad = [
        f"{m} -> {t} (line {line})"
        for m, edges in graph.items()
        if m == PACKAGE or m.startswith(PACKAGE + ".")
        for t, line in edges.items()
        if t == HARNESS or t.startswith(HARNESS + ".")
    ]
    assert not bad, "the runtime package imports the research harness: " + "; ".join(bad)
    mentions = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value.split(":")[0]] if _DOTTED.match(node.value) else []
            bad = [n for n in names if n == HARNESS or n.startswith(HARNESS + ".")]
            mentions += [f"{path.relative_to(ROOT)} line {node.lineno}: {n}" for n in bad]
    assert not mentions, "; ".join(mentions)


def test_the_walker_counts_an_import_of_the_harness():
    modules = {f"{HARNESS}.cost": None, f"{HARNESS}": None}
    tree = ast.parse(f"from {HARNESS}.cost import run_bench\n")
    node = tree.body[0]
    assert _targets(f"{PACKAGE}.cli", True, node, modules) == [f"{HARNESS}.cost"]
    tree = ast.parse(f'X = "{HARNESS}.cost:run_bench"\n')
    assert _runtime_targets(f"{PACKAGE}.cli", True, tree, modules) == [(f"{HARNESS}.cost", 1)]


def _algorithm_modules(graph: dict[str, dict[str, int]]) -> list[str]:
    """The algorithm side: the signals, every policy, the engine's loops (step by step and
    sequence level, with their prefill, views and statistics), the trace."""
    p = PACKAGE
    fixed = {f"{p}.trace", f"{p}.speed", f"{p}.engine"}
    fixed |= {f"{p}.engine.{m}" for m in ("loop", "stats", "view")}
    fixed |= {m for m in graph if m == f"{p}.contexts" or m.startswith(f"{p}.contexts.")}
    policies = {m for m in graph if m == f"{p}.policies" or m.startswith(f"{p}.policies.")}
    return sorted(fixed | policies)


def test_no_algorithm_module_imports_accel():
    """The speed paths sit behind one seam (``accel``), chosen by the step loop's decoder
    from ``speed=``: no module of
    the algorithm side imports it, at module level or lazily inside a function. The role
    batches (``contexts``) sit below ``accel``: it builds on them."""
    graph = import_graph()
    modules = _algorithm_modules(graph)
    assert f"{PACKAGE}.engine.loop" in modules and f"{PACKAGE}.policies.tokrag" in modules
    accel = f"{PACKAGE}.accel"
    bad = [
        f"{m} -> {t} (line {line})"
        for m in modules
        for t, line in graph[m].items()
        if t == accel or t.startswith(accel + ".")
    ]
    assert not bad, "algorithm modules import accel: " + "; ".join(bad)


def test_accel_is_reached_through_one_seam():
    """Outside ``accel`` itself, one module imports it: the engine's seam (``engine.seam``),
    where every speed choice is read from the decode's ``Speed``; ``accel`` imports no module
    of the engine (it builds on ``contexts``, below both)."""
    graph = import_graph()
    accel, engine = f"{PACKAGE}.accel", f"{PACKAGE}.engine"

    def inside(m: str, pkg: str) -> bool:
        return m == pkg or m.startswith(pkg + ".")

    importers = sorted(
        m for m, edges in graph.items() if not inside(m, accel) and any(inside(t, accel) for t in edges)
    )
    assert importers == [f"{engine}.seam"], importers
    up = [
        f"{m} -> {t} (line {line})"
        for m, edges in graph.items()
        if inside(m, accel)
        for t, line in edges.items()
        if inside(t, engine)
    ]
    assert not up, "accel imports the engine: " + "; ".join(up)


def folder_graph(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, tuple[str, str, int]]]:
    """The import graph between the package's rooms: each sub-package (a folder, with all its
    modules and sub-folders) and each module at the package root is one node (the harness
    package, ``tokrag_eval``, one more); an edge is any
    module of one importing any module of another (every import form the module graph
    counts), kept with one example ``(module, imported module, line)``."""

    def room(m: str) -> str:
        parts = m.split(".")
        if parts[0] != PACKAGE:
            return parts[0]  # the harness package: one folder
        return parts[1] if len(parts) > 1 else "(package root)"

    rooms: dict[str, dict[str, tuple[str, str, int]]] = {}
    for m, edges in graph.items():
        out = rooms.setdefault(room(m), {})
        for t, line in edges.items():
            if room(t) != room(m):
                out.setdefault(room(t), (m, t, line))
    return rooms


def test_folder_graph_merges_a_folder_and_keeps_an_example():
    graph = {
        f"{PACKAGE}.a.x": {f"{PACKAGE}.b.y": 3, f"{PACKAGE}.a.z": 4},
        f"{PACKAGE}.a.z": {},
        f"{PACKAGE}.b.y": {f"{PACKAGE}.c": 7},
        f"{PACKAGE}.c": {f"{PACKAGE}.a.z": 9},
    }
    rooms = folder_graph(graph)
    assert rooms["a"] == {"b": (f"{PACKAGE}.a.x", f"{PACKAGE}.b.y", 3)}
    cycles = find_cycles({r: {t: 1 for t in e} for r, e in rooms.items()})
    assert cycles == [["a", "b", "c", "a"]]


def test_no_import_cycle_between_folders():
    """No cycle between the package's folders (and root modules), every import form counted
    (issue 55): e.g. accel -> engine -> models -> accel, or langchain -> server -> postgres ->
    langchain, would be one."""
    rooms = folder_graph(import_graph())
    cycles = find_cycles({r: {t: 1 for t in e} for r, e in rooms.items()})
    described = [
        "; ".join(
            f"{a} -> {b} ({rooms[a][b][0]} imports {rooms[a][b][1]}, line {rooms[a][b][2]})"
            for a, b in zip(c, c[1:], strict=False)
        )
        for c in cycles
    ]
    assert not cycles, "folder cycles:\n" + "\n".join(described)


#: Modules that load a user's own plugin by a name given at run time ("package.module:Class"
#: in a registry or an option): the only place a name-not-constant import is allowed.
PLUGIN_LOADERS = frozenset({f"{PACKAGE}.policies"})


def test_no_import_the_graph_cannot_read():
    """Every import a module makes is one the walker reads (a statement, or a run-time import
    of a constant name): a computed name hides an edge, and a hidden edge can hide a cycle."""
    hidden = []
    for name, (path, _) in _modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if _is_import_call(node) and not (node.args and isinstance(node.args[0], ast.Constant)):
                if name not in PLUGIN_LOADERS:
                    hidden.append(f"{name} line {node.lineno}")
    assert not hidden, "imports by computed name (not counted in the graph): " + "; ".join(hidden)


def test_the_walker_counts_run_time_imports():
    tree = ast.parse(
        'import importlib\n'
        'importlib.import_module(".engine.view", __package__)\n'
        f'REGISTRY = {{"tokrag": "{PACKAGE}.trace:Trace"}}\n'
    )
    modules = {f"{PACKAGE}.engine.view": None, f"{PACKAGE}.trace": None, f"{PACKAGE}.engine": None}
    got = _runtime_targets(f"{PACKAGE}.x", False, tree, modules)
    assert got == [(f"{PACKAGE}.engine.view", 2), (f"{PACKAGE}.trace", 3)]
