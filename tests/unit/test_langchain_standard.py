"""LangChain's own standard test suites (``langchain-tests``) run against ``ChatTokRAG``.

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_langchain_standard.py``."""

from __future__ import annotations

from _langchain_flags import _PARAMS, _Flags  # noqa: F401
from langchain_tests.unit_tests import ChatModelUnitTests


class TestChatTokRAGUnit(_Flags, ChatModelUnitTests):
    """``ChatModelUnitTests``: construction, standard params, LangSmith params (no decoding)."""
