"""``speed="cuda"``: the static decode state and its one step per token
(``accel/static_state.py``), on CPU.

On a tiny random model shaped like SmolLM2 (30 layers, small hidden size; ``tiny_smollm2``):
the tokens, sources and candidates of the view path (``speed="reference"``), alone, in a
batch and with queries joining between steps (shifts, bigger buckets and capacities, rows
reused); one host read per step over a whole ``generate`` (prefill and trace included);
zero graph breaks of the step under ``torch._dynamo.explain``; the scheduler's continuous
batching. The packaged model's comparison is in ``test_stock_exactness.py``."""

from __future__ import annotations

import collections
import threading

import pytest
import torch
from _constraints import Digits
from _host_reads import HostReads

from tokrag_integrations import generate, generate_batch
from tokrag_integrations.accel.static_step import static_step
from tokrag_integrations.engine.decoder import Decoder
from tokrag_integrations.engine.sampler import QuerySampling
from tokrag_integrations.engine.scheduler import MicroBatcher
from tokrag_integrations.policies import get_policy
from tokrag_integrations.prompts import PromptBuilder
from tokrag_integrations.sampling import sampling_of

Q = "Who founded Quillfeather Aerospace, and where?"
PASSAGES = [
    "Quillfeather Aerospace was founded by Ada Brandt in Tromso in 2011.",
    "The company builds small satellites for weather agencies.",
]
LONG_Q = (
    "I am writing a short report about small aerospace companies in northern Europe and would "
    "like to know, in one sentence, who founded Quillfeather Aerospace and in which town?"
)
#: Policies with a device rule, compared here on the tiny model (every policy is compared on
#: the packaged model in test_stock_exactness.py).
DEVICE_RULES = ("no_rag", "rag", "floor", "tokrag", "cad", "rag_token")


def _decisions(r) -> list[tuple]:
    return [
        (s.token_id, s.source, sorted((role, c.token_id) for role, c in s.candidates.items()))
        for s in r.trace.steps
    ]


def _same(got, want) -> None:
    assert got.trace.timings["static"] == 1.0  # decoded on the static state
    assert got.token_ids == want.token_ids
    assert _decisions(got) == _decisions(want)
    for g, w in zip(got.trace.steps, want.trace.steps, strict=True):
        for role, stats in w.stats.items():
            assert g.stats[role] == pytest.approx(stats, rel=1e-4, abs=1e-4)
        assert g.citation == pytest.approx(w.citation, abs=1e-4)
        assert g.logprob == pytest.approx(w.logprob, rel=1e-4, abs=1e-4)
        assert [t.token_id for t in g.top_logprobs] == [t.token_id for t in w.top_logprobs]
        assert [t.logprob for t in g.top_logprobs] == pytest.approx(
            [t.logprob for t in w.top_logprobs], rel=1e-4, abs=1e-4
        )


def test_the_cuda_preset_turns_the_static_state_on(tiny):
    r = generate(tiny, Q, PASSAGES, policy="rag", speed="cuda", max_new_tokens=3)
    assert r.trace.timings["static"] == 1.0
    assert "static" not in r.trace.speed.get("speed_paths_off", {})
    auto = generate(tiny, Q, PASSAGES, policy="rag", max_new_tokens=3)
    assert "static" not in auto.trace.timings  # "auto" on a CPU: the default path


@pytest.mark.parametrize("policy", DEVICE_RULES)
def test_alone_and_batched_equal_the_reference(tiny, policy):
    want = [
        generate(tiny, q, PASSAGES, policy=policy, speed="reference", max_new_tokens=10)
        for q in (Q, LONG_Q)
    ]
    for q, w in zip((Q, LONG_Q), want, strict=True):
        _same(generate(tiny, q, PASSAGES, policy=policy, speed="cuda", max_new_tokens=10), w)
    batch = generate_batch(tiny, [Q, LONG_Q], [PASSAGES, PASSAGES[:1]], policy=policy,
                           speed="cuda", max_new_tokens=10)  # fmt: skip
    want_b = generate(tiny, LONG_Q, PASSAGES[:1], policy=policy, speed="reference", max_new_tokens=10)
    _same(batch[0], want[0])
    _same(batch[1], want_b)


@pytest.mark.parametrize("policy", ["rag", "floor"])
def test_citations_equal_the_reference(tiny, policy):
    """``citations=True``: each step's passage scores (copy vote, else attention mass) from
    the step's attention rows are the view path's."""
    kw = dict(policy=policy, max_new_tokens=8, citations=True)
    for q in (Q, LONG_Q):
        want = generate(tiny, q, PASSAGES, speed="reference", **kw)
        got = generate(tiny, q, PASSAGES, speed="cuda", **kw)
        assert got.trace.timings["static"] == 1.0
        _same(got, want)
        assert all(len(s.citation) == len(PASSAGES) for s in want.trace.steps)
        for g, w in zip(got.trace.steps, want.trace.steps, strict=True):
            assert g.citation == pytest.approx(w.citation, abs=1e-4)


def test_decodes_reuse_the_buffers_of_the_model(tiny):
    """A decode's buffers go back to the model's pool when it ends and the next decode of
    that shape takes them (the same addresses: a captured graph is replayed, not recorded
    again)."""
    generate(tiny, Q, PASSAGES, policy="rag", speed="cuda", max_new_tokens=3)
    pool = tiny.__dict__["_tokrag_static_pool"]
    before = {k: id(b) for k, b in pool.items()}
    generate(tiny, Q, PASSAGES, policy="rag", speed="cuda", max_new_tokens=3)
    assert before and {k: id(b) for k, b in pool.items()} == before


@pytest.mark.parametrize(("policy", "queries", "rows", "slots"), [("tokrag", 3, 8, 4), ("rag", 3, 4, 4)])
def test_the_step_computes_the_slots_a_query_can_take(tiny, policy, queries, rows, slots):
    """With R rows and queries of two contexts, only the first R // 2 slots can hold a query:
    the step's rule runs on those (its record has that many rows); one context a query: all."""
    d = Decoder(tiny, get_policy(policy), max_new_tokens=2, speed="cuda")
    d.admit([_plan(tiny, Q, PASSAGES)] * queries)
    st = d._static
    assert st.buf.valid.shape[0] == rows and st.step_args()[-1] == slots
    assert sorted(st.slot_of.values()) == list(range(queries))
    with st.attention(), torch.inference_mode():
        out = static_step(*st.step_args())
    assert out.shape == (slots, 1 + st.rule.record_width)


def test_a_one_token_prompt(tiny):
    """A prompt of one token has nothing to prefill: its row starts empty."""
    assert len(tiny.tokenizer("Hi")["input_ids"]) == 1
    kw = dict(policy="no_rag", prompt_format="text", max_new_tokens=5)
    want = generate(tiny, "Hi", None, speed="reference", **kw)
    got = generate(tiny, "Hi", None, speed="cuda", **kw)
    assert got.trace.timings["static"] == 1.0
    _same(got, want)
    both = generate_batch(tiny, ["Hi", Q], None, speed="cuda", **kw)
    _same(both[0], want)


def test_a_policy_without_device_rule_falls_back_and_says_so(tiny):
    r = generate(tiny, Q, PASSAGES, policy="rag_sequence", speed="cuda", max_new_tokens=3)
    assert "device rule" in r.trace.speed["speed_paths_off"]["static"]
    want = generate(tiny, Q, PASSAGES, policy="rag_sequence", speed="reference", max_new_tokens=3)
    assert r.token_ids == want.token_ids


def _plan(lm, q, passages):
    return PromptBuilder(lm.tokenizer, context_window=lm.context_window).build(q, passages)


def _tokens(d: Decoder, events_by_q: dict, steps: int) -> None:
    for _ in range(steps):
        if not d.active:
            return
        for ev in d.choose():
            events_by_q.setdefault(ev.query_idx, []).append(ev.step.token_id)
        d.advance()


@pytest.mark.parametrize("policy", ["floor", "rag"])
def test_queries_joining_between_steps_get_what_they_get_alone(tiny, policy):
    """A short query, then a longer one (the state shifts right), then two more once the
    first has finished (its rows reused, the bucket grows), with a small max_new_tokens so
    that capacity runs out (the state compacts or grows): each query's tokens are its
    tokens alone."""
    n = 6
    plans = [
        _plan(tiny, Q, PASSAGES[:1]),
        _plan(tiny, LONG_Q, PASSAGES),
        _plan(tiny, "Where is Tromso?", []),
        _plan(tiny, Q, PASSAGES[::-1]),
    ]
    alone = []
    for p in plans:
        d = Decoder(tiny, get_policy(policy), max_new_tokens=n, speed="reference")
        d.admit([p])
        got: dict = {}
        _tokens(d, got, n)
        alone.append(got[0])
    d = Decoder(tiny, get_policy(policy), max_new_tokens=n, speed="cuda")
    got = {}
    d.admit(plans[:1])
    _tokens(d, got, 2)
    d.admit(plans[1:2])
    assert d._static is not None and d._static.rows_in_use() == 2 * len(get_policy(policy).roles)
    _tokens(d, got, n - 2)  # the first query ends
    shape = d._static.buf.shape  # type: ignore[union-attr]
    d.admit(plans[2:])
    assert d._static.buf.shape != shape  # a bigger state  # type: ignore[union-attr]
    _tokens(d, got, 3 * n)
    assert [got[q] for q in range(4)] == alone
    assert d.rows_in_use() == 0 and d._static.buf is None  # its buffers went back to the pool


#: Sampled decoding (issue 57): a seed, the cuts and the alternatives.
SAMPLED = dict(temperature=1.0, top_p=0.9, top_k=40, top_logprobs=3)


@pytest.mark.parametrize("policy", DEVICE_RULES)
def test_seeded_sampling_alone_and_batched_equals_the_reference(tiny, policy):
    """The draw and the log-probabilities run inside the step: a seeded query gets the view
    path's tokens, sources, log-probabilities and alternatives, alone and in a batch."""
    kw = dict(policy=policy, max_new_tokens=8, **SAMPLED)
    want = [generate(tiny, q, PASSAGES, speed="reference", seed=s, **kw) for q, s in ((Q, 1), (LONG_Q, 2))]
    assert want[0].trace.sampling["seed"] == 1
    for (q, s), w in zip(((Q, 1), (LONG_Q, 2)), want, strict=True):
        _same(generate(tiny, q, PASSAGES, speed="cuda", seed=s, **kw), w)
    batch = generate_batch(tiny, [LONG_Q, Q], [PASSAGES, PASSAGES], speed="cuda", seed=[2, 1], **kw)
    _same(batch[0], want[1])
    _same(batch[1], want[0])
    greedy = generate(tiny, Q, PASSAGES, policy=policy, speed="reference", max_new_tokens=8)
    assert [r.token_ids for r in want] != [greedy.token_ids] * 2  # it did sample


@pytest.mark.parametrize("policy", ["rag", "tokrag", "cad", "rag_token"])
def test_a_constraint_on_the_static_state_equals_the_reference(tiny, policy):
    """The constraint's bitmask is a device buffer written before the step: every context
    masked, the tokens allowed, the answer ended when the grammar is complete."""
    for temperature in (0.0, 1.0):
        kw = dict(policy=policy, max_new_tokens=8, temperature=temperature, seed=4)
        want = generate(tiny, Q, PASSAGES, speed="reference", constraint=Digits(tiny), **kw)
        c = Digits(tiny)
        got = generate(tiny, Q, PASSAGES, speed="cuda", constraint=c, **kw)
        _same(got, want)
        assert got.stop_reason == "stop" and c.taken == got.token_ids
        assert all(t in c.allowed for t in got.token_ids)


def test_sampled_and_constrained_queries_join_a_greedy_decode(tiny):
    """Queries with other sampling and a constraint share one static decode with greedy
    ones, joining between steps; each gets what it gets alone."""
    qs = [
        QuerySampling(sampling_of()),
        QuerySampling(sampling_of(temperature=0.7, seed=9, top_logprobs=2)),
        QuerySampling(sampling_of(temperature=1.2, seed=3), Digits(tiny)),
    ]
    plan = _plan(tiny, Q, PASSAGES)
    alone = []
    for smp in qs:
        d = Decoder(tiny, get_policy("tokrag"), max_new_tokens=6, speed="reference")
        smp_copy = QuerySampling(smp.sampling, smp.constraint.fork() if smp.constraint else None)
        d.admit([plan], sampling=[smp_copy])
        got: dict = {}
        _tokens(d, got, 6)
        alone.append(got[0])
    d = Decoder(tiny, get_policy("tokrag"), max_new_tokens=6, speed="cuda")
    got = {}
    for i, smp in enumerate(qs):
        d.admit([plan], sampling=[smp])
        _tokens(d, got, 1 if i < 2 else 6)
    assert d._static is not None
    _tokens(d, got, 6)
    assert [got[q] for q in range(3)] == alone


def _read_counts(tiny, policy: str, speed, **kw) -> tuple[int, int, collections.Counter]:
    eos = tiny.eos_token_ids
    generate(tiny, Q, PASSAGES, policy=policy, speed=speed, max_new_tokens=2, **kw)  # warm
    with HostReads() as c:
        r = generate(tiny, Q, PASSAGES, policy=policy, speed=speed, max_new_tokens=48, **kw)
    steps = len(r.trace.steps) + (r.trace.stop_reason == "eos")
    assert not set(r.token_ids) & set(eos)
    return len(c.calls), steps, collections.Counter(c.calls)


def test_the_counter_sees_the_reads_of_the_view_path(tiny):
    """The counter's premise: today's closest settings read about 5 times a token for rag."""
    reads, steps, _ = _read_counts(tiny, "rag", {"fuse": False, "cpu_kernels": "off"})
    assert reads / steps >= 4


@pytest.mark.parametrize(
    "policy",
    [
        "rag",
        "floor",
        "tokrag",
        "cad",
    ],
)  # fmt: skip
def test_one_host_read_a_step(tiny, policy):
    """Over a whole 48-token ``generate`` with ``speed="cuda"``, prefill and trace included:
    at most 1.5 host reads per generated token, and the step itself reads once."""
    reads, steps, counts = _read_counts(tiny, policy, "cuda")
    assert steps == 48
    assert reads <= 1.5 * steps, counts
    assert counts["tolist"] <= steps + 1, counts  # one read per step (+ one in the prefill)


@pytest.mark.parametrize("policy", ["rag", "tokrag"])
def test_one_host_read_a_step_sampled_and_constrained(tiny, policy):
    """Sampling, log-probabilities and a constraint's mask add no host read to the step."""
    reads, steps, counts = _read_counts(tiny, policy, "cuda", seed=5, **SAMPLED)
    assert steps == 48
    assert reads <= 1.5 * steps, counts
    assert counts["tolist"] <= steps + 1, counts
    with HostReads() as c:
        r = generate(
            tiny, Q, PASSAGES, policy=policy, speed="cuda", max_new_tokens=8,
            constraint=Digits(tiny, 6), seed=5, **SAMPLED,
        )  # fmt: skip
    assert r.stop_reason == "stop" and len(r.token_ids) == 6
    assert c.calls.count("tolist") <= 7 and len(c.calls) <= 1.5 * 7, collections.Counter(c.calls)


@pytest.mark.parametrize(
    "policy",
    ["rag", "tokrag"],
)  # fmt: skip
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("sampled", [False, True])
def test_the_step_compiles_without_graph_breaks(shallow, policy, batch, sampled):
    d = Decoder(shallow, get_policy(policy), max_new_tokens=4, speed="cuda")
    if d._static is None:
        pytest.fail(f"no static state for {policy}: {d.static_off}")
    smp = None
    if sampled:  # sampled queries, one constrained: the draw and the masks in the graph
        drawn = sampling_of(temperature=0.8, seed=1, top_p=0.9)
        smp = [QuerySampling(drawn, Digits(shallow))] + [QuerySampling(drawn)] * (batch - 1)
    d.admit([_plan(shallow, Q, PASSAGES)] * batch, sampling=smp)
    assert d._static.step_args()[5:7] == ((True, True) if sampled else (False, False))
    st = d._static
    torch._dynamo.reset()
    with st.attention(), torch.inference_mode():
        ex = torch._dynamo.explain(static_step)(*st.step_args())
    assert ex.graph_break_count == 0, [b.reason for b in ex.break_reasons]
    assert ex.graph_count == 1


def test_continuous_batching_with_the_static_state(tiny):
    """Concurrent calls with ``speed="cuda"`` decoded together by the scheduler (joining the
    running decode at step boundaries) get the tokens they get alone."""
    qs = [(Q, PASSAGES), (LONG_Q, PASSAGES[:1]), ("Where is Tromso?", PASSAGES[1:])]
    alone = [generate(tiny, q, p, policy="rag", speed="cuda", max_new_tokens=8).token_ids for q, p in qs]
    b = MicroBatcher(tiny, wait_s=0.05)
    out: list = [None] * len(qs)

    def call(i: int) -> None:
        q, p = qs[i]
        out[i] = b.generate(q, p, policy="rag", speed="cuda", max_new_tokens=8 if i else 24)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(qs))]
    threads[0].start()
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(120)
    assert out[0].token_ids[:8] == alone[0]
    assert [r.token_ids for r in out[1:]] == alone[1:]
    assert all(r.trace.timings["static"] == 1.0 for r in out)
    assert b.batched_calls >= 2
