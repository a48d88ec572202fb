"""What the LangChain chains share: their inputs (the question, the documents, the
prompt's variables), the package's own prompt, and the checks of a user prompt."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.documents import Document
from langchain_core.messages import (
    BaseMessage,
    HumanMessage,
    SystemMessage,
    convert_to_messages,
)
from langchain_core.prompts import BasePromptTemplate, PromptTemplate, format_document
from langchain_core.runnables import Runnable

#: Keys of every output (``invoke``) and of the aggregated stream.
OUTPUT_KEYS = ("answer", "context", "sources", "trace", "warnings", "retrieval_empty")
#: ``create_stuff_documents_chain``'s defaults: documents joined by a blank line, each one
#: formatted as its page content.
DEFAULT_DOCUMENT_SEPARATOR = "\n\n"
DEFAULT_DOCUMENT_PROMPT = PromptTemplate.from_template("{page_content}")
#: The prompt variable that receives the formatted documents (as LangChain's chains).
DOCUMENTS_KEY = "context"


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

