"""The packed batch: one query's pure and RAG contexts as one sequence in one KV cache.

The two-context prefill attention and the two-query decode attention against the masked
reference (tiny tensors), and on the real default model: the same logits, probe states and
attention rows as prefilling each context on its own and fusing them, steps,
the same decoded tokens and decisions, and the cases where it does not apply.

Cases that need no model, database or server are in ``tests/unit/test_packed.py``."""

from __future__ import annotations

import pytest
import torch

from tokrag_integrations.accel import sdpa as S
from tokrag_integrations.accel.packed import fuse_batches, prefill, prefill_packed
from tokrag_integrations.contexts.prefill import prefill_roles, shared_prefill
from tokrag_integrations.engine.scheduler import generate
from tokrag_integrations.engine.view import ContextView
from tokrag_integrations.policies.base import ContextSpec
from tokrag_integrations.prompts import PromptBuilder
from tokrag_integrations.speed import Speed

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


def _packed_model(lm):
    if lm.model.config._attn_implementation != S.ATTN_IMPLEMENTATION:
        pytest.skip("model not on the few-query attention path")


def test_packed_batch_equals_separate_prefills_fused(lm):
    _packed_model(lm)
    spec = _specs(lm, *FICTION)
    roles = ["pure", "rag"]
    probe = frozenset(roles)
    with torch.inference_mode():
        sep = prefill_roles(roles, [spec], lm, probe)
        want = fuse_batches([sep["pure"], sep["rag"]])
        got = prefill_packed(roles, [spec], lm, probe)
        assert got is not None and want is not None
        n_pure, n_rag = len(spec["pure"].ids), len(spec["rag"].ids)
        # One sequence: the RAG prompt, then the pure prompt after the head both share.
        assert got.cache.layers[0].keys.shape[0] == 1
        assert got.mask.shape == (2, got.cache.get_seq_length())
        assert got.mask[1].sum().item() == n_rag and got.mask[0].sum().item() == n_pure
        torch.testing.assert_close(got.logits, want.logits, atol=2e-4, rtol=0)
        # The probe keeps each context's last position, as separate prefills do.
        torch.testing.assert_close(got.records.resid, want.records.resid, atol=2e-3, rtol=1e-4)
        for c1, c2 in zip(got.records.cos, want.records.cos, strict=True):
            torch.testing.assert_close(c1, c2)
        for _ in range(2):  # the prefill's rows, then a step's
            rows = {}
            for name, b in (("got", got), ("want", want)):
                view = ContextView(b, 1, b.records.select([1]))
                att = view.attention_all()
                seen = b.mask[1].bool()
                rows[name] = att[..., seen]  # the keys the RAG context sees, in order
            torch.testing.assert_close(rows["got"], rows["want"], atol=2e-4, rtol=0)
            rt = ContextView(got, 1, None).rt_positions
            assert torch.equal(rt, ContextView(want, 1, None).rt_positions)  # no padding
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
        monkeypatch.setenv("TOKRAG_PACKED_PREFILL", "0")  # Speed().packed_prefill
        assert not prefill(roles, [specs], lm, frozenset(), Speed()).packed
