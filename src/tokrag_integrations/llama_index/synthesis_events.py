"""What ``TokRAGLLM`` learns from LlamaIndex around its calls: a prompt template's retrieved
context and question (``Templated``), and the synthesize call in progress (its nodes, the
policy and result of its last ``TokRAGLLM`` call), noted by an event handler and a span
handler on LlamaIndex's root dispatcher, which give the synthesizer's response its
``policy_used``, citations and source nodes by contribution."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import llama_index.core.instrumentation as instrument
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.synthesis import (
    SynthesizeEndEvent,
    SynthesizeStartEvent,
)
from llama_index.core.instrumentation.span_handlers import NullSpanHandler
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.schema import NodeWithScore

from ..results import GenerationResult
from .nodes import node_citations, nodes_by_contribution, split_node_context

#: Template variables that carry retrieved text in LlamaIndex's prompts (text QA, summary
#: and chat-engine context templates: ``context_str``; refine templates: ``context_msg``).
CONTEXT_VARIABLES = ("context_str", "context_msg")
#: Template variables that carry the question.
QUERY_VARIABLES = ("query_str", "question")


class Templated:
    """Formatted from a prompt template whose context variable held retrieved text
    (``context``; ``query``: the question). LlamaIndex hands what ``_get_messages`` /
    ``_get_prompt`` return on to ``chat`` / ``complete`` unchanged, so these reach the decoder."""

    context: str = ""
    query: str | None = None


class TemplatedMessages(Templated, list):
    pass


class TemplatedText(Templated, str):
    pass


def remember(formatted: Any, kind: type, prompt: Any, prompt_args: dict[str, Any]) -> Any:
    """``formatted`` as a ``kind`` carrying the template's context and question (from its
    arguments, partial ones included), or as it is when no variable held retrieved context."""
    args = {**(getattr(prompt, "kwargs", None) or {}), **prompt_args}
    context = next((args[k] for k in CONTEXT_VARIABLES if k in args), None)
    if isinstance(context, (list, tuple)) and all(isinstance(v, str) for v in context):
        context = str(context)  # simple_summarize passes its one truncated chunk as a list
    if not isinstance(context, str):
        return formatted
    out = kind(formatted)
    out.context = context
    out.query = next((args[k] for k in QUERY_VARIABLES if isinstance(args.get(k), str)), None)
    return out


@dataclass
class _Synthesis:
    """A synthesize call in progress: its nodes, and the policy, result and kept nodes of
    its ``TokRAGLLM`` calls so far (the last call's policy and result)."""

    nodes: list[NodeWithScore]
    policy: str | None = None
    result: GenerationResult | None = None
    decoded: set[str] = field(default_factory=set)


#: The synthesize calls in progress (innermost last).
_SYNTH_CALLS: ContextVar[tuple[_Synthesis, ...]] = ContextVar("tokrag_synth_calls", default=())
#: (span id, nodes) of the last synthesize span entered in this context.
_SPAN_NODES: ContextVar[tuple[str | None, list[NodeWithScore]]] = ContextVar(
    "tokrag_span_nodes", default=(None, [])
)


class _SynthesizeNodes(NullSpanHandler):
    """Notes the nodes a synthesizer's ``synthesize`` / ``asynthesize`` span is given, for
    the ``SynthesizeStartEvent`` of that span (LlamaIndex's events do not carry them)."""

    @classmethod
    def class_name(cls) -> str:
        return "TokRAGSynthesizeNodes"

    def span_enter(self, id_: str, bound_args: Any, instance: Any = None, **kwargs: Any) -> None:
        nodes = bound_args.arguments.get("nodes")
        if isinstance(instance, BaseSynthesizer) and isinstance(nodes, list):
            _SPAN_NODES.set((id_, nodes))


class _PolicyUsed(BaseEventHandler):
    """Gives every response a LlamaIndex synthesizer makes with ``TokRAGLLM`` calls
    ``metadata["policy_used"]`` (the policy of its last call), ``metadata["citations"]`` and
    ``["contributions"]`` (:func:`.nodes.node_citations` of its last call) and its
    ``source_nodes`` by contribution. LlamaIndex's streaming synthesizers call the model when
    their stream is first read, so a streaming response gets ``policy_used`` with its first
    token and the rest when the stream ends."""

    @classmethod
    def class_name(cls) -> str:
        return "TokRAGPolicyUsed"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, SynthesizeStartEvent):
            span, nodes = _SPAN_NODES.get()
            _SPAN_NODES.set((None, []))
            synth = _Synthesis(list(nodes) if span == event.span_id else [])
            _SYNTH_CALLS.set((*_SYNTH_CALLS.get(), synth))
        elif isinstance(event, SynthesizeEndEvent) and _SYNTH_CALLS.get():
            *outer, synth = _SYNTH_CALLS.get()
            _SYNTH_CALLS.set(tuple(outer))
            response = event.response
            if response is None or not hasattr(response, "metadata"):
                return
            if response.metadata is None:
                response.metadata = {}
            if synth.policy:
                response.metadata.setdefault("policy_used", synth.policy)
            gen = getattr(response, "response_gen", None)
            if gen is not None and not isinstance(gen, (str, list)):
                response.response_gen = _noting(gen, response, synth)
            else:
                _cite(response, synth)


def _cite(response: Any, synth: _Synthesis) -> None:
    """The citations of the synthesis's last ``TokRAGLLM`` call in ``response`` (unless its
    synthesizer put its own there), its source nodes by contribution."""
    if synth.result is None or "citations" in response.metadata:
        return
    cited = node_citations(synth.result.trace)
    response.metadata.update(cited)
    response.source_nodes = nodes_by_contribution(
        response.source_nodes, cited["contributions"], synth.decoded
    )


def _noting(gen: Any, response: Any, synth: _Synthesis) -> Any:
    """``gen`` (a token generator, sync or async) that notes the ``TokRAGLLM`` calls made
    while it runs (as ``synth``'s), puts the last one's policy into
    ``metadata["policy_used"]`` and, once exhausted, the citations (:func:`_cite`)."""
    metadata = response.metadata

    def note() -> None:
        if synth.policy:
            metadata["policy_used"] = synth.policy

    def enter() -> None:
        _SYNTH_CALLS.set((*_SYNTH_CALLS.get(), synth))

    def leave() -> None:
        _SYNTH_CALLS.set(tuple(c for c in _SYNTH_CALLS.get() if c is not synth))

    if hasattr(gen, "__aiter__"):

        async def agen() -> Any:
            enter()
            try:
                async for token in gen:
                    note()
                    yield token
                note()
                _cite(response, synth)
            finally:
                leave()

        return agen()

    def sync() -> Any:
        enter()
        try:
            for token in gen:
                note()
                yield token
            note()
            _cite(response, synth)
        finally:
            leave()

    return sync()


def watch_synthesizers() -> None:
    """Register :class:`_PolicyUsed` and :class:`_SynthesizeNodes` on LlamaIndex's root
    dispatcher (once)."""
    dispatcher = instrument.get_dispatcher()
    if not any(isinstance(h, _PolicyUsed) for h in dispatcher.event_handlers):
        dispatcher.add_event_handler(_PolicyUsed())
    if not any(isinstance(h, _SynthesizeNodes) for h in dispatcher.span_handlers):
        dispatcher.add_span_handler(_SynthesizeNodes())


def node_parts(formatted: Templated) -> list[Any] | None:
    """The template's context cut into the nodes of the synthesize call in progress
    (:func:`.nodes.split_node_context`), so that each is its own passage; None outside one."""
    calls = _SYNTH_CALLS.get()
    if not calls or not calls[-1].nodes:
        return None
    return split_node_context(formatted.context, calls[-1].nodes)


def note_policy(policy: str) -> None:
    """The policy of a ``TokRAGLLM`` call, for the synthesize call in progress (if any)."""
    calls = _SYNTH_CALLS.get()
    if calls:
        calls[-1].policy = policy


def note_result(result: GenerationResult) -> None:
    """A finished ``TokRAGLLM`` call's result and the nodes it decoded, for the synthesize
    call in progress (if any)."""
    calls = _SYNTH_CALLS.get()
    if calls:
        calls[-1].result = result
        calls[-1].decoded |= {
            p.metadata["node_id"]
            for p in result.trace.passages
            if p.kept and "node_id" in p.metadata
        }
