"""``ChatTokRAG``: a LangChain chat model over a local model decoded by the Tok-RAG core."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from pydantic import (
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    StrictBool,
    field_validator,
    model_validator,
)

from ..adapters.translate import decode_on, given_options, model_label
from ..defaults import MAX_NEW_TOKENS, REMOTE_MAX_RESPONSE_MB
from ..models import LOAD_FIELDS, LoadedModel, load_model, unknown_arguments
from ..results import GenerationResult, TokenEvent
from .calls import Call, prepare_call
from .chat_options import SAMPLING_FIELDS, logprobs_metadata, sampling_options
from .messages import (
    final_metadata,
    token_metadata,
    usage_metadata,
)
from .structured_output import structured_runnable
from .tools import (
    HeldText,
    call_chunks,
    checked_tool_choice,
    langchain_calls,
    parsed_calls,
    tool_specs,
    unsent,
)

_MODEL_CACHE: dict[tuple[str, str], LoadedModel] = {}
_MODEL_CACHE_LOCK = threading.Lock()


def _load_cached(name: str, options: dict[str, Any]) -> LoadedModel:
    """Load a model by name or path once per process and set of load options."""
    options = given_options(**options)
    key = (name, repr(sorted(options.items())))
    with _MODEL_CACHE_LOCK:
        if key not in _MODEL_CACHE:
            _MODEL_CACHE[key] = load_model(name, **options)
        return _MODEL_CACHE[key]


class ChatTokRAG(BaseChatModel):
    """Chat model over a local causal LM decoded with a Tok-RAG policy.

    System messages become the system prompt, the last human message the question, earlier
    turns the history. With ``passages`` (the field, a call keyword or ``.bind(passages=)``)
    the answer is decoded under ``policy``. With ``context=`` (a call keyword: the text a
    prompt template's context variable received) the messages are the RAG context as
    formatted, the retrieved tokens are where ``context`` lands, and the pure context is
    ``question=`` (default: the last human message without the context) after the turns
    that do not hold the context; ``passages=`` then are the documents ``context`` holds, in
    its order (each its own passage: citations name it). Without either (LangChain's own RAG
    chains), the documents the run's retrievers returned before the call are looked up in the
    messages (:mod:`.retrieved`): the span from the first found to the last is ``context=``,
    the found documents its passages; with none found (LangGraph's recipe), the text a prompt
    template's ``context`` / ``documents`` variable received in the run. With no
    retrieved text it is the plain model (policy ``"no_rag"``, as ``ChatHuggingFace``); unless
    ``policy="no_rag"`` was asked for, the first such call of an instance warns
    (:data:`NO_PASSAGES_WARNING`). ``response_metadata["retrieval"]`` says on every call where
    the retrieved text came from (``source``) and, for a run's documents, how many were
    ``found`` in the prompt, how many are ``missing`` and why (``note``).

    ``response_metadata`` holds ``token_sources`` (per generated token: ``"agree"``,
    ``"rag"``, ``"no_rag"``...), ``token_ids``, the ``trace`` as a dict and ``citations``
    (:meth:`~tokrag_integrations.trace.Trace.citations_data`: the answer's spans, each with
    the passage it is cited to, its score and the document's ``metadata``, ``id`` included).
    Streaming yields one ``AIMessageChunk`` per token (``token_sources == [source]``); the
    last chunk (``chunk_position="last"``) carries usage, the trace and the citations.

    As a chat model (ChatOpenAI's names, fields and per-call keywords): ``temperature``,
    ``top_p``, ``top_k``, ``seed`` (:mod:`.chat_options`), ``logprobs`` / ``top_logprobs``
    (``response_metadata["logprobs"]``), :meth:`with_structured_output` and
    ``response_format=`` (:mod:`.structured_output`), :meth:`bind_tools` (:mod:`.tools`).

        >>> from langchain_core.documents import Document
        >>> docs = [Document("Quillfeather Aerospace was founded in 1994 by Ottoline Varga.")]
        >>> msg = ChatTokRAG(max_tokens=16).invoke("Who founded Quillfeather?", passages=docs)
        >>> msg.response_metadata["policy"], msg.response_metadata["retrieval"]["source"]
        ('tokrag', 'passages')
    """

    model_config = ConfigDict(populate_by_name=True, extra="forbid")

    model_name: str = Field(default="default", alias="model")
    """What :func:`tokrag_integrations.load_model` takes (loaded on first use, shared per
    process), a ``LoadedModel``, or a loaded ``PreTrainedModel`` with ``tokenizer=``."""
    device: str | None = None
    """Device used when the model is loaded by name (default: CUDA when available)."""
    device_map: Any = None
    """``load_model(device_map=)``, e.g. ``"auto"`` for a large model over the GPUs."""
    dtype: str | None = None
    """``load_model(dtype=)``: ``"float32"``, ``"bfloat16"``, ``"float16"``."""
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """``load_model(model_kwargs=)``: ``from_pretrained`` arguments."""
    tokenizer_kwargs: dict[str, Any] = Field(default_factory=dict)
    """``load_model(tokenizer_kwargs=)``."""
    trust_remote_code: StrictBool = False
    """``load_model(trust_remote_code=)`` (``True`` or ``False``; a string is refused)."""
    revision: str | None = None
    """``load_model(revision=)`` of a hub id."""
    tokenizer: Any = Field(default=None, exclude=True)
    """``load_model(tokenizer=)``: a tokenizer object or where to load one from."""
    policy: str = "tokrag"
    """Decoding policy used when passages are given (``"tokrag"``, ``"rag"``, ``"cad"``...)."""
    policy_options: dict[str, Any] = Field(default_factory=dict)
    """Options of the policy (e.g. ``{"pr_norm": "softmax"}``)."""
    passages: list[Any] | None = None
    """Default passages (Documents, strings or ``Passage`` objects), ranked best first."""
    max_tokens: int = MAX_NEW_TOKENS
    """Maximum number of generated tokens."""
    stop: list[str] | None = None
    """Stop strings (cut from the answer); a call's ``stop`` replaces these."""
    max_context_tokens: int | None = None
    """A context budget tighter than the model's window (lowest-ranked passages drop first)."""
    citations: StrictBool | None = None
    """Read which passage each token drew on (``generate(citations=)``): None, the engine's
    default (on for ``tokrag`` / ``tokrag_authors``); ``False``: none."""
    temperature: float | None = None
    """Sampling temperature; ``None`` or ``0``: greedy, today's tokens. Above 0 the policy still
    picks the context of each token and the token is drawn from that context's distribution
    (docs/algorithm.md)."""
    top_p: float | None = None
    """Nucleus sampling: the smallest set of tokens whose probability reaches ``top_p``, in
    (0, 1] (``temperature`` > 0 only)."""
    top_k: int | None = None
    """Sample among the ``top_k`` most likely tokens (0 or None: no cut)."""
    seed: int | None = None
    """Seed of the sampler: the same seed gives the same answer alone, batched or served."""
    logprobs: StrictBool | None = None
    """Put each generated token's log-probability in ``response_metadata["logprobs"]``
    (``{"content": [...]}``, ChatOpenAI's format)."""
    top_logprobs: int | None = None
    """How many most likely alternatives each token's entry lists (0..20; needs
    ``logprobs=True``)."""
    streaming: StrictBool = False
    """Whether ``invoke`` runs through the token stream (callbacks see every token)."""
    batching: StrictBool = True
    """Decode concurrent calls on the same model with the same settings together as one
    batch (:mod:`tokrag_integrations.engine.scheduler`); ``False``: one at a time."""
    base_url: str | None = None
    """A ``tokrag serve`` server (``http://host:8000/v1``) that decodes instead of a local
    model (:class:`~tokrag_integrations.server.client.RemoteModel`); no model is loaded."""
    api_key: SecretStr | None = None
    """The server's bearer token (default ``$TOKRAG_API_KEY``); never shown."""
    timeout: float = 120.0
    """Seconds a whole server call may take: retries, waits and the whole answer or stream
    included (``base_url`` only)."""
    max_retries: int = 2
    """Retries of a server request on connection errors, 408, 409, 429 and 5xx, after
    ``Retry-After`` when the server sends it, within ``timeout`` (``base_url`` only)."""
    max_response_mb: float = REMOTE_MAX_RESPONSE_MB
    """The largest server answer read, in MB of 2**20 bytes (``base_url`` only)."""

    _lm: Any = PrivateAttr(default=None)
    _warned_no_passages: bool = PrivateAttr(default=False)

    def __init__(self, **kwargs: Any) -> None:
        lm = kwargs.get("model", kwargs.get("model_name"))
        if lm is not None and not isinstance(lm, str):
            kwargs.pop("model_name", None)
            kwargs["model"] = model_label(lm)
        if kwargs.get("dtype") is not None:
            kwargs["dtype"] = str(kwargs["dtype"]).removeprefix("torch.")
        super().__init__(**kwargs)
        if self.base_url is not None:
            from ..server.client import RemoteModel

            local = [k for k in ("model", "model_name", *LOAD_FIELDS) if k in kwargs]
            if local:
                raise ValueError(
                    f"{', '.join(local)} load a local model; with base_url= the server decodes "
                    "with its own model: leave them out"
                )
            key = self.api_key.get_secret_value() if self.api_key is not None else None
            self._lm = RemoteModel(
                self.base_url,
                key,
                timeout=self.timeout,
                max_retries=self.max_retries,
                max_response_mb=self.max_response_mb,
            )
        elif isinstance(lm, LoadedModel):
            given = given_options(**{k: kwargs.get(k) for k in LOAD_FIELDS if k != "device"})
            if given:
                raise ValueError(
                    f"{', '.join(given)} apply to loading a model; this LoadedModel is already loaded"
                )
            self._lm = lm
        elif lm is not None and not isinstance(lm, (str, os.PathLike)):
            self._lm = load_model(lm, **self._load_options())

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_arguments(cls, values: Any) -> Any:
        if isinstance(values, dict):
            known = {a for n, f in cls.model_fields.items() for a in (n, f.alias) if a}
            unknown = set(values) - known
            if unknown:  # extra="forbid" would say so too, without naming the accepted ones
                error = unknown_arguments("ChatTokRAG", unknown, known)
                raise ValueError(f"Extra inputs are not permitted: {error}")
        return values

    @model_validator(mode="after")
    def _check_sampling(self) -> ChatTokRAG:
        sampling_options({k: getattr(self, k) for k in SAMPLING_FIELDS})
        return self

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"max_tokens must be >= 1, got {v}")
        return v

    # ------------------------------------------------------------------ LangChain hooks
    @property
    def _llm_type(self) -> str:
        return "tokrag"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "policy": self.policy,
            "policy_options": dict(self.policy_options),
            "max_tokens": self.max_tokens,
            "stop": self.stop,
            "max_context_tokens": self.max_context_tokens,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        model = kwargs.get("model", self.model_name)
        params = LangSmithParams(
            ls_provider="tokrag",
            ls_model_name=model.name if isinstance(model, LoadedModel) else str(model),
            ls_model_type="chat",
            ls_temperature=float(kwargs.get("temperature", self.temperature) or 0.0),
            ls_max_tokens=int(kwargs.get("max_tokens", self.max_tokens)),
        )
        stops = stop if stop is not None else self.stop
        if stops:
            params["ls_stop"] = list(stops)
        return params

    # ------------------------------------------------------------------ translation
    @property
    def loaded_model(self) -> LoadedModel:
        """The model this instance decodes with (loaded by name on first access)."""
        if self._lm is None:
            self._lm = _load_cached(self.model_name, self._load_options())
        return self._lm

    def _load_options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`~tokrag_integrations.load_model` set on this model."""
        return given_options(**{k: getattr(self, k) for k in LOAD_FIELDS})

    def _resolve_model(self, model: Any) -> Any:
        if self.base_url is not None:
            if model not in (None, self.model_name):
                raise ValueError("model= per call: with base_url= the server's model decodes")
            return self._lm
        if model is None:
            return self.loaded_model
        if isinstance(model, LoadedModel):
            return model
        if isinstance(model, str):
            if model == self.model_name:
                return self.loaded_model
            return _load_cached(model, self._load_options())
        raise TypeError(
            f"model must be a model name, a path or a LoadedModel, not {type(model).__name__}"
        )

    def _prepare(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        kwargs: dict[str, Any],
        run_manager: Any = None,
    ) -> Call:
        """Messages and call options -> arguments of the core API (validated here)."""
        return prepare_call(self, messages, stop, kwargs, run_manager)

    @staticmethod
    def _answer(result: GenerationResult, call: Call) -> tuple[str, dict[str, Any], dict[str, Any]]:
        """(the answer's text, its ``tool_calls`` / ``invalid_tool_calls``, its metadata but
        the per-token lists)."""
        metadata = {**final_metadata(result, call.lm), "retrieval": call.retrieval}
        content, calls, invalid = result.text, [], []
        if call.tools is not None:
            content, calls, invalid = parsed_calls(result.text)
            if calls:
                metadata["finish_reason"] = "tool_calls"
        return content, {"calls": calls, "invalid": invalid}, metadata

    @classmethod
    def _result(cls, result: GenerationResult, call: Call) -> ChatResult:
        steps = result.trace.steps
        content, calls, final = cls._answer(result, call)
        metadata = {
            **token_metadata([s.source for s in steps], [s.token_id for s in steps]),
            **final,
        }
        if call.logprobs:
            metadata["logprobs"] = {"content": result.logprobs}
        message = AIMessage(
            content=content,
            tool_calls=langchain_calls(calls["calls"]),
            invalid_tool_calls=calls["invalid"],
            response_metadata=metadata,
            usage_metadata=usage_metadata(result),
        )
        info = {"finish_reason": metadata["finish_reason"]}
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)])

    @staticmethod
    def _token_chunk(ev: TokenEvent, eos_ids: set[int], call: Call, text: str) -> ChatGenerationChunk:
        """A token's chunk, ``text`` the answer text it adds (held back while it may be part
        of a tool call)."""
        # The EOS step only flushes text held back as a possible start of a stop string.
        if ev.token_id in eos_ids:
            return ChatGenerationChunk(message=AIMessageChunk(content=text))
        meta = token_metadata([ev.source], [ev.token_id])
        if call.logprobs:
            meta.update(logprobs_metadata([ev.step]))
        return ChatGenerationChunk(message=AIMessageChunk(content=text, response_metadata=meta))

    @classmethod
    def _last_chunk(cls, result: GenerationResult, call: Call, sent: str) -> ChatGenerationChunk:
        """The last chunk: the metadata of the whole answer, the text not sent yet (``sent``:
        what the token chunks held) and the tool calls."""
        content, calls, metadata = cls._answer(result, call)
        message = AIMessageChunk(
            content=unsent(content, sent),
            # (a malformed call block stays in the text, as in invoke's content)
            tool_call_chunks=call_chunks(calls["calls"]),
            response_metadata=metadata,
            usage_metadata=usage_metadata(result),
            chunk_position="last",
        )
        return ChatGenerationChunk(
            message=message, generation_info={"finish_reason": metadata["finish_reason"]}
        )

    def _decode(self, how: str, call: Call) -> Any:
        """``how`` (generate, stream, agenerate, astream_with_result) on the local model
        through the scheduler, or on the server."""
        return decode_on(
            call.lm, how, call.query, call.passages, batching=self.batching, **call.kwargs
        )

    # ------------------------------------------------------------------ sync
    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        call = self._prepare(messages, stop, kwargs, run_manager)
        return self._result(self._decode("generate", call), call)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        call = self._prepare(messages, stop, kwargs, run_manager)
        tokens = self._decode("stream", call)
        eos = set(call.lm.eos_token_ids)
        held = HeldText(call.tools is not None)
        for ev in tokens:
            chunk = self._token_chunk(ev, eos, call, held.push(ev.text))
            if run_manager:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk
        yield self._last_chunk(tokens.result, call, held.sent)

    # ------------------------------------------------------------------ async
    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        # may load the model
        call = await asyncio.to_thread(self._prepare, messages, stop, kwargs, run_manager)
        return self._result(await self._decode("agenerate", call), call)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        # may load the model
        call = await asyncio.to_thread(self._prepare, messages, stop, kwargs, run_manager)
        eos = set(call.lm.eos_token_ids)
        held = HeldText(call.tools is not None)
        async for item in self._decode("astream_with_result", call):
            if isinstance(item, GenerationResult):
                yield self._last_chunk(item, call, held.sent)
                continue
            chunk = self._token_chunk(item, eos, call, held.push(item.text))
            if run_manager:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    # ------------------------------------------------------------------ tools, structured output
    def bind_tools(
        self,
        tools: Sequence[Any],
        *,
        tool_choice: Any = None,
        parallel_tool_calls: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (LangChain tools, pydantic classes, functions, OpenAI tool dicts): they
        are shown to the model, its calls are constrained to their schemas and parsed into
        ``AIMessage.tool_calls`` (:mod:`.tools`). ``tool_choice``: ``"auto"`` (None), ``"none"``,
        ``"required"`` / ``"any"`` / ``True`` or a tool's name (a forced call).
        ``parallel_tool_calls``: ``True`` lets one answer hold several calls; by default (None,
        ``False``) the answer ends after its first call (a small model repeats a call it was
        made to start until ``max_tokens``).

        Raises:
            ValueError: ``tool_choice`` names no bound tool, or two tools share a name.
        """
        specs = tool_specs(tools)
        choice = checked_tool_choice(tool_choice, specs)
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return self.bind(tools=specs, tool_choice=choice, **kwargs)

    def with_structured_output(
        self,
        schema: Any = None,
        *,
        method: str = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, Any]:
        """A runnable whose answer is ``schema``'s JSON by constrained decoding, parsed (a
        pydantic instance for a pydantic class, else a dict); ``schema``: a pydantic class, a
        TypedDict or a JSON-schema dict. ``method``: ``"json_schema"`` (default),
        ``"json_mode"`` or ``"function_calling"``; ``include_raw=True``: ``{"raw", "parsed",
        "parsing_error"}``. ``strict`` is accepted for ChatOpenAI's signature: the constraint
        is always strict. :mod:`.structured_output` says more."""
        return structured_runnable(self, schema, method, include_raw, kwargs)
