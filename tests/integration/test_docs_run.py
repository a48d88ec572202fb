"""Every Python example in README.md, docs/*.md and the packages' docstrings runs (issue 55).

What is run:

* every fenced ```` ```python ```` block of ``README.md`` and ``docs/*.md``, in the order of its
  file, the blocks of one file sharing one namespace (a page reads top to bottom); top-level
  ``await`` is allowed;
* every ``>>>`` example in a docstring of ``src/tokrag_integrations`` and ``src/tokrag_eval``
  (with :mod:`doctest`: a shown output is compared, ``...`` matching anything);
* every ``::`` literal block of such a docstring that is Python (it parses), run as a
  script.

A markdown block may be skipped only by an HTML comment on the line before its fence,
``<!-- docs-run: skip: <reason> -->``, for an example that needs a server this test does not
start (the reason is the skip's message; it shows on the page's source). Everything runs on
the packaged model (shared with the other tests), offline, in a temporary folder holding
``my_docs/`` and ``handbook/`` (the packaged sample documents), with ``$TOKRAG_PG_DSN`` set to
the tests' embedded Postgres.
"""

from __future__ import annotations

import ast
import asyncio
import doctest
import importlib
import inspect
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [ROOT / "src" / "tokrag_integrations", ROOT / "src" / "tokrag_eval"]
SKIP = re.compile(r"<!--\s*docs-run:\s*skip:\s*(.+?)\s*-->")
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


@dataclass
class Example:
    """One runnable example: where it is, its code, and a skip reason if its page gives one."""

    where: str
    code: str
    kind: str  # "markdown" | "doctest" | "literal"
    page: str = ""
    skip: str = ""


def markdown_examples() -> list[Example]:
    out = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            skip = SKIP.search(before)
            rel = str(page.relative_to(ROOT))
            out.append(
                Example(f"{rel}:{line}", m.group(1), "markdown", rel, skip.group(1) if skip else "")
            )
    return out


def _docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, docstring) of the module and of every class and function in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                found.append((getattr(node, "lineno", 1), doc))
    return found


def _literal_blocks(doc: str) -> list[str]:
    """The ``::`` literal blocks of a docstring that are Python and hold no ``>>>`` (those
    are doctests)."""
    lines, out, i = doc.splitlines(), [], 0
    while i < len(lines):
        if lines[i].rstrip().endswith("::"):
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            block = []
            while j < len(lines) and (not lines[j].strip() or lines[j].startswith((" ", "\t"))):
                block.append(lines[j])
                j += 1
            code = inspect.cleandoc("\n".join(block))
            if code and ">>>" not in code:
                try:
                    ast.parse(code)
                except SyntaxError:
                    pass  # a shell command or a grammar: not Python
                else:
                    out.append(code)
            i = j
        else:
            i += 1
    return out


def docstring_examples() -> list[Example]:
    out = []
    parser = doctest.DocTestParser()
    for pkg in PACKAGES:
        for path in sorted(pkg.rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            for line, doc in _docstrings(path):
                if parser.get_examples(doc):
                    out.append(Example(f"{rel}:{line}", doc, "doctest", rel))
                for code in _literal_blocks(doc):
                    out.append(Example(f"{rel}:{line}", code, "literal", rel))
    return out


EXAMPLES = markdown_examples() + docstring_examples()


def test_the_docs_have_examples_to_run():
    """The collection itself works: the README's quickstart and a docstring example are found."""
    kinds = {e.kind for e in EXAMPLES}
    assert {"markdown", "doctest", "literal"} <= kinds, kinds
    assert any(e.page == "README.md" for e in EXAMPLES)


@pytest.fixture(scope="module")
def docs_folder(tmp_path_factory, lm, module_pg_dsn):
    """A working folder like a user's: sample documents as ``my_docs/`` and ``handbook/``,
    the tests' Postgres as ``$TOKRAG_PG_DSN``, the session's model for ``load_model()``."""
    from _helpers import sharing_model

    from tokrag_integrations.retrieval import get_sample_docs_path

    folder = tmp_path_factory.mktemp("docs-run")
    for name in ("my_docs", "handbook"):
        shutil.copytree(get_sample_docs_path(), folder / name)
    old = Path.cwd()
    with pytest.MonkeyPatch.context() as mp, sharing_model(lm):
        mp.setenv("TOKRAG_PG_DSN", module_pg_dsn)
        os.chdir(folder)
        try:
            yield folder
        finally:
            os.chdir(old)


_NAMESPACES: dict[str, dict] = {}


def _module_name(page: str) -> str:
    """``src/tokrag_integrations/engine/speed.py`` -> ``tokrag_integrations.engine.speed``."""
    parts = list(Path(page).with_suffix("").parts[1:])
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _run(code: str, ns: dict, where: str) -> None:
    compiled = compile(code, where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    if compiled.co_flags & inspect.CO_COROUTINE:
        asyncio.run(eval(compiled, ns))
    else:
        exec(compiled, ns)


@pytest.mark.parametrize("example", EXAMPLES, ids=[f"{e.kind}:{e.where}" for e in EXAMPLES])
def test_example_runs(example: Example, docs_folder):
    if example.skip:
        pytest.skip(example.skip)
    if example.kind == "doctest":
        # As doctest.testmod: the examples see their module's names.
        module = importlib.import_module(_module_name(example.page))
        test = doctest.DocTestParser().get_doctest(
            example.code, dict(vars(module)), example.where, example.page, 0
        )
        runner = doctest.DocTestRunner(
            optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
        )
        report: list[str] = []
        runner.run(test, out=report.append)
        assert runner.failures == 0, "".join(report)
        return
    ns = _NAMESPACES.setdefault(example.page, {"__name__": "__docs__"})
    if example.kind == "literal":
        ns = {"__name__": "__docs__"}
    _run(example.code, ns, example.where)
