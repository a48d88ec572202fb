"""``create_tokrag_chain``: any LangChain retriever in front of a Tok-RAG decoded answer."""

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
from langchain_core.runnables import Runnable, RunnableConfig
from pydantic import BaseModel, ConfigDict, create_model

from ..models import LoadedModel, check_greedy
from ..policies import get_policy
from .chat_models import CHAT_LOAD_OPTIONS, ChatTokRAG

#: Keys of every output (``invoke``) and of the aggregated stream.
OUTPUT_KEYS = ("answer", "context", "sources", "trace", "warnings", "retrieval_empty")
#: Arguments of create_tokrag_chain other than load options and the policy's options.
_CHAIN_ARGUMENTS = (
    "retriever",
    "model",
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
    ) -> None:
        self.retriever = retriever
        self.model = model
        self.system_prompt = system_prompt
        self.model_kwargs = dict(model_kwargs or {})
        self.name = name or "TokRAGChain"

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
    @staticmethod
    def _question(input_: Any) -> str:
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

    def _messages(self, question: str, input_: Any = None) -> list[BaseMessage]:
        msgs: list[BaseMessage] = []
        if self.system_prompt is not None:
            msgs.append(SystemMessage(self.system_prompt))
        if isinstance(input_, Mapping) and input_.get("chat_history"):
            msgs += convert_to_messages(input_["chat_history"])
        msgs.append(HumanMessage(question))
        return msgs

    def _model_kwargs(self, docs: list[Document]) -> dict[str, Any]:
        # Documents go in the retriever's order: the core drops the lowest-ranked first.
        return {**self.model_kwargs, "passages": list(docs)}

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
        question = self._question(input_)
        docs = self._retrieve(question, config)
        notes = self._empty_note(question, docs)
        msg = self.model.invoke(
            self._messages(question, input_), config, **self._model_kwargs(docs)
        )
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
        question = self._question(input_)
        docs = await self._aretrieve(question, config)
        notes = self._empty_note(question, docs)
        msg = await self.model.ainvoke(
            self._messages(question, input_), config, **self._model_kwargs(docs)
        )
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
        question = self._question(input_)
        docs = self._retrieve(question, config)
        notes = self._empty_note(question, docs)
        chunks = self.model.stream(
            self._messages(question, input_), config, **self._model_kwargs(docs)
        )
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
        question = self._question(last)
        docs = await self._aretrieve(question, config)
        notes = self._empty_note(question, docs)
        chunks = self.model.astream(
            self._messages(question, last), config, **self._model_kwargs(docs)
        )
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


def create_tokrag_chain(
    retriever: Runnable[str, list[Document]],
    model: Any = "default",
    *,
    temperature: float | None = None,
    policy: str | None = None,
    system_prompt: str | None = None,
    max_tokens: int | None = None,
    stop: list[str] | None = None,
    max_context_tokens: int | None = None,
    **policy_options: Any,
) -> TokRAGChain:
    """A Runnable that retrieves documents for a question and answers from them with Tok-RAG.

    The question and the documents reach the decoder separately: the documents become the
    ranked passages of the RAG context, the question the final user turn (the pure context
    sees only the question).

    Args:
        retriever: any LangChain retriever (or Runnable str -> list[Document]): vector-store
            retrievers, BM25, ensembles, Postgres... Its order is the ranking (best first).
        model: a :class:`ChatTokRAG` (its settings are the defaults), a ``LoadedModel``, or
            what :func:`~tokrag_integrations.load_model` takes (``"default"``, a hub id in the
            local cache, a folder, a ``.gguf`` path, a loaded ``PreTrainedModel``), with its
            keyword options (``tokenizer``, ``device``, ``device_map``, ``dtype``,
            ``model_kwargs``, ``tokenizer_kwargs``, ``trust_remote_code``, ``revision``).
        temperature: only None or 0 (greedy decoding).
        policy: decoding policy; None keeps the model's (``"tokrag"`` for a LoadedModel).
        system_prompt: a system message before the question (None: the core default).
        max_tokens / stop / max_context_tokens: override the model's settings.
        **policy_options: options of the policy (e.g. ``pr_norm="softmax"``).

    Input: a question string, or a dict with ``"input"`` (the ``create_retrieval_chain``
    convention) or ``"question"``, optional ``"chat_history"`` (messages placed between the
    system prompt and the question) and any other keys, which are returned unchanged.

    ``invoke`` / ``ainvoke`` / ``batch`` / ``abatch`` return the input's keys (``{"input":
    question}`` for a string input) plus::

        {"answer": str,                # the generated answer
         "context": list[Document],    # the retrieved documents, in retriever order
         "sources": list[str],         # per generated token: "agree" | "rag" | "llm" | ...
         "trace": dict,                # the full trace (Trace.to_dict() as JSON data)
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
    check_greedy(temperature, "create_tokrag_chain")
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
        raise TypeError(
            f"create_tokrag_chain got an unknown keyword argument ({e}); besides the policy's "
            f"options it accepts: {', '.join(_CHAIN_ARGUMENTS + CHAT_LOAD_OPTIONS)}"
        ) from e
    model_kwargs: dict[str, Any] = {}
    if policy is not None:
        model_kwargs["policy"] = policy
    if max_tokens is not None:
        model_kwargs["max_tokens"] = max_tokens
    if stop is not None:
        model_kwargs["stop"] = list(stop)
    if max_context_tokens is not None:
        model_kwargs["max_context_tokens"] = max_context_tokens
    if policy_options:
        model_kwargs["policy_options"] = dict(policy_options)
    return TokRAGChain(retriever, model, system_prompt=system_prompt, model_kwargs=model_kwargs)
