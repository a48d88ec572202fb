"""TokRAGLLM: the local model as a LlamaIndex ``FunctionCallingLLM`` (pure model or a Tok-RAG
policy), with sampling, log-probabilities, tool calls and structured output by constrained
decoding."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import default_completion_to_prompt
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
    load_model,
    unknown_arguments,
)
from ..prompts import RenderedPrompt
from ..results import GenerationResult
from ..sampling import sampling_of
from . import function_calling
from .function_calling import ToolCalling
from .llm_responses import result_logprobs, token_response
from .nodes import messages_to_dicts, messages_to_turns, node_passages
from .structured_predict import StructuredOutput
from .synthesis_events import (
    TemplatedMessages,
    TemplatedText,
    node_parts,
    note_policy,
    note_result,
    remember,
    watch_synthesizers,
)

#: Per-call keywords (and fields) of how tokens are drawn and what they record.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "seed", "top_logprobs")


@dataclass
class _Call:
    """One decode: the question, the passages for the core, the core's keyword arguments,
    whether responses carry ``logprobs``, and the tools offered (their answer is parsed for
    calls)."""

    query: str
    passages: Any
    gen_kw: dict[str, Any]
    logprobs: bool = False
    tools: list[dict[str, Any]] | None = field(default=None)


def _given(fn: Any, default: Any) -> bool:
    """Whether the user set a formatting hook (LlamaIndex fills in its own defaults)."""
    return fn is not None and fn is not default


class TokRAGLLM(ToolCalling, StructuredOutput, FunctionCallingLLM):
    """A local causal LM (default: the packaged SmolLM2-135M-Instruct) as a LlamaIndex LLM.

    Every call that formats a prompt template with retrieved context (``context_str`` /
    ``context_msg``) decodes under ``policy``: the RAG context is the template as formatted,
    the retrieved tokens are where the context landed, the pure context is the question.
    Other calls are the plain model (``policy="no_rag"``). ``passages=[...]`` (nodes, strings,
    :class:`~tokrag_integrations.Passage` objects or (text, score) pairs, best first) decodes
    under ``policy`` with the package's own prompt. Per-call ``policy=``,
    ``max_new_tokens=``, ``stop=``, ``max_context_tokens=``, ``policy_options=`` and the
    sampling keywords (``temperature``, ``top_p``, ``top_k``, ``seed``, ``logprobs``,
    ``top_logprobs``) override the fields; ``constraint=`` (a JSON-schema, regex or grammar
    spec, as the engine takes it) masks every step. Responses carry provenance in
    ``additional_kwargs``, the trace in ``raw`` and, when asked, ``logprobs``; streams end
    with one empty-delta response carrying them.

    A ``FunctionCallingLLM``: ``chat_with_tools`` (and ``FunctionAgent``) render the tools
    with the model's chat template and constrain a call to their schemas; a turn answering
    tool results decodes under ``policy`` with the last result as retrieved text
    (:mod:`.function_calling`). ``structured_predict`` / ``as_structured_llm`` decode under
    the output class's JSON schema (:mod:`.structured_predict`).

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
        default=0.0,
        description=(
            "Sampling temperature in [0, 100]; 0 or None: greedy, exactly the policy's own "
            "tokens. With T > 0 the policy chooses each token's source distribution and the "
            "token is drawn from it (docs/algorithm.md)."
        ),
    )
    top_p: float = Field(
        default=1.0,
        description="Nucleus sampling: draw from the most likely tokens whose probability "
        "reaches top_p, in (0, 1] (1: no cut).",
    )
    top_k: int = Field(default=0, description="Draw from the k most likely tokens (0: no cut).")
    seed: int | None = Field(
        default=None,
        description=(
            "Seed of the sampling noise: the same seed, prompt and settings give the same "
            "answer alone or batched (None: one drawn per call, recorded in the trace)."
        ),
    )
    logprobs: StrictBool = Field(
        default=False,
        description=(
            "Responses carry `logprobs`: per generated token, [the token, then its "
            "top_logprobs alternatives], each a LogProb under the distribution it was taken from."
        ),
    )
    top_logprobs: int = Field(
        default=0,
        description="How many alternatives each token's logprobs lists (0..20); > 0 implies "
        "logprobs=True.",
    )
    max_tool_rounds: int | None = Field(
        default=None,
        ge=0,
        description=(
            "After this many rounds of tool calls since the last user message, tools are no "
            "longer offered (tool_choice='none'): the model answers from their results. "
            "None: no limit. A small model under 'auto' may call tools again and again."
        ),
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
        sampling_of(**{k: kwargs.get(k) for k in SAMPLING_KEYS})  # a bad value fails here
        tokenizer = kwargs.pop("tokenizer", None)
        watch_synthesizers()
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
            is_function_calling_model=True,
            model_name=self._lm.name,
        )

    # ------------------------------------------------------------------ prompt templates
    def _get_messages(self, prompt: Any, **prompt_args: Any) -> list[ChatMessage]:
        """LlamaIndex's formatting, remembering the template's context and question."""
        messages = super()._get_messages(prompt, **prompt_args)
        return remember(messages, TemplatedMessages, prompt, prompt_args)

    def _get_prompt(self, prompt: Any, **prompt_args: Any) -> str:
        """LlamaIndex's formatting, remembering the template's context and question."""
        return remember(
            super()._get_prompt(prompt, **prompt_args), TemplatedText, prompt, prompt_args
        )

    # ------------------------------------------------------------------ argument plumbing
    def _sampling(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """(the sampling keywords for the core that differ from greedy's defaults, whether
        responses carry logprobs), per-call values over the fields, checked."""
        values = {
            k: kwargs[k] if kwargs.get(k) is not None else getattr(self, k) for k in SAMPLING_KEYS
        }
        sampling_of(**values)
        defaults = {"temperature": 0, "top_p": 1, "top_k": 0, "seed": None, "top_logprobs": 0}
        out = {k: v for k, v in values.items() if v is not None and v != defaults[k]}
        wanted = kwargs.get("logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise ValueError(f"logprobs must be True or False, got {wanted!r}")
        return out, bool(self.logprobs if wanted is None else wanted) or bool(
            values["top_logprobs"]
        )

    def _call_args(self, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any], bool]:
        """(passages for the core, keyword arguments for generate/stream, whether responses
        carry logprobs)."""
        passages = node_passages(kwargs.get("passages"))
        opts = {**self.policy_options, **dict(kwargs.get("policy_options") or {})}
        sampling, logprobs = self._sampling(kwargs)
        gen_kw: dict[str, Any] = {
            "policy": kwargs.get("policy") or (self.policy if passages is not None else "no_rag"),
            "max_new_tokens": int(kwargs.get("max_new_tokens") or self.max_new_tokens),
            "stop": kwargs["stop"] if kwargs.get("stop") is not None else self.stop,
            "max_context_tokens": kwargs.get("max_context_tokens", self.max_context_tokens),
            "policy_options": opts,
            **sampling,
        }
        if kwargs.get("constraint") is not None:
            gen_kw["constraint"] = kwargs["constraint"]
        if self.system_prompt is not None:
            gen_kw["system_prompt"] = self.system_prompt
        citations = kwargs.get("citations", self.citations)
        if citations is not None:
            gen_kw["citations"] = citations
        return passages, gen_kw, logprobs

    def _prompt_args(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> _Call:
        # Without passages this is a plain LLM and formats as HuggingFaceLLM does.
        passages, gen_kw, logprobs = self._call_args(kwargs)
        if passages is None and isinstance(prompt, TemplatedText):
            rendered = RenderedPrompt(prompt.context, text=str(prompt), passages=node_parts(prompt))
            return self._templated(prompt.query, kwargs, gen_kw, rendered, [], logprobs)
        if not formatted:
            if _given(self.completion_to_prompt, default_completion_to_prompt):
                prompt = self.completion_to_prompt(prompt)
            elif self.system_prompt:
                prompt = f"{self.system_prompt} {prompt}"
        if passages is None:
            gen_kw["prompt_format"] = "text"
            gen_kw.pop("system_prompt", None)
        return _Call(prompt, passages, gen_kw, logprobs)

    def _templated(
        self,
        query: str | None,
        kwargs: dict[str, Any],
        gen_kw: dict[str, Any],
        rendered: RenderedPrompt,
        history: list[dict[str, str]],
        logprobs: bool,
    ) -> _Call:
        """The call of a template-formatted RAG prompt (no passages: ``rendered`` holds them)."""
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
        return _Call(query, None, gen_kw, logprobs)

    def _chat_args(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> _Call:
        passages, gen_kw, logprobs = self._call_args(kwargs)
        if kwargs.get("tools"):
            specs = function_calling.specs_of(kwargs["tools"])
            choice = function_calling.choice_of(kwargs.get("tool_choice"), specs)
            rounds = function_calling.tool_rounds(messages)
            if self.max_tool_rounds is not None and rounds >= self.max_tool_rounds:
                choice = "none"
            query, gen_kw = function_calling.tool_turn(
                self._lm,
                messages,
                specs,
                choice,
                gen_kw,
                policy=kwargs.get("policy") or self.policy,
                passages=passages,
                parallel=kwargs.get("parallel_tool_calls", True) is not False,
            )
            return _Call(query, passages, gen_kw, logprobs, specs if choice != "none" else None)
        if passages is None and isinstance(messages, TemplatedMessages) and messages:
            turns = messages_to_dicts(messages)
            # The pure context keeps the conversation, not the template's own turns.
            history = [
                t
                for t in turns[:-1]
                if t["role"] != "system" and messages.context not in t["content"]
            ]
            rendered = RenderedPrompt(
                messages.context, messages=turns, passages=node_parts(messages)
            )
            return self._templated(messages.query, kwargs, gen_kw, rendered, history, logprobs)
        if passages is None and _given(self.messages_to_prompt, generic_messages_to_prompt):
            gen_kw["prompt_format"] = "text"
            return _Call(self.messages_to_prompt(messages), passages, gen_kw, logprobs)
        turns = messages_to_turns(messages)
        if turns.history:
            gen_kw["messages"] = turns.history
        if turns.system_prompt is not None:  # the conversation's own system messages win
            gen_kw["system_prompt"] = turns.system_prompt
        if passages is None:
            gen_kw["prompt_format"] = "chat"
        return _Call(turns.query, passages, gen_kw, logprobs)

    # ------------------------------------------------------------------ responses
    def _final(
        self, call: _Call, result: GenerationResult, text: str | None = None
    ) -> CompletionResponse:
        """The response of a whole answer (a stream's last one, ``text`` so far and an empty
        delta, when ``text`` is given), with its provenance and, when asked, its logprobs."""
        if self._results is not None:
            self._results.append(result)
        note_result(result)
        return CompletionResponse(
            text=result.text if text is None else text,
            delta=None if text is None else "",
            additional_kwargs=result_summary(result),
            raw=result.trace.to_dict(),
            logprobs=result_logprobs(result) if call.logprobs else None,
        )

    def _backend(self, how: str, call: _Call) -> Any:
        """``how`` (generate, stream, agenerate, astream_with_result) on the local model
        through the scheduler, or on the server (called when the call is made, streams
        included: its policy is noted for the synthesize call around it)."""
        note_policy(call.gen_kw["policy"])
        return decode_on(
            self._lm, how, call.query, call.passages, batching=self.batching, **call.gen_kw
        )

    def _stream(self, call: _Call) -> CompletionResponseGen:
        s = self._backend("stream", call)

        def gen() -> CompletionResponseGen:
            text = ""
            for ev in s:
                if ev.text:
                    text += ev.text
                    yield token_response(text, ev, call.logprobs)
            yield self._final(call, s.result, text)

        return gen()

    def _astream(self, call: _Call) -> CompletionResponseAsyncGen:
        items = self._backend("astream_with_result", call)

        async def gen() -> CompletionResponseAsyncGen:
            text = ""
            async for item in items:
                if isinstance(item, GenerationResult):
                    yield self._final(call, item, text)
                elif item.text:
                    text += item.text
                    yield token_response(text, item, call.logprobs)

        return gen()

    def _generate(self, call: _Call) -> CompletionResponse:
        return self._final(call, self._backend("generate", call))

    async def _agenerate(self, call: _Call) -> CompletionResponse:
        return self._final(call, await self._backend("agenerate", call))

    # ------------------------------------------------------------------ completion
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Complete ``prompt`` (pure model, or ``policy`` over ``passages=``)."""
        return self._generate(self._prompt_args(prompt, formatted, kwargs))

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        """Like :meth:`complete`, one response per chosen token (``delta`` = its text)."""
        return self._stream(self._prompt_args(prompt, formatted, kwargs))

    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        """Async :meth:`complete`; the model runs in a worker thread."""
        return await self._agenerate(self._prompt_args(prompt, formatted, kwargs))

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        """Async :meth:`stream_complete`; tokens are produced in a worker thread."""
        return self._astream(self._prompt_args(prompt, formatted, kwargs))

    # ------------------------------------------------------------------ chat
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Answer the last user message (or the tool results after it); earlier messages
        become the chat history. ``tools=`` (LlamaIndex tools or OpenAI tool dicts),
        ``tool_choice=`` and ``parallel_tool_calls=`` (False: the answer ends with its first
        call) offer tools, as :meth:`chat_with_tools` does."""
        call = self._chat_args(messages, kwargs)
        return function_calling.chat_response(self._generate(call), call.tools)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """Like :meth:`chat`, one response per chosen token (``delta`` = its text; a tool
        call's text is not streamed: the last response carries the call)."""
        call = self._chat_args(messages, kwargs)
        return function_calling.chat_stream(self._stream(call), call.tools)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Async :meth:`chat`; the model runs in a worker thread."""
        call = self._chat_args(messages, kwargs)
        return function_calling.chat_response(await self._agenerate(call), call.tools)

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        """Async :meth:`stream_chat`; tokens are produced in a worker thread."""
        call = self._chat_args(messages, kwargs)
        return function_calling.achat_stream(self._astream(call), call.tools)


__all__ = ["TokRAGLLM"]
