"""The packed prefill: one query's pure and RAG prompts run as one sequence.

The layout in the cache (tiny tensors), the two-context attention against the masked
reference, and on the real default model: the same logits, cache rows and probe states as
prefilling each context on its own and fusing them, the same decoded tokens and decisions,
and the cases where it does not apply.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokrag_integrations import cpu_kernels as K
from tokrag_integrations.api import generate
from tokrag_integrations.decoding import (
    ContextSpec,
    fuse_batches,
    prefill_packed,
    prefill_roles,
    shared_prefill,
)
from tokrag_integrations.kv_cache import GrowableLayer
from tokrag_integrations.prompts import PromptBuilder

FICTION = (
    "What is the name of the cat owned by Zorbin Quell?",
    ["Zorbin Quell owns a grey cat named Pistachio.", "Pistachio sleeps on the red sofa."],
)


def _specs(lm, q, ps):
    plan = PromptBuilder(lm.tokenizer, context_window=lm.context_window).build(q, ps)
    return {
        "pure": ContextSpec(plan.pure_ids),
        "rag": ContextSpec(plan.rag_ids, plan.retrieved_positions),
    }


def test_expect_packed_splits_one_sequence_into_left_padded_rows():
    layer = GrowableLayer()
    layer.expect_packed([[(0, 2), (5, 7)], [(0, 5)]])
    k = torch.arange(7.0).view(1, 1, 7, 1).expand(1, 2, 7, 3).contiguous()
    v = -k
    got_k, got_v = layer.update(k, v)
    assert got_k is k and got_v is v  # the packed pass attends within its own sequence
    assert layer.keys.shape == (2, 2, 5, 3)
    assert layer.keys[0, 0, :, 0].tolist() == [0.0, 0.0, 1.0, 5.0, 6.0]  # one zero of padding
    assert layer.keys[1, 0, :, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert torch.equal(layer.values, -layer.keys)
    assert layer.get_seq_length() == 5
    # Later updates append to every row.
    layer.update(torch.full((2, 2, 1, 3), 9.0), torch.full((2, 2, 1, 3), -9.0))
    assert layer.keys.shape == (2, 2, 6, 3) and layer.keys[:, :, -1].eq(9.0).all()
    with pytest.raises(RuntimeError, match="fresh"):
        layer.expect_packed([[(0, 1)]])
    with pytest.raises(ValueError, match="non-empty"):
        GrowableLayer().expect_packed([[(0, 1)], []])


class _Attn(torch.nn.Module):
    layer_idx = 0
    num_key_value_groups = 3
    is_causal = True


@pytest.mark.parametrize("head", [0, 3])
def test_packed_attention_equals_the_masked_product(head):
    torch.manual_seed(0)
    r, tail = 9, 4
    n = r + tail
    q = torch.randn(1, 6, n, 8)
    k = torch.randn(1, 2, n, 8)
    v = torch.randn(1, 2, n, 8)
    mask = torch.ones(n, n, dtype=torch.bool).tril_()
    mask[r:, head:r] = False
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    token = K.PACKED_PREFILL.set((r, head))
    try:
        got, _ = K.few_query_attention(_Attn(), q, k, v, mask[None, None], scaling=8**-0.5)
    finally:
        K.PACKED_PREFILL.reset(token)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _packed_model(lm):
    if lm.model.config._attn_implementation != K.ATTN_IMPLEMENTATION:
        pytest.skip("model not on the few-query attention path")


def test_packed_prefill_equals_separate_prefills_fused(lm):
    _packed_model(lm)
    specs = [_specs(lm, *FICTION)]
    roles = ["pure", "rag"]
    probe = frozenset(roles)
    with torch.inference_mode():
        sep = prefill_roles(roles, specs, lm, probe)
        want = fuse_batches([sep["pure"], sep["rag"]])
        got = prefill_packed(roles, specs, lm, probe)
        assert got is not None and want is not None
        assert got.pad == want.pad and got.pad[0] > 0 and got.pad[1] == 0
        assert torch.equal(got.mask, want.mask) and torch.equal(got.ids, want.ids)
        torch.testing.assert_close(got.logits, want.logits, atol=2e-4, rtol=0)
        for a, b in zip(got.cache.layers, want.cache.layers, strict=True):
            assert a.keys.shape == b.keys.shape
            torch.testing.assert_close(a.keys, b.keys, atol=2e-4, rtol=0)
            torch.testing.assert_close(a.values, b.values, atol=2e-4, rtol=0)
            assert a.keys[0, :, : got.pad[0]].abs().max().item() == 0.0
        # The probe keeps each context's last position, as separate prefills do.
        torch.testing.assert_close(got.records.resid, want.records.resid, atol=2e-3, rtol=1e-4)
        for c1, c2 in zip(got.records.cos, want.records.cos, strict=True):
            torch.testing.assert_close(c1, c2)
        # And decoding goes on from it as from the fused batch.
        got.forward(torch.tensor([11, 11]))
        want.forward(torch.tensor([11, 11]))
        torch.testing.assert_close(got.logits, want.logits, atol=2e-4, rtol=0)


def test_packed_decoding_gives_the_same_answer(lm, monkeypatch):
    _packed_model(lm)
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("TOKRAG_PACKED_PREFILL", flag)
        r = generate(lm, *FICTION, policy="tokrag", max_new_tokens=12)
        outs[flag] = r
        assert r.trace.timings["packed"] == float(flag == "1")
    a, b = outs["1"], outs["0"]
    assert [(s.token_id, s.source) for s in a.trace.steps] == [
        (s.token_id, s.source) for s in b.trace.steps
    ]
    assert a.text == b.text


def test_packed_prefill_applies_only_to_one_query_with_two_contexts(lm, monkeypatch):
    _packed_model(lm)
    specs = _specs(lm, *FICTION)
    roles = ["pure", "rag"]
    with torch.inference_mode():
        assert prefill_packed(roles, [specs, specs], lm, frozenset()) is None  # two queries
        assert prefill_packed(["rag"], [specs], lm, frozenset()) is None  # one context
        with shared_prefill():  # the harness reuses per-context prefills across policies
            assert prefill_packed(roles, [specs], lm, frozenset()) is None
        monkeypatch.setenv("TOKRAG_PACKED_PREFILL", "0")
        assert prefill_packed(roles, [specs], lm, frozenset()) is None
