"""``create_tokrag_chain``: any LangChain retriever in front of a Tok-RAG decoded answer;
``create_tokrag_documents_chain``: the same answer step for documents retrieved elsewhere."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any

from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import BasePromptTemplate
from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda

from ..adapters.translate import checked_policy, options_dict
from ..config import require_bool
from ..defaults import ANSWER_STOP
from ..models import LOAD_FIELDS, LoadedModel, unknown_arguments
from ..sampling import sampling_of
from .chat_models import ChatTokRAG
from .tokrag_chain import (
    DEFAULT_DOCUMENT_SEPARATOR,
    TokRAGChain,
    check_prompt,
    input_documents,
    question_of,
)


def _chat_model(
    model: Any,
    where: Callable[..., Any],
    *,
    temperature: float | None,
    policy: str | None,
    max_tokens: int | None,
    stop: list[str] | None,
    max_context_tokens: int | None,
    policy_options: Mapping[str, Any] | None,
    citations: bool | None = None,
    options: Mapping[str, Any] | None = None,
) -> tuple[ChatTokRAG, dict[str, Any]]:
    """(the chat model, the call keywords that override its settings) of the chain
    constructor ``where``; every argument is checked here, before anything is loaded or
    decoded. ``options`` are the load options of a model spec."""
    name = where.__name__
    accepted = [*inspect.signature(where).parameters][:-1] + list(LOAD_FIELDS)
    sampling_of(temperature=temperature)  # checked before anything loads
    options = dict(options or {})
    unknown = set(options) - set(LOAD_FIELDS)
    if unknown:
        raise unknown_arguments(name, unknown, accepted)
    policy_options = options_dict(policy_options)
    if isinstance(model, ChatTokRAG):
        if options:
            raise ValueError(
                f"{', '.join(options)}: load options go with a model spec, not with a "
                "ChatTokRAG (set them on the ChatTokRAG)"
            )
    elif isinstance(model, (LoadedModel, str, os.PathLike)) or hasattr(model, "config"):
        model = ChatTokRAG(model=model, **options)
    else:
        raise TypeError(
            f"model must be a ChatTokRAG, a LoadedModel, a model name or path, or a loaded "
            f"PreTrainedModel, not {type(model).__name__}"
        )
    options = {**model.policy_options, **policy_options}
    checked_policy(policy or model.policy, options, name, accepted)
    model_kwargs: dict[str, Any] = {}
    if policy is not None:
        model_kwargs["policy"] = policy
    if max_tokens is not None:
        model_kwargs["max_tokens"] = max_tokens
    if stop is not None:
        model_kwargs["stop"] = list(stop)
    elif model.stop is None:
        # An answer over documents ends where tokrag ask's does (a blank line, a heading).
        model_kwargs["stop"] = list(ANSWER_STOP)
    if max_context_tokens is not None:
        model_kwargs["max_context_tokens"] = max_context_tokens
    if policy_options:
        model_kwargs["policy_options"] = policy_options
    if citations is not None:
        model_kwargs["citations"] = require_bool(citations, "citations")
    if temperature is not None:
        model_kwargs["temperature"] = temperature
    return model, model_kwargs


def create_tokrag_chain(
    retriever: Runnable[str, list[Document]],
    model: Any = "default",
    prompt: BasePromptTemplate | None = None,
    *,
    document_prompt: BasePromptTemplate | None = None,
    document_separator: str = DEFAULT_DOCUMENT_SEPARATOR,
    temperature: float | None = None,
    policy: str | None = None,
    system_prompt: str | None = None,
    max_tokens: int | None = None,
    stop: list[str] | None = None,
    max_context_tokens: int | None = None,
    policy_options: Mapping[str, Any] | None = None,
    citations: bool | None = None,
    **options: Any,
) -> TokRAGChain:
    """A Runnable that retrieves documents for a question and answers from them with Tok-RAG.

    Without ``prompt`` the documents are the ranked passages of the package's prompt. With
    ``prompt`` (as for ``create_stuff_documents_chain``) ``{context}`` receives the formatted
    documents: the RAG context is the prompt as formatted, the retrieved tokens are where the
    ``{context}`` text lands, the pure context is the question after the turns that do not
    hold the context.

    Args:
        retriever: any LangChain retriever (or Runnable str -> list[Document]); its order is
            the ranking (best first).
        model: a :class:`ChatTokRAG` (its settings are the defaults), a ``LoadedModel``, or
            what :func:`~tokrag_integrations.load_model` takes, with its keyword options
            (``tokenizer``, ``device``, ``device_map``, ``dtype``, ``model_kwargs``...).
        prompt: a prompt template taking ``{context}``; None: the package's prompt.
        document_prompt: formats each document (default ``"{page_content}"``).
        document_separator: joins the formatted documents in ``{context}`` (default ``"\n\n"``).
        temperature: the chat model's sampling temperature for the chain's calls (None: the
            model's; 0: greedy). Set ``top_p`` / ``seed`` on the ``ChatTokRAG``.
        policy: decoding policy; None keeps the model's (``"tokrag"`` for a LoadedModel).
        system_prompt: a system message before the question; only without ``prompt``.
        max_tokens / stop / max_context_tokens: override the model's settings; without
            ``stop`` here or on the ChatTokRAG the answer stops at ``defaults.ANSWER_STOP``.
        policy_options: the policy's options as a dict (e.g. ``{"pr_norm": "softmax"}``).
        citations: read which document each answer token drew on (``ChatTokRAG.citations``:
            None, on for ``tokrag``; False, none).
        **options: the load options of a model spec (above).

    Input: a question string, or a dict with ``"input"`` (or ``"question"``), optional
    ``"chat_history"`` and other keys (returned unchanged; with ``prompt``, its variables).
    Output: the input's keys plus ``answer``, ``context`` (the documents, by their share of
    the answer's attention, the others after them in retrieval order), ``sources`` (per token:
    ``agree`` / ``rag`` / ``pure``), ``trace``, ``citations`` (``Trace.citations_data``: spans
    of the answer, each with its document's ``metadata`` and ``id``; ``[]`` without
    citations), ``warnings`` and ``retrieval_empty``; ``stream`` chunks (the input's keys,
    ``context`` in retrieval order, once the first token is chosen, then per token
    ``{"answer", "sources"}``, then ``{"trace", "citations", "warnings"}``) add up to it. A
    retriever that
    raises surfaces as ``RuntimeError("retriever <name> failed for question ...")``.
    """
    if not isinstance(retriever, Runnable):
        raise TypeError(
            f"retriever must be a LangChain retriever or Runnable, not {type(retriever).__name__}"
        )
    check_prompt(prompt, system_prompt, "create_tokrag_chain")
    chat, model_kwargs = _chat_model(
        model,
        create_tokrag_chain,
        temperature=temperature,
        policy=policy,
        max_tokens=max_tokens,
        stop=stop,
        max_context_tokens=max_context_tokens,
        policy_options=policy_options,
        citations=citations,
        options=options,
    )
    return TokRAGChain(
        retriever,
        chat,
        system_prompt=system_prompt,
        model_kwargs=model_kwargs,
        prompt=prompt,
        document_prompt=document_prompt,
        document_separator=document_separator,
    )


def create_tokrag_documents_chain(
    model: Any = "default",
    prompt: BasePromptTemplate | None = None,
    *,
    document_prompt: BasePromptTemplate | None = None,
    document_separator: str = DEFAULT_DOCUMENT_SEPARATOR,
    output_parser: Runnable[Any, Any] | None = None,
    temperature: float | None = None,
    policy: str | None = None,
    system_prompt: str | None = None,
    max_tokens: int | None = None,
    stop: list[str] | None = None,
    max_context_tokens: int | None = None,
    policy_options: Mapping[str, Any] | None = None,
    citations: bool | None = None,
    **options: Any,
) -> Runnable[dict[str, Any], Any]:
    """``create_stuff_documents_chain`` decoded with Tok-RAG, for your own retrieval step.

    Input: a dict with ``"context"`` (Documents, best first), ``"input"`` (or
    ``"question"``) and any variables of ``prompt``. Output: ``output_parser``'s (default
    ``StrOutputParser()``; ``RunnablePassthrough()`` gives the ``AIMessage`` with its
    provenance metadata). The other arguments are those of :func:`create_tokrag_chain`.
    """
    check_prompt(prompt, system_prompt, "create_tokrag_documents_chain")
    chat, model_kwargs = _chat_model(
        model,
        create_tokrag_documents_chain,
        temperature=temperature,
        policy=policy,
        max_tokens=max_tokens,
        stop=stop,
        max_context_tokens=max_context_tokens,
        policy_options=policy_options,
        citations=citations,
        options=options,
    )
    answer = TokRAGChain(
        None,
        chat,
        system_prompt=system_prompt,
        model_kwargs=model_kwargs,
        prompt=prompt,
        document_prompt=document_prompt,
        document_separator=document_separator,
    )

    def answer_step(inputs: dict[str, Any], config: RunnableConfig) -> Runnable[Any, Any]:
        docs = input_documents(inputs)
        messages, kwargs = answer.model_input(inputs, question_of(inputs), docs, config)
        return RunnableLambda(lambda _: messages, name="format_messages") | chat.bind(**kwargs)

    parser = output_parser if output_parser is not None else StrOutputParser()
    step = RunnableLambda(answer_step, name="tokrag_answer")
    return (step | parser).with_config(run_name="tokrag_documents_chain")
