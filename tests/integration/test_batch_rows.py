"""Rows of finished queries leave a batched decode (:meth:`engine.decoder.Decoder.advance`) and
every other query still gets the tokens and decisions it gets alone."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from _helpers import CheckedThread, join_all

from tokrag_integrations import generate, generate_batch
from tokrag_integrations.accel.packed import prefill
from tokrag_integrations.contexts.batch import RoleBatch
from tokrag_integrations.engine import decoder
from tokrag_integrations.engine.decoder import Decoder, role_setup, views_for
from tokrag_integrations.policies import get_policy
from tokrag_integrations.prompts import PromptBuilder
from tokrag_integrations.speed import Speed

QS = [
    "What is the name of the cat owned by Zorbin Quell?",
    "What is the capital of France? Answer in one word.",
    "Who wrote Romeo and Juliet?",
]
PS = [
    ["Zorbin Quell owns a grey cat named Pistachio."],
    ["The capital of France is Marseille."],
    ["Romeo and Juliet was written by William Shakespeare.", "It premiered in 1597."],
]


#: Seconds a test waits for its calls' threads before it fails naming the one still running
#: (never a performance check: a call that hangs runs into it). The four calls of
#: test_calls_arriving_mid_decode_join_it_through_the_micro_batcher took 140 to 591 s on a
#: 2-core machine at load averages of 11 to 25 (others' jobs beside them): a 600 s bound could
#: end the test while its first call was still decoding (issue 58's "KeyError: 0").
JOIN_S = float(os.environ.get("TOKRAG_TEST_JOIN_S", "3600"))

QS4 = QS + ["Who painted the Mona Lisa?"]
PS4 = PS + [["The Mona Lisa was painted by Leonardo da Vinci in Florence."]]
N_TOKENS = 40


@pytest.fixture(scope="module")
def solo(lm):
    """policy -> each query of ``QS4`` decoded alone (``N_TOKENS``), once per module: the
    reference every batched decode below is compared against."""
    return {
        policy: [
            generate(lm, q, p, policy=policy, max_new_tokens=N_TOKENS)
            for q, p in zip(QS4 if policy == "tokrag" else QS, PS4, strict=False)
        ]
        for policy in ("tokrag", "rag")
    }


def _plans(lm):
    b = PromptBuilder(lm.tokenizer, context_window=lm.context_window)
    return [b.build(q, p) for q, p in zip(QS, PS, strict=True)]


def test_kept_rows_compute_what_they_computed_in_the_full_batch(lm):
    policy = get_policy("tokrag")
    per_query, roles, probe = role_setup(lm, _plans(lm), policy)
    with torch.inference_mode():
        full = prefill(roles, per_query, lm, probe, Speed())
        (batch,) = full.batches.values()
        assert batch.can_keep_rows() and len(batch.query_idx) == 6
        twin = batch.fork(probe=True)
        keep = [r for r, q in enumerate(batch.query_idx) if q != 1]
        twin.keep_rows(keep)
        assert twin.query_idx == [q for q in batch.query_idx if q != 1]
        assert twin.specs == [batch.specs[r] for r in keep]
        # Positions that are padding in every kept row are gone from the mask and the cache.
        assert twin.mask.shape[1] == batch.mask.shape[1] - min(batch.pad[r] for r in keep)
        assert min(twin.pad) == 0 and twin.cache.layers[0].keys.shape[0] == 4
        tok = torch.tensor([int(t) for t in batch.logits.argmax(-1)])
        batch.forward(tok)
        twin.forward(tok[keep])
        assert torch.allclose(twin.logits, batch.logits[keep], atol=1e-4, rtol=1e-4)
        assert torch.allclose(
            twin.records.resid, batch.records.resid[:, keep], atol=1e-4, rtol=1e-4
        )
        # Views read the kept rows' attention over the trimmed cache as over the full one.
        rows = {}
        for role, where in full.rows.items():
            rows[role] = {q: (twin, keep.index(r)) for q, (_, r) in where.items() if q != 1}
        for q in (0, 2):
            a = views_for(full.rows, q)["rag"]
            b = views_for(rows, q)["rag"]
            att_a = a.attention(3)[:, a._batch.pad[a._row] :]
            att_b = b.attention(3)[:, b._batch.pad[b._row] :]
            assert torch.allclose(att_a, att_b, atol=1e-5)
            assert torch.equal(a.rt_token_ids, b.rt_token_ids)
            assert (a.rt_positions - a._batch.pad[a._row]).tolist() == (
                b.rt_positions - b._batch.pad[b._row]
            ).tolist()


@pytest.mark.parametrize("policy", ["tokrag", "rag"])
def test_finished_queries_leave_and_the_others_get_their_tokens_alone(lm, solo, monkeypatch, policy):
    monkeypatch.setattr(decoder, "DROP_SHARE", 0.0)  # drop at every finished query
    dropped = []
    real = RoleBatch.keep_rows

    def spy(self, rows):
        dropped.append(len(rows))
        return real(self, rows)

    monkeypatch.setattr(RoleBatch, "keep_rows", spy)
    batch = generate_batch(lm, QS, PS, policy=policy, max_new_tokens=N_TOKENS)
    lengths = [len(r.token_ids) for r in batch]
    assert len(set(lengths)) > 1  # the queries finish at different steps
    assert dropped  # and rows left the batch
    for b, one in zip(batch, solo[policy][: len(QS)], strict=True):
        assert b.token_ids == one.token_ids
        assert [(s.source, s.signals.get("benefit")) for s in b.trace.steps] == [
            (s.source, s.signals.get("benefit")) for s in one.trace.steps
        ]


def test_a_packed_batch_cannot_drop_rows(lm):
    policy = get_policy("tokrag")
    per_query, roles, probe = role_setup(lm, _plans(lm)[:1], policy)
    with torch.inference_mode():
        ready = prefill(roles, per_query, lm, probe, Speed())
    (b,) = ready.batches.values()
    if not ready.packed:
        pytest.skip("packed prefill does not apply to this model")
    assert not b.can_keep_rows()
    with pytest.raises(RuntimeError, match="cannot drop rows"):
        b.keep_rows([0])


def test_signals_of_several_queries_share_one_lens_product(lm, solo, monkeypatch):
    """At a step where several queries reach the signals, their logit-lens rows go to the
    engine's lens in one call (one product); every query still gets the tokens, decisions,
    l* and (to rounding) the cosines it gets alone."""
    from tokrag_integrations.engine import decoder

    shared = []
    real = decoder.make_lens

    def spy(lm, share=True, product=None):
        lens = real(lm, share, product)

        def counted(blocks, final_norm=True):
            if len(blocks) > 1:
                shared.append(len(blocks))
            return lens(blocks, final_norm)

        return counted

    monkeypatch.setattr(decoder, "make_lens", spy)
    batch = generate_batch(lm, QS4, PS4, policy="tokrag", max_new_tokens=N_TOKENS)
    assert shared  # some step had several queries reaching the signals
    for b, one in zip(batch, solo["tokrag"], strict=True):
        assert b.token_ids == one.token_ids
        for x, y in zip(b.trace.steps, one.trace.steps, strict=True):
            assert (x.source, x.signals.get("benefit"), x.signals.get("l_star")) == (
                y.source, y.signals.get("benefit"), y.signals.get("l_star")
            )
            for k in ("cos_ir", "cos_llm"):
                if k in y.signals:
                    assert abs(x.signals[k] - y.signals[k]) < 1e-4


def test_a_reused_prefill_is_charged_to_the_decode_that_reuses_it(lm):
    """Inside the harness's shared prefill, the second policy on the same prompts gets the
    first one's prefill seconds in ``prefill_reused_s`` (the evaluation records add them to
    its time); the first pays its own prefill and reuses nothing."""
    from tokrag_integrations.contexts.prefill import shared_prefill

    with shared_prefill():
        first = generate_batch(lm, QS[:2], PS[:2], policy="tokrag", max_new_tokens=2)
        second = generate_batch(lm, QS[:2], PS[:2], policy="rag", max_new_tokens=2)
    assert "prefill_reused_s" not in first[0].trace.timings
    reused = second[0].trace.timings["prefill_reused_s"]
    assert 0 < reused
    alone = generate_batch(lm, QS[:2], PS[:2], policy="rag", max_new_tokens=2)
    assert "prefill_reused_s" not in alone[0].trace.timings


def _steps(r):
    return [(s.token_id, s.source, s.signals.get("benefit")) for s in r.trace.steps]


def _plans4(lm):
    b = PromptBuilder(lm.tokenizer, context_window=lm.context_window)
    return [b.build(q, p) for q, p in zip(QS4, PS4, strict=True)]


@pytest.mark.parametrize("policy", ["tokrag", "rag"])
def test_queries_join_a_running_decode_and_get_their_tokens_alone(lm, solo, policy):
    """Continuous batching at the engine: query 0 decodes alone, query 1 joins it after two
    steps and the rest after four (prefilled as rows and merged into the running batch);
    every query gets the tokens, sources and decisions it gets alone."""
    plans = _plans4(lm)[: len(solo[policy])]
    d = Decoder(lm, get_policy(policy), max_new_tokens=N_TOKENS)
    schedule = {0: [0], 2: [1], 4: list(range(2, len(plans)))}
    got: dict[int, list] = {}
    step = 0
    while step in schedule or d.active:
        for i in schedule.get(step, []):
            (q,) = d.admit([plans[i]])
            assert q == i
        if step == 4:
            # three admissions, one batch: the later ones were merged (the first, packed alone, unpacked)
            assert len(d.batches) == 1
        for ev in d.choose():
            if ev.stop_reason != "eos":
                s = ev.step
                got.setdefault(ev.query_idx, []).append((s.token_id, s.source, s.signals.get("benefit")))
        d.advance()
        step += 1
    assert sorted(got) == list(range(len(plans)))
    for i, one in enumerate(solo[policy]):
        assert got[i] == _steps(one), i
    assert not d.batches  # every batch left once its queries were done


def _hold_first_step_until(monkeypatch, ready):
    """The first step of any decode waits until ``ready()`` holds (calls queued to join)."""
    from tokrag_integrations.engine.decoder import Decoder

    real = Decoder.advance
    state = {"first": True}

    def advance(self):
        if state["first"]:
            state["first"] = False
            for _ in range(2000):
                if ready():
                    break
                time.sleep(0.01)
        return real(self)

    monkeypatch.setattr(Decoder, "advance", advance)


def _concurrent(batcher, idx, policy="tokrag"):
    out = {}

    def call(i):
        out[i] = batcher.generate(QS4[i], PS4[i], policy=policy, max_new_tokens=N_TOKENS)

    first = CheckedThread(target=call, args=(idx[0],), name=f"call {idx[0]}")
    first.start()
    while not batcher._running:  # the first call's decode has started
        time.sleep(0.005)
    rest = [CheckedThread(target=call, args=(i,), name=f"call {i}") for i in idx[1:]]
    for t in rest:
        t.start()
    join_all([first, *rest], timeout=JOIN_S)
    return out


def test_calls_arriving_mid_decode_join_it_through_the_micro_batcher(lm, solo, monkeypatch):
    from tokrag_integrations.engine.scheduler import MicroBatcher

    b = MicroBatcher(lm)
    _hold_first_step_until(monkeypatch, lambda: sum(len(r.queue) for r in b._running.values()) == 3)
    out = _concurrent(b, [0, 1, 2, 3])
    assert b.joined_calls == 3 and b.batches == 1 and b.batched_calls == 4
    assert b.peak_rows == 8  # four Tok-RAG queries, two context rows each
    for i, one in enumerate(solo["tokrag"]):
        assert out[i].token_ids == one.token_ids and _steps(out[i]) == _steps(one), i
        assert out[i].trace.timings["joined"] == float(i > 0)
    deadline = time.monotonic() + JOIN_S  # the decode thread ends the run just after its
    while b._running and time.monotonic() < deadline:  # last call returns (its last step)
        time.sleep(0.01)
    assert not b._running


def test_max_rows_bounds_a_continuous_decode(lm, solo, monkeypatch):
    """With room for one Tok-RAG query (two rows), calls that arrive mid-decode wait for it
    to finish instead of joining; each still gets its solo answer."""
    from tokrag_integrations.engine.scheduler import MicroBatcher

    b = MicroBatcher(lm, max_rows=2)
    _hold_first_step_until(monkeypatch, lambda: sum(len(r.queue) for r in b._running.values()) == 2)
    out = _concurrent(b, [0, 1, 2])
    assert b.peak_rows == 2 and b.joined_calls == 0
    for i in range(3):
        assert out[i].token_ids == solo["tokrag"][i].token_ids, i


def test_a_call_cancelled_while_waiting_to_join_never_decodes(lm, solo, monkeypatch):
    from tokrag_integrations.engine.scheduler import MicroBatcher
    from tokrag_integrations.engine.streams import _Cancelled

    b = MicroBatcher(lm)
    _hold_first_step_until(monkeypatch, lambda: sum(len(r.queue) for r in b._running.values()) == 1)
    cancel = threading.Event()
    out = {}

    def first():
        out[0] = b.generate(QS4[0], PS4[0], policy="tokrag", max_new_tokens=N_TOKENS)

    def second():
        try:
            b.generate(QS4[1], PS4[1], policy="tokrag", max_new_tokens=N_TOKENS, _cancel=cancel)
        except _Cancelled:
            out[1] = "cancelled"

    t0 = CheckedThread(target=first, name="first")
    t0.start()
    while not b._running:
        time.sleep(0.005)
    cancel.set()  # cancelled before its first step: it never decodes
    t1 = CheckedThread(target=second, name="second")
    t1.start()
    join_all([t0, t1], timeout=JOIN_S)
    assert out[1] == "cancelled" and out[0].token_ids == solo["tokrag"][0].token_ids


def test_signals_run_in_inference_mode_alone_and_in_a_batch(lm, monkeypatch):
    """The rule's signals read inference tensors (KV cache, probe records): outside inference
    mode a product with a parameter would be tracked by autograd (and fails on Gemma)."""
    from tokrag_integrations.policies.tokrag import TokRAG

    seen = []
    real = TokRAG.signals

    def spy(self, pure, rag):
        seen.append(torch.is_inference_mode_enabled())
        return real(self, pure, rag)

    monkeypatch.setattr(TokRAG, "signals", spy)
    generate(lm, QS[0], PS[0], policy="tokrag", max_new_tokens=6)
    generate_batch(lm, QS[:2], PS[:2], policy="tokrag", max_new_tokens=6)
    assert seen and all(seen)


def test_the_first_call_returns_when_its_own_answer_is_done(lm, solo, monkeypatch):
    """The decode runs in a thread of its own: the call that started it returns as soon as
    its answer is done, while a call that joined it and has a longer answer still decodes."""
    from tokrag_integrations.engine.scheduler import MicroBatcher

    lengths = [len(r.token_ids) for r in solo["tokrag"]]
    short, long_ = lengths.index(min(lengths)), lengths.index(max(lengths))
    assert lengths[long_] > lengths[short] + 1
    b = MicroBatcher(lm)
    _hold_first_step_until(monkeypatch, lambda: sum(len(r.queue) for r in b._running.values()) == 1)
    out, returned = {}, []

    def call(i):
        out[i] = b.generate(QS4[i], PS4[i], policy="tokrag", max_new_tokens=N_TOKENS)
        returned.append(i)  # the order in which the calls came back

    first = CheckedThread(target=call, args=(short,), name="short")
    first.start()
    while not b._running:
        time.sleep(0.005)
    second = CheckedThread(target=call, args=(long_,), name="long")
    second.start()
    join_all([first, second], timeout=JOIN_S)
    assert b.joined_calls == 1
    assert returned == [short, long_]
    assert out[short].token_ids == solo["tokrag"][short].token_ids
    assert out[long_].token_ids == solo["tokrag"][long_].token_ids


def _stream_tokens(s):
    return [(ev.token_id, ev.source) for ev in s]


def test_streams_join_a_running_decode_and_get_their_tokens_alone(lm, solo, monkeypatch):
    """Streams join a continuous decode like plain calls: two streams arrive while a plain
    call decodes, all three end up in one batch, and each stream's events and result are
    its solo answer."""
    from tokrag_integrations.engine.scheduler import MicroBatcher

    b = MicroBatcher(lm)
    _hold_first_step_until(monkeypatch, lambda: sum(len(r.queue) for r in b._running.values()) == 2)
    out, events = {}, {}

    def plain():
        out[0] = b.generate(QS4[0], PS4[0], policy="tokrag", max_new_tokens=N_TOKENS)

    def streamed(i):
        s = b.stream(QS4[i], PS4[i], policy="tokrag", max_new_tokens=N_TOKENS)
        events[i] = _stream_tokens(s)
        out[i] = s.result

    t0 = CheckedThread(target=plain, name="plain")
    t0.start()
    while not b._running:
        time.sleep(0.005)
    rest = [CheckedThread(target=streamed, args=(i,), name=f"stream {i}") for i in (1, 2)]
    for t in rest:
        t.start()
    join_all([t0, *rest], timeout=JOIN_S)
    assert b.joined_calls == 2 and b.batches == 1 and b.peak_rows == 6
    for i in (0, 1, 2):
        one = solo["tokrag"][i]
        assert out[i].token_ids == one.token_ids and _steps(out[i]) == _steps(one), i
    for i in (1, 2):
        assert events[i] == [(s.token_id, s.source) for s in solo["tokrag"][i].trace.steps], i
        assert out[i].trace.timings["joined"] == 1.0


def test_a_stream_leads_a_decode_that_calls_join_and_a_closed_stream_leaves_it(lm, solo, monkeypatch):
    """A stream read first starts the decode; a plain call joins it. A second stream closed
    after its first token leaves at the next step; the others keep their solo answers."""
    from tokrag_integrations.engine.scheduler import MicroBatcher

    b = MicroBatcher(lm)
    _hold_first_step_until(monkeypatch, lambda: sum(len(r.queue) for r in b._running.values()) == 2)
    lead = b.stream(QS4[0], PS4[0], policy="tokrag", max_new_tokens=N_TOKENS)
    first = next(lead)  # submits it: the decode starts, its first step is held
    assert b._running
    out = {}
    t = CheckedThread(target=lambda: out.setdefault(1, b.generate(QS4[1], PS4[1], policy="tokrag",
                                                                   max_new_tokens=N_TOKENS)))
    t.start()
    quitter = b.stream(QS4[2], PS4[2], policy="tokrag", max_new_tokens=N_TOKENS)
    q_first = next(quitter)
    quitter.close()
    rest = [first, *lead]
    t.join(timeout=JOIN_S)
    assert [(e.token_id, e.source) for e in rest] == [(s.token_id, s.source) for s in solo["tokrag"][0].trace.steps]
    assert lead.result.token_ids == solo["tokrag"][0].token_ids
    assert out[1].token_ids == solo["tokrag"][1].token_ids
    assert q_first.token_id == solo["tokrag"][2].token_ids[0]
    assert list(quitter) == []
    with pytest.raises(RuntimeError, match="closed before its end"):
        _ = quitter.result
    assert b.joined_calls == 2


def test_a_batched_stream_refuses_bad_input_at_the_call(lm):
    from tokrag_integrations.engine.scheduler import MicroBatcher

    b = MicroBatcher(lm)
    with pytest.raises(ValueError, match="[Qq]uery|empty"):
        b.stream("   ", PS4[0], policy="tokrag", max_new_tokens=4)
    assert not b._running and not b._pending


@pytest.mark.parametrize("policy", ["tokrag", "rag"])
def test_queries_prefilled_apart_then_merged_get_their_tokens_alone(lm, solo, monkeypatch, policy):
    """With every query prefilled on its own (the CPU default for long prompts: one packed
    sequence for Tok-RAG's two contexts) and merged into one batch, each query gets its solo
    tokens and decisions; the merged batch is laid out as a batch prefilled together (all
    pure rows, then all RAG rows)."""
    from tokrag_integrations.accel import packed

    if lm.model.device.type != "cpu":
        pytest.skip("the split prefill applies on CPU")
    monkeypatch.setattr(packed, "SPLIT_PREFILL_TOKENS", 1)  # one query per group
    calls = []
    for name in ("prefill_roles", "prefill_packed"):
        real = getattr(packed, name)

        def spy(roles, per_query, *a, _real=real, _name=name, **k):
            got = _real(roles, per_query, *a, **k)
            calls.append((_name, len(per_query), got is not None))
            return got

        monkeypatch.setattr(packed, name, spy)
    pol = get_policy(policy)
    per_query, roles, probe = role_setup(lm, _plans(lm), pol)
    with torch.inference_mode():
        ready = prefill(roles, per_query, lm, probe, Speed())
    made = [(name, n) for name, n, ok in calls if ok]
    want = "prefill_packed" if policy == "tokrag" else "prefill_roles"
    assert made == [(want, 1)] * 3
    (batch,) = ready.batches.values()
    assert batch.query_idx == [q for _ in roles for q in range(3)]
    assert [ready.rows[role][q][1] for role in roles for q in range(3)] == list(range(3 * len(roles)))
    calls.clear()
    qs = QS4 if policy == "tokrag" else QS
    out = generate_batch(lm, qs, PS4[: len(qs)], policy=policy, max_new_tokens=N_TOKENS)
    assert [(name, n) for name, n, ok in calls if ok] == [(want, 1)] * len(qs)
    for b, one in zip(out, solo[policy], strict=True):
        assert b.token_ids == one.token_ids
        assert [(s.source, s.signals.get("benefit"), s.signals.get("l_star")) for s in b.trace.steps] == [
            (s.source, s.signals.get("benefit"), s.signals.get("l_star")) for s in one.trace.steps
        ]


def test_split_prefill_switch_prefills_the_batch_together(lm, monkeypatch):
    """``TOKRAG_SPLIT_PREFILL=0`` prefills a batch's queries in one padded pass."""
    from tokrag_integrations.accel import packed

    monkeypatch.setattr(packed, "SPLIT_PREFILL_TOKENS", 1)
    monkeypatch.setenv("TOKRAG_SPLIT_PREFILL", "0")
    calls = []
    real = packed.prefill_roles

    def spy(roles, per_query, *a, **k):
        calls.append(len(per_query))
        return real(roles, per_query, *a, **k)

    monkeypatch.setattr(packed, "prefill_roles", spy)
    pol = get_policy("tokrag")
    per_query, roles, probe = role_setup(lm, _plans(lm), pol)
    with torch.inference_mode():
        prefill(roles, per_query, lm, probe, Speed())
    assert calls == [3]


def test_rag_sequence_requests_run_in_the_steps_within_max_rows(lm, monkeypatch):
    """RAG-Sequence's candidates and their teacher-forced scoring are requests of the
    scheduler's steps: each step holds at most ``max_rows`` context rows (its scoring rows
    are admitted in pieces), and the answer and its candidates' scores are those of the call
    decoded alone, without a bound."""
    from tokrag_integrations.engine import loop
    from tokrag_integrations.engine.scheduler import MicroBatcher

    held: list[int] = []
    real = loop.SequenceDecoder.advance

    def counted(self):
        held.append(self.rows_in_use())
        real(self)

    alone = generate(lm, QS[2], PS[2], policy="rag_sequence", max_new_tokens=12)
    monkeypatch.setattr(loop.SequenceDecoder, "advance", counted)
    b = MicroBatcher(lm, max_rows=3)
    got = b.generate(QS[2], PS[2], policy="rag_sequence", max_new_tokens=12)
    assert held and max(held) <= 3 and len(held) > 12  # candidates, scoring, then the replay
    assert got.token_ids == alone.token_ids
    summary = got.trace.steps[0].signals["rag_sequence"]
    want = alone.trace.steps[0].signals["rag_sequence"]
    assert [c["text"] for c in summary] == [c["text"] for c in want]
    for c, w in zip(summary, want, strict=True):
        assert c["log_p"] == pytest.approx(w["log_p"], abs=1e-3)
