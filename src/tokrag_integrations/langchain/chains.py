"""``create_tokrag_chain``: any LangChain retriever in front of a Tok-RAG decoded answer;
``create_tokrag_documents_chain``: the same answer step for documents retrieved elsewhere."""

from __future__ import annotations

import os
import warnings
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForChainRun, CallbackManagerForChainRun
from langchain_core.documents import Document
from langchain_core.messages import (
    BaseMessage,
    HumanMessage,
    SystemMessage,
    convert_to_messages,
)
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import BasePromptTemplate, PromptTemplate, format_document
from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda, RunnablePassthrough
from pydantic import BaseModel, ConfigDict, create_model

from ..defaults import ANSWER_STOP
from ..models import LoadedModel, check_greedy
from ..policies import get_policy
from .chat_models import CHAT_LOAD_OPTIONS, ChatTokRAG

#: Keys of every output (``invoke``) and of the aggregated stream.
OUTPUT_KEYS = ("answer", "context", "sources", "trace", "warnings", "retrieval_empty")
#: ``create_stuff_documents_chain``'s defaults: documents joined by a blank line, each one
#: formatted as its page content.
DEFAULT_DOCUMENT_SEPARATOR = "\n\n"
DEFAULT_DOCUMENT_PROMPT = PromptTemplate.from_template("{page_content}")
#: The prompt variable that receives the formatted documents (as LangChain's chains).
DOCUMENTS_KEY = "context"
#: Arguments of create_tokrag_chain other than load options and the policy's options.
_CHAIN_ARGUMENTS = (
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


def _runnable_name(obj: Any) -> str:
    if isinstance(obj, Runnable):
        return obj.get_name()
    return type(obj).__name__


def _question(input_: Any) -> str:
    """The question of a chain input: a string, or the ``"input"`` / ``"question"`` key."""
    if isinstance(input_, Mapping):
        key = "input" if "input" in input_ else "question"
        if key not in input_:
            raise ValueError(
                f"The chain input has no 'input' or 'question' key (keys: {sorted(input_)}); "
                "pass a string, {'input': ...} or {'question': ...}."
            )
        input_ = input_[key]
    if not isinstance(input_, str):
        raise TypeError(
            f"The question must be a string, not {type(input_).__name__}; pass a string, "
            "{'input': ...} or {'question': ...}."
        )
    if not input_.strip():
        raise ValueError("The question is empty: pass a non-empty question.")
    return input_


def _own_messages(question: str, input_: Any, system_prompt: str | None) -> list[BaseMessage]:
    """The package's own prompt: optional system message, ``chat_history``, the question (the
    documents go to the decoder separately, as ranked passages)."""
    msgs: list[BaseMessage] = []
    if system_prompt is not None:
        msgs.append(SystemMessage(system_prompt))
    if isinstance(input_, Mapping) and input_.get("chat_history"):
        msgs += convert_to_messages(input_["chat_history"])
    msgs.append(HumanMessage(question))
    return msgs


def _passages(docs: list[Document], document_prompt: BasePromptTemplate | None) -> list[Document]:
    """The documents as ranked passages, each formatted by ``document_prompt`` when given."""
    if document_prompt is None:
        return list(docs)
    return [
        Document(page_content=format_document(d, document_prompt), metadata=dict(d.metadata))
        for d in docs
    ]


def format_documents(
    docs: Sequence[Document],
    document_prompt: BasePromptTemplate | None = None,
    document_separator: str = DEFAULT_DOCUMENT_SEPARATOR,
) -> str:
    """The ``{context}`` text ``create_stuff_documents_chain`` makes: every document formatted
    by ``document_prompt`` (default ``"{page_content}"``), joined by ``document_separator``."""
    document_prompt = document_prompt or DEFAULT_DOCUMENT_PROMPT
    return document_separator.join(format_document(d, document_prompt) for d in docs)


def _prompt_values(input_: Any, question: str, context: str) -> dict[str, Any]:
    """A user prompt's variables: the input's keys, ``input`` (the question, also when the
    input says ``question``) and ``context``."""
    values = dict(input_) if isinstance(input_, Mapping) else {}
    values.setdefault("input", question)
    values[DOCUMENTS_KEY] = context
    return values


def _check_prompt(prompt: Any, system_prompt: str | None, where: str) -> None:
    if prompt is None:
        return
    if not isinstance(prompt, BasePromptTemplate):
        raise TypeError(
            f"{where}: prompt must be a LangChain prompt template (ChatPromptTemplate, "
            f"PromptTemplate), not {type(prompt).__name__}"
        )
    if DOCUMENTS_KEY not in prompt.input_variables:
        raise ValueError(
            f"{where}: the prompt must take {{{DOCUMENTS_KEY}}}, where the documents go "
            f"(as with create_stuff_documents_chain); its input variables are "
            f"{prompt.input_variables}"
        )
    if system_prompt is not None:
        raise ValueError(
            f"{where}: system_prompt= belongs to the package's own prompt; with prompt= put "
            "the system message in your prompt"
        )


class TokRAGChain(Runnable[Any, dict[str, Any]]):
    """Retrieve with any retriever, then answer with :class:`ChatTokRAG` over the documents.

    Built by :func:`create_tokrag_chain`; see there for the input and output shapes.
    """

    def __init__(
        self,
        retriever: Runnable[str, list[Document]],
        model: ChatTokRAG,
        *,
        system_prompt: str | None = None,
        model_kwargs: dict[str, Any] | None = None,
        name: str | None = None,
        prompt: BasePromptTemplate | None = None,
        document_prompt: BasePromptTemplate | None = None,
        document_separator: str = DEFAULT_DOCUMENT_SEPARATOR,
    ) -> None:
        self.retriever = retriever
        self.model = model
        self.system_prompt = system_prompt
        self.model_kwargs = dict(model_kwargs or {})
        self.name = name or "TokRAGChain"
        self.prompt = prompt
        self.document_prompt = document_prompt
        self.document_separator = document_separator

    # ------------------------------------------------------------------ schemas
    def get_input_schema(self, config: RunnableConfig | None = None) -> type[BaseModel]:
        """``{"input" | "question": str, "chat_history": [messages], ...}`` (extra keys allowed)."""
        return create_model(
            "TokRAGChainInput",
            __config__=ConfigDict(extra="allow"),
            input=(str | None, None),
            question=(str | None, None),
            chat_history=(list[Any], []),
        )

    def get_output_schema(self, config: RunnableConfig | None = None) -> type[BaseModel]:
        """The keys of :data:`OUTPUT_KEYS` (plus the input's keys)."""
        return create_model(
            "TokRAGChainOutput",
            __config__=ConfigDict(extra="allow", arbitrary_types_allowed=True),
            answer=(str, ...),
            context=(list[Document], ...),
            sources=(list[str], ...),
            trace=(dict[str, Any], ...),
            warnings=(list[str], ...),
            retrieval_empty=(bool, ...),
        )

    # ------------------------------------------------------------------ translation
    def _retrieval_error(self, question: str, error: Exception) -> RuntimeError:
        return RuntimeError(
            f"retriever {_runnable_name(self.retriever)} failed for question {question!r}: "
            f"{type(error).__name__}: {error}"
        )

    def _check_docs(self, docs: Any) -> list[Document]:
        if not isinstance(docs, Sequence) or not all(isinstance(d, Document) for d in docs):
            raise TypeError(
                f"retriever {_runnable_name(self.retriever)} returned {type(docs).__name__}; "
                "a retriever must return a list of langchain_core Documents."
            )
        return list(docs)

    def _retrieve(self, question: str, config: RunnableConfig) -> list[Document]:
        try:
            docs = self.retriever.invoke(question, config)
        except Exception as e:
            raise self._retrieval_error(question, e) from e
        return self._check_docs(docs)

    async def _aretrieve(self, question: str, config: RunnableConfig) -> list[Document]:
        try:
            docs = await self.retriever.ainvoke(question, config)
        except Exception as e:
            raise self._retrieval_error(question, e) from e
        return self._check_docs(docs)

    @staticmethod
    def _passthrough(input_: Any, question: str) -> dict[str, Any]:
        """The input's keys, returned with the output as ``create_retrieval_chain`` does."""
        if isinstance(input_, Mapping):
            return dict(input_)
        return {"input": question}

    def _model_input(
        self, input_: Any, question: str, docs: list[Document], config: RunnableConfig
    ) -> tuple[list[BaseMessage], dict[str, Any]]:
        """(messages, call keywords) of the model call.

        The package's prompt: the documents are the passages, in the retriever's order (the
        core drops the lowest-ranked first). A user prompt: formatted with the documents as
        ``{context}``, which the model is told (``context=``) so that where it lands are the
        retrieved tokens; ``question=`` is the pure context's question.
        """
        if self.prompt is None:
            messages = _own_messages(question, input_, self.system_prompt)
            return messages, {
                **self.model_kwargs,
                "passages": _passages(docs, self.document_prompt),
            }
        context = format_documents(docs, self.document_prompt, self.document_separator)
        value = self.prompt.invoke(_prompt_values(input_, question, context), config)
        kwargs = {**self.model_kwargs, "context": context, "question": question}
        return value.to_messages(), kwargs

    def _empty_note(self, question: str, docs: list[Document]) -> list[str]:
        if docs:
            return []
        msg = (
            f"retriever {_runnable_name(self.retriever)} returned no documents for question "
            f"{question!r}: answered from the pure context"
        )
        warnings.warn(msg, stacklevel=4)
        return [msg]

    @staticmethod
    def _tail(metadata: Mapping[str, Any], notes: list[str]) -> dict[str, Any]:
        return {"trace": metadata["trace"], "warnings": notes + list(metadata["warnings"])}

    # ------------------------------------------------------------------ invoke
    def invoke(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        return self._call_with_config(self._invoke, input, config, **kwargs)

    def _invoke(
        self, input_: Any, run_manager: CallbackManagerForChainRun, config: RunnableConfig
    ) -> dict[str, Any]:
        question = _question(input_)
        docs = self._retrieve(question, config)
        notes = self._empty_note(question, docs)
        messages, kwargs = self._model_input(input_, question, docs, config)
        msg = self.model.invoke(messages, config, **kwargs)
        return {
            **self._passthrough(input_, question),
            "answer": msg.text,
            "context": docs,
            "sources": list(msg.response_metadata["token_sources"]),
            **self._tail(msg.response_metadata, notes),
            "retrieval_empty": not docs,
        }

    async def ainvoke(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        return await self._acall_with_config(self._ainvoke, input, config, **kwargs)

    async def _ainvoke(
        self, input_: Any, run_manager: AsyncCallbackManagerForChainRun, config: RunnableConfig
    ) -> dict[str, Any]:
        question = _question(input_)
        docs = await self._aretrieve(question, config)
        notes = self._empty_note(question, docs)
        messages, kwargs = self._model_input(input_, question, docs, config)
        msg = await self.model.ainvoke(messages, config, **kwargs)
        return {
            **self._passthrough(input_, question),
            "answer": msg.text,
            "context": docs,
            "sources": list(msg.response_metadata["token_sources"]),
            **self._tail(msg.response_metadata, notes),
            "retrieval_empty": not docs,
        }

    # ------------------------------------------------------------------ stream
    def stream(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> Iterator[dict[str, Any]]:
        yield from self._transform_stream_with_config(
            iter([input]), self._transform, config, **kwargs
        )

    def transform(
        self, input: Iterator[Any], config: RunnableConfig | None = None, **kwargs: Any
    ) -> Iterator[dict[str, Any]]:
        yield from self._transform_stream_with_config(input, self._transform, config, **kwargs)

    def _transform(
        self,
        inputs: Iterator[Any],
        run_manager: CallbackManagerForChainRun,
        config: RunnableConfig,
    ) -> Iterator[dict[str, Any]]:
        input_ = _last(inputs)
        question = _question(input_)
        docs = self._retrieve(question, config)
        notes = self._empty_note(question, docs)
        messages, kwargs = self._model_input(input_, question, docs, config)
        chunks = self.model.stream(messages, config, **kwargs)
        # Pull the first token before yielding anything, so a failing call (bad option,
        # question too long...) raises with nothing half-written.
        first = next(chunks, None)
        yield {**self._passthrough(input_, question), "context": docs, "retrieval_empty": not docs}
        for chunk in _chain_first(first, chunks):
            yield from self._stream_item(chunk, notes)

    async def astream(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[dict[str, Any]]:
        async def one() -> AsyncIterator[Any]:
            yield input

        async for item in self._atransform_stream_with_config(
            one(), self._atransform, config, **kwargs
        ):
            yield item

    async def atransform(
        self, input: AsyncIterator[Any], config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[dict[str, Any]]:
        async for item in self._atransform_stream_with_config(
            input, self._atransform, config, **kwargs
        ):
            yield item

    async def _atransform(
        self,
        inputs: AsyncIterator[Any],
        run_manager: AsyncCallbackManagerForChainRun,
        config: RunnableConfig,
    ) -> AsyncIterator[dict[str, Any]]:
        last: Any = None
        async for item in inputs:
            last = item
        question = _question(last)
        docs = await self._aretrieve(question, config)
        notes = self._empty_note(question, docs)
        messages, kwargs = self._model_input(last, question, docs, config)
        chunks = self.model.astream(messages, config, **kwargs)
        first = await anext(chunks, None)
        yield {**self._passthrough(last, question), "context": docs, "retrieval_empty": not docs}
        if first is not None:
            for out in self._stream_item(first, notes):
                yield out
        async for chunk in chunks:
            for out in self._stream_item(chunk, notes):
                yield out

    def _stream_item(self, chunk: Any, notes: list[str]) -> Iterator[dict[str, Any]]:
        meta = chunk.response_metadata
        if "trace" in meta:
            yield self._tail(meta, notes)
            return
        item: dict[str, Any] = {"answer": chunk.text}
        if meta.get("token_sources"):
            item["sources"] = list(meta["token_sources"])
        if item["answer"] or "sources" in item:
            yield item


def _last(inputs: Iterator[Any]) -> Any:
    last: Any = None
    for item in inputs:
        last = item
    return last


def _chain_first(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    if first is not None:
        yield first
    yield from rest


def _chat_model(
    model: Any,
    where: str,
    *,
    temperature: float | None,
    policy: str | None,
    max_tokens: int | None,
    stop: list[str] | None,
    max_context_tokens: int | None,
    policy_options: dict[str, Any],
) -> tuple[ChatTokRAG, dict[str, Any]]:
    """(the chat model, the call keywords that override its settings) of a chain constructor;
    every argument is checked here, before anything is loaded or decoded."""
    check_greedy(temperature, where)
    load_options = {k: policy_options.pop(k) for k in CHAT_LOAD_OPTIONS if k in policy_options}
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
    **policy_options: Any,
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
        **policy_options: options of the policy (e.g. ``pr_norm="softmax"``).

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


def _input_documents(inputs: Any) -> list[Document]:
    if not isinstance(inputs, Mapping) or DOCUMENTS_KEY not in inputs:
        got = sorted(inputs) if isinstance(inputs, Mapping) else type(inputs).__name__
        raise ValueError(
            "A documents chain takes a dict with 'context' (a list of Documents) and 'input' "
            f"(the question); got {got}."
        )
    docs = inputs[DOCUMENTS_KEY]
    if not isinstance(docs, Sequence) or not all(isinstance(d, Document) for d in docs):
        raise TypeError(
            f"The 'context' input is a {type(docs).__name__}; pass a list of langchain_core "
            "Documents (a retriever's output)."
        )
    return list(docs)


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
    **policy_options: Any,
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
