"""The probe: last-position states read during the ordinary forward pass, without hooks.

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_probe.py``."""

from __future__ import annotations

import pytest
import torch

from tokrag_integrations.accel import sdpa as S
from tokrag_integrations.attention.probe import ACTIVE_TAP
from tokrag_integrations.attention.rows import attention_from_queries


class _Attn(torch.nn.Module):
    layer_idx = 0
    num_key_value_groups = 3
    is_causal = True


@pytest.mark.parametrize(
    "rows,mask_kind", [(1, "none"), (2, "left"), (3, "holes"), (6, "left"), (2, "float")]
)
def test_attention_function_keeps_the_rotated_queries(rows, mask_kind):
    """Under a probe, the one-query attention computes the same output as without one and
    leaves each row's query and the scaling in the tap."""
    from tokrag_integrations.attention.probe import _Tap

    torch.manual_seed(rows)
    h, hkv, hd, t = 6, 2, 8, 11
    q = torch.randn(rows, h, 1, hd)
    k = torch.randn(rows, hkv, t, hd)
    v = torch.randn(rows, hkv, t, hd)
    valid = torch.ones(rows, t, dtype=torch.bool)
    if mask_kind in ("left", "float"):
        for r in range(rows):
            valid[r, : (3 * r) % 7] = False
    elif mask_kind == "holes":
        valid[:, 4] = False
        valid[0, 1] = False
    mask = None if mask_kind == "none" else valid[:, None, None, :]
    if mask_kind == "float":
        mask = torch.zeros(rows, 1, 1, t).masked_fill_(~mask, float("-inf"))
    kk = k.repeat_interleave(h // hkv, dim=1)
    vv = v.repeat_interleave(h // hkv, dim=1)
    scores = (q @ kk.transpose(-1, -2))[:, :, 0] * 0.3  # [B, H, T]
    want_p = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
    want_out = (want_p[:, :, None] @ vv).transpose(1, 2)  # [B, 1, H, hd]
    tap = _Tap(1)
    token = ACTIVE_TAP.set((tap,))
    try:
        got, weights = S.few_query_attention(_Attn(), q, k, v, mask, scaling=0.3)
    finally:
        ACTIVE_TAP.reset(token)
    assert weights is None
    torch.testing.assert_close(got, want_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(tap.query[0], q[:, :, 0]) and tap.scale[0] == 0.3
    # The kept query gives the reference probabilities, row by row.
    for r in range(rows):
        p = attention_from_queries([tap.query[0][r]], [0.3], [k[r : r + 1]], valid[r : r + 1], t)
        torch.testing.assert_close(p[0], want_p[r], atol=1e-6, rtol=1e-5)


def test_probe_positions_keep_those_positions():
    """A probe on chosen positions of a one-sequence batch keeps those queries as rows."""
    from tokrag_integrations.attention.probe import _Tap

    torch.manual_seed(0)
    q = torch.randn(1, 6, 3, 8)
    k = torch.randn(1, 2, 5, 8)
    v = torch.randn(1, 2, 5, 8)
    mask = torch.zeros(1, 1, 3, 5)
    mask[0, 0, 0, 4] = float("-inf")
    for positions in ([2, 0], [1, 2]):
        tap = _Tap(1, positions)
        token = ACTIVE_TAP.set((tap,))
        try:
            S.few_query_attention(_Attn(), q, k, v, mask, scaling=0.5)
        finally:
            ACTIVE_TAP.reset(token)
        want = q[0, :, positions].transpose(0, 1)
        assert torch.equal(tap.query[0], want)
