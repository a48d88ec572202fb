"""The model is run only inside the engine (issue 55): every forward pass of the language
model happens in ``engine/``, in the speed paths it drives (``accel/``) or in the role batches
it decodes (``contexts/``); every other room asks the engine (a decode on the scheduler's step
loop, GECE's sampled drafts included, or a function of ``engine/passes.py``).

Read from the source with :mod:`ast`, nothing imported. What counts as running the model:

* a call of ``.generate(...)`` on an object reached through a name or attribute spelled
  ``model`` (``lm.model.generate(...)``, ``model.generate(...)``): transformers' own loop;
* a call whose callee is a name or attribute spelled ``model`` (``lm.model(...)``,
  ``self.model(...)``, ``model(...)``): a forward pass;
* a call of a role batch's model-running methods (``.forward(...)``, ``.prefill_from(...)``,
  ``._model_pass(...)``) on any object: they run the model (the batch's private ``_call`` /
  ``_run`` are called by these only; other classes' methods of those names are not counted).

Not counted: applying one module of the model to states the engine recorded (the logit lens's
LM head, a layer's query projection in ``attention/``), and embedders and rerankers (other
models, called through their own methods, e.g. ``encode``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "src" / "tokrag_integrations"
#: Where the model may run.
ENGINE = ("engine", "accel", "contexts")
RUNNING_METHODS = {"forward", "prefill_from", "_model_pass"}


def _spelled_model(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "model") or (
        isinstance(node, ast.Attribute) and node.attr == "model"
    )


def model_runs(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for every call of ``tree`` that runs the model (the module docstring)."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "generate" and _spelled_model(f.value):
            out.append((node.lineno, "model.generate(...)"))
        elif _spelled_model(f):
            out.append((node.lineno, "model(...)"))
        elif isinstance(f, ast.Attribute) and f.attr in RUNNING_METHODS:
            out.append((node.lineno, f".{f.attr}(...)"))
    return out


def test_the_scan_counts_each_form():
    src = (
        "lm.model.generate(x)\n"
        "out = lm.model(input_ids=x)\n"
        "model(x)\n"
        "batch.forward(None)\n"
        "b.prefill_from(src, 3)\n"
        "self.embedder.model.encode(texts)\n"
        "parts.lm_head(h)\n"
        "generate(lm, q)\n"
    )
    got = [what for _, what in model_runs(ast.parse(src))]
    assert got == [
        "model.generate(...)", "model(...)", "model(...)", ".forward(...)", ".prefill_from(...)",
    ]


def test_the_model_runs_only_inside_the_engine():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ENGINE:
            continue
        for line, what in model_runs(ast.parse(path.read_text(encoding="utf-8"))):
            bad.append(f"{rel}:{line} {what}")
    assert not bad, "the model runs outside the engine: " + "; ".join(bad)


def test_the_engine_does_run_the_model():
    """The scan finds the engine's own passes (it would find them elsewhere)."""
    found = {
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("*.py")
        if p.relative_to(ROOT).parts[0] in ENGINE and model_runs(ast.parse(p.read_text("utf-8")))
    }
    assert {"engine/passes.py", "contexts/batch.py", "engine/decoder.py"} <= found
