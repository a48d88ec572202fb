"""``gated_router``: a LangChain Runnable that asks a retrieval gate about the question and
runs the direct chain or the RAG chain (invoked, streamed or awaited with its own methods)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.runnables import Runnable
from langchain_core.runnables.config import patch_config
from langchain_core.runnables.utils import AddableDict

from ..adapters.translate import gate_summary


def _question(inp: Any) -> str:
    if isinstance(inp, str):
        return inp
    if isinstance(inp, dict):
        for k in ("question", "query", "input"):
            if k in inp:
                return str(inp[k])
    raise TypeError(
        "the gated router takes a question string or {'question': ...} / {'input': ...}"
    )


def _answer(out: Any) -> str:
    if isinstance(out, str):
        return out
    if isinstance(out, dict):
        return str(out.get("answer", ""))
    content = getattr(out, "content", None)
    return str(content) if content is not None else str(out)


def _citations(out: Any) -> list[Any]:
    """A branch output's citations: a chain's ``"citations"``, a chat message's
    ``response_metadata["citations"]``; none for anything else."""
    if isinstance(out, dict):
        return list(out.get("citations") or [])
    return list((getattr(out, "response_metadata", None) or {}).get("citations") or [])


def _chunk(c: Any) -> dict[str, Any]:
    return AddableDict(answer=_answer(c), output=AddableDict(c) if isinstance(c, dict) else c)


class GatedRouter(Runnable[Any, dict[str, Any]]):
    """Gate, then the chosen branch (see :func:`gated_router`)."""

    name = "GatedRouter"

    def __init__(self, gate: Any, direct: Any, rag: Any) -> None:
        self.gate, self.direct, self.rag = gate, direct, rag

    def _decision(self, inp: Any) -> tuple[Any, Any, dict[str, Any]]:
        q = _question(inp)
        decision = self.gate.decide(q)
        d, details = gate_summary(decision)
        branch, branch_input = (self.rag, inp) if decision.retrieve else (self.direct, q)
        route = {
            "route": "rag" if decision.retrieve else "direct",
            "gate": {**d, "details": details},
        }
        return branch, branch_input, route

    def _invoke(self, inp: Any, run_manager: Any, config: Any) -> dict[str, Any]:
        branch, x, route = self._decision(inp)
        out = branch.invoke(x, patch_config(config, callbacks=run_manager.get_child()))
        return {"answer": _answer(out), **route, "citations": _citations(out), "output": out}

    async def _ainvoke(self, inp: Any, run_manager: Any, config: Any) -> dict[str, Any]:
        branch, x, route = await asyncio.to_thread(self._decision, inp)
        out = await branch.ainvoke(x, patch_config(config, callbacks=run_manager.get_child()))
        return {"answer": _answer(out), **route, "citations": _citations(out), "output": out}

    def invoke(self, input: Any, config: Any = None, **kwargs: Any) -> dict[str, Any]:  # noqa: A002
        return self._call_with_config(self._invoke, input, config)

    async def ainvoke(self, input: Any, config: Any = None, **kwargs: Any) -> dict[str, Any]:  # noqa: A002
        return await self._acall_with_config(self._ainvoke, input, config)

    def _transform(self, inputs: Iterator[Any], run_manager: Any, config: Any) -> Iterator[Any]:
        *_, inp = inputs  # a router input is one value, not a stream of parts
        branch, x, route = self._decision(inp)
        yield AddableDict(route)
        for c in branch.stream(x, patch_config(config, callbacks=run_manager.get_child())):
            yield _chunk(c)

    async def _atransform(
        self, inputs: AsyncIterator[Any], run_manager: Any, config: Any
    ) -> AsyncIterator[Any]:
        inp = [x async for x in inputs][-1]
        branch, x, route = await asyncio.to_thread(self._decision, inp)
        yield AddableDict(route)
        async for c in branch.astream(x, patch_config(config, callbacks=run_manager.get_child())):
            yield _chunk(c)

    def stream(self, input: Any, config: Any = None, **kwargs: Any) -> Iterator[Any]:  # noqa: A002
        yield from self._transform_stream_with_config(iter([input]), self._transform, config)

    async def astream(self, input: Any, config: Any = None, **kwargs: Any) -> AsyncIterator[Any]:  # noqa: A002
        async def one() -> AsyncIterator[Any]:
            yield input

        async for c in self._atransform_stream_with_config(one(), self._atransform, config):
            yield c


def gated_router(gate: Any, direct: Any, rag: Any) -> GatedRouter:
    """A Runnable routing each question to ``direct`` or ``rag`` by ``gate.decide``.

    ``invoke`` returns ``{"answer", "route": "direct" | "rag", "gate", "citations", "output"}``
    (``citations``: the branch's, ``[]`` without); ``stream`` yields the route and gate, then
    ``{"answer": piece, "output": chunk}`` per branch chunk (the citations in the last).

    Args:
        gate: a :class:`~tokrag_integrations.gating.Gate`.
        direct: a Runnable answering without retrieval (e.g. a ``ChatTokRAG`` with
            ``policy="no_rag"``); it receives the question string.
        rag: a Runnable answering with retrieval (e.g. ``create_tokrag_chain(...)``); it
            receives the original input.
    """
    return GatedRouter(gate, direct, rag)
