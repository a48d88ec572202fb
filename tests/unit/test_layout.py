"""The house's counts (issue 44), read from the source without importing anything.

A newcomer should find the package's layers as folders, one name per module, one small
policy contract, and no compatibility leftovers from before the first release (house style,
point 11: moving a name means updating its callers).
"""

from __future__ import annotations

import ast
import collections
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "src" / "tokrag_integrations"
#: The research harness (issue 55): its own package, held to the same rules.
HARNESS = ROOT.parent / "tokrag_eval"
SOURCES = sorted(ROOT.rglob("*.py"))
ALL_SOURCES = sorted([*SOURCES, *HARNESS.rglob("*.py")])


def test_at_most_ten_modules_at_the_package_root():
    root = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(root) <= 10, f"{len(root)} modules at the package root: {root}"


def test_no_two_modules_share_a_file_name():
    names = collections.defaultdict(list)
    for p in ALL_SOURCES:
        if p.name not in ("__init__.py", "__main__.py"):
            names[p.stem].append(str(p.relative_to(ROOT.parent)))
    # A module may not share its name with a subpackage either (``gating/langchain.py`` beside
    # the ``langchain`` package reads as the same thing); the harness's modules count too
    # (``tokrag_eval/cli.py`` beside ``tokrag_integrations/cli/`` would).
    for d in [*ROOT.rglob("__init__.py"), *HARNESS.rglob("__init__.py")]:
        if d.parent not in (ROOT, HARNESS):
            names[d.parent.name].append(str(d.parent.relative_to(ROOT.parent)) + "/")
    same = {n: where for n, where in names.items() if len(where) > 1}
    assert not same, f"modules with the same name: {same}"


def test_no_compatibility_leftovers():
    """No deprecation paths and no re-export aliases (an import of the package's own names kept
    only to be imported from here, ``noqa: F401``) in an unreleased package. (An import of a
    third-party module for its side effect is not a re-export.)"""
    found = []
    for p in ALL_SOURCES:
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            own = line.lstrip().startswith("from .") or "tokrag_" in line
            if "DeprecationWarning" in line or ("noqa: F401" in line and own):
                found.append(f"{p.relative_to(ROOT.parent)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


def _policy_class() -> tuple[Path, ast.ClassDef]:
    for p in sorted((ROOT / "policies").glob("*.py")):
        for node in ast.parse(p.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and node.name == "Policy":
                return p, node
    raise AssertionError("no class Policy in policies/")


def test_the_policy_contract_has_at_most_six_members():
    path, cls = _policy_class()
    members = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            members.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members.add(node.target.id)
        elif isinstance(node, ast.Assign):
            members |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    public = sorted(m for m in members if not m.startswith("_"))
    assert len(public) <= 6, f"{path.name}: Policy has {len(public)} members: {public}"


def _defined_commands(root: Path) -> set[str]:
    """The ``tokrag`` subcommand names a package's modules add: the first argument of every
    ``<subparsers>.add_parser("name", ...)`` call."""
    found = set()
    for p in root.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_parser"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                found.add(node.args[0].value)
    return found


def test_the_runtime_package_defines_no_harness_command():
    """Issue 55: ``tokrag eval`` and ``tokrag bench`` are the research harness's, added from
    ``tokrag_eval`` (an entry point of the ``tokrag.commands`` group); the runtime package
    defines the commands an application needs."""
    runtime, harness = _defined_commands(ROOT), _defined_commands(HARNESS)
    assert {"ask", "ingest", "serve"} <= runtime
    assert not runtime & {"eval", "bench"}, sorted(runtime)
    assert harness == {"eval", "bench"}
    pyproject = (ROOT.parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    for name in sorted(harness):
        assert f'\n{name} = "tokrag_eval.commands:add_{name}_parser"' in pyproject


def test_no_module_over_600_lines():
    """Rooms of a readable size (issue 55, item 6): no module of the runtime package (the
    engine's scheduler split by what it does; ``models`` and ``prompts`` packages of three
    rooms each) or of the research harness over 600 lines."""
    harness = ROOT.parent / "tokrag_eval"
    big = {
        str(p.relative_to(ROOT.parent)): n
        for p in [*SOURCES, *sorted(harness.rglob("*.py"))]
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > 600
    }
    assert not big, f"modules over 600 lines: {big}"


def test_the_architecture_diagram_names_every_room():
    """docs/architecture.md's "Layers, as folders" is drawn from the code as it is (issue 55,
    item 4): every folder of the package holding Python and every module at its root is in
    the diagram, and every folder or root module the diagram names exists."""
    doc = (ROOT.parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = doc.split("## Layers, as folders", 1)[1]
    diagram = section.split("```", 2)[1]
    rooms = {p.name + "/" for p in ROOT.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    rooms |= {p.name for p in ROOT.glob("*.py") if p.name != "__init__.py"}
    named = set(re.findall(r"(?<![\w/.])([a-z_]+/|[a-z_]+\.py)", diagram))
    top = {n for n in named if n.endswith("/") or n in rooms}
    assert rooms <= named, f"rooms missing from the diagram: {sorted(rooms - named)}"
    folders = {p.name + "/" for p in ROOT.rglob("*") if p.is_dir() and any(p.glob("*.py"))}
    ghosts = {n for n in top if n.endswith("/") and n not in folders}
    assert not ghosts, f"the diagram names folders the package lacks: {sorted(ghosts)}"
