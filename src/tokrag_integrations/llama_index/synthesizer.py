"""TokRAGSynthesizer: a LlamaIndex response synthesizer that decodes with a Tok-RAG policy."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Generator, Sequence
from typing import Any

import llama_index.core.instrumentation as instrument
from llama_index.core.base.response.schema import (
    RESPONSE_TYPE,
    AsyncStreamingResponse,
    Response,
    StreamingResponse,
)
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.instrumentation.events.synthesis import (
    SynthesizeEndEvent,
    SynthesizeStartEvent,
)
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.response_synthesizers.base import BaseSynthesizer, QueryTextType
from llama_index.core.schema import NodeWithScore, QueryBundle
from llama_index.core.types import RESPONSE_TEXT_TYPE

from ..api import GenerationResult, agenerate, astream_with_result, generate, stream
from ..decoding import Policy
from ..models import LOAD_OPTIONS, LoadedModel, check_greedy
from ..policies import get_policy
from ._convert import jsonable, nodes_to_passages, response_metadata
from .llm import TokRAGLLM

dispatcher = instrument.get_dispatcher(__name__)

_GATE_SKIP = "the gate decided not to use retrieval"
#: Constructor arguments of TokRAGSynthesizer other than the policy's options.
_OWN_ARGUMENTS = (
    "lm", "model", "temperature", "policy", "max_new_tokens", "stop", "max_context_tokens",
    "system_prompt", "gate", "streaming", "callback_manager",
)


class TokRAGSynthesizer(BaseSynthesizer):
    """Answers from the retrieved nodes with a decoding policy (default ``tokrag``).

    The query and the node texts go to the core separately (no prompt template is
    formatted here): nodes become :class:`~tokrag_integrations.Passage` objects, best score
    first, so when they do not fit the window the lowest-scored are dropped first.

    ``response.metadata`` holds ``policy``, ``policy_used`` (``"llm"`` when answered from the
    pure context), ``answered_from`` (``"retrieval"`` or ``"pure_context"``) and
    ``pure_context_reason``, ``counts`` (generated tokens per source: ``agree``/``rag``/
    ``llm``), ``passages`` (node id, rank, score, kept/cut/empty, tokens), ``nodes_used``,
    ``nodes_cut``, ``nodes_dropped``, ``nodes_skipped_empty``, ``warnings``, ``gate`` (the
    gate's decision or None), ``model``, ``stop_reason`` and ``trace`` (``Trace.to_dict()``,
    JSON-safe). With ``streaming=True`` the metadata dict is filled in place once the token
    generator is exhausted (``policy`` and ``gate`` are there from the start).

    Args:
        lm: a LoadedModel, a :class:`TokRAGLLM` to share, or None to load ``model``.
        model: what :func:`~tokrag_integrations.load_model` takes (``"default"``, a hub id
            in the local cache, a folder, a ``.gguf`` path, a loaded ``PreTrainedModel``),
            with its keyword options (``tokenizer``, ``device``, ``device_map``, ``dtype``,
            ``model_kwargs``, ``tokenizer_kwargs``, ``trust_remote_code``, ``revision``...).
        temperature: only None or 0 (greedy decoding).
        policy: decoding policy name or instance (``"tokrag"``, ``"rag"``, ``"llm"``...).
        max_new_tokens: answer budget in tokens.
        stop: stop strings (EOS always stops).
        max_context_tokens: a tighter context budget than the model's window.
        system_prompt: override the core's default system prompt (None = no system turn).
        gate: optional object with ``decide(query)`` returning a decision with ``.retrieve``
            (bool), ``.score`` (float) and ``.to_dict()``; when it says no, the answer comes
            from the pure context and the decision is in the metadata.
        streaming: return ``StreamingResponse`` / ``AsyncStreamingResponse``.
        callback_manager: LlamaIndex callback manager.
        **policy_options: the policy's options (e.g. ``pr_norm="softmax"``).
    """

    def __init__(
        self,
        lm: LoadedModel | TokRAGLLM | None = None,
        *,
        model: Any = None,
        temperature: float | None = None,
        policy: str | Policy = "tokrag",
        max_new_tokens: int = 64,
        stop: str | Sequence[str] | None = None,
        max_context_tokens: int | None = None,
        system_prompt: Any = ...,
        gate: Any = None,
        streaming: bool = False,
        callback_manager: CallbackManager | None = None,
        **policy_options: Any,
    ) -> None:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if gate is not None and not callable(getattr(gate, "decide", None)):
            raise TypeError(f"gate must have a decide(query) method, got {type(gate).__name__}")
        check_greedy(temperature, "TokRAGSynthesizer")
        load_options = {k: policy_options.pop(k) for k in LOAD_OPTIONS if k in policy_options}
        # Unknown policies or options fail here, not at the first query.
        try:
            self._policy_name = get_policy(policy, **policy_options).name
        except ValueError as e:
            if "unknown option" not in str(e):
                raise
            raise TypeError(
                f"TokRAGSynthesizer got an unknown keyword argument ({e}); besides the policy's "
                f"options it accepts: {', '.join(_OWN_ARGUMENTS + LOAD_OPTIONS)}"
            ) from e
        if (model is not None or load_options) and lm is not None:
            raise ValueError("pass lm, or model with its load options, not both")
        if isinstance(lm, TokRAGLLM):
            llm = lm
        elif model is not None or load_options:
            llm = TokRAGLLM(model=model or "default", max_new_tokens=max_new_tokens, **load_options)
        elif lm is None or isinstance(lm, LoadedModel):
            llm = TokRAGLLM(lm, max_new_tokens=max_new_tokens)
        else:
            raise TypeError(
                f"lm must be a LoadedModel, a TokRAGLLM or None, got {type(lm).__name__}"
            )
        super().__init__(llm=llm, callback_manager=callback_manager, streaming=streaming)
        self._lm: LoadedModel = llm.loaded_model
        self._gate = gate
        self._gen_kwargs: dict[str, Any] = {
            "policy": policy,
            "max_new_tokens": max_new_tokens,
            "stop": stop,
            "max_context_tokens": max_context_tokens,
            **policy_options,
        }
        if system_prompt is not ...:
            self._gen_kwargs["system_prompt"] = system_prompt

    @property
    def llm(self) -> TokRAGLLM:
        """The :class:`TokRAGLLM` over the same model (e.g. for ``as_query_engine(llm=...)``)."""
        return self._llm  # type: ignore[return-value]

    @property
    def loaded_model(self) -> LoadedModel:
        return self._lm

    @property
    def policy(self) -> str:
        return self._policy_name

    def _get_prompts(self) -> PromptDictType:
        return {}

    def _update_prompts(self, prompts: PromptDictType) -> None:
        """No prompt templates: the core builds both contexts itself."""

    # ------------------------------------------------------------------ translation
    def _gate_dict(self, decision: Any) -> dict[str, Any] | None:
        if decision is None:
            return None
        return jsonable(
            {
                **dict(decision.to_dict()),
                "retrieve": bool(decision.retrieve),
                "score": float(decision.score),
            }
        )

    def _inputs(
        self, nodes: Sequence[NodeWithScore], decision: Any
    ) -> tuple[list[NodeWithScore], list[Any] | None, str | None]:
        """(nodes in rank order, passages or None, why no passages are given)."""
        if decision is not None and not decision.retrieve:
            return [], None, _GATE_SKIP
        if not nodes:
            return [], None, "no nodes were retrieved"
        ordered, passages = nodes_to_passages(nodes)
        return ordered, passages, None

    def _metadata(
        self, result: GenerationResult, ordered: list[NodeWithScore], gate: Any, reason: str | None
    ) -> dict[str, Any]:
        return response_metadata(
            result, ordered, policy=self._policy_name, gate=gate, pure_reason=reason
        )

    # ------------------------------------------------------------------ BaseSynthesizer API
    def get_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        """Answer from plain text chunks (ranked best first); a generator when streaming."""
        passages = [c for c in text_chunks] or None
        if self._streaming:
            s = stream(self._lm, query_str, passages, **self._gen_kwargs)
            return (ev.text for ev in s if ev.text)
        return generate(self._lm, query_str, passages, **self._gen_kwargs).text

    async def aget_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        """Async :meth:`get_response`; the model runs in a worker thread."""
        passages = [c for c in text_chunks] or None
        if self._streaming:

            async def gen() -> AsyncGenerator[str, None]:
                async for item in astream_with_result(
                    self._lm, query_str, passages, **self._gen_kwargs
                ):
                    if not isinstance(item, GenerationResult) and item.text:
                        yield item.text

            return gen()
        return (await agenerate(self._lm, query_str, passages, **self._gen_kwargs)).text

    @dispatcher.span
    def synthesize(
        self,
        query: QueryTextType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        """Answer ``query`` from ``nodes``; with no nodes, from the pure context (said in metadata)."""
        dispatcher.event(SynthesizeStartEvent(query=query))
        qb = QueryBundle(query_str=query) if isinstance(query, str) else query
        source_nodes = list(nodes) + list(additional_source_nodes or [])
        with self._callback_manager.event(
            CBEventType.SYNTHESIZE, payload={EventPayload.QUERY_STR: qb.query_str}
        ) as event:
            decision = self._gate.decide(qb.query_str) if self._gate is not None else None
            gate = self._gate_dict(decision)
            ordered, passages, reason = self._inputs(nodes, decision)
            response: RESPONSE_TYPE
            if self._streaming:
                s = stream(self._lm, qb.query_str, passages, **self._gen_kwargs)
                metadata: dict[str, Any] = {"policy": self._policy_name, "gate": gate}

                def gen() -> Generator[str, None, None]:
                    for ev in s:
                        if ev.text:
                            yield ev.text
                    metadata.update(self._metadata(s.result, ordered, gate, reason))

                response = StreamingResponse(gen(), source_nodes=source_nodes, metadata=metadata)
            else:
                result = generate(self._lm, qb.query_str, passages, **self._gen_kwargs)
                response = Response(
                    result.text,
                    source_nodes=source_nodes,
                    metadata=self._metadata(result, ordered, gate, reason),
                )
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=qb, response=response))
        return response

    @dispatcher.span
    async def asynthesize(
        self,
        query: QueryTextType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        """Async :meth:`synthesize`: the gate and the model run in worker threads."""
        dispatcher.event(SynthesizeStartEvent(query=query))
        qb = QueryBundle(query_str=query) if isinstance(query, str) else query
        source_nodes = list(nodes) + list(additional_source_nodes or [])
        with self._callback_manager.event(
            CBEventType.SYNTHESIZE, payload={EventPayload.QUERY_STR: qb.query_str}
        ) as event:
            decision = (
                await asyncio.to_thread(self._gate.decide, qb.query_str)
                if self._gate is not None
                else None
            )
            gate = self._gate_dict(decision)
            ordered, passages, reason = self._inputs(nodes, decision)
            response: RESPONSE_TYPE
            if self._streaming:
                metadata: dict[str, Any] = {"policy": self._policy_name, "gate": gate}
                lm, kw = self._lm, self._gen_kwargs

                async def agen() -> AsyncGenerator[str, None]:
                    async for item in astream_with_result(lm, qb.query_str, passages, **kw):
                        if isinstance(item, GenerationResult):
                            metadata.update(self._metadata(item, ordered, gate, reason))
                        elif item.text:
                            yield item.text

                response = AsyncStreamingResponse(
                    agen(), source_nodes=source_nodes, metadata=metadata
                )
            else:
                result = await agenerate(self._lm, qb.query_str, passages, **self._gen_kwargs)
                response = Response(
                    result.text,
                    source_nodes=source_nodes,
                    metadata=self._metadata(result, ordered, gate, reason),
                )
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=qb, response=response))
        return response


__all__ = ["TokRAGSynthesizer"]
