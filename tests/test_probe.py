"""The probe: last-position states read during the ordinary forward pass, without hooks.

On the real default model: the tapped states equal what module hooks see, the attention
input derived from the residuals equals the attention module's input, the attention rows a
probed step keeps equal the rows recomputed from the cache (and the eager model's), and a
forward pass outside a probe is untouched.
"""

from __future__ import annotations

import pytest
import torch

from tokrag_integrations import cpu_kernels as K
from tokrag_integrations.attention import (
    ACTIVE_TAP,
    Probe,
    ProbeRecord,
    attention_rows,
    cached_keys,
    model_parts,
)
from tokrag_integrations.decoding import ContextSpec, _RoleBatch, fuse_batches
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


def test_tapped_attention_equals_recomputed_rows(lm):
    """A probed decode step of a fused (left-padded) batch keeps each row's attention as the
    forward pass computed it; it equals the rows recomputed from the cache, with zeros on the
    padding."""
    if lm.model.config._attn_implementation != K.ATTN_IMPLEMENTATION:
        pytest.skip("model not on the few-query attention path")
    parts = model_parts(lm.model)
    pure, rag = _ids(lm, *FICTION)
    with torch.inference_mode():
        a, b = _batch(lm, [pure]), _batch(lm, [rag])
        a.forward(None)
        b.forward(None)
        fused = fuse_batches([a, b])
        assert fused is not None and fused.records.attn is None  # a prefill keeps no rows
        fused.forward(torch.tensor([11, 11]))
        rec = fused.records
        assert rec.attn is not None and len(rec.attn) == parts.num_layers
        seen = fused.mask.shape[1]
        pad = fused.pad[0]
        assert pad > 0 and fused.pad[1] == 0
        for row in (0, 1):
            one = rec.select([row])
            tapped = torch.stack([one.attention_taps(i, 0, seen) for i in range(parts.num_layers)])
            recomputed = ProbeRecord(one.resid, None, one.cos, one.sin, norms=one.norms)
            keys = [cached_keys(fused.cache, i)[row : row + 1] for i in range(parts.num_layers)]
            valid = fused.mask[row : row + 1].bool()
            want = attention_rows(parts, recomputed, keys, valid, seen)
            torch.testing.assert_close(tapped, want, atol=1e-5, rtol=0)
            torch.testing.assert_close(tapped.sum(-1), torch.ones_like(tapped[..., 0]), atol=1e-5, rtol=0)
            if row == 0:
                assert tapped[..., :pad].abs().max().item() == 0.0
        # Taps are only used for the length they were computed at.
        assert rec.select([1]).attention_taps(0, 0, seen - 1) is None


class _Attn(torch.nn.Module):
    layer_idx = 0
    num_key_value_groups = 3
    is_causal = True


@pytest.mark.parametrize(
    "rows,mask_kind", [(1, "none"), (2, "left"), (3, "holes"), (6, "left"), (2, "float")]
)
def test_tapped_attention_function_equals_reference(rows, mask_kind):
    """Under a probe, the one-query attention computes the same output as without one and
    keeps each row's probabilities (zero on masked keys)."""
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
    plain, _ = K.few_query_attention(_Attn(), q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(got, plain, atol=1e-5, rtol=1e-5)
    assert tap.attn[0] is not None and len(tap.attn[0]) == rows
    for r, (start, p) in enumerate(tap.attn[0]):
        full = torch.nn.functional.pad(p, (start, 0))
        torch.testing.assert_close(full, want_p[r], atol=1e-6, rtol=1e-5)
        assert full[:, ~valid[r]].abs().max().item() == 0.0 if (~valid[r]).any() else True
