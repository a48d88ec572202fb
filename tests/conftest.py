"""Shared fixtures: one real default model per test session (loaded once, ~2 s from cache)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def lm():
    """The packaged default model (SmolLM2-135M-Instruct), shared by every test."""
    from tokrag_integrations import load_model

    return load_model("default", device="cpu")
