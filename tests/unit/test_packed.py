"""The packed batch: one query's pure and RAG contexts as one sequence in one KV cache.

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_packed.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokrag_integrations.accel import sdpa as S


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
    token = S.PACKED_PREFILL.set((r, head))
    try:
        got, _ = S.few_query_attention(_Attn(), q, k, v, mask[None, None], scaling=8**-0.5)
    finally:
        S.PACKED_PREFILL.reset(token)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_two_queries_of_one_sequence_attend_under_an_additive_mask():
    """A packed decode step (one sequence, two new positions, each context seeing its own
    keys) takes the flash path with the mask and equals the masked reference."""
    torch.manual_seed(1)
    q = torch.randn(1, 6, 2, 8)
    k = torch.randn(1, 2, 12, 8)
    v = torch.randn(1, 2, 12, 8)
    visible = torch.zeros(2, 12, dtype=torch.bool)
    visible[0, :3] = True
    visible[0, 9:11] = True
    visible[1, :9] = True
    visible[1, 11] = True
    mask = torch.zeros(2, 12).masked_fill_(~visible, float("-inf"))[None, None]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True, scale=0.2)
    got, _ = S.few_query_attention(_Attn(), q, k, v, mask, scaling=0.2)
    torch.testing.assert_close(got, want.transpose(1, 2), atol=1e-5, rtol=0)
