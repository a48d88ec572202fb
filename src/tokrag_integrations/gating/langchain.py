"""LangChain router driven by a gate (the framework is imported lazily).

:func:`gated_router` returns a Runnable that asks the gate about the question and invokes
the direct chain or the RAG chain; its output is
``{"answer": str, "route": "direct" | "rag", "gate": decision dict, "output": <chain output>}``.
"""

from __future__ import annotations

from typing import Any


def _question(inp: Any) -> str:
    if isinstance(inp, str):
        return inp
    if isinstance(inp, dict):
        for k in ("question", "query", "input"):
            if k in inp:
                return str(inp[k])
    raise TypeError("the gated router takes a question string or {'question': ...}")


def _answer(out: Any) -> str:
    if isinstance(out, str):
        return out
    if isinstance(out, dict) and "answer" in out:
        return str(out["answer"])
    content = getattr(out, "content", None)
    return str(content) if content is not None else str(out)


def gated_router(gate: Any, direct: Any, rag: Any) -> Any:
    """A Runnable routing each question to ``direct`` or ``rag`` by ``gate.decide``.

    Args:
        gate: a :class:`..base.Gate`.
        direct: a Runnable answering without retrieval (e.g. a ``ChatTokRAG`` with
            ``policy="llm"``); it receives the question string.
        rag: a Runnable answering with retrieval (e.g. ``create_tokrag_chain(...)``); it
            receives the original input.
    """
    try:
        from langchain_core.runnables import RunnableLambda
    except ImportError as e:  # pragma: no cover - optional extra
        raise ImportError(
            "the LangChain router needs langchain-core: pip install 'tokrag-integrations[langchain]'"
        ) from e

    def route(inp: Any, config: Any = None) -> dict[str, Any]:
        q = _question(inp)
        decision = gate.decide(q)
        out = rag.invoke(inp, config) if decision.retrieve else direct.invoke(q, config)
        d = decision.to_dict()
        details = {k: v for k, v in d.pop("details", {}).items() if k not in ("result", "tokens")}
        return {
            "answer": _answer(out),
            "route": "rag" if decision.retrieve else "direct",
            "gate": {**d, "details": details},
            "output": out,
        }

    return RunnableLambda(route, name="GatedRouter")
