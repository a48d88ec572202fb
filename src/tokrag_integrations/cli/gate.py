"""``tokrag ask --gate NAME``: answer with or without retrieval as a gate decides.

:func:`gated_ask` is the library form of that command::

    gated_ask(lm, question, gate="confidence", *, retriever=None, calibration=None,
              metric="self_certainty", top_k=3, policy="tokrag", max_new_tokens=64,
              percentile=None) -> dict

* ``gate``: ``confidence`` | ``gece`` | ``ctrla``.
* ``calibration``: a JSON file written by ``Gate.save``; if it does not exist yet, the gate
  is calibrated on the packaged sample questions and saved there (when given).
* ``retriever``: any object with ``retrieve(query, top_k)`` (e.g. ``build_retriever``).

Returns ``{"answer", "route": "rag" | "direct", "gate": decision dict, "result":
GenerationResult, "passages": [...]}``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..defaults import MAX_NEW_TOKENS
from ..gating import GATES
from ..gating.gate_base import Gate


def build_gate(
    lm: Any,
    name: str,
    *,
    calibration: str | Path | None = None,
    metric: str = "self_certainty",
    percentile: float | None = None,
) -> Gate:
    """Load a calibrated gate, or calibrate one on the sample questions (and save it)."""
    if name not in GATES:
        raise ValueError(f"unknown gate {name!r}; choose one of {', '.join(GATES)}")
    cls = GATES[name]
    if calibration is not None and Path(calibration).exists():
        return cls.load(calibration, lm)
    gate = cls(lm, metric=metric) if name == "confidence" else cls(lm)
    from ..retrieval import get_sample_questions

    qs = [q["question"] if isinstance(q, dict) else str(q) for q in get_sample_questions()]
    gate.calibrate(qs, percentile=percentile)
    if calibration is not None:
        gate.save(calibration)
    return gate


def gated_ask(
    lm: Any,
    question: str,
    gate: str | Gate = "confidence",
    *,
    retriever: Any = None,
    calibration: str | Path | None = None,
    metric: str = "self_certainty",
    top_k: int = 3,
    policy: str = "tokrag",
    max_new_tokens: int = MAX_NEW_TOKENS,
    percentile: float | None = None,
) -> dict[str, Any]:
    """Decide with the gate, retrieve only if it says so, answer."""
    from ..engine.scheduler import generate

    g = (
        gate
        if isinstance(gate, Gate)
        else build_gate(lm, gate, calibration=calibration, metric=metric, percentile=percentile)
    )
    decision = g.decide(question)
    passages: list[Any] = []
    if decision.retrieve and retriever is not None:
        passages = [h.text for h in retriever.retrieve(question, top_k=top_k)]
    result = generate(
        lm,
        question,
        passages or None,
        policy=policy if passages else "llm",
        max_new_tokens=max_new_tokens,
    )
    d = decision.to_dict()
    d["details"] = {k: v for k, v in d.get("details", {}).items() if k not in ("result", "tokens")}
    return {
        "answer": result.text,
        "route": "rag" if passages else "direct",
        "gate": d,
        "result": result,
        "passages": passages,
    }
