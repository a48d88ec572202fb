"""Sampling, log-probabilities and constrained decoding (issue 57) on the packaged model
(the ``lm`` fixture): greedy is unchanged for every policy; a seeded call gives the same
answer alone, in ``generate_batch``, through the micro-batcher and on the static path
(``speed="cuda"``, run on CPU); ``top_k=1`` is greedy; each step's log-probability is the
log-softmax of the distribution its token came from; a constraint keeps every policy's
tokens inside its mask and ends the answer when complete; bad values are refused."""

from __future__ import annotations

import threading

import pytest
import torch
from _constraints import Digits

from tokrag_integrations import generate, generate_batch
from tokrag_integrations.engine.scheduler import MicroBatcher
from tokrag_integrations.policies import available_policies
from tokrag_integrations.sampling import TokenConstraint

Q = "Who founded Quillfeather Aerospace, and where?"
Q2 = "What does Quillfeather Aerospace build?"
PASSAGES = [
    "Quillfeather Aerospace was founded by Ada Brandt in Tromso in 2011.",
    "The company builds small satellites for weather agencies.",
]
N = 8
POLICIES = sorted(available_policies())
#: Every built-in policy but RAG-Sequence (whose tokens are a candidate's, checked apart).
TOKEN_POLICIES = [p for p in POLICIES if p != "rag_sequence"]


def test_the_test_constraint_is_a_token_constraint(lm):
    assert isinstance(Digits(lm), TokenConstraint)
    assert len(Digits(lm).allowed) > 10


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_is_unchanged_and_top_k_1_is_greedy(lm, policy):
    want = generate(lm, Q, PASSAGES, policy=policy, max_new_tokens=N)
    zero = generate(lm, Q, PASSAGES, policy=policy, max_new_tokens=N, temperature=0, top_p=0.3, seed=4)
    top1 = generate(lm, Q, PASSAGES, policy=policy, max_new_tokens=N, temperature=1.3, top_k=1, seed=9)
    assert zero.token_ids == want.token_ids and top1.token_ids == want.token_ids
    assert [s.source for s in zero.trace.steps] == [s.source for s in want.trace.steps]
    assert want.trace.sampling == {} and zero.trace.sampling == {}
    assert top1.trace.sampling == {"temperature": 1.3, "top_p": 1.0, "top_k": 1, "seed": 9}


@pytest.mark.parametrize("policy", ["tokrag", "cad", "rag_token", "rag_sequence"])
def test_a_seeded_call_is_the_same_alone_and_in_a_batch(lm, policy):
    kw = dict(policy=policy, max_new_tokens=N, temperature=1.0, top_p=0.95)
    alone = [generate(lm, q, PASSAGES, seed=s, **kw) for q, s in ((Q, 11), (Q2, 12))]
    batch = generate_batch(lm, [Q2, Q], [PASSAGES, PASSAGES], seed=[12, 11], **kw)
    assert [r.token_ids for r in batch] == [alone[1].token_ids, alone[0].token_ids]
    for got, want in zip(batch, alone[::-1], strict=True):
        assert [s.logprob for s in got.trace.steps] == pytest.approx(
            [s.logprob for s in want.trace.steps], abs=1e-4
        )


def test_two_concurrent_calls_through_the_micro_batcher(lm):
    kw = dict(policy="tokrag", max_new_tokens=N, temperature=0.8)
    alone = [generate(lm, Q, PASSAGES, seed=1, **kw), generate(lm, Q2, PASSAGES, seed=2, top_k=20, **kw)]
    b = MicroBatcher(lm, wait_s=0.3)
    got: dict[int, object] = {}

    def call(i, q, extra):
        got[i] = b.generate(q, PASSAGES, **kw, **extra)

    threads = [
        threading.Thread(target=call, args=(0, Q, {"seed": 1})),
        threading.Thread(target=call, args=(1, Q2, {"seed": 2, "top_k": 20})),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert b.batched_calls == 2  # one decode: the sampling keywords are per call
    assert [got[0].token_ids, got[1].token_ids] == [r.token_ids for r in alone]


def test_different_seeds_differ_somewhere(lm):
    qs = [Q, Q2, "Where is Quillfeather Aerospace based?"]
    kw = dict(policy="tokrag", max_new_tokens=N, temperature=1.0)
    a = generate_batch(lm, qs, [PASSAGES] * 3, seed=1, **kw)
    b = generate_batch(lm, qs, [PASSAGES] * 3, seed=2, **kw)
    assert [r.token_ids for r in a] != [r.token_ids for r in b]
    again = generate_batch(lm, qs, [PASSAGES] * 3, seed=1, **kw)
    assert [r.token_ids for r in again] == [r.token_ids for r in a]


@pytest.mark.parametrize("policy", ["rag", "tokrag", "logprob", "no_rag"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_logprob_is_the_sources_log_softmax_at_the_token(lm, policy, temperature):
    r = generate(
        lm, Q, PASSAGES, policy=policy, max_new_tokens=N, temperature=temperature, seed=5, top_logprobs=3
    )
    for s in r.trace.steps:
        role = "pure" if s.source == "pure" else "rag"
        # stats[role]["logp"]: log_softmax of that context's logits at the chosen token.
        assert s.logprob == pytest.approx(s.stats[role]["logp"], abs=1e-5)
        assert len(s.top_logprobs) == 3
        assert s.top_logprobs[0].logprob == pytest.approx(
            torch.tensor(s.candidates[role].prob).log().item(), abs=1e-5
        )
        assert s.logprob <= s.top_logprobs[0].logprob + 1e-6
    entries = r.logprobs
    assert len(entries) == len(r.trace.steps)
    assert entries[0]["token"] == r.trace.steps[0].text
    assert entries[0]["bytes"] == list(r.trace.steps[0].text.encode())
    assert set(entries[0]["top_logprobs"][0]) == {"token", "logprob", "bytes"}


def test_the_logprob_of_llm_equals_the_models_own_forward(lm):
    """Independently of the engine's views: the model run on the prompt and the answer."""
    from tokrag_integrations.prompts import PromptBuilder

    r = generate(lm, Q, None, policy="no_rag", max_new_tokens=N, temperature=1.0, seed=8)
    plan = PromptBuilder(lm.tokenizer, context_window=lm.context_window).build(Q, [])
    ids = torch.tensor([plan.pure_ids + r.token_ids])
    with torch.inference_mode():
        logits = lm.model(ids).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    start = len(plan.pure_ids) - 1
    want = [lp[start + i, t].item() for i, t in enumerate(r.token_ids)]
    assert [s.logprob for s in r.trace.steps] == pytest.approx(want, abs=2e-3)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_constraint_keeps_every_policys_tokens_inside_its_mask(lm, policy, temperature):
    c = Digits(lm)
    r = generate(
        lm, Q, PASSAGES, policy=policy, max_new_tokens=N, constraint=c, temperature=temperature, seed=3
    )
    assert r.token_ids and all(t in c.allowed for t in r.token_ids), r.text
    assert r.stop_reason == "stop" and len(r.token_ids) == 3
    assert r.text.replace(" ", "").isdigit()
    if policy != "rag_sequence":  # RAG-Sequence decodes a fork per candidate
        assert c.taken == r.token_ids


def test_constraints_per_query_in_a_batch(lm):
    out = generate_batch(
        lm, [Q, Q2], [PASSAGES, PASSAGES], policy="tokrag", max_new_tokens=N,
        constraint=[Digits(lm, 2), None],
    )  # fmt: skip
    assert len(out[0].token_ids) == 2 and out[0].text.replace(" ", "").isdigit()
    free = generate(lm, Q2, PASSAGES, policy="tokrag", max_new_tokens=N)
    assert out[1].token_ids == free.token_ids


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_bad_values_get_a_one_sentence_error(lm, kw, name):
    with pytest.raises(ValueError, match=rf"^{name} must be [^.\n]*$"):
        generate(lm, Q, PASSAGES, max_new_tokens=2, **kw)
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        generate_batch(lm, [Q], [PASSAGES], max_new_tokens=2, **kw)


def test_a_constraint_of_the_wrong_kind_is_refused(lm):
    with pytest.raises(TypeError, match="constraint must be a TokenConstraint"):
        generate(lm, Q, PASSAGES, max_new_tokens=2, constraint="json")


@pytest.mark.parametrize("policy", ["rag", "tokrag", "cad", "rag_token", "logprob"])
def test_a_seeded_call_is_the_same_on_the_view_and_static_paths(lm, policy):
    """``speed="cuda"`` (the static state, run on CPU here) draws inside its step with the
    same noise: the view path's tokens, log-probabilities and alternatives, alone and in a
    batch."""
    kw = dict(policy=policy, max_new_tokens=N, temperature=1.0, top_p=0.9, top_logprobs=2)
    view = generate(lm, Q, PASSAGES, speed="reference", seed=3, **kw)
    static = generate(lm, Q, PASSAGES, speed="cuda", seed=3, **kw)
    batch = generate_batch(lm, [Q2, Q], [PASSAGES, PASSAGES], speed="cuda", seed=[4, 3], **kw)
    for got in (static, batch[1]):
        assert got.trace.timings["static"] == 1.0
        assert got.token_ids == view.token_ids
        assert [s.source for s in got.trace.steps] == [s.source for s in view.trace.steps]
        assert [s.logprob for s in got.trace.steps] == pytest.approx(
            [s.logprob for s in view.trace.steps], rel=1e-4, abs=1e-4
        )
        assert [[t.token_id for t in s.top_logprobs] for s in got.trace.steps] == [
            [t.token_id for t in s.top_logprobs] for s in view.trace.steps
        ]


#: A JSON schema compiled by llguidance (``structured.constraint_for``).
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "founder",
        "schema": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 24},
                "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                "kind": {"enum": ["person", "company"]},
            },
            "required": ["name", "year", "kind"],
        },
    },
}


@pytest.mark.parametrize("policy", ["tokrag", "rag", "cad"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_json_schema_constraint_gives_valid_json_on_the_view_and_static_paths(lm, policy, temperature):
    """A real grammar (llguidance), every context masked: the answer parses and fits the
    schema, sampled or not, and the static step gives the view path's tokens."""
    pytest.importorskip("llguidance")
    import json

    kw = dict(policy=policy, max_new_tokens=48, temperature=temperature, seed=2, constraint=SCHEMA)
    view = generate(lm, Q, PASSAGES, speed="reference", **kw)
    static = generate(lm, Q, PASSAGES, speed="cuda", **kw)
    assert static.trace.timings["static"] == 1.0 and static.token_ids == view.token_ids
    data = json.loads(view.text)
    assert set(data) == {"name", "year", "kind"} and isinstance(data["year"], int)
    assert data["kind"] in ("person", "company") and 1900 <= data["year"] <= 2100
    assert view.stop_reason == "stop"
    assert {s.source for s in view.trace.steps} <= {"agree", "rag", "pure", "mix"}


def test_stream_and_agenerate_take_the_keywords(lm):
    import asyncio

    from tokrag_integrations import agenerate, stream

    kw = dict(policy="tokrag", max_new_tokens=N, temperature=0.9, seed=21, top_logprobs=1)
    want = generate(lm, Q, PASSAGES, **kw)
    s = stream(lm, Q, PASSAGES, **kw)
    events = [e for e in s if e.token_id not in lm.eos_token_ids]
    assert [e.token_id for e in events] == want.token_ids
    assert [e.step.logprob for e in events] == pytest.approx(
        [st.logprob for st in want.trace.steps]
    )
    got = asyncio.run(agenerate(lm, Q, PASSAGES, **kw))
    assert got.token_ids == want.token_ids and got.trace.sampling["seed"] == 21


def test_a_policy_without_logits_keeps_its_token_and_says_so(lm):
    from tokrag_integrations.policies.base import Choice, Policy

    class NoLogits(Policy):
        name = "no_logits"
        roles = ("rag",)

        def choose(self, views, lens):
            return [Choice(int(v["rag"].logits.argmax()), "rag") for v in views]

    want = generate(lm, Q, PASSAGES, policy="rag", max_new_tokens=N)
    with pytest.warns(UserWarning, match="Choice has no logits"):
        got = generate(lm, Q, PASSAGES, policy=NoLogits(), max_new_tokens=N, temperature=1.0, seed=1)
    assert got.token_ids == want.token_ids
    assert all(s.logprob is None for s in got.trace.steps)
