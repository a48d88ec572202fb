"""TokRAGSynthesizer: a LlamaIndex response synthesizer that decodes with a Tok-RAG policy.

The native multi-call modes are planned by :mod:`tokrag_integrations.adapters.synthesis`;
with a prompt template (or LlamaIndex's other modes) LlamaIndex's own synthesizer runs
through a :class:`TokRAGLLM` that keeps its calls' results.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncGenerator, Callable, Generator, Mapping, Sequence
from contextlib import contextmanager
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
from llama_index.core.prompts.base import BasePromptTemplate
from llama_index.core.prompts.default_prompt_selectors import (
    DEFAULT_REFINE_PROMPT_SEL,
    DEFAULT_TEXT_QA_PROMPT_SEL,
    DEFAULT_TREE_SUMMARIZE_PROMPT_SEL,
)
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.response_synthesizers.base import BaseSynthesizer, QueryTextType
from llama_index.core.response_synthesizers.factory import get_response_synthesizer
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode
from llama_index.core.types import RESPONSE_TEXT_TYPE

from ..adapters.synthesis import Call, Session, Setup, call_summary, totals
from ..adapters.translate import checked_policy, options_dict
from ..config import require_bool
from ..defaults import ANSWER_STOP, MAX_NEW_TOKENS
from ..engine import scheduler
from ..models import LOAD_OPTIONS, LoadedModel, unknown_arguments
from ..policies.base import Policy
from ..results import GenerationResult
from ..sampling import sampling_of
from ..trace import json_data
from .call_events import LLMEvent
from .llm import TokRAGLLM
from .nodes import node_citations, node_to_passage, nodes_by_contribution, order_nodes

dispatcher = instrument.get_dispatcher(__name__)

#: ``response_mode`` values with the package's own prompt: one decode over every node that
#: fits (the default), or LlamaIndex's multi-call modes of the same names.
NATIVE_MODES = ("one_pass", "compact", "refine", "tree_summarize")
#: Every ``response_mode``: the native ones, and LlamaIndex's other built-in modes, which
#: run LlamaIndex's own synthesizer with its templates through :class:`TokRAGLLM`.
RESPONSE_MODES = (*NATIVE_MODES, "simple_summarize", "accumulate", "compact_accumulate", "no_text")
#: The prompt templates of LlamaIndex's synthesizers that this one takes (and their defaults).
DEFAULT_TEMPLATES = {
    "text_qa_template": DEFAULT_TEXT_QA_PROMPT_SEL,
    "refine_template": DEFAULT_REFINE_PROMPT_SEL,
    "summary_template": DEFAULT_TREE_SUMMARIZE_PROMPT_SEL,
}
TEMPLATE_KEYS = tuple(DEFAULT_TEMPLATES)


def _check_arguments(max_new_tokens: Any, max_context_tokens: Any, gate: Any) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if max_context_tokens is not None and (
        isinstance(max_context_tokens, bool)
        or not isinstance(max_context_tokens, int)
        or max_context_tokens < 1
    ):
        raise ValueError(
            f"max_context_tokens must be a whole number >= 1 or None, got {max_context_tokens!r}"
        )
    if gate is not None and not callable(getattr(gate, "decide", None)):
        raise TypeError(f"gate must have a decide(query) method, got {type(gate).__name__}")


def _the_llm(lm: Any, model: Any, load_options: dict[str, Any], max_new_tokens: int) -> TokRAGLLM:
    if (model is not None or load_options) and lm is not None:
        raise ValueError("pass lm, or model with its load options, not both")
    if isinstance(lm, TokRAGLLM):
        return lm
    if model is not None or load_options:
        return TokRAGLLM(model=model or "default", max_new_tokens=max_new_tokens, **load_options)
    if lm is None or isinstance(lm, LoadedModel):
        return TokRAGLLM(lm, max_new_tokens=max_new_tokens)
    raise TypeError(f"lm must be a LoadedModel, a TokRAGLLM or None, got {type(lm).__name__}")


def _mode_name(response_mode: Any) -> str:
    mode = getattr(response_mode, "value", response_mode)
    if mode not in RESPONSE_MODES:
        raise ValueError(
            f"Unknown response_mode {response_mode!r}; TokRAGSynthesizer accepts "
            + ", ".join(repr(m) for m in RESPONSE_MODES)
            + " ('one_pass' is the default)."
        )
    return str(mode)


def _template(key: str, value: Any) -> BasePromptTemplate | None:
    if value is None or isinstance(value, BasePromptTemplate):
        return value
    raise TypeError(
        f"{key} must be a LlamaIndex prompt template (PromptTemplate, ChatPromptTemplate...), "
        f"got {type(value).__name__}"
    )


def _metadata_mode(metadata_mode: Any) -> MetadataMode:
    try:
        return MetadataMode(getattr(metadata_mode, "value", metadata_mode))
    except ValueError:
        raise ValueError(
            f"Unknown metadata_mode {metadata_mode!r}; use one of "
            + ", ".join(f"MetadataMode.{m.name}" for m in MetadataMode)
        ) from None


def _then(answer: Any, finish: Callable[[], dict[str, Any]], metadata: dict[str, Any]) -> Any:
    """``answer`` (a token generator, sync or async) that fills ``metadata`` with ``finish()``
    once exhausted."""
    if hasattr(answer, "__aiter__"):

        async def agen() -> AsyncGenerator[str, None]:
            async for token in answer:
                yield token
            metadata.update(finish())

        return agen()

    def gen() -> Generator[str, None, None]:
        yield from answer
        metadata.update(finish())

    return gen()


def _metadata(sess: Session) -> dict[str, Any]:
    """The session's metadata with the citations of its final call."""
    return {**sess.metadata(), **node_citations(sess.calls[-1][1].trace)}


async def _no_tokens() -> AsyncGenerator[str, None]:
    return
    yield  # an async generator that yields nothing


class TokRAGSynthesizer(BaseSynthesizer):
    """Answers from the retrieved nodes with a decoding policy (default ``tokrag``).

    The query and the node texts (``node.get_content(metadata_mode=...)``) go to the core
    separately, nodes best score first, so the lowest-scored are dropped first when the
    window is full. ``response_mode``: ``"one_pass"`` (default, one decode), ``"compact"``,
    ``"refine"``, ``"tree_summarize"`` (multi-call, planned with the package's prompt), or
    LlamaIndex's ``"simple_summarize"``, ``"accumulate"``, ``"compact_accumulate"``,
    ``"no_text"``. With ``text_qa_template``, ``refine_template`` or ``summary_template`` (or
    ``update_prompts``) every mode runs LlamaIndex's synthesizer of that name (``one_pass``
    as ``compact``) with your templates through a :class:`TokRAGLLM` with these settings.
    With ``streaming=True`` the last call streams. Every model call emits ``CBEventType.LLM``
    (token counts in ``raw["usage"]``, for ``TokenCountingHandler``) and the
    ``LLMCompletionStart/EndEvent`` events. The modes and the keys of ``response.metadata``
    are described in docs/integrations.md; when streaming, the metadata is filled once the
    generator is exhausted (``policy``, ``gate`` and ``response_mode`` are there from the
    start).

    Args:
        lm: a LoadedModel, a :class:`TokRAGLLM` to share, or None to load ``model``.
        model: what :func:`~tokrag_integrations.load_model` takes, with its keyword options
            (``tokenizer``, ``device``, ``device_map``, ``dtype``, ``model_kwargs``...).
        temperature / seed: how each answer's tokens are drawn (None or 0: greedy; a seed
            makes a sampled answer repeatable), as for ``TokRAGLLM``.
        policy: decoding policy name or instance (``"tokrag"``, ``"rag"``, ``"no_rag"``...).
        policy_options: the policy's options as a dict (e.g. ``{"pr_norm": "softmax"}``).
        max_new_tokens: answer budget per call (default ``defaults.MAX_NEW_TOKENS``).
        stop: stop strings (default ``defaults.ANSWER_STOP``; None or ``[]``: none).
        max_context_tokens: a tighter context budget than the model's window.
        system_prompt: override the core's default system prompt (None = no system turn).
        gate: an object with ``decide(query)`` (``.retrieve``, ``.score``, ``.to_dict()``);
            when it says no, the answer comes from the pure context in one call.
        streaming: return ``StreamingResponse`` / ``AsyncStreamingResponse``.
        callback_manager: default ``Settings.callback_manager``.
        response_mode: see above.
        metadata_mode: node metadata in the passage text (default ``MetadataMode.LLM``).
        batching: decode concurrent calls together as one batch; False: one at a time.
        citations: which node each part of the answer drew on (``metadata["citations"]``,
            ``["contributions"]``, ``source_nodes`` by contribution): None = with the policies
            that read that attention anyway (``tokrag``), True / False = always / never.
        **options: the load options of ``model``.
    """

    def __init__(
        self,
        lm: LoadedModel | TokRAGLLM | None = None,
        *,
        model: Any = None,
        temperature: float | None = None,
        seed: int | None = None,
        policy: str | Policy = "tokrag",
        policy_options: Mapping[str, Any] | None = None,
        max_new_tokens: int = MAX_NEW_TOKENS,
        stop: str | Sequence[str] | None = ANSWER_STOP,
        max_context_tokens: int | None = None,
        system_prompt: Any = ...,
        gate: Any = None,
        streaming: bool = False,
        callback_manager: CallbackManager | None = None,
        response_mode: Any = "one_pass",
        metadata_mode: Any = MetadataMode.LLM,
        batching: bool = True,
        citations: bool | None = None,
        text_qa_template: BasePromptTemplate | None = None,
        refine_template: BasePromptTemplate | None = None,
        summary_template: BasePromptTemplate | None = None,
        **options: Any,
    ) -> None:
        given = (text_qa_template, refine_template, summary_template)
        self._templates: dict[str, BasePromptTemplate] = {
            k: t
            for k, v in zip(TEMPLATE_KEYS, given, strict=True)
            if (t := _template(k, v)) is not None
        }
        _check_arguments(max_new_tokens, max_context_tokens, gate)
        drawn = sampling_of(temperature=temperature, seed=seed)
        require_bool(streaming, "streaming")
        require_bool(batching, "batching")
        if citations is not None:
            require_bool(citations, "citations")
        self._mode = _mode_name(response_mode)
        self._metadata_mode = _metadata_mode(metadata_mode)
        own = [*inspect.signature(TokRAGSynthesizer.__init__).parameters][1:-1]
        unknown = set(options) - set(LOAD_OPTIONS)
        if unknown:
            raise unknown_arguments("TokRAGSynthesizer", unknown, own + list(LOAD_OPTIONS))
        self._policy_options = opts = options_dict(policy_options)
        pol = checked_policy(policy, opts, "TokRAGSynthesizer", own + list(LOAD_OPTIONS))
        self._policy_name = pol.name
        self._roles: tuple[str, ...] = tuple(pol.roles)
        llm = _the_llm(lm, model, options, max_new_tokens)
        super().__init__(llm=llm, callback_manager=callback_manager, streaming=streaming)
        self._lm: LoadedModel = llm.loaded_model
        self._gate = gate
        self._batching = batching
        self._gen_kwargs: dict[str, Any] = {
            "policy": policy,
            "max_new_tokens": max_new_tokens,
            "stop": stop,
            "max_context_tokens": max_context_tokens,
            "policy_options": dict(opts),
            "citations": citations,
        }
        if not drawn.greedy:
            self._gen_kwargs.update(temperature=temperature, seed=seed)
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

    @property
    def response_mode(self) -> str:
        return self._mode

    @property
    def metadata_mode(self) -> MetadataMode:
        return self._metadata_mode

    @property
    def uses_templates(self) -> bool:
        """Whether answers go through LlamaIndex's synthesizer with prompt templates (a
        template was set, or the mode is one of LlamaIndex's others)."""
        return bool(self._templates) or self._mode not in NATIVE_MODES

    def _get_prompts(self) -> PromptDictType:
        """The templates the template path formats (yours, else LlamaIndex's defaults)."""
        return {k: self._templates.get(k, d) for k, d in DEFAULT_TEMPLATES.items()}

    def _update_prompts(self, prompts: PromptDictType) -> None:
        """Set templates; from then on every mode runs through them."""
        for key, value in prompts.items():
            if key not in TEMPLATE_KEYS:
                raise KeyError(
                    f"unknown prompt {key!r}; TokRAGSynthesizer has {', '.join(TEMPLATE_KEYS)}"
                )
            self._templates[key] = _template(key, value)

    def _gate_dict(self, decision: Any) -> dict[str, Any] | None:
        if decision is None:
            return None
        return json_data(
            {
                **dict(decision.to_dict()),
                "retrieve": bool(decision.retrieve),
                "score": float(decision.score),
            }
        )

    def _session(self, query: str, nodes: Sequence[NodeWithScore], decision: Any = None) -> Session:
        setup = Setup(self._lm, self._gen_kwargs, self._mode, self._policy_name, self._roles)
        ordered = [
            (
                n.node.node_id,
                None if n.score is None else float(n.score),
                node_to_passage(n, self._metadata_mode),
            )
            for n in order_nodes(nodes)
        ]
        return Session(setup, query, ordered, decision, self._gate_dict(decision))

    # ------------------------------------------------------------------ running a session
    def _call(self, sess: Session, call: Call) -> GenerationResult:
        event = LLMEvent(self, sess, call)
        with event.failing():
            result = scheduler.generate(
                self._lm, sess.query, call.passages, batching=self._batching, **self._gen_kwargs
            )
        return event.end(result)

    async def _acall(self, sess: Session, call: Call) -> GenerationResult:
        event = LLMEvent(self, sess, call)
        with event.failing():
            result = await scheduler.agenerate(
                self._lm, sess.query, call.passages, batching=self._batching, **self._gen_kwargs
            )
        return event.end(result)

    def _run(self, sess: Session) -> tuple[Any, dict[str, Any]]:
        """(answer text, or a token generator when streaming; the metadata dict)."""
        program = sess.program()
        call = next(program)
        while not call.final:
            call = program.send(self._call(sess, call))
        program.close()
        if not self._streaming:
            return self._call(sess, call).text, _metadata(sess)
        event = LLMEvent(self, sess, call)
        with event.failing():
            s = scheduler.stream(
                self._lm, sess.query, call.passages, batching=self._batching, **self._gen_kwargs
            )

        def gen() -> Generator[str, None, None]:
            with event.failing():
                yield from (ev.text for ev in s if ev.text)
            event.end(s.result)

        metadata = sess.partial_metadata()
        return _then(gen(), lambda: _metadata(sess), metadata), metadata

    async def _arun(self, sess: Session) -> tuple[Any, dict[str, Any]]:
        """Async :meth:`_run`: every call runs in a worker thread."""
        program = sess.program()
        call = next(program)
        while not call.final:
            call = program.send(await self._acall(sess, call))
        program.close()
        if not self._streaming:
            return (await self._acall(sess, call)).text, _metadata(sess)

        async def agen() -> AsyncGenerator[str, None]:
            event = LLMEvent(self, sess, call)
            with event.failing():
                async for item in scheduler.astream_with_result(
                    self._lm, sess.query, call.passages, batching=self._batching, **self._gen_kwargs
                ):
                    if isinstance(item, GenerationResult):
                        event.end(item)
                    elif item.text:
                        yield item.text

        metadata = sess.partial_metadata()
        return _then(agen(), lambda: _metadata(sess), metadata), metadata

    # ------------------------------------------------------------------ the template path
    def _template_llm(self) -> TokRAGLLM:
        """A TokRAGLLM with this synthesizer's settings that keeps its calls' results."""
        kw = self._gen_kwargs
        own: dict[str, Any] = {
            "policy": self._policy_name,
            "max_new_tokens": kw["max_new_tokens"],
            "stop": [kw["stop"]] if isinstance(kw["stop"], str) else kw["stop"],
            "max_context_tokens": kw["max_context_tokens"],
            "policy_options": self._policy_options,
            "batching": self._batching,
            "citations": kw["citations"],
        }
        if "system_prompt" in kw:
            own["system_prompt"] = kw["system_prompt"]
        llm = TokRAGLLM(self._lm, callback_manager=self._callback_manager, **own)
        llm._results = []
        return llm

    def _template_metadata(
        self, llm: TokRAGLLM, nodes: Sequence[NodeWithScore], gate: dict[str, Any] | None
    ) -> dict[str, Any]:
        results = list(llm._results or [])
        calls = [
            call_summary(i, "template", r, [{}], roles=self._roles) for i, r in enumerate(results)
        ]
        final = results[-1] if results else None
        policy_used = final.trace.policy if final is not None else None
        counts, notes, total = totals(calls, [])
        return {
            "response_mode": self._mode,
            "templates": sorted(self._templates),
            "policy": self._policy_name,
            "policy_used": policy_used,
            "answered_from": "retrieval" if policy_used not in (None, "no_rag") else "pure_context",
            "counts": final.counts if final is not None else {},
            "counts_all_calls": counts,
            "model": self._lm.name,
            "stop_reason": final.trace.stop_reason if final is not None else None,
            "gate": gate,
            "nodes_used": [n.node.node_id for n in nodes],
            "warnings": notes,
            "trace": calls[-1]["trace"] if calls else None,
            "calls": calls,
            "usage": total,
            **(node_citations(final.trace) if final else {"citations": [], "contributions": []}),
        }

    def _template_synth(
        self, query: str, nodes: Sequence[NodeWithScore], gate: dict[str, Any] | None
    ) -> tuple[BaseSynthesizer | None, Callable[[], dict[str, Any]], list[str]]:
        """(LlamaIndex's synthesizer for the mode, None for ``no_text``: no call at all; the
        metadata to come; the chunks it answers from)."""
        llm = self._template_llm()
        synth = None
        if self._mode != "no_text":
            synth = get_response_synthesizer(
                llm=llm,
                response_mode="compact" if self._mode == "one_pass" else self._mode,
                streaming=self._streaming,
                callback_manager=self._callback_manager,
                **self._templates,
            )
        chunks = [n.node.get_content(metadata_mode=self._metadata_mode) for n in nodes]
        return synth, lambda: self._template_metadata(llm, nodes, gate), chunks

    def _template_answer(self, answer: Any, finish: Callable[[], dict[str, Any]], gate: Any) -> Any:
        if not self._streaming or isinstance(answer, str):
            return answer, finish()
        metadata = {"policy": self._policy_name, "gate": gate, "response_mode": self._mode}
        return _then(answer, finish, metadata), metadata

    def _run_templates(
        self, query: str, nodes: Sequence[NodeWithScore], gate: dict[str, Any] | None
    ) -> tuple[Any, dict[str, Any]]:
        synth, finish, chunks = self._template_synth(query, nodes, gate)
        if synth is None:
            return (iter(()) if self._streaming else ""), finish()
        return self._template_answer(synth.get_response(query, chunks), finish, gate)

    async def _arun_templates(
        self, query: str, nodes: Sequence[NodeWithScore], gate: dict[str, Any] | None
    ) -> tuple[Any, dict[str, Any]]:
        synth, finish, chunks = self._template_synth(query, nodes, gate)
        if synth is None:
            return (_no_tokens() if self._streaming else ""), finish()
        return self._template_answer(await synth.aget_response(query, chunks), finish, gate)

    # ------------------------------------------------------------------ BaseSynthesizer API
    def get_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        """Answer from plain text chunks (ranked best first) in the synthesizer's
        ``response_mode``; a generator when streaming."""
        nodes = _chunk_nodes(text_chunks)
        if self.uses_templates:
            return self._run_templates(query_str, nodes, None)[0]
        return self._run(self._session(query_str, nodes))[0]

    async def aget_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        """Async :meth:`get_response`; the model runs in a worker thread."""
        nodes = _chunk_nodes(text_chunks)
        if self.uses_templates:
            return (await self._arun_templates(query_str, nodes, None))[0]
        return (await self._arun(self._session(query_str, nodes)))[0]

    @contextmanager
    def _synthesis(
        self, query: QueryTextType, source_nodes: list[NodeWithScore]
    ) -> Generator[tuple[QueryBundle, Callable[[Any, dict[str, Any]], RESPONSE_TYPE]], None, None]:
        """The synthesize events around a block given (the query, a function making the
        response from the answer and its metadata)."""
        dispatcher.event(SynthesizeStartEvent(query=query))
        qb = QueryBundle(query_str=query) if isinstance(query, str) else query
        made: list[RESPONSE_TYPE] = []

        def ordered() -> dict[str, Any]:
            made[0].source_nodes = nodes_by_contribution(
                source_nodes,
                made[0].metadata.get("contributions") or [],
                made[0].metadata.get("nodes_used"),
            )
            return {}

        def respond(answer: Any, metadata: dict[str, Any]) -> RESPONSE_TYPE:
            if not self._streaming:
                made.append(Response(answer, source_nodes=source_nodes, metadata=metadata))
                ordered()
                return made[0]
            if not isinstance(answer, str):  # the source nodes are ordered once it is read
                answer = _then(answer, ordered, {})
            if isinstance(answer, AsyncGenerator):
                made.append(
                    AsyncStreamingResponse(answer, source_nodes=source_nodes, metadata=metadata)
                )
            else:
                made.append(StreamingResponse(answer, source_nodes=source_nodes, metadata=metadata))
            return made[0]

        with self._callback_manager.event(
            CBEventType.SYNTHESIZE, payload={EventPayload.QUERY_STR: qb.query_str}
        ) as event:
            yield qb, respond
            event.on_end(payload={EventPayload.RESPONSE: made[0]})
        dispatcher.event(SynthesizeEndEvent(query=qb, response=made[0]))

    @dispatcher.span
    def synthesize(
        self,
        query: QueryTextType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        """Answer ``query`` from ``nodes``; with no nodes, from the pure context (said in metadata)."""
        with self._synthesis(query, [*nodes, *(additional_source_nodes or [])]) as (qb, respond):
            decision = self._gate.decide(qb.query_str) if self._gate is not None else None
            if self.uses_templates and (decision is None or decision.retrieve):
                gate = self._gate_dict(decision)
                return respond(*self._run_templates(qb.query_str, nodes, gate))
            return respond(*self._run(self._session(qb.query_str, nodes, decision)))

    @dispatcher.span
    async def asynthesize(
        self,
        query: QueryTextType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        """Async :meth:`synthesize`: the gate and the model run in worker threads."""
        with self._synthesis(query, [*nodes, *(additional_source_nodes or [])]) as (qb, respond):
            decision = None
            if self._gate is not None:
                decision = await asyncio.to_thread(self._gate.decide, qb.query_str)
            if self.uses_templates and (decision is None or decision.retrieve):
                gate = self._gate_dict(decision)
                return respond(*await self._arun_templates(qb.query_str, nodes, gate))
            return respond(*await self._arun(self._session(qb.query_str, nodes, decision)))


def _chunk_nodes(text_chunks: Sequence[str]) -> list[NodeWithScore]:
    return [
        NodeWithScore(node=TextNode(text=c, id_=f"chunk-{i}")) for i, c in enumerate(text_chunks)
    ]


__all__ = ["NATIVE_MODES", "RESPONSE_MODES", "TEMPLATE_KEYS", "TokRAGSynthesizer"]
