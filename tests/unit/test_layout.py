"""The house's counts (issue 44), read from the source without importing anything.

A newcomer should find the package's layers as folders, one name per module, one small
policy contract, and no compatibility leftovers from before the first release (house style,
point 11: moving a name means updating its callers).
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "src" / "tokrag_integrations"
SOURCES = sorted(ROOT.rglob("*.py"))


def test_at_most_ten_modules_at_the_package_root():
    root = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(root) <= 10, f"{len(root)} modules at the package root: {root}"


def test_no_two_modules_share_a_file_name():
    names = collections.defaultdict(list)
    for p in SOURCES:
        if p.name not in ("__init__.py", "__main__.py"):
            names[p.stem].append(str(p.relative_to(ROOT)))
    # A module may not share its name with a subpackage either (``gating/langchain.py`` beside
    # the ``langchain`` package reads as the same thing).
    for d in ROOT.rglob("__init__.py"):
        if d.parent != ROOT:
            names[d.parent.name].append(str(d.parent.relative_to(ROOT)) + "/")
    same = {n: where for n, where in names.items() if len(where) > 1}
    assert not same, f"modules with the same name: {same}"


def test_no_compatibility_leftovers():
    """No deprecation paths and no re-export aliases (an import of the package's own names kept
    only to be imported from here, ``noqa: F401``) in an unreleased package. (An import of a
    third-party module for its side effect is not a re-export.)"""
    found = []
    for p in SOURCES:
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            own = line.lstrip().startswith("from .") or "tokrag_integrations" in line
            if "DeprecationWarning" in line or ("noqa: F401" in line and own):
                found.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
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
