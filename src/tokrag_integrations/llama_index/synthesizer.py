"""TokRAGSynthesizer: a LlamaIndex response synthesizer that decodes with a Tok-RAG policy.

The multi-call modes (compact, refine, tree_summarize) are planned in :mod:`._modes`: unlike
LlamaIndex's loops of the same names, Tok-RAG needs the question alone as every call's pure
context and a per-token trace of every call. The template path (LlamaIndex's own
synthesizers through :class:`TokRAGLLM`) is in :mod:`._synth_templates`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Generator, Mapping, Sequence
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
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.response_synthesizers.base import BaseSynthesizer, QueryTextType
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode
from llama_index.core.types import RESPONSE_TEXT_TYPE

from .. import batching as _batching
from ..booleans import require_bool
from ..defaults import ANSWER_STOP, MAX_NEW_TOKENS
from ..models import LOAD_OPTIONS, LoadedModel, check_greedy
from ..policies import checked_policy_options, get_policy
from ..policies.base import Policy
from ..results import GenerationResult
from ._call_events import _CallEvents
from ._convert import jsonable
from ._modes import EXISTING_ANSWER_PREFIX, _Session, _Setup
from ._synth_templates import (
    _DEFAULT_TEMPLATES,
    NATIVE_MODES,
    RESPONSE_MODES,
    TEMPLATE_KEYS,
    _metadata_mode,
    _mode_name,
    _template,
    _TemplatePath,
)
from .llm import TokRAGLLM

dispatcher = instrument.get_dispatcher(__name__)

#: Constructor arguments of TokRAGSynthesizer other than the policy's options.
_OWN_ARGUMENTS = (
    "lm", "model", "temperature", "policy", "policy_options", "max_new_tokens", "stop",
    "max_context_tokens", "system_prompt", "gate", "streaming", "callback_manager",
    "response_mode", "metadata_mode", "batching", "text_qa_template", "refine_template",
    "summary_template",
)


def _check_budget(max_new_tokens: Any, max_context_tokens: Any, gate: Any) -> None:
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


def _checked_policy(policy: str | Policy, options: dict[str, Any]) -> Policy:
    """The policy, built by the registry (which checks the options): unknown policies or
    options fail here, not at the first query."""
    try:
        return get_policy(policy, **options)
    except ValueError as e:
        if "unknown option" not in str(e):
            raise
        raise TypeError(
            f"TokRAGSynthesizer got an unknown keyword argument ({e}); besides the policy's "
            f"options it accepts: {', '.join(_OWN_ARGUMENTS + LOAD_OPTIONS)}"
        ) from e


def _the_llm(
    lm: Any, model: Any, load_options: dict[str, Any], max_new_tokens: int
) -> TokRAGLLM:
    if (model is not None or load_options) and lm is not None:
        raise ValueError("pass lm, or model with its load options, not both")
    if isinstance(lm, TokRAGLLM):
        return lm
    if model is not None or load_options:
        return TokRAGLLM(model=model or "default", max_new_tokens=max_new_tokens, **load_options)
    if lm is None or isinstance(lm, LoadedModel):
        return TokRAGLLM(lm, max_new_tokens=max_new_tokens)
    raise TypeError(f"lm must be a LoadedModel, a TokRAGLLM or None, got {type(lm).__name__}")


class TokRAGSynthesizer(_CallEvents, _TemplatePath, BaseSynthesizer):
    """Answers from the retrieved nodes with a decoding policy (default ``tokrag``).

    The query and the node texts go to the core separately (no prompt template is
    formatted here): nodes become :class:`~tokrag_integrations.Passage` objects (text from
    ``node.get_content(metadata_mode=...)``), best score first, so when they do not fit the
    window the lowest-scored are dropped first.

    ``response_mode`` (a string or LlamaIndex's ``ResponseMode``):

    * ``"one_pass"`` (default): one decode over every node that fits the window; the rest
      are listed in ``nodes_dropped`` / ``n_nodes_dropped``.
    * ``"compact"``: nodes are packed, best first, into chunks that fill the window (token
      counts from the model's tokenizer, the same budget the one-pass prompt has; a node
      longer than a whole chunk is split); the first chunk is answered, and each next chunk
      refines that answer (the answer so far goes in as the first passage, "Existing
      answer: ...", see :data:`EXISTING_ANSWER_PREFIX`).
    * ``"refine"``: the same with one node (or one part of a long node) per call.
    * ``"tree_summarize"``: every packed chunk is answered, then the answers are packed and
      answered again, level by level, until one call remains.
    * ``"simple_summarize"``, ``"accumulate"``, ``"compact_accumulate"``, ``"no_text"``:
      LlamaIndex's own synthesizer of that name (``no_text`` makes no call).

    Prompt templates: the native modes above use the package's own prompt (passages each
    behind a ``[Retrieved Passage]`` line, then ``Question: ...``) while no template is set.
    Give ``text_qa_template``, ``refine_template`` or ``summary_template`` (or set them with
    ``update_prompts``) and every mode runs LlamaIndex's synthesizer of the same name
    (``one_pass`` as ``compact``) with your templates, LlamaIndex's defaults filling the
    others, through a :class:`TokRAGLLM` with this synthesizer's settings: the RAG context is
    your template as formatted and Tok-RAG compares it with the question alone. This is the
    path ``Settings.llm = TokRAGLLM(...)`` takes, token for token. ``get_prompts()`` returns
    the templates that path uses.

    Every call decodes under the synthesizer's policy with the same question. With
    ``streaming=True`` the earlier calls run when the response is made and the last call
    streams. Each call emits LlamaIndex's LLM callback event (``CBEventType.LLM`` with the
    prompt and a ``CompletionResponse`` whose ``raw["usage"]`` holds the exact token counts,
    so ``TokenCountingHandler`` counts them) and the ``LLMCompletionStart/EndEvent``
    instrumentation events.

    ``response.metadata`` holds ``response_mode``, ``policy``, ``policy_used`` (``"llm"``
    when answered from the pure context), ``answered_from`` (``"retrieval"`` or
    ``"pure_context"``) and ``pure_context_reason``, ``counts`` (generated tokens per source
    in the final answer: ``agree``/``rag``/``llm``), ``passages`` (per node: node id, rank,
    score, kept/cut/empty, tokens; in the multi-call modes also ``calls`` and ``parts``),
    ``nodes_used``, ``nodes_cut``, ``nodes_dropped``, ``n_nodes_dropped``,
    ``nodes_skipped_empty``, ``warnings``, ``gate`` (the gate's decision or None), ``model``,
    ``stop_reason``, ``trace`` (the final call's ``Trace.to_dict()``, JSON-safe), ``usage``
    (prompt/completion tokens over all calls) and ``calls`` (one entry per model call:
    ``index``, ``kind`` (answer/refine/summarize/combine), ``node_ids``, ``answers_from``,
    ``text``, ``counts``, ``usage``, ``nodes_used``/``cut``/``dropped``, ``warnings``,
    ``trace``; ``level`` in tree_summarize); the multi-call modes add ``counts_all_calls``.
    With ``streaming=True`` the metadata dict is filled in place once the token generator is
    exhausted (``policy``, ``gate`` and ``response_mode`` are there from the start).

    Args:
        lm: a LoadedModel, a :class:`TokRAGLLM` to share, or None to load ``model``.
        model: what :func:`~tokrag_integrations.load_model` takes (``"default"``, a hub id
            in the local cache, a folder, a ``.gguf`` path, a loaded ``PreTrainedModel``),
            with its keyword options (``tokenizer``, ``device``, ``device_map``, ``dtype``,
            ``model_kwargs``, ``tokenizer_kwargs``, ``trust_remote_code``, ``revision``...).
        temperature: only None or 0 (greedy decoding).
        policy: decoding policy name or instance (``"tokrag"``, ``"rag"``, ``"llm"``...).
        max_new_tokens: answer budget in tokens (per call; default
            :data:`~tokrag_integrations.defaults.MAX_NEW_TOKENS`, as ``tokrag ask``).
        stop: stop strings (EOS always stops); default
            :data:`~tokrag_integrations.defaults.ANSWER_STOP` (a blank line or a heading
            ends the answer, as ``tokrag ask``); None or ``[]``: none.
        max_context_tokens: a tighter context budget than the model's window.
        system_prompt: override the core's default system prompt (None = no system turn).
        gate: optional object with ``decide(query)`` returning a decision with ``.retrieve``
            (bool), ``.score`` (float) and ``.to_dict()``; when it says no, the answer comes
            from the pure context (one call in every mode) and the decision is in the metadata.
        streaming: return ``StreamingResponse`` / ``AsyncStreamingResponse``.
        callback_manager: LlamaIndex callback manager (default ``Settings.callback_manager``).
        response_mode: ``"one_pass"`` (default), ``"compact"``, ``"refine"`` or
            ``"tree_summarize"``.
        metadata_mode: which node metadata goes into the passage text (default
            ``MetadataMode.LLM``, as LlamaIndex's synthesizers; ``MetadataMode.NONE`` for
            the text alone).
        batching: decode concurrent calls (``asyncio.gather`` over ``aquery``, threads,
            streamed answers included) together as one batch
            (:mod:`tokrag_integrations.batching`); False decodes them one at a time.
        policy_options: the policy's options as a dict (e.g. ``{"pr_norm": "softmax"}``);
            checked by :func:`~tokrag_integrations.policies.get_policy`.
        **options: the load options of ``model`` (above); policy options given here still
            work but are deprecated (a DeprecationWarning names ``policy_options=``).
    """

    def __init__(
        self,
        lm: LoadedModel | TokRAGLLM | None = None,
        *,
        model: Any = None,
        temperature: float | None = None,
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
        text_qa_template: BasePromptTemplate | None = None,
        refine_template: BasePromptTemplate | None = None,
        summary_template: BasePromptTemplate | None = None,
        **options: Any,
    ) -> None:
        self._templates: dict[str, BasePromptTemplate] = {
            k: t
            for k, v in (
                ("text_qa_template", text_qa_template),
                ("refine_template", refine_template),
                ("summary_template", summary_template),
            )
            if (t := _template(k, v)) is not None
        }
        _check_budget(max_new_tokens, max_context_tokens, gate)
        check_greedy(temperature, "TokRAGSynthesizer")
        require_bool(streaming, "streaming")
        require_bool(batching, "batching")
        mode = _mode_name(response_mode)
        meta_mode = _metadata_mode(metadata_mode)
        load_options = {k: options.pop(k) for k in LOAD_OPTIONS if k in options}
        opts = checked_policy_options(policy_options, options, "TokRAGSynthesizer")
        pol = _checked_policy(policy, opts)
        self._policy_name = pol.name
        self._roles: tuple[str, ...] = tuple(pol.roles)
        llm = _the_llm(lm, model, load_options, max_new_tokens)
        super().__init__(llm=llm, callback_manager=callback_manager, streaming=streaming)
        self._lm: LoadedModel = llm.loaded_model
        self._gate = gate
        self._mode = mode
        self._metadata_mode = meta_mode
        self._batching = bool(batching)
        self._policy_options = dict(opts)
        self._gen_kwargs: dict[str, Any] = {
            "policy": policy,
            "max_new_tokens": max_new_tokens,
            "stop": stop,
            "max_context_tokens": max_context_tokens,
            "policy_options": dict(opts),
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
        return {k: self._templates.get(k, _DEFAULT_TEMPLATES[k]) for k in TEMPLATE_KEYS}

    def _update_prompts(self, prompts: PromptDictType) -> None:
        """Set templates (``text_qa_template``, ``refine_template``, ``summary_template``);
        from then on every mode runs through them (see the class docstring)."""
        for key, value in prompts.items():
            if key not in TEMPLATE_KEYS:
                raise KeyError(f"unknown prompt {key!r}; TokRAGSynthesizer has {', '.join(TEMPLATE_KEYS)}")
            self._templates[key] = _template(key, value)

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

    def _session(
        self, query: str, nodes: Sequence[NodeWithScore], decision: Any = None
    ) -> _Session:
        setup = _Setup(
            self._lm, self._gen_kwargs, self._mode, self._metadata_mode, self._policy_name,
            self._roles,
        )
        return _Session(setup, query, nodes, decision, self._gate_dict(decision))

    @staticmethod
    def _chunk_nodes(text_chunks: Sequence[str]) -> list[NodeWithScore]:
        return [
            NodeWithScore(node=TextNode(text=c, id_=f"chunk-{i}"))
            for i, c in enumerate(text_chunks)
        ]

    # ------------------------------------------------------------------ running a session
    def _run(self, sess: _Session) -> tuple[Any, dict[str, Any]]:
        """(answer text, or a token generator when streaming; the metadata dict)."""
        program = sess.program()
        call = next(program)
        while not call.final:
            call = program.send(self._call(sess, call))
        program.close()
        if not self._streaming:
            return self._call(sess, call).text, sess.metadata()
        metadata = sess.partial_metadata()
        event_id, prompt = self._llm_start(sess, call)
        try:
            s = _batching.stream(self._lm, sess.query, call.passages, batching=self._batching,
                                 **self._gen_kwargs)
        except BaseException as e:
            self._llm_error(event_id, e)
            raise

        def gen() -> Generator[str, None, None]:
            try:
                for ev in s:
                    if ev.text:
                        yield ev.text
            except BaseException as e:
                self._llm_error(event_id, e)
                raise
            self._llm_end(sess, call, event_id, prompt, s.result)
            metadata.update(sess.metadata())

        return gen(), metadata

    async def _arun(self, sess: _Session) -> tuple[Any, dict[str, Any]]:
        """Async :meth:`_run`: every call runs in a worker thread."""
        program = sess.program()
        call = next(program)
        while not call.final:
            call = program.send(await self._acall(sess, call))
        program.close()
        if not self._streaming:
            return (await self._acall(sess, call)).text, sess.metadata()
        metadata = sess.partial_metadata()
        lm, kw, last = self._lm, self._gen_kwargs, call

        async def agen() -> AsyncGenerator[str, None]:
            event_id, prompt = self._llm_start(sess, last)
            try:
                async for item in _batching.astream_with_result(
                    lm, sess.query, last.passages, batching=self._batching, **kw
                ):
                    if isinstance(item, GenerationResult):
                        self._llm_end(sess, last, event_id, prompt, item)
                        metadata.update(sess.metadata())
                    elif item.text:
                        yield item.text
            except BaseException as e:
                if len(sess.calls) == 0 or sess.calls[-1][0] is not last:
                    self._llm_error(event_id, e)
                raise

        return agen(), metadata

    # ------------------------------------------------------------------ BaseSynthesizer API
    def get_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        """Answer from plain text chunks (ranked best first) in the synthesizer's
        ``response_mode``; a generator when streaming."""
        nodes = self._chunk_nodes(text_chunks)
        if self.uses_templates:
            return self._run_templates(query_str, nodes, None)[0]
        return self._run(self._session(query_str, nodes))[0]

    async def aget_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        """Async :meth:`get_response`; the model runs in a worker thread."""
        nodes = self._chunk_nodes(text_chunks)
        if self.uses_templates:
            return (await self._arun_templates(query_str, nodes, None))[0]
        return (await self._arun(self._session(query_str, nodes)))[0]

    def _response(
        self, answer: Any, metadata: dict[str, Any], source_nodes: list[NodeWithScore]
    ) -> RESPONSE_TYPE:
        if not self._streaming:
            return Response(answer, source_nodes=source_nodes, metadata=metadata)
        if isinstance(answer, AsyncGenerator):
            return AsyncStreamingResponse(answer, source_nodes=source_nodes, metadata=metadata)
        return StreamingResponse(answer, source_nodes=source_nodes, metadata=metadata)

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
            if self.uses_templates and (decision is None or decision.retrieve):
                answer, metadata = self._run_templates(qb.query_str, nodes, self._gate_dict(decision))
            else:
                answer, metadata = self._run(self._session(qb.query_str, nodes, decision))
            response = self._response(answer, metadata, source_nodes)
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
            if self.uses_templates and (decision is None or decision.retrieve):
                answer, metadata = await self._arun_templates(
                    qb.query_str, nodes, self._gate_dict(decision)
                )
            else:
                answer, metadata = await self._arun(self._session(qb.query_str, nodes, decision))
            response = self._response(answer, metadata, source_nodes)
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=qb, response=response))
        return response


__all__ = [
    "EXISTING_ANSWER_PREFIX",
    "NATIVE_MODES",
    "RESPONSE_MODES",
    "TEMPLATE_KEYS",
    "TokRAGSynthesizer",
]