"""The probe: last-position states read during the ordinary forward pass, without hooks.

On the real default model: the tapped states equal what module hooks see, the attention
input derived from the residuals equals the attention module's input, the attention rows
computed from the rotated queries a probed step keeps equal the rows recomputed from the
attention input, and a forward pass outside a probe is untouched.
"""

from __future__ import annotations

import pytest
import torch

from tokrag_integrations.accel import cpu_kernels as K
from tokrag_integrations.accel.packed import fuse_batches
from tokrag_integrations.attention import (
    ACTIVE_TAP,
    Probe,
    ProbeRecord,
    attention_from_queries,
    attention_rows,
    cached_keys,
    model_parts,
)
from tokrag_integrations.engine.batch import RoleBatch as _RoleBatch
from tokrag_integrations.policies.base import ContextSpec
from tokrag_integrations.prompts import PromptBuilder

FICTION = (
    "What is the name of the cat owned by Zorbin Quell?",
    ["Zorbin Quell owns a grey cat named Pistachio.", "Pistachio sleeps on the red sofa."],
)


def _ids(lm, q, ps):
    plan = PromptBuilder(lm.tokenizer, context_window=lm.context_window).build(q, ps)
    return plan.pure_ids, plan.rag_ids


class _Hooked:
    """What module hooks see in one forward pass (the old way of probing)."""

    def __init__(self, parts):
        self.parts, self.handles = parts, []
        self.resid, self.attn_in = {}, {}

    def __enter__(self):
        p = self.parts
        self.handles.append(
            p.embed.register_forward_hook(lambda _m, _i, o: self.resid.__setitem__(0, o[:, -1].clone()))
        )
        for i, (layer, attn) in enumerate(zip(p.layers, p.attn, strict=True)):
            self.handles.append(
                layer.register_forward_hook(
                    lambda _m, _i, o, i=i: self.resid.__setitem__(i + 1, o[:, -1].clone())
                )
            )
            self.handles.append(
                attn.register_forward_pre_hook(
                    lambda _m, a, kw, i=i: self.attn_in.__setitem__(
                        i, kw.get("hidden_states", a[0] if a else None)[:, -1].clone()
                    ),
                    with_kwargs=True,
                )
            )
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def _batch(lm, ids_rows, probe=True):
    return _RoleBatch("rag", [(i, ContextSpec(ids)) for i, ids in enumerate(ids_rows)], lm, probe=probe)


def test_tapped_states_equal_hooked_states(lm):
    parts = model_parts(lm.model)
    pure, rag = _ids(lm, *FICTION)
    with torch.inference_mode():
        b = _batch(lm, [pure, rag])  # left-padded batch of two rows
        with Probe(lm.model) as probe, _Hooked(parts) as hooked:
            b.forward(None)
        rec = probe.take()
        assert rec.resid.shape == (parts.num_layers + 1, 2, lm.model.config.hidden_size)
        for i in range(parts.num_layers + 1):
            assert torch.equal(rec.resid[i], hooked.resid[i])
        # The attention input is derived on first access from the residuals.
        assert rec._attn_in is None
        for i in range(parts.num_layers):
            torch.testing.assert_close(rec.attn_in[i], hooked.attn_in[i], atol=1e-6, rtol=0)
        with Probe(lm.model) as probe, _Hooked(parts) as hooked:
            b.forward(torch.tensor([11, 12]))
        rec = probe.take()
        for i in range(parts.num_layers + 1):
            assert torch.equal(rec.resid[i], hooked.resid[i])
        # Rotary slices: one per distinct rotary tensor, shared by the layers that share it.
        assert all(c is rec.cos[0] for c in rec.cos)


def test_no_probe_no_tap_and_same_logits(lm):
    """Outside a probe the wrapped layers keep nothing and compute the same logits."""
    _, rag = _ids(lm, *FICTION)
    with torch.inference_mode():
        plain = _batch(lm, [rag], probe=False)
        plain.forward(None)
        probed = _batch(lm, [rag], probe=True)
        probed.forward(None)
        assert ACTIVE_TAP.get() == ()
        assert torch.equal(plain.logits, probed.logits)
        plain.forward(torch.tensor([7]))
        probed.forward(torch.tensor([7]))
        torch.testing.assert_close(plain.logits, probed.logits, atol=1e-4, rtol=0)
        assert int(plain.logits.argmax()) == int(probed.logits.argmax())
    with pytest.raises(RuntimeError, match="before a forward pass"):
        with Probe(lm.model) as p:
            pass
        p.take()


def test_kept_queries_give_the_recomputed_rows(lm):
    """A probed decode step of a fused (left-padded) batch keeps each row's rotated query;
    the attention row computed from it equals the row recomputed from the attention input
    (query projection, rotary), with zeros on the padding."""
    if lm.model.config._attn_implementation != K.ATTN_IMPLEMENTATION:
        pytest.skip("model not on the few-query attention path")
    parts = model_parts(lm.model)
    pure, rag = _ids(lm, *FICTION)
    with torch.inference_mode():
        a, b = _batch(lm, [pure]), _batch(lm, [rag])
        a.forward(None)
        b.forward(None)
        fused = fuse_batches([a, b])
        assert fused is not None and fused.records.query is not None  # the prefill's last one
        fused.forward(torch.tensor([11, 11]))
        rec = fused.records
        assert rec.query is not None and len(rec.query) == parts.num_layers
        assert rec.query[0].shape == (2, parts.attn[0].config.num_attention_heads, parts.attn[0].head_dim)
        assert rec.query_scale == [parts.attn[0].scaling] * parts.num_layers
        seen = fused.mask.shape[1]
        pad = fused.pad[0]
        assert pad > 0 and fused.pad[1] == 0
        for row in (0, 1):
            one = rec.select([row])
            keys = [cached_keys(fused.cache, i)[row : row + 1] for i in range(parts.num_layers)]
            valid = fused.mask[row : row + 1].bool()
            got = attention_from_queries([q[0] for q in one.query], one.query_scale, keys, valid, seen)
            recomputed = ProbeRecord(one.resid, None, one.cos, one.sin, norms=one.norms)
            want = attention_rows(parts, recomputed, keys, valid, seen)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            torch.testing.assert_close(got.sum(-1), torch.ones_like(got[..., 0]), atol=1e-5, rtol=0)
            if row == 0:
                assert got[..., :pad].abs().max().item() == 0.0


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
    from tokrag_integrations.attention import _Tap

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
        got, weights = K.few_query_attention(_Attn(), q, k, v, mask, scaling=0.3)
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
    from tokrag_integrations.attention import _Tap

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
            K.few_query_attention(_Attn(), q, k, v, mask, scaling=0.5)
        finally:
            ACTIVE_TAP.reset(token)
        want = q[0, :, positions].transpose(0, 1)
        assert torch.equal(tap.query[0], want)
