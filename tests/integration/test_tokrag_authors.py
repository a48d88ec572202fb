"""The authors' released rule (policies/tokrag_authors.py) on hand-made tensors, and its
skip / gate masks on the real default tokenizer.

This file holds the cases that need the real model, a database, a server or a subprocess; the others are in
``tests/unit/test_tokrag_authors.py``."""

from __future__ import annotations

import pytest
import torch

from tokrag_integrations.policies import tokrag_authors as R
from tokrag_integrations.policies import vocab as V


def attention(m_or_values, *, heads: int = 2, extra: int = 0) -> torch.Tensor:
    """[H, T] attention with the given per-position values on every head (T = m + extra)."""
    vals = torch.as_tensor(m_or_values, dtype=torch.float)
    row = torch.cat([vals, torch.zeros(extra)])
    return row.repeat(heads, 1)


# ---------------------------------------------------------------- masks on the real tokenizer
@pytest.fixture(scope="module")
def tok(lm):
    return lm.tokenizer


def _id(tok, text: str) -> int:
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == 1, (text, ids)
    return ids[0]


def test_skip_mask_default_tokenizer(lm, tok):
    mask = V.skip_mask(tok, vocab_size=lm.vocab_size)
    assert mask.dtype == torch.bool and mask.numel() == lm.vocab_size
    for s in [".", "1", "0", "7", ")", ":", "'", "-", "]", "]:", "}:", " ", " ["]:
        assert mask[_id(tok, s)], s
    for s in [" Paris", "Paris", ",", " the", "(", " (", '"', " '"]:
        assert not mask[_id(tok, s)], s
    if tok.bos_token is not None:
        assert mask[tok.convert_tokens_to_ids(tok.bos_token)]
    # small: a handful of pieces, not all punctuation-bearing tokens
    assert 10 <= int(mask.sum()) <= 40


def test_skip_mask_all_special(lm, tok):
    mask = V.skip_mask(tok, vocab_size=lm.vocab_size, all_special=True)
    for i in tok.all_special_ids:
        assert mask[i]


def test_gate_mask_default_tokenizer(lm, tok):
    gate = V.gate_mask(tok, vocab_size=lm.vocab_size)
    for s in [" the", "the", " The", " a", " an", " in", " for", ".", ":", " ", "Query", " ["]:
        assert gate[_id(tok, s)], s
    for s in [" Paris", "1", " London", ","]:
        assert not gate[_id(tok, s)], s


def test_end_to_end_with_real_embeddings(lm, tok):
    """The skip mask drops a '.' that holds the most attention; the answer token wins."""
    A = lm.model.get_input_embeddings().weight.detach()
    skip = V.skip_mask(tok, vocab_size=A.shape[0])
    ids = [_id(tok, s) for s in [" capital", " of", " France", " is", " Paris", "."]]
    Vv = A.shape[0]
    rag = torch.zeros(Vv)
    rag[_id(tok, " Paris")] = 0.7
    rag[_id(tok, " Lyon")] = 0.2
    pure = torch.zeros(Vv)
    pure[_id(tok, " Lyon")] = 0.6
    pure[_id(tok, " London")] = 0.3
    pure[_id(tok, " Rome")] = 0.1
    att = attention([0.0, 0.0, 0.05, 0.05, 0.3, 0.6])  # '.' most attended
    sig = R.authors_signals(att, torch.arange(6), torch.tensor(ids), rag, pure, A, skip=skip)
    assert _id(tok, ".") not in sig["attended"]
    assert sig["attended"][0] == _id(tok, " Paris")
    assert sig["best_token"] == _id(tok, " Paris")
    assert sig["benefit"] is True


def test_vocab_masks_built_once_per_model(lm, tok):
    """``prepare`` runs for every call; the vocabulary masks (a decode of every token, ~0.3 s
    on SmolLM2) are built once per model and tokenizer and then reused, equal to a fresh build."""
    from tokrag_integrations.policies.tokrag import TokRAG

    first, second = TokRAG(), TokRAG()
    first.prepare(lm)
    second.prepare(lm)
    assert second._gate is first._gate
    assert torch.equal(first._gate, V.gate_mask(tok, vocab_size=lm.vocab_size))
    ref1, ref2 = R.TokRAGAuthors(), R.TokRAGAuthors()
    ref1.prepare(lm)
    ref2.prepare(lm)
    assert ref2._skip is ref1._skip
    assert torch.equal(ref1._skip, V.skip_mask(tok, vocab_size=lm.vocab_size))


def test_model_memo_keys_apart(lm):
    """:meth:`LoadedModel.memo` builds once per key and keeps keys apart."""
    calls = []

    def build(v):
        calls.append(v)
        return [v]

    key = ("test-memo", object())
    a = lm.memo((*key, 1), lambda: build(1))
    assert lm.memo((*key, 1), lambda: build(99)) is a
    assert lm.memo((*key, 2), lambda: build(2)) == [2]
    assert calls == [1, 2]
