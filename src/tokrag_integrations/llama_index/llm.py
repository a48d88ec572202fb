"""TokRAGLLM: the local model as a LlamaIndex ``CustomLLM`` (pure model or a Tok-RAG policy)."""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import llama_index.core.instrumentation as instrument
from llama_index.core.base.llms.generic_utils import (
    messages_to_prompt as generic_messages_to_prompt,
)
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.synthesis import (
    SynthesizeEndEvent,
    SynthesizeStartEvent,
)
from llama_index.core.instrumentation.span_handlers import NullSpanHandler
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.llm import default_completion_to_prompt
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.schema import NodeWithScore
from pydantic import SecretStr, StrictBool, field_serializer

from ..adapters.translate import (
    decode_on,
    given_options,
    model_label,
    result_summary,
)
from ..defaults import MAX_NEW_TOKENS, REMOTE_MAX_RESPONSE_MB
from ..models import (
    LOAD_FIELDS,
    LOAD_OPTIONS,
    LoadedModel,
    check_greedy,
    load_model,
    unknown_arguments,
)
from ..prompts import RenderedPrompt
from ..results import GenerationResult, TokenEvent
from .nodes import (
    messages_to_dicts,
    messages_to_turns,
    node_citations,
    node_passages,
    nodes_by_contribution,
    split_node_context,
)

#: Template variables that carry retrieved text in LlamaIndex's prompts (text QA, summary
#: and chat-engine context templates: ``context_str``; refine templates: ``context_msg``).
CONTEXT_VARIABLES = ("context_str", "context_msg")
#: Template variables that carry the question.
QUERY_VARIABLES = ("query_str", "question")


class _Templated:
    """Formatted from a prompt template whose context variable held retrieved text
    (``context``; ``query``: the question). LlamaIndex hands what ``_get_messages`` /
    ``_get_prompt`` return on to ``chat`` / ``complete`` unchanged, so these reach the decoder."""

    context: str = ""
    query: str | None = None


class _TemplatedMessages(_Templated, list):
    pass


class _TemplatedText(_Templated, str):
    pass


def _remember(formatted: Any, kind: type, prompt: Any, prompt_args: dict[str, Any]) -> Any:
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


def _watch_synthesizers() -> None:
    """Register :class:`_PolicyUsed` and :class:`_SynthesizeNodes` on LlamaIndex's root
    dispatcher (once)."""
    dispatcher = instrument.get_dispatcher()
    if not any(isinstance(h, _PolicyUsed) for h in dispatcher.event_handlers):
        dispatcher.add_event_handler(_PolicyUsed())
    if not any(isinstance(h, _SynthesizeNodes) for h in dispatcher.span_handlers):
        dispatcher.add_span_handler(_SynthesizeNodes())


def _parts(formatted: _Templated) -> list[Any] | None:
    """The template's context cut into the nodes of the synthesize call in progress
    (:func:`.nodes.split_node_context`), so that each is its own passage; None outside one."""
    calls = _SYNTH_CALLS.get()
    if not calls or not calls[-1].nodes:
        return None
    return split_node_context(formatted.context, calls[-1].nodes)


def _given(fn: Any, default: Any) -> bool:
    """Whether the user set a formatting hook (LlamaIndex fills in its own defaults)."""
    return fn is not None and fn is not default


class TokRAGLLM(CustomLLM):
    """A local causal LM (default: the packaged SmolLM2-135M-Instruct) as a LlamaIndex LLM.

    Every call that formats a prompt template with retrieved context (``context_str`` /
    ``context_msg``) decodes under ``policy``: the RAG context is the template as formatted,
    the retrieved tokens are where the context landed, the pure context is the question.
    Other calls are the plain model (``policy="llm"``). ``passages=[...]`` (nodes, strings,
    :class:`~tokrag_integrations.Passage` objects or (text, score) pairs, best first) decodes
    under ``policy`` with the package's own prompt. Per-call ``policy=``,
    ``max_new_tokens=``, ``stop=``, ``max_context_tokens=`` and ``policy_options=`` override
    the fields. Responses carry provenance in ``additional_kwargs`` and the trace in ``raw``;
    streams end with one empty-delta response carrying them.

    Example:
        >>> from llama_index.core import Settings
        >>> Settings.llm = TokRAGLLM(max_new_tokens=16)
        >>> r = Settings.llm.complete("What is Quillfeather?",
        ...                           passages=["Quillfeather is an aerospace company."])
        >>> r.raw["policy"]
        'tokrag'
    """

    model: str = Field(
        default="default",
        description=(
            "Model given to load_model(): 'default', a Hugging Face hub id in the local cache, "
            "a folder or a .gguf path (a loaded PreTrainedModel or LoadedModel is accepted as "
            "model= too; the field then holds its name)."
        ),
    )
    device: str | None = Field(default=None, description="load_model(device=): 'cpu', 'cuda'...")
    device_map: Any = Field(
        default=None, description="load_model(device_map=), e.g. 'auto' for a large model on GPUs."
    )
    dtype: str | None = Field(
        default=None, description="load_model(dtype=): 'float32', 'bfloat16', 'float16'."
    )
    model_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="load_model(model_kwargs=): from_pretrained arguments (attn_implementation...).",
    )
    tokenizer_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="load_model(tokenizer_kwargs=)."
    )
    trust_remote_code: StrictBool = Field(
        default=False, description="load_model(trust_remote_code=); a string is refused."
    )
    revision: str | None = Field(default=None, description="load_model(revision=) of a hub id.")
    temperature: float | None = Field(
        default=None, description="Only None or 0: every policy decodes greedily."
    )
    max_new_tokens: int = Field(
        default=MAX_NEW_TOKENS,
        gt=0,
        description="Answer budget in tokens (reported as num_output).",
    )
    policy: str = Field(
        default="tokrag", description="Decoding policy used when passages are given."
    )
    stop: list[str] | None = Field(default=None, description="Stop strings (EOS always stops).")
    max_context_tokens: int | None = Field(
        default=None, description="A tighter context budget than the model's window."
    )
    policy_options: dict[str, Any] = Field(
        default_factory=dict, description="Options of the policy (e.g. {'pr_norm': 'softmax'})."
    )
    load_options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for load_model() (device, dtype)."
    )
    citations: StrictBool | None = Field(
        default=None,
        description=(
            "Record which passage each token drew on (Trace.citations): None = where the policy "
            "reads the RAG context's attention anyway (tokrag), True / False = always / never."
        ),
    )
    batching: StrictBool = Field(
        default=True,
        description=(
            "Decode concurrent calls on the same model with the same settings together as one "
            "batch; False: one at a time."
        ),
    )

    base_url: str | None = Field(
        default=None,
        description=(
            "A tokrag serve server (http://host:8000/v1) that decodes instead of a local model; "
            "no model is loaded."
        ),
    )
    api_key: SecretStr | None = Field(
        default=None, description="The server's bearer token (default $TOKRAG_API_KEY)."
    )
    timeout: float = Field(
        default=120.0,
        description="Seconds a whole server call may take (retries and the whole answer included).",
    )
    max_retries: int = Field(
        default=2,
        description="Retries of a server request (connection errors, 408, 409, 429, 5xx; "
        "Retry-After), within timeout.",
    )
    max_response_mb: float = Field(
        default=REMOTE_MAX_RESPONSE_MB,
        description="The largest server answer read (MB of 2**20 bytes).",
    )

    _lm: Any = PrivateAttr()
    #: When a list, every finished call's GenerationResult is appended to it.
    _results: list[GenerationResult] | None = PrivateAttr(default=None)

    def __init__(self, lm: LoadedModel | None = None, **kwargs: Any) -> None:
        """Wrap ``lm`` (from :func:`tokrag_integrations.load_model`) or load ``model``."""
        if lm is not None and not isinstance(lm, LoadedModel):
            raise TypeError(
                f"lm must be a LoadedModel from tokrag_integrations.load_model(), got "
                f"{type(lm).__name__}; to load by name use TokRAGLLM(model=...)."
            )
        unknown = set(kwargs) - set(type(self).model_fields) - {"tokenizer"}
        if unknown:
            raise unknown_arguments("TokRAGLLM", unknown, [*type(self).model_fields, "tokenizer"])
        check_greedy(kwargs.get("temperature"), "TokRAGLLM")
        tokenizer = kwargs.pop("tokenizer", None)
        _watch_synthesizers()
        if kwargs.get("base_url") is not None:
            self._remote_init(lm, tokenizer, kwargs)
            return
        spec = kwargs.get("model", "default")
        if isinstance(spec, LoadedModel):
            lm = spec
        kwargs["model"] = model_label(spec)
        if kwargs.get("dtype") is not None:
            kwargs["dtype"] = str(kwargs["dtype"]).removeprefix("torch.")
        super().__init__(**kwargs)
        given = [k for k in LOAD_OPTIONS if kwargs.get(k) not in (None, False, {})]
        if lm is not None and (given or self.load_options or tokenizer is not None):
            raise ValueError(
                f"{', '.join(given or list(self.load_options) or ['tokenizer'])} apply to loading "
                "a model; this LoadedModel is already loaded"
            )
        if lm is None:
            options = given_options(
                tokenizer=tokenizer, **{k: getattr(self, k) for k in LOAD_FIELDS[1:]}
            )
            both = sorted(set(options) & set(self.load_options))
            if both:
                raise ValueError(f"{', '.join(both)} given both as arguments and in load_options")
            source = spec if not isinstance(spec, str) else self.model
            lm = load_model(source, **options, **self.load_options)
        self._lm = lm

    def _remote_init(self, lm: Any, tokenizer: Any, kwargs: dict[str, Any]) -> None:
        from ..server.client import RemoteModel

        local = [k for k in ("model", *LOAD_OPTIONS) if kwargs.get(k) not in (None, False, {})]
        local += ["lm"] * (lm is not None) + ["tokenizer"] * (tokenizer is not None)
        local += ["load_options"] * bool(kwargs.get("load_options"))
        if local:
            raise ValueError(
                f"{', '.join(local)} load a local model; with base_url= the server decodes with "
                "its own model: leave them out"
            )
        super().__init__(**kwargs)
        key = self.api_key.get_secret_value() if self.api_key is not None else None
        self._lm = RemoteModel(
            self.base_url,
            key,
            timeout=self.timeout,
            max_retries=self.max_retries,
            max_response_mb=self.max_response_mb,
        )

    @field_serializer("api_key")
    def _hidden(self, key: SecretStr | None) -> str | None:
        """``to_dict`` / ``to_json`` (and LlamaIndex's events) show the key as stars."""
        return None if key is None else str(key)

    @classmethod
    def class_name(cls) -> str:
        return "TokRAGLLM"

    @property
    def loaded_model(self) -> LoadedModel:
        """The underlying :class:`~tokrag_integrations.models.LoadedModel`."""
        if not isinstance(self._lm, LoadedModel):
            raise ValueError(
                "this TokRAGLLM decodes on a server (base_url=) and holds no model; "
                "TokRAGSynthesizer needs a local one: use the server through Settings.llm"
            )
        return self._lm

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self._lm.context_window,
            num_output=self.max_new_tokens,
            is_chat_model=self._lm.is_chat,
            model_name=self._lm.name,
        )

    # ------------------------------------------------------------------ prompt templates
    def _get_messages(self, prompt: Any, **prompt_args: Any) -> list[ChatMessage]:
        """LlamaIndex's formatting, remembering the template's context and question."""
        messages = super()._get_messages(prompt, **prompt_args)
        return _remember(messages, _TemplatedMessages, prompt, prompt_args)

    def _get_prompt(self, prompt: Any, **prompt_args: Any) -> str:
        """LlamaIndex's formatting, remembering the template's context and question."""
        return _remember(
            super()._get_prompt(prompt, **prompt_args), _TemplatedText, prompt, prompt_args
        )

    # ------------------------------------------------------------------ argument plumbing
    def _call_args(self, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """(passages for the core, keyword arguments for generate/stream)."""
        check_greedy(kwargs.get("temperature"), "TokRAGLLM")
        passages = node_passages(kwargs.get("passages"))
        opts = {**self.policy_options, **dict(kwargs.get("policy_options") or {})}
        gen_kw: dict[str, Any] = {
            "policy": kwargs.get("policy") or (self.policy if passages is not None else "llm"),
            "max_new_tokens": int(kwargs.get("max_new_tokens") or self.max_new_tokens),
            "stop": kwargs["stop"] if kwargs.get("stop") is not None else self.stop,
            "max_context_tokens": kwargs.get("max_context_tokens", self.max_context_tokens),
            "policy_options": opts,
        }
        if self.system_prompt is not None:
            gen_kw["system_prompt"] = self.system_prompt
        citations = kwargs.get("citations", self.citations)
        if citations is not None:
            gen_kw["citations"] = citations
        return passages, gen_kw

    def _prompt_args(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> tuple:
        # Without passages this is a plain LLM and formats as HuggingFaceLLM does.
        passages, gen_kw = self._call_args(kwargs)
        if passages is None and isinstance(prompt, _TemplatedText):
            rendered = RenderedPrompt(prompt.context, text=str(prompt), passages=_parts(prompt))
            return self._templated(prompt.query, kwargs, gen_kw, rendered, [])
        if not formatted:
            if _given(self.completion_to_prompt, default_completion_to_prompt):
                prompt = self.completion_to_prompt(prompt)
            elif self.system_prompt:
                prompt = f"{self.system_prompt} {prompt}"
        if passages is None:
            gen_kw["prompt_format"] = "text"
            gen_kw.pop("system_prompt", None)
        return prompt, passages, gen_kw

    def _templated(
        self,
        query: str | None,
        kwargs: dict[str, Any],
        gen_kw: dict[str, Any],
        rendered: RenderedPrompt,
        history: list[dict[str, str]],
    ) -> tuple:
        """(question, no passages, keyword arguments) for a template-formatted RAG prompt."""
        if not query or not query.strip():
            source = (
                rendered.text
                if rendered.text is not None
                else (rendered.messages or [{}])[-1].get("content", "")
            )
            query = source.replace(rendered.context, " ").strip() or "?"
        gen_kw["policy"] = kwargs.get("policy") or self.policy
        gen_kw["rendered"] = rendered
        if history:
            gen_kw["messages"] = history
        return query, None, gen_kw

    def _chat_args(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> tuple:
        passages, gen_kw = self._call_args(kwargs)
        if passages is None and isinstance(messages, _TemplatedMessages) and messages:
            turns = messages_to_dicts(messages)
            # The pure context keeps the conversation, not the template's own turns.
            history = [
                t
                for t in turns[:-1]
                if t["role"] != "system" and messages.context not in t["content"]
            ]
            rendered = RenderedPrompt(messages.context, messages=turns, passages=_parts(messages))
            return self._templated(messages.query, kwargs, gen_kw, rendered, history)
        if passages is None and _given(self.messages_to_prompt, generic_messages_to_prompt):
            gen_kw["prompt_format"] = "text"
            return self.messages_to_prompt(messages), passages, gen_kw
        turns = messages_to_turns(messages)
        if turns.history:
            gen_kw["messages"] = turns.history
        if turns.system_prompt is not None:  # the conversation's own system messages win
            gen_kw["system_prompt"] = turns.system_prompt
        query = turns.query
        if passages is None:
            gen_kw["prompt_format"] = "chat"
        return query, passages, gen_kw

    # ------------------------------------------------------------------ responses
    def _final(self, result: GenerationResult, text: str | None = None) -> CompletionResponse:
        """The response of a whole answer (a stream's last one, ``text`` so far and an empty
        delta, when ``text`` is given), with its provenance."""
        if self._results is not None:
            self._results.append(result)
        calls = _SYNTH_CALLS.get()
        if calls:
            calls[-1].result = result
            calls[-1].decoded |= {
                p.metadata["node_id"]
                for p in result.trace.passages
                if p.kept and "node_id" in p.metadata
            }
        return CompletionResponse(
            text=result.text if text is None else text,
            delta=None if text is None else "",
            additional_kwargs=result_summary(result),
            raw=result.trace.to_dict(),
        )

    def _backend(self, how: str, query: str, passages: Any, gen_kw: dict[str, Any]) -> Any:
        """``how`` (generate, stream, agenerate, astream_with_result) on the local model
        through the scheduler, or on the server (called when the call is made, streams
        included: its policy is noted for the synthesize call around it)."""
        calls = _SYNTH_CALLS.get()
        if calls:
            calls[-1].policy = gen_kw["policy"]
        return decode_on(self._lm, how, query, passages, batching=self.batching, **gen_kw)

    def _stream(self, query: str, passages: Any, gen_kw: dict[str, Any]) -> CompletionResponseGen:
        s = self._backend("stream", query, passages, gen_kw)

        def gen() -> CompletionResponseGen:
            text = ""
            for ev in s:
                if ev.text:
                    text += ev.text
                    yield _token(text, ev)
            yield self._final(s.result, text)

        return gen()

    def _astream(
        self, query: str, passages: Any, gen_kw: dict[str, Any]
    ) -> CompletionResponseAsyncGen:
        items = self._backend("astream_with_result", query, passages, gen_kw)

        async def gen() -> CompletionResponseAsyncGen:
            text = ""
            async for item in items:
                if isinstance(item, GenerationResult):
                    yield self._final(item, text)
                elif item.text:
                    text += item.text
                    yield _token(text, item)

        return gen()

    def _generate(self, query: str, passages: Any, gen_kw: dict[str, Any]) -> CompletionResponse:
        return self._final(self._backend("generate", query, passages, gen_kw))

    async def _agenerate(
        self, query: str, passages: Any, gen_kw: dict[str, Any]
    ) -> CompletionResponse:
        return self._final(await self._backend("agenerate", query, passages, gen_kw))

    # ------------------------------------------------------------------ completion
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Complete ``prompt`` (pure model, or ``policy`` over ``passages=``)."""
        return self._generate(*self._prompt_args(prompt, formatted, kwargs))

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        """Like :meth:`complete`, one response per chosen token (``delta`` = its text)."""
        return self._stream(*self._prompt_args(prompt, formatted, kwargs))

    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        """Async :meth:`complete`; the model runs in a worker thread."""
        return await self._agenerate(*self._prompt_args(prompt, formatted, kwargs))

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        """Async :meth:`stream_complete`; tokens are produced in a worker thread."""
        return self._astream(*self._prompt_args(prompt, formatted, kwargs))

    # ------------------------------------------------------------------ chat
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Answer the last user message; earlier messages become the chat history."""
        return _as_chat(self._generate(*self._chat_args(messages, kwargs)))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """Like :meth:`chat`, one response per chosen token (``delta`` = its text)."""
        return (_as_chat(c) for c in self._stream(*self._chat_args(messages, kwargs)))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Async :meth:`chat`; the model runs in a worker thread."""
        return _as_chat(await self._agenerate(*self._chat_args(messages, kwargs)))

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        """Async :meth:`stream_chat`; tokens are produced in a worker thread."""
        return (_as_chat(c) async for c in self._astream(*self._chat_args(messages, kwargs)))


def _token(text: str, ev: TokenEvent) -> CompletionResponse:
    return CompletionResponse(text=text, delta=ev.text, additional_kwargs={"source": ev.source})


def _as_chat(c: CompletionResponse) -> ChatResponse:
    return ChatResponse(
        message=ChatMessage(role=MessageRole.ASSISTANT, content=c.text),
        delta=c.delta,
        additional_kwargs=c.additional_kwargs,
        raw=c.raw,
    )


__all__ = ["TokRAGLLM"]
