"""Blockwise verification (issue 8): exactness against the step-by-step loop, cache rollback,
and the recorder, on the real default model.

Decoding is deterministic, so each (question, options) decode is made once per module (the
``decode`` fixture) and every fast path is compared against that one reference.

Cases that need no model, database or server are in ``tests/unit/test_speculative.py``."""

from __future__ import annotations

import math

import pytest
import torch

from tokrag_integrations import generate, generate_batch
from tokrag_integrations.accel.speculative import _Recorder, blockwise_supported
from tokrag_integrations.attention import Probe, model_parts
from tokrag_integrations.engine.batch import RoleBatch as _RoleBatch
from tokrag_integrations.policies import get_policy
from tokrag_integrations.policies.base import ContextSpec
from tokrag_integrations.prompts import PromptBuilder
from tokrag_integrations.retrieval import (
    BM25Retriever,
    chunk_documents,
    get_sample_docs_path,
    get_sample_questions,
    load_documents,
)

FICTION = (
    "What is the name of the cat owned by Zorbin Quell?",
    ["Zorbin Quell owns a grey cat named Pistachio."],
)
CONTRA = ("What is the capital of France?", ["The capital of France is Marseille."])


@pytest.fixture(scope="module")
def cases():
    """Hand-made benefit/detriment cases and the sample-doc questions with BM25 passages."""
    chunks = chunk_documents(load_documents(get_sample_docs_path()))
    bm25 = BM25Retriever(chunks)
    out = [FICTION, CONTRA]
    for sq in get_sample_questions()[:4]:
        out.append((sq["question"], [h.chunk.text for h in bm25.retrieve(sq["question"], top_k=3)]))
    return out


@pytest.fixture(scope="module")
def decode(lm):
    """``decode(q, ps, n, **options)``: ``generate(policy="tokrag")``, each distinct call made
    once per module (the reference decodes are shared by the tests)."""
    made: dict = {}

    def run(q, ps, n, **options):
        key = (q, tuple(ps), n, tuple(sorted((k, repr(v)) for k, v in options.items())))
        if key not in made:
            made[key] = generate(lm, q, ps, policy="tokrag", max_new_tokens=n, **options)
        return made[key]

    return run


def _decisions(r):
    return [
        (
            s.token_id,
            s.source,
            s.signals.get("benefit"),
            s.signals.get("l_star"),
            s.signals.get("cos_ir"),
            s.signals.get("cos_llm"),
        )
        for s in r.trace.steps
    ]


def _tie(x) -> bool:
    """cos_ir and cos_llm equal to float rounding (both candidates near one-hot on the same
    token, cosines 1 - 1e-7): the rule's flag is rounding noise there, the token is not."""
    return x[4] is not None and x[5] is not None and abs(x[4] - x[5]) < 1e-5


def _assert_same(a, b):
    da, db = _decisions(a), _decisions(b)
    assert [(x[0], x[1], x[3]) for x in da] == [(x[0], x[1], x[3]) for x in db]
    assert [x[2] for x in da if not _tie(x)] == [x[2] for x in db if not _tie(x)]
    for x, y in zip(da, db, strict=True):
        for u, v in zip(x[4:], y[4:], strict=True):
            assert (u is None) == (v is None)
            if u is not None:
                assert math.isclose(u, v, abs_tol=1e-4)  # block passes round differently


#: The step-by-step algorithm as written: one forward pass per context.
STEP = {"speculative": False, "fuse": False}
BLOCKWISE = {"speculative": True}


def test_fused_default_and_blockwise_equal_step_by_step(decode, cases):
    totals = dict.fromkeys(("blocks", "verifier_wins", "stale", "accepted"), 0.0)
    disagreements = 0
    for q, ps in cases:
        ref = decode(q, ps, 24, **STEP)
        fused = decode(q, ps, 24)
        fast = decode(q, ps, 24, **BLOCKWISE)
        assert fused.trace.options["speculative"] is False and fused.trace.options["fuse"] is True
        assert fast.trace.options["speculative"] is True
        assert fused.trace.timings["fused"] == 1.0 and ref.trace.timings["fused"] == 0.0
        assert "blocks" not in ref.trace.timings and "blocks" not in fused.trace.timings
        for other in (fused, fast):
            _assert_same(ref, other)
            assert other.text == ref.text and other.stop_reason == ref.stop_reason
        for k in totals:
            totals[k] += fast.trace.timings[k]
        disagreements += len(fast.trace.disagreement_steps)
    # The set must exercise what can go wrong: disagreements, verifier wins, rollbacks.
    assert disagreements > 0 and totals["verifier_wins"] > 0 and totals["stale"] > 0, totals
    assert totals["accepted"] > totals["blocks"], totals  # blocks carry more than one token


@pytest.mark.parametrize(
    "options",
    [
        # Block 1 and the pure drafter's own block length repeat what the two below cover.
        pytest.param({"drafter": "rag", "block": 1}, marks=pytest.mark.slow),
        {"drafter": "rag", "block": 5},
        {"drafter": "pure", "block": 3},
        pytest.param({"drafter": "pure"}, marks=pytest.mark.slow),
        # The signal options: the reference variant by default, the lens options with -m slow.
        pytest.param({"lens_norm": True, "top_k": None, "pr_norm": "softmax"}, marks=pytest.mark.slow),
        {"variant": "reference"},
    ],
)
def test_options_do_not_change_the_result(decode, cases, options):
    """Drafter, block length and the signal options: blockwise = step by step."""
    rule = {k: v for k, v in options.items() if k not in ("drafter", "block")}
    for q, ps in cases[:3]:
        ref = decode(q, ps, 24, **STEP, **rule)
        fast = decode(q, ps, 24, **BLOCKWISE, **options)
        _assert_same(ref, fast)
        _assert_same(ref, decode(q, ps, 24, **rule))


@pytest.mark.parametrize(
    "loop",
    # Blockwise = step by step is shown above for one query at a time: slow here.
    [pytest.param({}, id="fused"), pytest.param(BLOCKWISE, id="blockwise", marks=pytest.mark.slow)],
)
def test_batch_equals_step_by_step_one_at_a_time(lm, decode, cases, loop):
    qs, ps = zip(*cases[:4], strict=True)
    batch = generate_batch(lm, list(qs), list(ps), policy="tokrag", max_new_tokens=24, **loop)
    for q, p, b in zip(qs, ps, batch, strict=True):
        _assert_same(decode(q, p, 24, **STEP), b)


def test_blockwise_respects_stop_strings_and_max_tokens(lm, decode):
    q, ps = CONTRA
    ref = decode(q, ps, 24, **STEP)
    word = ref.text.split()[2]
    for n in (1, 2, 7):
        got = generate(lm, q, ps, policy="tokrag", max_new_tokens=n, **BLOCKWISE).token_ids
        assert got == ref.token_ids[:n]
    a = generate(lm, q, ps, policy="tokrag", max_new_tokens=24, stop=[word], **STEP)
    b = generate(lm, q, ps, policy="tokrag", max_new_tokens=24, stop=[word], **BLOCKWISE)
    assert b.stop_reason == a.stop_reason == "stop" and b.text == a.text


def _batch(lm, prompts):
    specs = [ContextSpec(ids) for ids in prompts]
    b = _RoleBatch("rag", list(enumerate(specs)), lm, probe=False)
    b.forward(None)
    return b


def test_rollback_then_same_tokens_gives_same_logits_as_never_drafting(lm):
    plan = PromptBuilder(lm.tokenizer, context_window=lm.context_window).build(*FICTION)
    ids = plan.rag_ids
    follow = lm.tokenizer(" Pistachio is grey", add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        drafted = _batch(lm, [ids])
        drafted.extend(torch.tensor([[follow[0]]]))
        drafted.extend(torch.tensor([[11, 22, 33]]))  # a block that will be rejected
        drafted.rollback([3])
        got = drafted.extend(torch.tensor([follow[1:]]))
        clean = _batch(lm, [ids])
        clean.extend(torch.tensor([[follow[0]]]))
        want = clean.extend(torch.tensor([follow[1:]]))
    assert drafted.mask.shape == clean.mask.shape
    assert torch.equal(got, want)  # cropped: the very same computation


def test_rollback_masks_rows_that_keep_fewer_positions(lm):
    """A batch where rows roll back different amounts: the shared part is cropped, the rest
    masked out; each row's later logits equal a clean single-row run (to float rounding)."""
    pb = PromptBuilder(lm.tokenizer, context_window=lm.context_window)
    prompts = [pb.build(*FICTION).rag_ids, pb.build(*CONTRA).rag_ids]
    follow = [[lm.tokenizer.encode(" The")[0]], [lm.tokenizer.encode(" It")[0]]]
    with torch.inference_mode():
        b = _batch(lm, prompts)
        b.extend(torch.tensor([[7, 8, 9, 10], [7, 8, 9, 10]]))
        b.rollback([4, 1])  # row 0 keeps none of the block, row 1 keeps 3 of 4
        assert b.mask.shape[1] == max(map(len, prompts)) + 3
        assert b.mask[0, -3:].sum() == 0 and b.mask[1, -3:].sum() == 3
        got = b.extend(torch.tensor([follow[0], follow[1]]))[:, -1]
        for r, (ids, extra) in enumerate(zip(prompts, ([], [7, 8, 9]), strict=True)):
            one = _batch(lm, [ids])
            if extra:
                one.extend(torch.tensor([extra]))
            want = one.extend(torch.tensor([follow[r]]))[0, -1]
            assert torch.allclose(got[r], want, atol=1e-3, rtol=1e-4), (got[r] - want).abs().max()
            assert int(got[r].argmax()) == int(want.argmax())


def test_recorder_reads_what_the_probe_reads(lm):
    """The recorder's per-position record equals the probe's, for a one-token step and for
    every position of a block (where the probe sees only the last)."""
    plan = PromptBuilder(lm.tokenizer, context_window=lm.context_window).build(*CONTRA)
    parts = model_parts(lm.model)
    with torch.inference_mode():
        b = _batch(lm, [plan.rag_ids])
        with Probe(lm.model) as probe, _Recorder(parts) as rec:
            b.forward(torch.tensor([5]))
            want, got = probe.take(), rec.take().record(0, 0)
        for field in ("resid", "attn_in"):
            assert torch.equal(getattr(want, field), getattr(got, field))
        assert all(
            torch.equal(x, y) for x, y in zip(want.cos + want.sin, got.cos + got.sin, strict=True)
        )
        with Probe(lm.model) as probe, _Recorder(parts) as rec:
            b.extend(torch.tensor([[6, 7, 8]]))
            want, cap = probe.take(), rec.take()
        assert torch.equal(want.resid, cap.record(0, 2).resid)
        assert cap.record(0, 0).resid.shape == want.resid.shape
        assert not torch.equal(cap.record(0, 0).resid, cap.record(0, 2).resid)


def test_blockwise_supported_only_for_pure_rag_rules_on_full_caches(lm):
    assert blockwise_supported(lm, get_policy("tokrag"))
    assert blockwise_supported(lm, get_policy("floor"))
    assert not blockwise_supported(lm, get_policy("rag"))
    assert not blockwise_supported(lm, get_policy("rag_sequence"))
    with pytest.raises(ValueError, match="drafter"):
        get_policy("tokrag", drafter="both")
    with pytest.raises(ValueError, match="block"):
        get_policy("tokrag", block=0)
