"""Every Python name that docs/architecture.md and docs/algorithm.md cite exists (issue 44).

The names are resolved against the source of ``src/tokrag_integrations`` (and of the research
harness, ``src/tokrag_eval``, cited as ``tokrag_eval.<module>``) with :mod:`ast`; nothing is
imported.

Which inline code spans (single backticks; fenced code blocks are skipped) are checked:

* **A file path**: a span ending in ``.py`` or ``/`` made of identifiers and ``/``. It is
  relative to the repository when its first part is ``src``, ``tests``, ``benchmarks``,
  ``examples`` or ``docs``, else to ``src/tokrag_integrations`` (as algorithm.md states); the file or
  folder must exist.
* **A dotted name**: after dropping a ``:mod:`` / ``:func:`` / ``:class:`` / ``:meth:``
  role and a trailing call ``(...)``, the span is identifiers joined by dots, at least two,
  and its first part is ``tokrag_integrations``, the name of a module or package anywhere in
  the package (``signals``, ``engine``, ``tokrag_authors``), or the name of a class
  defined at the top level of some module (``TokRAG``, ``PromptBuilder``). Anything else
  (``lm.lock``, ``r.text``: a variable of an example) is not a name of the package.
* **A name qualified by a file**: on a line, the spans after ``` `path.py`: ``` up to the
  next ``;`` or ``|`` are names inside that module (``` `policies/vocab.py`: `verdict_mask` ```
  means ``policies.vocab.verdict_mask``).

How a dotted name resolves: the longest leading part that names a module (its dotted path
from the package root, or the tail of one: ``tokrag_authors`` matches
``policies.tokrag_authors``; several modules may match) is the module; the next part must
be bound at the module's top level, and any further part a member of that class. Bound
means defined: ``def``, ``class``, an assignment or annotation; an ``import`` binds a name
only in a package's ``__init__.py`` (its public surface), so a doc that cites a re-export
of another module is stale. A class's members are its methods, class-level assignments and
annotations (dataclass fields), ``self.x = ...`` in its methods, and the members of its
bases that are classes of the package. A name that is a module itself resolves too.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

PACKAGE = "tokrag_integrations"
REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / "src" / PACKAGE
DOCS = [REPO / "docs" / "architecture.md", REPO / "docs" / "algorithm.md"]
REPO_DIRS = ("src", "tests", "benchmarks", "examples", "docs")

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = re.compile(rf"{_IDENT}(?:\.{_IDENT})+")
_PATH = re.compile(rf"(?:{_IDENT}/)*(?:{_IDENT}\.py|{_IDENT}/)")
_SPAN = re.compile(r"(?::(?:mod|func|class|meth|attr|data):)?`([^`\n]+)`")
_ROLE = re.compile(r"^:(?:mod|func|class|meth|attr|data):")
_CALL = re.compile(r"\(.*\)$")


@dataclass
class _Class:
    members: set[str] = field(default_factory=set)
    bases: list[str] = field(default_factory=list)


@dataclass
class _Module:
    names: set[str] = field(default_factory=set)
    classes: dict[str, _Class] = field(default_factory=dict)


def _class_info(node: ast.ClassDef) -> _Class:
    info = _Class(
        bases=[b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
    )
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            info.members.add(item.name)
        elif isinstance(item, ast.Assign):
            info.members.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            info.members.add(item.target.id)
    for sub in ast.walk(node):
        targets = sub.targets if isinstance(sub, ast.Assign) else [getattr(sub, "target", None)]
        for t in targets:
            if (
                isinstance(t, ast.Attribute)
                and isinstance(t.value, ast.Name)
                and t.value.id == "self"
            ):
                info.members.add(t.attr)
    return info


@cache
def _package() -> dict[str, _Module]:
    """Dotted module path from the package root ("" for the root) -> its top-level names."""
    modules = {}
    # The research harness's modules are indexed too, as ``tokrag_eval.<module>``.
    harness = sorted((ROOT.parent / "tokrag_eval").rglob("*.py"))
    for path in [*sorted(ROOT.rglob("*.py")), *harness]:
        base = ROOT if path.is_relative_to(ROOT) else ROOT.parent
        parts = list(path.relative_to(base).with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        if is_init:
            parts = parts[:-1]
        mod = _Module()
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                mod.names.add(node.name)
            elif isinstance(node, ast.ClassDef):
                mod.names.add(node.name)
                mod.classes[node.name] = _class_info(node)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            mod.names.add(n.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                mod.names.add(node.target.id)
            elif is_init and isinstance(node, (ast.Import, ast.ImportFrom)):
                mod.names.update((a.asname or a.name).split(".")[0] for a in node.names)
        modules[".".join(parts)] = mod
    return modules


def _all_classes() -> dict[str, list[_Class]]:
    out: dict[str, list[_Class]] = {}
    for mod in _package().values():
        for name, cls in mod.classes.items():
            out.setdefault(name, []).append(cls)
    return out


def _has_member(cls: _Class, member: str, seen: frozenset[int] = frozenset()) -> bool:
    if member in cls.members:
        return True
    return any(
        _has_member(base, member, seen | {id(cls)})
        for name in cls.bases
        for base in _all_classes().get(name, [])
        if id(base) not in seen
    )


def _resolves_in(mod: _Module, rest: list[str]) -> bool:
    if not rest:
        return True
    if rest[0] not in mod.names:
        return False
    if len(rest) == 1:
        return True
    cls = mod.classes.get(rest[0])
    return cls is not None and len(rest) == 2 and _has_member(cls, rest[1])


def _matching_modules(prefix: str) -> list[_Module]:
    mods = _package()
    return [m for path, m in mods.items() if path == prefix or path.endswith("." + prefix)]


def _resolves(name: str) -> bool:
    parts = name.split(".")
    if parts[0] == PACKAGE:
        parts = parts[1:]
        if len(parts) == 1:
            return _resolves_in(_package()[""], parts)
    for i in range(len(parts), 0, -1):
        for mod in _matching_modules(".".join(parts[:i])):
            if _resolves_in(mod, parts[i:]):
                return True
    classes = _all_classes().get(parts[0], [])
    return len(parts) == 2 and any(_has_member(c, parts[1]) for c in classes)


def _is_package_name(name: str) -> bool:
    first = name.split(".")[0]
    stems = {p.rsplit(".", 1)[-1] for p in _package() if p}
    return first == PACKAGE or first in stems or first in _all_classes()


def _path_exists(span: str) -> bool:
    base = REPO if span.split("/")[0] in REPO_DIRS else ROOT
    return (base / span).exists()


def _spans(text: str):
    """(line, span) for every inline code span outside fenced blocks."""
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield line, [m.group(0) for m in _SPAN.finditer(line)]


def _qualified(line: str) -> list[str]:
    """``module.name`` for the spans that follow ```path.py`:`` on ``line``."""
    out = []
    for m in re.finditer(r"`((?:[A-Za-z_][A-Za-z0-9_]*/)*[A-Za-z_][A-Za-z0-9_]*)\.py`:", line):
        module = m.group(1).replace("/", ".")
        tail = re.split(r"[;|]", line[m.end() :], maxsplit=1)[0]
        for span in re.findall(r"`([^`]+)`", tail):
            span = _CALL.sub("", span)
            if re.fullmatch(rf"{_IDENT}(?:\.{_IDENT})*", span):
                out.append(f"{module}.{span}")
    return out


def cited_names(text: str) -> tuple[set[str], set[str]]:
    """The dotted names and the file paths that ``text`` cites, by the module's rule."""
    names, paths = set(), set()
    for line, spans in _spans(text):
        for raw in spans:
            span = _CALL.sub("", _ROLE.sub("", raw).strip("`").strip())
            if _PATH.fullmatch(span):
                paths.add(span)
            elif _DOTTED.fullmatch(span) and _is_package_name(span):
                names.add(span)
        names.update(_qualified(line))
    return names, paths


def missing(text: str) -> list[str]:
    names, paths = cited_names(text)
    gone = [n for n in sorted(names) if not _resolves(n)]
    gone += [f"{p} (no such file)" for p in sorted(paths) if not _path_exists(p)]
    return gone


def test_every_name_the_architecture_and_algorithm_docs_cite_exists():
    report = {}
    for doc in DOCS:
        gone = missing(doc.read_text(encoding="utf-8"))
        if gone:
            report[doc.name] = gone
    assert not report, "names cited in the docs that the package does not define:\n" + "\n".join(
        f"  {doc}: {name}" for doc, names in report.items() for name in names
    )


def test_the_rule_finds_stale_names_and_accepts_real_ones():
    text = (
        "`TokRAG._choice_without_signals` and `tokrag_authors.punctuation_mask`;\n"
        "| `policies/base.py`: `ContextView.rt_positions` |\n"
        "`signals.fusion_layer`, `TokRAG.choose`, `policies/vocab.py`: `punctuation_mask`\n"
        "`lm.lock`, `r.trace.to_dict()`, `no_such_dir/thing.py`\n"
        "```\n`signals.not_checked_in_a_fence`\n```\n"
    )
    assert missing(text) == [
        "TokRAG._choice_without_signals",
        "policies.base.ContextView.rt_positions",
        "tokrag_authors.punctuation_mask",
        "no_such_dir/thing.py (no such file)",
    ]
