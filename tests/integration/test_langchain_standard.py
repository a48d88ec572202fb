"""LangChain's own standard test suites (``langchain-tests``) run against ``ChatTokRAG``.

The model under test is the real packaged default model, constructed from keyword arguments
(``ChatTokRAG(model="default", ...)``, loaded once per process). Generation is kept short
(``max_tokens=4`` in ``standard_chat_model_params``) so the integration suite stays cheap on CPU; without passages the chat
model is the pure model (policy ``"llm"``), which is what these generic chat tests exercise.

Feature flags switched off, and why (the defaults of the suite are kept otherwise):

* ``has_tool_calling = False`` / ``has_tool_choice = False`` - ChatTokRAG does not implement
  ``bind_tools``: a 135M local model with greedy Tok-RAG decoding has no function-calling
  format; tool tests (tool calls, tool-message histories, agent loop) are skipped.
* ``has_structured_output = False`` - no ``with_structured_output`` (it relies on tool calling
  or a JSON mode, neither of which exists here).
* ``supports_json_mode = False`` - no constrained JSON decoding.
* ``supports_image_inputs`` / ``supports_image_urls`` / ``supports_pdf_inputs`` /
  ``supports_audio_inputs`` / ``supports_video_inputs`` / ``supports_image_tool_message`` /
  ``supports_pdf_tool_message`` / ``supports_anthropic_inputs`` = False - the model is
  text-only; non-text content blocks are refused with a ValueError.
* ``enable_vcr_tests = False`` - nothing is sent over a network, so there is nothing to record.

Kept on: ``returns_usage_metadata`` (input tokens from the prompt, output tokens = decoding
steps) and ``supports_model_override`` (``invoke(..., model="SmolLM2-135M-Instruct")`` loads
that model by name; it is the default model's display name, so the override costs one cached
load, not a second model).

Cases that need no model, database or server are in ``tests/unit/test_langchain_standard.py``."""

from __future__ import annotations

import pytest
from _langchain_flags import _PARAMS, _Flags  # noqa: F401
from langchain_tests.integration_tests import ChatModelIntegrationTests


@pytest.mark.slow
class TestChatTokRAGIntegration(_Flags, ChatModelIntegrationTests):
    """``ChatModelIntegrationTests`` on the real default model (short answers)."""
