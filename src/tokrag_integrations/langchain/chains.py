"""``create_tokrag_chain``: any LangChain retriever in front of a Tok-RAG decoded answer;
``create_tokrag_documents_chain``: the same answer step for documents retrieved elsewhere.

The chain itself is :class:`~.tokrag_chain.TokRAGChain`; the inputs' helpers are in
:mod:`._chain_inputs`. Every name stays importable from here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import BasePromptTemplate
from langchain_core.runnables import Runnable, RunnableLambda, RunnablePassthrough

from ..defaults import ANSWER_STOP
from ..models import LoadedModel, check_greedy
from ..policies import checked_policy_options, get_policy
from ._chain_inputs import (  # noqa: F401 - importable from here as before
    DEFAULT_DOCUMENT_PROMPT,
    DEFAULT_DOCUMENT_SEPARATOR,
    DOCUMENTS_KEY,
    OUTPUT_KEYS,
    _check_prompt,
    _input_documents,
    _own_messages,
    _passages,
    _question,
    format_documents,
)
from .chat_models import CHAT_LOAD_OPTIONS, ChatTokRAG
from .tokrag_chain import TokRAGChain

#: Arguments of create_tokrag_chain other than load options and the policy's options.
_CHAIN_ARGUMENTS = (
    "policy_options",
    "retriever",
    "model",
    "prompt",
    "document_prompt",
    "document_separator",
    "temperature",
    "policy",
    "system_prompt",
    "max_tokens",
    "stop",
    "max_context_tokens",
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
    every argument is checked here, before anything is loaded or decoded.

    ``options`` are the constructor's other keyword arguments: the load options of a model
    spec, and policy options in the deprecated spelling."""
    check_greedy(temperature, where)
    loose = dict(options or {})
    load_options = {k: loose.pop(k) for k in CHAT_LOAD_OPTIONS if k in loose}
    policy_options = checked_policy_options(policy_options, loose, where)
    if isinstance(model, ChatTokRAG):
        if load_options:
            raise ValueError(
                f"{', '.join(load_options)}: load options go with a model spec, not with a "
                "ChatTokRAG (set them on the ChatTokRAG)"
            )
    elif isinstance(model, (LoadedModel, str, os.PathLike)) or hasattr(model, "config"):
        model = ChatTokRAG(model=model, **load_options)
    else:
        raise TypeError(
            f"model must be a ChatTokRAG, a LoadedModel, a model name or path, or a loaded "
            f"PreTrainedModel, not {type(model).__name__}"
        )
    try:
        get_policy(policy or model.policy, **{**model.policy_options, **policy_options})
    except ValueError as e:
        if "unknown option" not in str(e):
            raise
        accepted = _CHAIN_ARGUMENTS + CHAT_LOAD_OPTIONS
        if where == "create_tokrag_documents_chain":
            accepted = tuple(a for a in accepted if a != "retriever") + ("output_parser",)
        raise TypeError(
            f"{where} got an unknown keyword argument ({e}); besides the policy's "
            f"options it accepts: {', '.join(accepted)}"
        ) from e
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
        model_kwargs["policy_options"] = dict(policy_options)
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

    Without ``prompt`` the question and the documents reach the decoder separately: the
    documents become the ranked passages of the package's RAG prompt, the question the final
    user turn (the pure context sees only the question).

    With ``prompt`` (the ``ChatPromptTemplate`` you would give ``create_stuff_documents_chain``
    and ``create_retrieval_chain``: ``{context}`` and usually ``{input}``) Tok-RAG runs on your
    prompt: ``{context}`` receives the documents, each formatted by ``document_prompt`` and
    joined by ``document_separator``; the RAG context is the prompt exactly as formatted and
    its retrieved tokens (Eq. 14-16) are where the ``{context}`` text lands; the pure context
    is the question alone after the conversation (the prompt's human/AI turns that do not
    hold the context, e.g. a ``MessagesPlaceholder("chat_history")``), under the prompt's
    system messages that do not hold the context (else the core's default system prompt).

    Args:
        retriever: any LangChain retriever (or Runnable str -> list[Document]): vector-store
            retrievers, BM25, ensembles, Postgres... Its order is the ranking (best first).
        model: a :class:`ChatTokRAG` (its settings are the defaults), a ``LoadedModel``, or
            what :func:`~tokrag_integrations.load_model` takes (``"default"``, a hub id in the
            local cache, a folder, a ``.gguf`` path, a loaded ``PreTrainedModel``), with its
            keyword options (``tokenizer``, ``device``, ``device_map``, ``dtype``,
            ``model_kwargs``, ``tokenizer_kwargs``, ``trust_remote_code``, ``revision``).
        prompt: a prompt template taking ``{context}`` (the formatted documents) and any
            input keys (``{input}`` is always the question); None: the package's prompt.
        document_prompt: formats each document (default ``"{page_content}"``, as
            ``create_stuff_documents_chain``); without ``prompt`` it formats each passage.
        document_separator: joins the formatted documents in ``{context}`` (default
            ``"\n\n"``); used only with ``prompt``.
        temperature: only None or 0 (greedy decoding).
        policy: decoding policy; None keeps the model's (``"tokrag"`` for a LoadedModel).
        system_prompt: a system message before the question (None: the core default); only
            without ``prompt`` (a user prompt carries its own system message).
        max_tokens / stop / max_context_tokens: override the model's settings. Without
            ``stop`` here or on the ChatTokRAG, the answer stops at
            :data:`~tokrag_integrations.defaults.ANSWER_STOP`, as ``tokrag ask``'s.
        policy_options: the policy's options as a dict (e.g. ``{"pr_norm": "softmax"}``),
            checked by :func:`~tokrag_integrations.policies.get_policy`.
        **options: the load options of a model spec (above); policy options given here
            still work but are deprecated (a DeprecationWarning names ``policy_options=``).

    Input: a question string, or a dict with ``"input"`` (the ``create_retrieval_chain``
    convention) or ``"question"``, optional ``"chat_history"`` (messages placed between the
    system prompt and the question; with ``prompt``, wherever the prompt puts them) and any
    other keys, which are returned unchanged (and, with ``prompt``, fill its variables).

    ``invoke`` / ``ainvoke`` / ``batch`` / ``abatch`` return the input's keys (``{"input":
    question}`` for a string input) plus::

        {"answer": str,                # the generated answer
         "context": list[Document],    # the retrieved documents, in retriever order
         "sources": list[str],         # per generated token: "agree" | "rag" | "llm" | ...
         "trace": dict,                # the full trace (Trace.to_dict() as JSON data): its
                                       # "policy", "counts", "prompt_tokens"; with prompt=,
                                       # its one passage is the formatted {context}
         "warnings": list[str],        # empty retrieval, skipped/dropped/cut passages...
         "retrieval_empty": bool}      # True: no documents, answered from the pure context

    ``stream`` / ``astream`` yield dict chunks, in this order:

    1. the input's keys with ``{"context": docs, "retrieval_empty": bool}`` once retrieval succeeded and the first
       token was chosen;
    2. ``{"answer": delta, "sources": [source]}`` per chosen token, as it is chosen
       (``delta`` may be ``""`` while a possible stop string is held back; a final
       ``{"answer": delta}`` without sources may flush held-back text at end of sequence);
    3. ``{"trace": dict, "warnings": [...]}`` last.

    Adding the chunks with ``+`` gives the ``invoke`` output (up to the trace's timings).

    Errors: a retriever that raises surfaces as ``RuntimeError("retriever <name> failed for
    question ...")`` chained to the original error, before anything is yielded.
    """
    if not isinstance(retriever, Runnable):
        raise TypeError(
            f"retriever must be a LangChain retriever or Runnable, not {type(retriever).__name__}"
        )
    _check_prompt(prompt, system_prompt, "create_tokrag_chain")
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

    Input: a dict with ``"context"`` (a list of Documents, best first) and ``"input"`` (or
    ``"question"``), plus any variables of ``prompt`` (``chat_history``...). Output: the
    answer string (``output_parser``, default ``StrOutputParser()``; pass
    ``RunnablePassthrough()`` to get the ``AIMessage``, whose ``response_metadata`` holds
    ``policy``, ``counts``, ``token_sources`` and ``trace``). ``invoke``, ``batch``,
    ``stream`` (token by token) and their async forms all work, as for any LCEL chain.

    With ``prompt`` it is ``create_stuff_documents_chain``'s composition: the documents are
    formatted into ``{context}`` (``document_prompt``, ``document_separator``) by
    ``RunnablePassthrough.assign``, then ``prompt | model``, where the model is told which
    text filled ``{context}`` so that the RAG context is the formatted prompt and the
    retrieved tokens are where that text lands (see :func:`create_tokrag_chain`). Without
    ``prompt`` the documents are the passages of the package's prompt. The other arguments
    are those of :func:`create_tokrag_chain`.

    Example:
        .. code-block:: python

            answer = create_tokrag_documents_chain(ChatTokRAG(model=lm), prompt)
            chain = RunnablePassthrough.assign(
                context=(lambda x: x["input"]) | retriever
            ).assign(answer=answer)   # create_retrieval_chain's shape
    """
    _check_prompt(prompt, system_prompt, "create_tokrag_documents_chain")
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
            docs = _input_documents(inputs)
            question = _question(inputs)
            messages = _own_messages(question, inputs, system_prompt)
            model_step = chat.bind(passages=_passages(docs, document_prompt), **model_kwargs)
            return RunnableLambda(lambda _: messages, name="format_messages") | model_step

        answer: Runnable[Any, Any] = RunnableLambda(own_prompt, name="tokrag_answer")
    else:

        def format_docs(inputs: dict[str, Any]) -> str:
            docs = _input_documents(inputs)
            return format_documents(docs, document_prompt, document_separator)

        def prompt_and_model(inputs: dict[str, Any]) -> Runnable[Any, Any]:
            # Bound per call: the model must know which text filled {context}.
            context, question = inputs[DOCUMENTS_KEY], inputs["input"]
            return prompt | chat.bind(context=context, question=question, **model_kwargs)

        format_inputs = RunnablePassthrough.assign(
            **{DOCUMENTS_KEY: format_docs, "input": _question}
        ).with_config(run_name="format_inputs")
        answer = format_inputs | RunnableLambda(prompt_and_model, name="tokrag_answer")
    return (answer | parser).with_config(run_name="tokrag_documents_chain")
