"""The documents a LangChain run's retrievers returned, found in ``ChatTokRAG``'s prompt.

LangChain's own RAG recipes (``{"context": retriever | format_docs, ...} | prompt | chat``,
``create_retrieval_chain`` + ``create_stuff_documents_chain``) format the documents into the
prompt and call the chat model with messages only. :class:`RunDocuments`, one callback handler
added to every LangChain run by a configure hook registered when
:mod:`tokrag_integrations.langchain` is imported, records each retriever's documents on every
run above the retriever. :func:`find_retrieved` takes the documents of the chat model's nearest
ancestor run that holds any, finds their text in the messages, and returns the span from the
first found document to the last as the ``context=`` of the call (so the retrieved tokens are
where that span lands), with what was found in ``response_metadata["retrieval"]``.

Memory: a run's entry is dropped when the run ends (its documents live on in its ancestors,
which end later); at most :data:`MAX_RUNS` entries are kept (the oldest dropped first) for runs
that never end.

The same handler records, on the runs above each prompt template it formats, the values of
the template's :data:`PROMPT_VARIABLES` (``context``, ``documents``). LangGraph's RAG recipe (a
retrieve node that calls ``vector_store.similarity_search``, a generate node that fills the RAG
prompt's ``context`` and calls the chat model) runs no retriever runnable: when none of the
run's retrieved documents is found, :func:`find_retrieved` takes the filled variable's text,
found in the messages, as the ``context=`` of the call (``source: "prompt_variable"``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.messages import BaseMessage
from langchain_core.runnables.config import var_child_runnable_config
from langchain_core.tracers.context import register_configure_hook

from .messages import _text, messages_to_prompt

#: Most runs tracked at once (runs that never end would otherwise stay).
MAX_RUNS = 10_000

#: A prompt template's variables whose text counts as retrieved text (the names LangChain's
#: and LangGraph's RAG prompts use), in the order they are looked for.
PROMPT_VARIABLES = ("context", "documents")

#: A prompt template's variables that hold the question (the pure context's query).
QUESTION_VARIABLES = ("question", "input", "query")


@dataclass
class Filled:
    """A prompt variable's value in a run: its ``variable`` name, the ``text`` it put in the
    prompt and the template's question variable (``question``, None when it has none)."""

    variable: str
    text: str
    question: str | None


def filled_variables(inputs: Any) -> list[Filled]:
    """The :data:`PROMPT_VARIABLES` a prompt template's ``inputs`` fill with text: a string,
    or Documents (their text as the template formats a list: ``str(value)``)."""
    if not isinstance(inputs, Mapping):
        return []
    question = next(
        (inputs[k] for k in QUESTION_VARIABLES if isinstance(inputs.get(k), str)), None
    )
    out = []
    for name in PROMPT_VARIABLES:
        value = inputs.get(name)
        if isinstance(value, Document):
            value = [value]
        if isinstance(value, str):
            text = value
        elif isinstance(value, Sequence) and value and all(isinstance(d, Document) for d in value):
            text = str(value)
        else:
            continue
        if text.strip():
            out.append(Filled(name, text, question))
    return out


@dataclass
class _Run:
    parent: UUID | None
    query: str | None = None
    # (the retriever's query, its documents), every retriever below this run.
    retrieved: list[tuple[str | None, list[Document]]] = field(default_factory=list)
    # The prompt variables filled below this run, in the order the prompts started.
    filled: list[Filled] = field(default_factory=list)


class RunDocuments(BaseCallbackHandler):
    """Records every retriever's documents on the runs above it, until those runs end."""

    run_inline = True  # in the caller's thread / task: recorded before the next step starts

    def __init__(self, max_runs: int = MAX_RUNS) -> None:
        self.max_runs = max_runs
        self._runs: OrderedDict[UUID, _Run] = OrderedDict()
        self._lock = threading.Lock()

    # Only the run tree and the retrievers are read.
    ignore_llm = ignore_chat_model = ignore_retry = ignore_custom_event = True  # type: ignore[assignment]

    def open_runs(self) -> int:
        """How many runs are tracked now (started, not ended)."""
        return len(self._runs)

    def _start(self, run_id: UUID, parent: UUID | None, query: str | None = None) -> None:
        with self._lock:
            self._runs[run_id] = _Run(parent, query)
            while len(self._runs) > self.max_runs:
                self._runs.popitem(last=False)

    def _end(self, _outcome: Any, *, run_id: UUID, **_: Any) -> None:
        with self._lock:
            self._runs.pop(run_id, None)

    def on_chain_start(
        self,
        serialized: Any,
        inputs: Any,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **kwargs: Any,
    ) -> None:
        self._start(run_id, parent_run_id)
        if kwargs.get("run_type") == "prompt":  # a prompt template formats ``inputs``
            filled = filled_variables(inputs)
            if filled:
                with self._lock:
                    self._up(parent_run_id, lambda run: run.filled.extend(filled))

    def _up(self, run_id: UUID | None, add: Any) -> None:
        """``add`` to ``run_id``'s run and every tracked run above it (the lock held)."""
        while run_id is not None and run_id in self._runs:
            run = self._runs[run_id]
            add(run)
            run_id = run.parent

    def on_tool_start(
        self,
        serialized: Any,
        input_str: Any,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **_: Any,
    ) -> None:
        self._start(run_id, parent_run_id)

    def on_retriever_start(
        self,
        serialized: Any,
        query: Any,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **_: Any,
    ) -> None:
        self._start(run_id, parent_run_id, query if isinstance(query, str) else None)

    def on_retriever_end(
        self,
        documents: Sequence[Document],
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **_: Any,
    ) -> None:
        docs = [d for d in documents if isinstance(getattr(d, "page_content", None), str)]
        with self._lock:
            run = self._runs.pop(run_id, None)
            entry = (run.query if run else None, docs)
            self._up(run.parent if run else parent_run_id, lambda r: r.retrieved.append(entry))

    on_chain_end = on_chain_error = on_tool_end = on_tool_error = on_retriever_error = _end  # type: ignore[assignment]

    def documents(self, parent_run_id: UUID | None) -> list[tuple[str | None, list[Document]]]:
        """What the retrievers below the nearest run above a call (``parent_run_id`` and up)
        that holds any returned, in the order they ended."""
        with self._lock:
            run_id = parent_run_id
            while run_id is not None and run_id in self._runs:
                run = self._runs[run_id]
                if run.retrieved:
                    return list(run.retrieved)
                run_id = run.parent
        return []

    def prompt_variables(self, parent_run_id: UUID | None) -> list[Filled]:
        """The prompt variables filled below the nearest run above a call that holds any,
        in the order the prompts started."""
        with self._lock:
            run_id = parent_run_id
            while run_id is not None and run_id in self._runs:
                run = self._runs[run_id]
                if run.filled:
                    return list(run.filled)
                run_id = run.parent
        return []


#: The handler every LangChain run gets (through the configure hook below).
RUN_DOCUMENTS = RunDocuments()
_HOOK: ContextVar[RunDocuments | None] = ContextVar("tokrag_run_documents", default=RUN_DOCUMENTS)
register_configure_hook(_HOOK, inheritable=True)


@dataclass
class Found:
    """What a call's messages hold of its run's retrieved documents: ``context`` (the span of
    the found documents, ``None`` when none was found), the pure context's ``question``
    (``None``: ``rendered_prompt``'s default), ``response_metadata["retrieval"]`` and the
    found ``documents`` in the order of the span."""

    context: str | None
    question: str | None
    metadata: dict[str, Any]
    documents: list[Document] = field(default_factory=list)


def retrieval_metadata(
    source: str,
    note: str | None = None,
    documents: int | None = None,
    found: int | None = None,
    variable: str | None = None,
) -> dict[str, Any]:
    """``response_metadata["retrieval"]``: ``source``, the rule that found the retrieved
    tokens (``"passages"``, ``"context"``: ``context=``, ``"retriever"``: the run's retrieved
    documents found in the prompt, ``"prompt_variable"``: a prompt template's ``variable``
    filled in the run, or ``"none"``: the plain model), the run's retrieved ``documents``, how
    many were ``found`` in the prompt and ``missing`` (``None``: not looked up), and a
    ``note`` saying why when the plain model answers or documents are missing."""
    missing = None if documents is None or found is None else documents - found
    return {
        "source": source,
        "documents": documents,
        "found": found,
        "missing": missing,
        "variable": variable,
        "note": note,
    }


def given_retrieval(passages: list[Any], context: str | None, policy: str) -> dict[str, Any]:
    """``response_metadata["retrieval"]`` of a call that was given its retrieved text (or
    told there is none): the run's documents are not looked up."""
    if context is not None:
        return retrieval_metadata("context")
    if passages:
        return retrieval_metadata("passages")
    if policy == "no_rag":
        return retrieval_metadata("none", "policy 'no_rag' was asked for")
    return retrieval_metadata("none", "passages=[] was given")


def find_retrieved(messages: Sequence[BaseMessage], run_manager: Any) -> Found:
    """The documents the run's retrievers returned before this call, found in ``messages``.

    The run above the call is ``run_manager``'s parent; without one (``BaseChatModel.stream``
    and ``astream`` call ``_stream`` / ``_astream`` without it), the parent of the config the
    calling runnable set for its steps (where ``stream`` found its callbacks)."""
    if run_manager is not None:
        parent = run_manager.parent_run_id
    else:
        callbacks = (var_child_runnable_config.get() or {}).get("callbacks")
        parent = getattr(callbacks, "parent_run_id", None)
    found = match_documents(messages, RUN_DOCUMENTS.documents(parent))
    if found.context is None:
        return match_variables(messages, RUN_DOCUMENTS.prompt_variables(parent), found) or found
    return found


def match_variables(
    messages: Sequence[BaseMessage], filled: list[Filled], documents: Found
) -> Found | None:
    """The last filled prompt variable whose text (outer whitespace aside) is in
    ``messages``, as the context; ``documents`` is what :func:`match_documents` found (none:
    its counts are kept). The question is the template's question variable when it is in the
    last human turn outside the text, else ``rendered_prompt``'s default. None when no
    variable's text is in the messages."""
    texts = [_text(m) for m in messages]
    last_human = messages_to_prompt(messages).query
    for f in reversed(filled):
        span = f.text.strip()
        if not any(span in t for t in texts):
            continue
        rest = last_human.replace(span, " ").strip()
        question = f.question.strip() if isinstance(f.question, str) else ""
        if question and (question in rest or not rest):
            pure_question: str | None = question
        elif rest:
            pure_question = None
        else:
            continue  # no question for the pure context
        n = documents.metadata["documents"]
        note = None
        if n:
            note = (
                f"none of the {n} documents this run's retrievers returned is in the prompt as "
                f"is; the text the prompt's {f.variable!r} variable received is the retrieved text"
            )
        meta = retrieval_metadata("prompt_variable", note, n, 0, f.variable)
        # One passage: the variable's text (citations name the variable).
        doc = Document(page_content=span, metadata={"source": f"prompt variable {f.variable!r}"})
        return Found(span, pure_question, meta, [doc])
    return None


def match_documents(
    messages: Sequence[BaseMessage], retrieved: list[tuple[str | None, list[Any]]]
) -> Found:
    """Find each retrieved document's text (stripped, exact; a Document or a string) in the
    message holding the most of them; the span from the first found to the last is the
    context. The question is the retriever's query when it is the same for every found
    document and is in the last human turn outside the span; else ``None``."""
    # text -> (its retriever's query, the first Document with it), distinct texts in order
    docs: dict[str, tuple[str | None, Document]] = {}
    for query, items in retrieved:
        for d in items:
            d = d if isinstance(d, Document) else Document(page_content=d)
            docs.setdefault(d.page_content.strip(), (query, d))
    docs.pop("", None)
    if not docs:
        note = (
            "no retriever ran in this run before the call, so nothing in the prompt is "
            "retrieved text"
        )
        return Found(None, None, retrieval_metadata("none", note, 0, 0))
    texts = [_text(m) for m in messages]
    held = [[d for d in docs if d in t] for t in texts]
    best = max(range(len(texts)), key=lambda i: len(held[i]), default=None)
    if best is None or not held[best]:
        note = (
            f"none of the {len(docs)} documents this run's retrievers returned is in the "
            "prompt as is (did the formatting change their text?), so nothing is decoded "
            "as retrieved text"
        )
        return Found(None, None, retrieval_metadata("none", note, len(docs), 0))
    text = texts[best]
    starts = [text.find(d) for d in held[best]]
    start = min(starts)
    end = max(s + len(d) for s, d in zip(starts, held[best], strict=True))
    span = text[start:end]
    found = sorted((d for d in docs if d in span), key=span.find)
    queries = {docs[d][0] for d in found}
    query = next(iter(queries)) if len(queries) == 1 else None
    query = query.strip() if isinstance(query, str) else ""
    rest = messages_to_prompt(messages).query.replace(span, " ").strip()
    if query and (query in rest or not rest):
        question = query
    elif rest:
        question = None  # rendered_prompt's default: the last human turn without the span
    else:
        note = (
            "the last human message holds only the retrieved documents, no question for "
            "the pure context, so nothing is decoded as retrieved text (pass context= and "
            "question=)"
        )
        return Found(None, None, retrieval_metadata("none", note, len(docs), 0))
    note = None
    if len(found) < len(docs):
        note = (
            f"{len(docs) - len(found)} of the {len(docs)} documents this run's retrievers "
            "returned are not in the prompt as is next to the others: only the others are "
            "retrieved text"
        )
    meta = retrieval_metadata("retriever", note, len(docs), len(found))
    return Found(span, question, meta, [docs[d][1] for d in found])
