"""TokRAGChain: any LangChain retriever in front of a Tok-RAG decoded answer (the
Runnable that :func:`~tokrag_integrations.langchain.chains.create_tokrag_chain` builds)."""

from __future__ import annotations

import warnings
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForChainRun, CallbackManagerForChainRun
from langchain_core.documents import Document
from langchain_core.messages import BaseMessage
from langchain_core.prompts import BasePromptTemplate
from langchain_core.runnables import Runnable, RunnableConfig
from pydantic import BaseModel, ConfigDict, create_model

from ._chain_inputs import (
    DEFAULT_DOCUMENT_SEPARATOR,
    _own_messages,
    _passages,
    _prompt_values,
    _question,
    _runnable_name,
    format_documents,
)
from .chat_models import ChatTokRAG


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
