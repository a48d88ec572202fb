"""The optional backend, llguidance, imported on first use with an install hint."""

from __future__ import annotations

from typing import Any

INSTALL_HINT = "pip install 'tokrag-integrations[structured]'"


def llguidance_module() -> Any:
    """The ``llguidance`` module (with its Hugging Face tokenizer bridge loaded), or
    ImportError naming the extra that installs it."""
    try:
        import llguidance
        import llguidance.hf  # noqa: F401 - the tokenizer bridge, used by grammar._Bridge
    except ImportError as exc:  # pragma: no cover - the extra is installed in the test venv
        raise ImportError(f"structured output and tool calls need llguidance: {INSTALL_HINT}") from exc
    return llguidance
