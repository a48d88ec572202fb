"""The probe: last-position states read during the ordinary forward pass, without hooks.

On the real default model: the tapped states equal what module hooks see, the attention
input derived from the residuals equals the attention module's input, the attention rows
computed from the rotated queries a probed step keeps equal the rows recomputed from the
attention input, and a forward pass outside a probe is untouched.

Cases that need no model, database or server are in ``tests/unit/test_probe.py``."""

from __future__ import annotations

import pytest
import torch

from tokrag_integrations.accel import sdpa as S
from tokrag_integrations.accel.packed import fuse_batches
from tokrag_integrations.attention.parts import model_parts
from tokrag_integrations.attention.probe import ACTIVE_TAP, Probe, ProbeRecord
from tokrag_integrations.attention.rows import attention_from_queries, attention_rows, cached_keys
from tokrag_integrations.contexts.batch import RoleBatch as _RoleBatch
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
    if lm.model.config._attn_implementation != S.ATTN_IMPLEMENTATION:
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
