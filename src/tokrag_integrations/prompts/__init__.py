"""Prompts: one builder for the pure and the RAG context (docs/algorithm.md, "Two contexts"),
and user text that never becomes a control token.

Three rooms: :mod:`.chat_template` (the chat template rendered with a step limit; user text
encoded as text), :mod:`.prompt_types` (:class:`Passage`, :class:`RenderedPrompt`,
:class:`PromptPlan`) and :mod:`.builder` (:class:`PromptBuilder`). Import from here.
"""

from __future__ import annotations

from .builder import DEFAULT_SYSTEM_PROMPT, DELIMITER, MIN_CUT_TOKENS, PromptBuilder
from .chat_template import (
    CHAT_ROLES,
    TEMPLATE_STEPS,
    ChatTemplateError,
    check_messages,
    clean_text,
    encode_chat,
    encode_user_text,
    render_chat_template,
)
from .prompt_types import Passage, PromptPlan, RenderedPrompt, as_passages

__all__ = [
    "CHAT_ROLES",
    "DEFAULT_SYSTEM_PROMPT",
    "DELIMITER",
    "MIN_CUT_TOKENS",
    "TEMPLATE_STEPS",
    "ChatTemplateError",
    "Passage",
    "PromptBuilder",
    "PromptPlan",
    "RenderedPrompt",
    "as_passages",
    "check_messages",
    "clean_text",
    "encode_chat",
    "encode_user_text",
    "render_chat_template",
]
