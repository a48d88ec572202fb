"""The feature flags of LangChain's standard test suites for ``ChatTokRAG``, shared by the
unit and integration halves (``tests/*/test_langchain_standard.py``; the reasons for each
flag are in the integration half's docstring)."""

from __future__ import annotations

from typing import Any

from tokrag_integrations.langchain import ChatTokRAG

_PARAMS: dict[str, Any] = {"model": "default", "device": "cpu"}


class _Flags:
    """Feature flags shared by both suites (see the module docstring for the reasons)."""

    @property
    def chat_model_class(self) -> type[ChatTokRAG]:
        return ChatTokRAG

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return dict(_PARAMS)

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        # Short answers keep the integration suite cheap on CPU (the suite asks for 100).
        return {**super().standard_chat_model_params, "max_tokens": 64}  # type: ignore[misc]

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_image_urls(self) -> bool:
        return False

    @property
    def supports_pdf_inputs(self) -> bool:
        return False

    @property
    def supports_audio_inputs(self) -> bool:
        return False

    @property
    def supports_video_inputs(self) -> bool:
        return False

    @property
    def supports_image_tool_message(self) -> bool:
        return False

    @property
    def supports_pdf_tool_message(self) -> bool:
        return False

    @property
    def supports_anthropic_inputs(self) -> bool:
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        return True

    @property
    def model_override_value(self) -> str:
        return "SmolLM2-135M-Instruct"
