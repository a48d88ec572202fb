"""TokRAGChain (what :func:`~tokrag_integrations.langchain.chains.create_tokrag_chain` builds)
and what the chains share: their inputs, the package's own prompt, the checks of a user prompt."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForChainRun, CallbackManagerForChainRun
from langchain_core.documents import Document
from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage, convert_to_messages
from langchain_core.prompts import BasePromptTemplate, PromptTemplate, format_document
from langchain_core.runnables import Runnable, RunnableConfig
from pydantic import BaseModel, ConfigDict, create_model

from ..trace import Trace
from .chat_models import ChatTokRAG

#: ``create_stuff_documents_chain``'s defaults.
DEFAULT_DOCUMENT_SEPARATOR = "\n\n"
DEFAULT_DOCUMENT_PROMPT = PromptTemplate.from_template("{page_content}")
#: The prompt variable that receives the formatted documents (as LangChain's chains).
DOCUMENTS_KEY = "context"


def question_of(input_: Any) -> str:
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


def format_documents(
    docs: Sequence[Document],
    document_prompt: BasePromptTemplate | None = None,
    document_separator: str = DEFAULT_DOCUMENT_SEPARATOR,
) -> str:
    """The ``{context}`` text ``create_stuff_documents_chain`` makes: every document formatted
    by ``document_prompt`` (default ``"{page_content}"``), joined by ``document_separator``."""
    document_prompt = document_prompt or DEFAULT_DOCUMENT_PROMPT
    return document_separator.join(format_document(d, document_prompt) for d in docs)


def check_prompt(prompt: Any, system_prompt: str | None, where: str) -> None:
    """Refuse a user prompt that is not a template, lacks ``{context}``, or comes with
    ``system_prompt=``."""
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


def input_documents(inputs: Any) -> list[Document]:
    """The ``"context"`` documents of a documents chain's input."""
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


def _by_contribution(docs: list[Document], trace: dict[str, Any]) -> list[Document]:
    """``docs`` (the trace's passages, in order) in :meth:`Trace.passage_order`; as retrieved
    when they are not one passage per document."""
    tr = Trace.from_dict(trace)
    if len(tr.passages) != len(docs):
        return list(docs)
    return [docs[i] for i in tr.passage_order()]


class TokRAGChain(Runnable[Any, dict[str, Any]]):
    """Retrieve with any retriever, then answer with :class:`ChatTokRAG` over the documents.

    Built by :func:`create_tokrag_chain`; see there for the input and output shapes. Without
    a retriever, :meth:`model_input` is the answer step of ``create_tokrag_documents_chain``.
    """

    def __init__(
        self,
        retriever: Runnable[str, list[Document]] | None,
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
        """The output's keys (plus the input's keys)."""
        return create_model(
            "TokRAGChainOutput",
            __config__=ConfigDict(extra="allow", arbitrary_types_allowed=True),
            answer=(str, ...),
            context=(list[Document], ...),
            sources=(list[str], ...),
            trace=(dict[str, Any], ...),
            citations=(list[dict[str, Any]], ...),
            warnings=(list[str], ...),
            retrieval_empty=(bool, ...),
        )

    # ------------------------------------------------------------------ translation
    def _retriever_name(self) -> str:
        r = self.retriever
        return r.get_name() if isinstance(r, Runnable) else type(r).__name__

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

    def _check_docs(self, docs: Any) -> list[Document]:
        if not isinstance(docs, Sequence) or not all(isinstance(d, Document) for d in docs):
            raise TypeError(
                f"retriever {self._retriever_name()} returned {type(docs).__name__}; "
                "a retriever must return a list of langchain_core Documents."
            )
        return list(docs)

    def _retrieval_error(self, question: str, error: Exception) -> RuntimeError:
        return RuntimeError(
            f"retriever {self._retriever_name()} failed for question {question!r}: "
            f"{type(error).__name__}: {error}"
        )

    def _prepare(
        self, input_: Any, question: str, docs: list[Document], config: RunnableConfig
    ) -> tuple[dict[str, Any], list[str], list[BaseMessage], dict[str, Any]]:
        """(the output's head, warnings, the model's messages, its call keywords)."""
        head = {
            **(dict(input_) if isinstance(input_, Mapping) else {"input": question}),
            "context": docs,
            "retrieval_empty": not docs,
        }
        notes = []
        if not docs:
            notes.append(
                f"retriever {self._retriever_name()} returned no documents for question "
                f"{question!r}: answered from the pure context"
            )
            warnings.warn(notes[0], stacklevel=4)
        return head, notes, *self.model_input(input_, question, docs, config)

    def model_input(
        self, input_: Any, question: str, docs: list[Document], config: RunnableConfig
    ) -> tuple[list[BaseMessage], dict[str, Any]]:
        """(the model's messages, its call keywords): the documents as passages, or a user
        prompt formatted with them as ``{context}`` (which the model is told, ``context=``,
        with the pure context's ``question=`` and the documents, ``passages=``)."""
        if self.document_prompt is not None:
            docs = [
                Document(
                    format_document(d, self.document_prompt), id=d.id, metadata=dict(d.metadata)
                )
                for d in docs
            ]
        if self.prompt is None:  # the system prompt, the chat history, the question
            messages = [] if self.system_prompt is None else [SystemMessage(self.system_prompt)]
            if isinstance(input_, Mapping) and input_.get("chat_history"):
                messages += convert_to_messages(input_["chat_history"])
            return [*messages, HumanMessage(question)], {**self.model_kwargs, "passages": docs}
        context = format_documents(docs, None, self.document_separator)
        values = dict(input_) if isinstance(input_, Mapping) else {}
        values.setdefault("input", question)
        values[DOCUMENTS_KEY] = context
        messages = self.prompt.invoke(values, config).to_messages()
        kwargs = {"context": context, "question": question, "passages": docs}
        return messages, {**self.model_kwargs, **kwargs}

    @staticmethod
    def _output(head: dict[str, Any], notes: list[str], msg: Any) -> dict[str, Any]:
        meta = msg.response_metadata
        out = {k: v for k, v in head.items() if k not in ("context", "retrieval_empty")}
        return {
            **out,
            "answer": msg.text,
            "context": _by_contribution(head["context"], meta["trace"]),
            "sources": list(meta["token_sources"]),
            "trace": meta["trace"],
            "citations": meta["citations"],
            "warnings": notes + list(meta["warnings"]),
            "retrieval_empty": head["retrieval_empty"],
        }

    @staticmethod
    def _stream_item(chunk: Any, notes: list[str]) -> Iterator[dict[str, Any]]:
        meta = chunk.response_metadata
        if "trace" in meta:
            yield {
                "trace": meta["trace"],
                "citations": meta["citations"],
                "warnings": notes + list(meta["warnings"]),
            }
            return
        item: dict[str, Any] = {"answer": chunk.text}
        if meta.get("token_sources"):
            item["sources"] = list(meta["token_sources"])
        if item["answer"] or "sources" in item:
            yield item

    # ------------------------------------------------------------------ invoke
    def invoke(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        return self._call_with_config(self._invoke, input, config, **kwargs)

    def _invoke(
        self, input_: Any, run_manager: CallbackManagerForChainRun, config: RunnableConfig
    ) -> dict[str, Any]:
        question = question_of(input_)
        docs = self._retrieve(question, config)
        head, notes, messages, kwargs = self._prepare(input_, question, docs, config)
        return self._output(head, notes, self.model.invoke(messages, config, **kwargs))

    async def ainvoke(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        return await self._acall_with_config(self._ainvoke, input, config, **kwargs)

    async def _ainvoke(
        self, input_: Any, run_manager: AsyncCallbackManagerForChainRun, config: RunnableConfig
    ) -> dict[str, Any]:
        question = question_of(input_)
        docs = await self._aretrieve(question, config)
        head, notes, messages, kwargs = self._prepare(input_, question, docs, config)
        return self._output(head, notes, await self.model.ainvoke(messages, config, **kwargs))

    # ------------------------------------------------------------------ stream
    def stream(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> Iterator[dict[str, Any]]:
        yield from self.transform(iter([input]), config, **kwargs)

    def transform(
        self, input: Iterator[Any], config: RunnableConfig | None = None, **kwargs: Any
    ) -> Iterator[dict[str, Any]]:
        yield from self._transform_stream_with_config(input, self._transform, config, **kwargs)

    def _transform(
        self, inputs: Iterator[Any], run_manager: CallbackManagerForChainRun, config: RunnableConfig
    ) -> Iterator[dict[str, Any]]:
        *_, input_ = inputs
        question = question_of(input_)
        docs = self._retrieve(question, config)
        head, notes, messages, kwargs = self._prepare(input_, question, docs, config)
        chunks = self.model.stream(messages, config, **kwargs)
        # The first token before anything is yielded: a failing call raises with nothing written.
        first = next(chunks, None)
        yield head
        for chunk in itertools.chain(() if first is None else (first,), chunks):
            yield from self._stream_item(chunk, notes)

    async def astream(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[dict[str, Any]]:
        async def one() -> AsyncIterator[Any]:
            yield input

        async for item in self.atransform(one(), config, **kwargs):
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
        input_ = [item async for item in inputs][-1]
        question = question_of(input_)
        docs = await self._aretrieve(question, config)
        head, notes, messages, kwargs = self._prepare(input_, question, docs, config)
        chunks = self.model.astream(messages, config, **kwargs)
        first = await anext(chunks, None)
        yield head
        for out in [] if first is None else self._stream_item(first, notes):
            yield out
        async for chunk in chunks:
            for out in self._stream_item(chunk, notes):
                yield out
