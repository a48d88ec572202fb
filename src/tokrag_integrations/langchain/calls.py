"""One ``ChatTokRAG`` call translated into the core API's arguments: the messages, the
retrieved text (given, or found by :mod:`.retrieved`), the policy, sampling (:mod:`.chat_options`),
tools (:mod:`.tools`) and the response format (:mod:`.structured_output`)."""

from __future__ import annotations

import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any

from langchain_core.messages import BaseMessage

from ..adapters.translate import options_dict
from ..models import LoadedModel, unknown_arguments
from ..policies import get_policy
from .chat_options import SAMPLING_FIELDS, sampling_options
from .messages import document_passages, messages_to_prompt, rendered_prompt
from .retrieved import find_retrieved, given_retrieval
from .structured_output import checked_response_format
from .tools import (
    checked_tool_choice,
    has_tool_turns,
    plain_messages,
    remote_tool_turns,
    tool_constraint,
    tool_specs,
)

#: Per-call keyword arguments (besides ``stop``).
_CALL_KWARGS = (
    *SAMPLING_FIELDS,
    "tools",
    "tool_choice",
    "response_format",
    "parallel_tool_calls",
    "passages",
    "context",
    "question",
    "policy",
    "policy_options",
    "max_tokens",
    "max_context_tokens",
    "citations",
    "model",
)

#: Said once per instance when a call has no retrieved text (the plain model answers);
#: ``response_metadata["retrieval"]["note"]`` says why on every such call.
NO_PASSAGES_WARNING = (
    "ChatTokRAG got no retrieved text, so it decodes as the plain model (policy 'no_rag'): no "
    "retriever ran before it in this LangChain run and no prompt template's 'context' or "
    "'documents' variable was filled, or what they returned is not in the prompt as is "
    "(response_metadata['retrieval'] says which, on every call). To decode with Tok-RAG, put "
    "the retrieved text in your prompt template's {context} variable, format the retrieved "
    "documents into the prompt unchanged (e.g. "
    "'\\n\\n'.join(d.page_content for d in docs)), pass them as passages "
    "(ChatTokRAG(...).bind(passages=docs), invoke(..., passages=docs) or the passages= "
    "field), or build the chain with create_tokrag_chain(retriever, model, prompt=your_prompt) "
    "(create_tokrag_documents_chain(model, prompt=your_prompt) with your own retrieval step). "
    "Pass policy='no_rag' to ask for the plain model without this warning."
)
_WARN_LOCK = threading.Lock()

@dataclass
class Call:
    """One call, translated into the arguments of the core API."""

    lm: LoadedModel
    query: str | None
    """The question (None: a server call whose messages end with a tool result)."""
    passages: list[Any]
    kwargs: dict[str, Any]
    retrieval: dict[str, Any]
    logprobs: bool = False
    """Whether ``response_metadata["logprobs"]`` is filled."""
    tools: list[dict[str, Any]] | None = None
    """The bound tools (OpenAI function shape): the answer's tool calls are parsed."""


#: Modules between user code and ChatTokRAG's hooks (LangChain's async paths run sync code
#: in worker threads).
_FRAMEWORK_MODULES = (
    "langchain",
    "tokrag_integrations",
    "asyncio",
    "concurrent.futures",
    "threading",
)


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame of user code, so a warning points there; 2 when
    there is none (a call prepared in a worker thread)."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        if not frame.f_globals.get("__name__", "").startswith(_FRAMEWORK_MODULES):
            return level
        frame, level = frame.f_back, level + 1
    return 2



def prepare_call(
    model: Any,
    messages: list[BaseMessage],
    stop: list[str] | None,
    kwargs: dict[str, Any],
    run_manager: Any = None,
) -> Call:
    """Messages and call options -> arguments of the core API (validated here)."""
    kwargs = {
        k: v for k, v in kwargs.items() if not k.startswith("ls_") and k not in ("stream",)
    }
    call = {k: kwargs.pop(k) for k in _CALL_KWARGS if k in kwargs}
    if kwargs:
        raise unknown_arguments("ChatTokRAG call", kwargs, (*_CALL_KWARGS, "stop"))
    values = {k: call.get(k, getattr(model, k)) for k in SAMPLING_FIELDS}
    sampling = sampling_options(values)
    tools = tool_specs(call["tools"]) if call.get("tools") else None
    if call.get("tool_choice") is not None and tools is None:
        raise ValueError(
            "tool_choice= needs tools: bind them with bind_tools(tools, tool_choice=...)"
        )
    choice = checked_tool_choice(call.get("tool_choice"), tools or [])
    fmt = call.get("response_format")
    if fmt is not None and tools is not None:
        raise ValueError(
            "response_format= and tools= cannot both constrain one answer: use "
            "with_structured_output(schema, method='function_calling') for a tool's arguments"
        )
    talk = has_tool_turns(messages)
    options = {**model.policy_options, **options_dict(call.get("policy_options"))}
    policy = call.get("policy", model.policy)
    get_policy(policy, **options)  # unknown policy or option: fail before loading anything
    given = call.get("passages", model.passages)
    passages = document_passages(given)
    context, question = call.get("context"), call.get("question")
    if context is None and question is not None:
        raise ValueError("question= is the pure context's question of a context= call")
    max_tokens = int(call.get("max_tokens", model.max_tokens))
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    lm = model._resolve_model(call.get("model"))
    remote = (tools or talk) and not isinstance(lm, LoadedModel)
    if (tools or talk) and not remote:
        # The tools shown and the tool turns written as text turns (what the model reads):
        # from here on a conversation like any other, a tool's retrieved text included.
        messages = plain_messages(messages, tools or [], lm)
    if remote:
        if context is not None:
            raise ValueError("context= cannot be given with tools or tool messages to a server")
        retrieval = given_retrieval(passages, None, policy)
        if given is None and policy != "no_rag":
            retrieval["note"] = (
                "the server renders the tool turns: the run's retrieved text is not looked up "
                "(pass passages= for Tok-RAG)"
            )
    elif context is None and given is None and policy != "no_rag":
        # LangChain's own RAG code: the run's retrieved documents, found in the messages.
        found = find_retrieved(messages, run_manager)
        context, question, retrieval = found.context, found.question, found.metadata
        passages = document_passages(found.documents)
    else:
        retrieval = given_retrieval(passages, context, policy)
    rendered = None
    if context is not None:
        rendered, prompt = rendered_prompt(messages, context, question, passages)
        passages = []  # the documents context holds, in rendered
    elif remote:
        prompt = remote_tool_turns(messages)  # the server renders the tools and the turns
    else:
        prompt = messages_to_prompt(messages)
        if given is None and policy != "no_rag" and retrieval["source"] == "none":
            with _WARN_LOCK:
                warn, model._warned_no_passages = not model._warned_no_passages, True
            if warn:
                warnings.warn(NO_PASSAGES_WARNING, UserWarning, stacklevel=_caller_stacklevel())
    retrieved = bool(passages) or rendered is not None
    stops = list(stop if stop is not None else (model.stop or []))
    core: dict[str, Any] = {
        **sampling,
        "policy": policy if retrieved else "no_rag",
        "max_new_tokens": max_tokens,
        "stop": stops,
        "messages": prompt.history or None,
        "max_context_tokens": call.get("max_context_tokens", model.max_context_tokens),
        "policy_options": options if retrieved else {},
    }
    if prompt.system_prompt is not None:
        core["system_prompt"] = prompt.system_prompt
    citations = call.get("citations", model.citations)
    if citations is not None:  # a server call takes no citations= (its default holds)
        core["citations"] = citations
    if rendered is not None:
        core["rendered"] = rendered
    elif not passages:
        # Like ChatHuggingFace: the chat template over the messages as given.
        core["prompt_format"] = "chat"
    if fmt is not None:
        core["constraint"] = checked_response_format(fmt)
    elif tools is not None and remote:
        core["tools"], core["tool_choice"] = tools, choice  # the server constrains the call
        core["parallel_tool_calls"] = bool(call.get("parallel_tool_calls"))  # as a local call
    elif tools is not None and choice != "none":
        constraint = tool_constraint(tools, choice, lm, bool(call.get("parallel_tool_calls")))
        if constraint is not None:
            core["constraint"] = constraint
    return Call(
        lm=lm,
        query=prompt.query,
        passages=passages,
        kwargs=core,
        retrieval=retrieval,
        logprobs=bool(values.get("logprobs")),
        tools=tools,
    )

