"""TokRAGLLM: the local model as a LlamaIndex ``CustomLLM`` (pure model or a Tok-RAG policy)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
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
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.llm import default_completion_to_prompt
from pydantic import StrictBool

from ..adapters.translate import LOAD_FIELDS, given_options, jsonable, model_label, result_summary
from ..defaults import MAX_NEW_TOKENS
from ..engine import scheduler
from ..models import LOAD_OPTIONS, LoadedModel, check_greedy, load_model, unknown_arguments
from ..prompts import RenderedPrompt
from ..results import GenerationResult, TokenEvent
from .nodes import messages_to_dicts, messages_to_turns, to_passages

#: Template variables that carry retrieved text in LlamaIndex's prompts (text QA, summary
#: and chat-engine context templates: ``context_str``; refine templates: ``context_msg``).
CONTEXT_VARIABLES = ("context_str", "context_msg")
#: Template variables that carry the question.
QUERY_VARIABLES = ("query_str", "question")


class _TemplatedMessages(list):
    """Chat messages formatted from a prompt template whose context variable held retrieved
    text; ``context`` is that text and ``query`` the question. LlamaIndex hands the list
    returned by :meth:`TokRAGLLM._get_messages` on to :meth:`TokRAGLLM.chat` (and its
    stream/async forms) unchanged, so the template's variables reach the decoder."""

    context: str = ""
    query: str | None = None


class _TemplatedText(str):
    """A prompt string formatted from such a template (the completion path of
    :meth:`TokRAGLLM._get_prompt`), with the same two attributes."""

    context: str = ""
    query: str | None = None


def _template_inputs(prompt_args: dict[str, Any]) -> tuple[str, str | None] | None:
    """(context, question) from a prompt template's arguments (partially formatted ones
    included: LlamaIndex's synthesizers fill ``query_str`` in first), or None if none holds
    context."""
    value = next((prompt_args[k] for k in CONTEXT_VARIABLES if k in prompt_args), None)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        value = str(value)  # simple_summarize passes its one truncated chunk as a list
    if not isinstance(value, str):
        return None
    context = value
    query = next((prompt_args[k] for k in QUERY_VARIABLES if isinstance(prompt_args.get(k), str)), None)
    return context, query


def _remember(formatted: Any, kind: type, prompt: Any, prompt_args: dict[str, Any]) -> Any:
    """``formatted`` as a ``kind`` carrying the template's context and question, or as it is
    when no template variable held retrieved context."""
    found = _template_inputs({**(getattr(prompt, "kwargs", None) or {}), **prompt_args})
    if found is None:
        return formatted
    out = kind(formatted)
    out.context, out.query = found
    return out


def _given(fn: Any, default: Any) -> bool:
    """Whether the user set a formatting hook (LlamaIndex fills in its own defaults)."""
    return fn is not None and fn is not default


class TokRAGLLM(CustomLLM):
    """A local causal LM (default: the packaged SmolLM2-135M-Instruct) as a LlamaIndex LLM.

    Set as ``Settings.llm`` (or passed as ``llm=``), every LlamaIndex call that formats a
    prompt template with retrieved context (``context_str`` / ``context_msg``: every response
    mode of the query engines, the ``context`` and ``condense_plus_context`` chat engines)
    decodes under ``policy``: the RAG context is the template exactly as formatted, its
    retrieved tokens are where the context landed, and the pure context is the question alone.
    Calls without retrieved context (a condense step, selectors, ``structured_predict``) are
    the plain model (``policy="llm"``) and say so in their response. ``passages=[...]``
    (nodes, strings, :class:`~tokrag_integrations.Passage` objects or (text, score) pairs, best
    first) given to any method decodes under ``policy`` with the package's own prompt instead.
    Per-call ``policy=``, ``max_new_tokens=``, ``stop=``, ``max_context_tokens=`` and
    ``policy_options=`` override the fields. The model runs in a worker thread in the async
    methods. Responses carry provenance in ``additional_kwargs`` (policy, counts per source,
    stop reason, warnings) and the full trace as a dict in ``raw``; streams end with one
    empty-delta response carrying them.

    Example:
        >>> Settings.llm = TokRAGLLM()
        >>> Settings.llm.complete("What is Quillfeather?", passages=["Quillfeather is ..."])
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
    batching: StrictBool = Field(
        default=True,
        description=(
            "Concurrent calls on the same model with the same settings (asyncio.gather over "
            "acomplete/achat, threads, streams included) are decoded together as one batch, "
            "each with the tokens it gets alone; False decodes them one at a time."
        ),
    )

    _lm: LoadedModel = PrivateAttr()
    #: When a list, every finished call's GenerationResult is appended to it (the
    #: synthesizer's template path reads its calls' traces back this way).
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

    @classmethod
    def class_name(cls) -> str:
        return "TokRAGLLM"

    @property
    def loaded_model(self) -> LoadedModel:
        """The underlying :class:`~tokrag_integrations.models.LoadedModel`."""
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
        return _remember(super()._get_prompt(prompt, **prompt_args), _TemplatedText, prompt, prompt_args)

    # ------------------------------------------------------------------ argument plumbing
    def _call_args(self, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """(passages for the core, keyword arguments for generate/stream)."""
        check_greedy(kwargs.get("temperature"), "TokRAGLLM")
        passages = to_passages(kwargs.get("passages"))
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
        return passages, gen_kw

    def _prompt_args(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> tuple:
        # Without passages this is a plain LLM and formats as HuggingFaceLLM does: the prompt
        # (after completion_to_prompt, or behind the system prompt, when not formatted) is
        # sent as is; the question-answer framing is only for RAG prompts.
        passages, gen_kw = self._call_args(kwargs)
        if passages is None and isinstance(prompt, _TemplatedText):
            rendered = RenderedPrompt(prompt.context, text=str(prompt))
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
            source = rendered.text if rendered.text is not None else (rendered.messages or [{}])[-1].get("content", "")
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
            # The pure context keeps the conversation (chat engines' history), not the
            # template's own turns: those holding the context, the system turn and the last.
            history = [
                t for t in turns[:-1] if t["role"] != "system" and messages.context not in t["content"]
            ]
            rendered = RenderedPrompt(messages.context, messages=turns)
            return self._templated(messages.query, kwargs, gen_kw, rendered, history)
        if passages is None and _given(self.messages_to_prompt, generic_messages_to_prompt):
            gen_kw["prompt_format"] = "text"
            return self.messages_to_prompt(messages), passages, gen_kw
        history, query = messages_to_turns(messages)
        if history:
            gen_kw["messages"] = history
        if passages is None:
            gen_kw["prompt_format"] = "chat"
        return query, passages, gen_kw

    # ------------------------------------------------------------------ response builders
    def _record(self, result: GenerationResult) -> GenerationResult:
        if self._results is not None:
            self._results.append(result)
        return result

    def _completion(self, result: GenerationResult) -> CompletionResponse:
        self._record(result)
        return CompletionResponse(
            text=result.text,
            additional_kwargs=result_summary(result),
            raw=jsonable(result.trace.to_dict()),
        )

    def _chat(self, result: GenerationResult) -> ChatResponse:
        self._record(result)
        return ChatResponse(
            message=ChatMessage(role=MessageRole.ASSISTANT, content=result.text),
            additional_kwargs=result_summary(result),
            raw=jsonable(result.trace.to_dict()),
        )

    def _completion_stream(self, events: Iterator[TokenEvent], result: Any) -> CompletionResponseGen:
        text = ""
        for ev in events:
            if ev.text:
                text += ev.text
                yield CompletionResponse(
                    text=text, delta=ev.text, additional_kwargs={"source": ev.source}
                )
        final = self._record(result())
        yield CompletionResponse(
            text=text,
            delta="",
            additional_kwargs=result_summary(final),
            raw=jsonable(final.trace.to_dict()),
        )

    def _generate(self, query: str, passages: Any, gen_kw: dict[str, Any]) -> GenerationResult:
        return scheduler.generate(self._lm, query, passages, batching=self.batching, **gen_kw)

    async def _agenerate(self, query: str, passages: Any, gen_kw: dict[str, Any]) -> GenerationResult:
        return await scheduler.agenerate(self._lm, query, passages, batching=self.batching, **gen_kw)

    # ------------------------------------------------------------------ completion
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Complete ``prompt`` (pure model, or ``policy`` over ``passages=``)."""
        prompt, passages, gen_kw = self._prompt_args(prompt, formatted, kwargs)
        return self._completion(self._generate(prompt, passages, gen_kw))

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        """Like :meth:`complete`, one response per chosen token (``delta`` = its text)."""
        prompt, passages, gen_kw = self._prompt_args(prompt, formatted, kwargs)
        s = scheduler.stream(self._lm, prompt, passages, batching=self.batching, **gen_kw)
        return self._completion_stream(s, lambda: s.result)

    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        """Async :meth:`complete`; the model runs in a worker thread."""
        prompt, passages, gen_kw = self._prompt_args(prompt, formatted, kwargs)
        return self._completion(await self._agenerate(prompt, passages, gen_kw))

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        """Async :meth:`stream_complete`; tokens are produced in a worker thread."""
        prompt, passages, gen_kw = self._prompt_args(prompt, formatted, kwargs)

        async def gen() -> CompletionResponseAsyncGen:
            text = ""
            async for item in scheduler.astream_with_result(
                self._lm, prompt, passages, batching=self.batching, **gen_kw
            ):
                if isinstance(item, GenerationResult):
                    self._record(item)
                    yield CompletionResponse(
                        text=text,
                        delta="",
                        additional_kwargs=result_summary(item),
                        raw=jsonable(item.trace.to_dict()),
                    )
                elif item.text:
                    text += item.text
                    yield CompletionResponse(
                        text=text, delta=item.text, additional_kwargs={"source": item.source}
                    )

        return gen()

    # ------------------------------------------------------------------ chat
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Answer the last user message; earlier messages become the chat history."""
        query, passages, gen_kw = self._chat_args(messages, kwargs)
        return self._chat(self._generate(query, passages, gen_kw))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """Like :meth:`chat`, one response per chosen token (``delta`` = its text)."""
        query, passages, gen_kw = self._chat_args(messages, kwargs)
        s = scheduler.stream(self._lm, query, passages, batching=self.batching, **gen_kw)
        return _chat_stream(self._completion_stream(s, lambda: s.result))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Async :meth:`chat`; the model runs in a worker thread."""
        query, passages, gen_kw = self._chat_args(messages, kwargs)
        return self._chat(await self._agenerate(query, passages, gen_kw))

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        """Async :meth:`stream_chat`; tokens are produced in a worker thread."""
        query, passages, gen_kw = self._chat_args(messages, kwargs)

        async def gen() -> ChatResponseAsyncGen:
            text = ""
            async for item in scheduler.astream_with_result(
                self._lm, query, passages, batching=self.batching, **gen_kw
            ):
                if isinstance(item, GenerationResult):
                    self._record(item)
                    yield ChatResponse(
                        message=ChatMessage(role=MessageRole.ASSISTANT, content=text),
                        delta="",
                        additional_kwargs=result_summary(item),
                        raw=jsonable(item.trace.to_dict()),
                    )
                elif item.text:
                    text += item.text
                    yield ChatResponse(
                        message=ChatMessage(role=MessageRole.ASSISTANT, content=text),
                        delta=item.text,
                        additional_kwargs={"source": item.source},
                    )

        return gen()


def _chat_stream(completions: Iterator[CompletionResponse]) -> ChatResponseGen:
    for c in completions:
        yield ChatResponse(
            message=ChatMessage(role=MessageRole.ASSISTANT, content=c.text),
            delta=c.delta,
            additional_kwargs=c.additional_kwargs,
            raw=c.raw,
        )


__all__ = ["TokRAGLLM"]
