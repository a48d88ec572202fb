"""TokRAGLLM's structured output (``structured_predict``, its async and streaming forms, and
so ``as_structured_llm``) by constrained decoding: the prompt template is formatted as for
any chat call (a retrieved ``context_str`` decodes under the LLM's policy) and every step is
masked to the tokens that keep the answer inside the JSON schema of the output class
(:func:`tokrag_integrations.structured.constraint_for`), so the answer parses whenever it
ends within ``max_new_tokens``.

``pydantic_program_mode`` other than ``DEFAULT`` keeps LlamaIndex's own programs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import llama_index.core.instrumentation as instrument
from llama_index.core.instrumentation.events.llm import (
    LLMStructuredPredictEndEvent,
    LLMStructuredPredictInProgressEvent,
    LLMStructuredPredictStartEvent,
)
from llama_index.core.llms.llm import LLM
from llama_index.core.llms.utils import parse_partial_json
from llama_index.core.program.utils import create_flexible_model
from llama_index.core.types import PydanticProgramMode

#: A TokRAGLLM (llm.py imports this module, not the other way).
TokRAGLLM = Any

dispatcher = instrument.get_dispatcher(__name__)


def _ours(llm: TokRAGLLM) -> bool:
    return llm.pydantic_program_mode == PydanticProgramMode.DEFAULT


def _request(
    llm: TokRAGLLM,
    output_cls: Any,
    prompt: Any,
    llm_kwargs: dict[str, Any] | None,
    args: dict[str, Any],
) -> tuple[list[Any], dict[str, Any]]:
    """(the formatted messages, the chat keywords with the schema's ``constraint``)."""
    from ..structured import json_schema_of

    schema, name = json_schema_of(output_cls)
    kwargs = dict(llm_kwargs or {})
    for key in ("tools", "tool_choice", "tool_required"):
        kwargs.pop(key, None)
    kwargs["constraint"] = {
        "type": "json_schema",
        "json_schema": {"name": name, "schema": schema, "strict": True},
    }
    dispatcher.event(
        LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt, template_args=args)
    )
    return llm._get_messages(prompt, **args), kwargs


def _parsed(output_cls: Any, text: str, raw: Any, budget: int) -> Any:
    """``text`` as an ``output_cls`` instance; an answer cut by ``max_new_tokens`` (the only
    way a constrained answer fails to parse) is a ValueError saying so."""
    from ..structured import parse_structured

    try:
        out = parse_structured(text, output_cls)
    except ValueError as e:
        stop = (raw or {}).get("stop_reason") if isinstance(raw, dict) else None
        if stop == "length":
            raise ValueError(
                f"the {getattr(output_cls, '__name__', 'structured')} answer was cut at "
                f"max_new_tokens={budget} before its JSON closed: pass a larger max_new_tokens "
                "(llm_kwargs={'max_new_tokens': ...})"
            ) from e
        raise
    dispatcher.event(LLMStructuredPredictEndEvent(output=out))
    return out


def _budget(llm: TokRAGLLM, kwargs: dict[str, Any]) -> int:
    return int(kwargs.get("max_new_tokens") or llm.max_new_tokens)


def predict(
    llm: TokRAGLLM, output_cls: Any, prompt: Any, llm_kwargs: Any, args: dict[str, Any]
) -> Any:
    """:meth:`TokRAGLLM.structured_predict`."""
    if not _ours(llm):
        return LLM.structured_predict(llm, output_cls, prompt, llm_kwargs, **args)
    messages, kwargs = _request(llm, output_cls, prompt, llm_kwargs, args)
    r = llm.chat(messages, **kwargs)
    return _parsed(output_cls, r.message.content or "", r.raw, _budget(llm, kwargs))


async def apredict(
    llm: TokRAGLLM, output_cls: Any, prompt: Any, llm_kwargs: Any, args: dict[str, Any]
) -> Any:
    """:meth:`TokRAGLLM.astructured_predict`."""
    if not _ours(llm):
        return await LLM.astructured_predict(llm, output_cls, prompt, llm_kwargs, **args)
    messages, kwargs = _request(llm, output_cls, prompt, llm_kwargs, args)
    r = await llm.achat(messages, **kwargs)
    return _parsed(output_cls, r.message.content or "", r.raw, _budget(llm, kwargs))


class _Partials:
    """The partial objects of a streamed answer: a ``FlexibleModel`` each time the JSON so
    far parses to something new, the ``output_cls`` instance at the end."""

    def __init__(self, output_cls: Any, budget: int) -> None:
        self.output_cls, self.budget = output_cls, budget
        self.flexible = create_flexible_model(output_cls)
        self.last: Any = None

    def __call__(self, r: Any) -> Any:
        text = r.message.content or ""
        if r.delta == "":  # the stream's last response: the whole answer
            return _parsed(self.output_cls, text, r.raw, self.budget)
        try:
            data = parse_partial_json(text)
        except (ValueError, TypeError):
            return None
        if not isinstance(data, dict) or data == self.last:
            return None
        self.last = data
        partial = self.flexible(**data)
        dispatcher.event(LLMStructuredPredictInProgressEvent(output=partial))
        return partial


def stream_predict(
    llm: TokRAGLLM, output_cls: Any, prompt: Any, llm_kwargs: Any, args: dict[str, Any]
) -> Iterator[Any]:
    """:meth:`TokRAGLLM.stream_structured_predict`."""
    if not _ours(llm):
        return LLM.stream_structured_predict(llm, output_cls, prompt, llm_kwargs, **args)
    messages, kwargs = _request(llm, output_cls, prompt, llm_kwargs, args)
    partials = _Partials(output_cls, _budget(llm, kwargs))
    stream = llm.stream_chat(messages, **kwargs)

    def gen() -> Iterator[Any]:
        for r in stream:
            out = partials(r)
            if out is not None:
                yield out

    return gen()


async def astream_predict(
    llm: TokRAGLLM, output_cls: Any, prompt: Any, llm_kwargs: Any, args: dict[str, Any]
) -> AsyncIterator[Any]:
    """:meth:`TokRAGLLM.astream_structured_predict`."""
    if not _ours(llm):
        return await LLM.astream_structured_predict(llm, output_cls, prompt, llm_kwargs, **args)
    messages, kwargs = _request(llm, output_cls, prompt, llm_kwargs, args)
    partials = _Partials(output_cls, _budget(llm, kwargs))
    stream = await llm.astream_chat(messages, **kwargs)

    async def gen() -> AsyncIterator[Any]:
        async for r in stream:
            out = partials(r)
            if out is not None:
                yield out

    return gen()


class StructuredOutput:
    """``structured_predict`` and its async and streaming forms by constrained decoding (a
    mixin of ``TokRAGLLM``; ``as_structured_llm`` calls them)."""

    def structured_predict(
        self, output_cls: Any, prompt: Any, llm_kwargs: dict[str, Any] | None = None, **args: Any
    ) -> Any:
        """An ``output_cls`` instance decoded under its JSON schema (a token mask at every
        step), so the answer parses; ``prompt`` formatted with ``args`` (a retrieved
        ``context_str`` decodes under the LLM's ``policy``)."""
        return predict(self, output_cls, prompt, llm_kwargs, args)

    async def astructured_predict(
        self, output_cls: Any, prompt: Any, llm_kwargs: dict[str, Any] | None = None, **args: Any
    ) -> Any:
        """Async :meth:`structured_predict`."""
        return await apredict(self, output_cls, prompt, llm_kwargs, args)

    def stream_structured_predict(
        self, output_cls: Any, prompt: Any, llm_kwargs: dict[str, Any] | None = None, **args: Any
    ) -> Any:
        """:meth:`structured_predict` as it is decoded: partial objects (LlamaIndex's
        ``FlexibleModel``), the last one the whole ``output_cls`` instance."""
        return stream_predict(self, output_cls, prompt, llm_kwargs, args)

    async def astream_structured_predict(
        self, output_cls: Any, prompt: Any, llm_kwargs: dict[str, Any] | None = None, **args: Any
    ) -> Any:
        """Async :meth:`stream_structured_predict`."""
        return await astream_predict(self, output_cls, prompt, llm_kwargs, args)
