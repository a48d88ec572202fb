"""``create_tokrag_chain``: any LangChain retriever in front of a Tok-RAG decoded answer;
``create_tokrag_documents_chain``: the same answer step for documents retrieved elsewhere.

The chain itself, and the inputs' helpers, are in :mod:`.tokrag_chain`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import BasePromptTemplate
from langchain_core.runnables import Runnable, RunnableLambda, RunnablePassthrough

from ..adapters.translate import LOAD_FIELDS, checked_policy
from ..defaults import ANSWER_STOP
from ..models import LoadedModel, check_greedy, unknown_arguments
from .chat_models import ChatTokRAG
from .tokrag_chain import (
    DEFAULT_DOCUMENT_SEPARATOR,
    DOCUMENTS_KEY,
    TokRAGChain,
    as_passages,
    check_prompt,
    format_documents,
    input_documents,
    own_messages,
    question_of,
)

#: Arguments of create_tokrag_chain other than load options.
_CHAIN_ARGUMENTS = (
    "policy_options", "retriever", "model", "prompt", "document_prompt", "document_separator",
    "temperature", "policy", "system_prompt", "max_tokens", "stop", "max_context_tokens",
)


def _chat_model(
    model: Any,
    where: str,
    *,
    temperature: float | None,
    policy: str | None,
    max_tokens: int | None,
    stop: list[str] | None,
    max_context_tokens: int | None,
    policy_options: Mapping[str, Any] | None,
    options: Mapping[str, Any] | None = None,
) -> tuple[ChatTokRAG, dict[str, Any]]:
    """(the chat model, the call keywords that override its settings) of a chain constructor;
    every argument is checked here, before anything is loaded or decoded. ``options`` are
    the load options of a model spec."""
    check_greedy(temperature, where)
    options = dict(options or {})
    unknown = set(options) - set(LOAD_FIELDS)
    if unknown:
        accepted = _CHAIN_ARGUMENTS + LOAD_FIELDS
        if where == "create_tokrag_documents_chain":
            accepted = tuple(a for a in accepted if a != "retriever") + ("output_parser",)
        raise unknown_arguments(where, unknown, accepted)
    if policy_options is not None and not isinstance(policy_options, Mapping):
        raise TypeError(
            f"policy_options must be a dict of option names to values, got {type(policy_options).__name__}"
        )
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
    policy_options = dict(policy_options or {})
    options = {**model.policy_options, **policy_options}
    checked_policy(policy or model.policy, options, where, _CHAIN_ARGUMENTS + LOAD_FIELDS)
    model_kwargs: dict[str, Any] = {}
    if policy is not None:
        model_kwargs["policy"] = policy
    if max_tokens is not None:
        model_kwargs["max_tokens"] = max_tokens
    if stop is not None:
        model_kwargs["stop"] = list(stop)
    elif model.stop is None:
        # An answer over documents ends where tokrag ask's does (a blank line, a heading);
        # stop=[] here, or a ChatTokRAG with its own stop, decodes without these.
        model_kwargs["stop"] = list(ANSWER_STOP)
    if max_context_tokens is not None:
        model_kwargs["max_context_tokens"] = max_context_tokens
    if policy_options:
        model_kwargs["policy_options"] = policy_options
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
    **options: Any,
) -> TokRAGChain:
    """A Runnable that retrieves documents for a question and answers from them with Tok-RAG.

    Without ``prompt`` the documents become the ranked passages of the package's RAG prompt
    and the question the final user turn (the pure context sees only the question). With
    ``prompt`` (what you would give ``create_stuff_documents_chain``: ``{context}`` and
    usually ``{input}``) ``{context}`` receives the documents, each formatted by
    ``document_prompt`` and joined by ``document_separator``; the RAG context is the prompt
    as formatted, its retrieved tokens (Eq. 14-16) are where the ``{context}`` text lands,
    and the pure context is the question after the prompt's turns and system messages that
    do not hold the context.

    Args:
        retriever: any LangChain retriever (or Runnable str -> list[Document]); its order is
            the ranking (best first).
        model: a :class:`ChatTokRAG` (its settings are the defaults), a ``LoadedModel``, or
            what :func:`~tokrag_integrations.load_model` takes, with its keyword options
            (``tokenizer``, ``device``, ``device_map``, ``dtype``, ``model_kwargs``...).
        prompt: a prompt template taking ``{context}``; None: the package's prompt.
        document_prompt: formats each document (default ``"{page_content}"``).
        document_separator: joins the formatted documents in ``{context}`` (default ``"\n\n"``).
        temperature: only None or 0 (greedy decoding).
        policy: decoding policy; None keeps the model's (``"tokrag"`` for a LoadedModel).
        system_prompt: a system message before the question; only without ``prompt``.
        max_tokens / stop / max_context_tokens: override the model's settings; without
            ``stop`` here or on the ChatTokRAG the answer stops at ``defaults.ANSWER_STOP``.
        policy_options: the policy's options as a dict (e.g. ``{"pr_norm": "softmax"}``).
        **options: the load options of a model spec (above).

    Input: a question string, or a dict with ``"input"`` (or ``"question"``), optional
    ``"chat_history"`` and other keys, returned unchanged (and, with ``prompt``, filling its
    variables). ``invoke`` / ``batch`` and their async forms return the input's keys (or
    ``{"input": question}``) plus ``answer``, ``context`` (the documents), ``sources`` (per
    token: ``agree`` / ``rag`` / ``llm``), ``trace`` (``Trace.to_dict()``), ``warnings`` and
    ``retrieval_empty`` (no documents: answered from the pure context). ``stream`` /
    ``astream`` yield the input's keys with ``context`` and ``retrieval_empty`` once the first
    token is chosen, then ``{"answer": delta, "sources": [source]}`` per token, then
    ``{"trace", "warnings"}``; the chunks add up to the ``invoke`` output. A retriever that
    raises surfaces as ``RuntimeError("retriever <name> failed for question ...")``.
    """
    if not isinstance(retriever, Runnable):
        raise TypeError(
            f"retriever must be a LangChain retriever or Runnable, not {type(retriever).__name__}"
        )
    check_prompt(prompt, system_prompt, "create_tokrag_chain")
    chat, model_kwargs = _chat_model(
        model,
        "create_tokrag_chain",
        temperature=temperature,
        policy=policy,
        max_tokens=max_tokens,
        stop=stop,
        max_context_tokens=max_context_tokens,
        policy_options=policy_options,
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
    **options: Any,
) -> Runnable[dict[str, Any], Any]:
    """``create_stuff_documents_chain`` decoded with Tok-RAG, for your own retrieval step.

    Input: a dict with ``"context"`` (Documents, best first), ``"input"`` (or
    ``"question"``) and any variables of ``prompt``. Output: ``output_parser``'s (default
    ``StrOutputParser()``; ``RunnablePassthrough()`` gives the ``AIMessage`` with its
    provenance metadata). With ``prompt`` the documents are formatted into ``{context}``,
    then ``prompt | model`` with the model told which text filled ``{context}``; without it
    they are the passages of the package's prompt. The other arguments are those of
    :func:`create_tokrag_chain`.
    """
    check_prompt(prompt, system_prompt, "create_tokrag_documents_chain")
    chat, model_kwargs = _chat_model(
        model,
        "create_tokrag_documents_chain",
        temperature=temperature,
        policy=policy,
        max_tokens=max_tokens,
        stop=stop,
        max_context_tokens=max_context_tokens,
        policy_options=policy_options,
        options=options,
    )
    parser = output_parser if output_parser is not None else StrOutputParser()
    if prompt is None:

        def own_prompt(inputs: dict[str, Any]) -> Runnable[Any, Any]:
            docs = input_documents(inputs)
            question = question_of(inputs)
            messages = own_messages(question, inputs, system_prompt)
            model_step = chat.bind(passages=as_passages(docs, document_prompt), **model_kwargs)
            return RunnableLambda(lambda _: messages, name="format_messages") | model_step

        answer: Runnable[Any, Any] = RunnableLambda(own_prompt, name="tokrag_answer")
    else:

        def format_docs(inputs: dict[str, Any]) -> str:
            docs = input_documents(inputs)
            return format_documents(docs, document_prompt, document_separator)

        def prompt_and_model(inputs: dict[str, Any]) -> Runnable[Any, Any]:
            # Bound per call: the model must know which text filled {context}.
            context, question = inputs[DOCUMENTS_KEY], inputs["input"]
            return prompt | chat.bind(context=context, question=question, **model_kwargs)

        format_inputs = RunnablePassthrough.assign(
            **{DOCUMENTS_KEY: format_docs, "input": question_of}
        ).with_config(run_name="format_inputs")
        answer = format_inputs | RunnableLambda(prompt_and_model, name="tokrag_answer")
    return (answer | parser).with_config(run_name="tokrag_documents_chain")
