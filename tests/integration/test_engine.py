"""The decoding engine on the real default model (SmolLM2-135M-Instruct).

Cases that need no model, database or server are in ``tests/unit/test_engine.py``."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from _helpers import greedy_generate

from tokrag_integrations import Passage, generate, generate_batch, stream
from tokrag_integrations.attention.parts import model_parts
from tokrag_integrations.attention.probe import Probe
from tokrag_integrations.attention.rows import attention_row, cached_keys
from tokrag_integrations.models import cache_argument
from tokrag_integrations.prompts import PromptBuilder

FICTION_Q = "What is the name of the cat owned by Zorbin Quell?"
FICTION_P = ["Zorbin Quell owns a grey cat named Pistachio."]
CONTRA_Q = "What is the capital of France?"
CONTRA_P = ["The capital of France is Marseille."]


def _plan(lm, q, ps, **kw):
    return PromptBuilder(lm.tokenizer, context_window=lm.context_window).build(q, ps, **kw)


def _hf_generate(lm, ids, n):
    return greedy_generate(lm.model, ids, n, lm.pad_token_id)


def _strip_eos(lm, ids):
    out = []
    for i in ids:
        if i in lm.eos_token_ids:
            break
        out.append(i)
    return out


@pytest.mark.parametrize("policy,ctx", [("no_rag", "pure_ids"), ("rag", "rag_ids")])
def test_baselines_equal_model_generate(lm, policy, ctx):
    for q, ps in [(FICTION_Q, FICTION_P), (CONTRA_Q, CONTRA_P)]:
        plan = _plan(lm, q, ps, max_new_tokens=24)
        want = _strip_eos(lm, _hf_generate(lm, getattr(plan, ctx), 24))
        r = generate(lm, q, ps, policy=policy, max_new_tokens=24)
        assert r.token_ids == want
        assert r.text == lm.tokenizer.decode(want, skip_special_tokens=True)


def test_recomputed_attention_matches_eager(lm):
    """The rows Tok-RAG reads equal the model's own eager attention (RoPE included)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    eager = AutoModelForCausalLM.from_pretrained(lm.path, dtype=torch.float32, attn_implementation="eager")
    eager.eval()
    plan = _plan(lm, FICTION_Q, FICTION_P + ["Pistachio likes to sleep on the red sofa."])
    ids = torch.tensor([plan.rag_ids])
    with torch.inference_mode():
        ref = eager(input_ids=ids, output_attentions=True).attentions  # L x [1, H, T, T]
        cache = DynamicCache(config=lm.model.config)
        with Probe(lm.model) as probe:
            lm.model(input_ids=ids, **{cache_argument(lm.model): cache}, use_cache=True, logits_to_keep=1)
        rec = probe.take()
        parts = model_parts(lm.model)
        valid = torch.ones_like(ids, dtype=torch.bool)
        for layer in range(parts.num_layers):
            mine = attention_row(parts, layer, rec, cached_keys(cache, layer), valid, ids.shape[1])[0]
            torch.testing.assert_close(mine, ref[layer][0, :, -1, :], atol=1e-4, rtol=0)


def test_recomputed_attention_matches_eager_with_left_padding(lm):
    """In a batch, padded rows read the same attention as unpadded ones."""
    from transformers import DynamicCache

    short = _plan(lm, CONTRA_Q, CONTRA_P).rag_ids
    long = _plan(lm, FICTION_Q, FICTION_P + ["Pistachio likes to sleep on the red sofa."]).rag_ids
    pad = len(long) - len(short)
    ids = torch.tensor([[lm.pad_token_id] * pad + short, long])
    mask = torch.tensor([[0] * pad + [1] * len(short), [1] * len(long)])
    parts = model_parts(lm.model)
    with torch.inference_mode():
        cache = DynamicCache(config=lm.model.config)
        with Probe(lm.model) as probe:
            lm.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                **{cache_argument(lm.model): cache},
                use_cache=True,
                logits_to_keep=1,
            )
        rec = probe.take().select([0])
        cache1 = DynamicCache(config=lm.model.config)
        with Probe(lm.model) as probe1:
            lm.model(input_ids=torch.tensor([short]), **{cache_argument(lm.model): cache1}, use_cache=True, logits_to_keep=1)
        rec1 = probe1.take()
        for layer in (0, parts.num_layers // 2, parts.num_layers - 1):
            padded = attention_row(parts, layer, rec, cached_keys(cache, layer)[:1], mask[:1].bool(), ids.shape[1])[0]
            alone = attention_row(parts, layer, rec1, cached_keys(cache1, layer), torch.ones(1, len(short), dtype=torch.bool), len(short))[0]
            assert padded[:, :pad].abs().max().item() == 0.0
            torch.testing.assert_close(padded[:, pad:], alone, atol=1e-4, rtol=0)


def _margin(r, s):
    """The rule's margin at a step: cosine scorer cos_ir - cos_llm, distribution scorer
    JSD(p_RAG, p_LLM) - JSD(p_RAG, p_R), less the threshold (benefit iff >= 0)."""
    sig, opts = s.signals, r.trace.options
    m = sig["jsd_llm"] - sig["jsd_ir"] if opts.get("scorer") == "distribution" else sig["cos_ir"] - sig["cos_llm"]
    return m - opts.get("threshold", 0.0)


def _check_trace(r):
    for s in r.trace.steps:
        cands = s.candidates
        if s.source == "agree":
            assert cands["pure"].token_id == cands["rag"].token_id == s.token_id
        elif s.source == "rag":
            assert cands["rag"].token_id == s.token_id != cands["pure"].token_id
            if s.signals.get("note") == "gated: function word":  # kept without comparing
                assert r.trace.options.get("function_word_gate") is True
                continue
            if s.signals.get("note") == "gated: verdict word":
                assert r.trace.options.get("verdict_gate") in ("rag", "either")
                continue
            if s.signals.get("note") == "gated: RAG alone plausible":  # x^{l'-l*} for any l*
                assert r.trace.options.get("rising_gate") is True
                continue
            if s.signals.get("note") == "gated: pure punctuation":
                assert r.trace.options.get("punctuation_gate") is True
                assert not any(c.isalnum() for c in cands["pure"].text)
                continue
            if s.signals.get("note") == "gated: RAG's rising token":  # Eq. 19 said the pure model
                assert r.trace.options.get("rising_gate") is True and s.signals["rising_token"] == s.text
                assert s.signals["benefit"] is True and _margin(r, s) < 0
                continue
            assert s.signals["benefit"] is True
            assert _margin(r, s) >= 0
        elif s.source == "pure":
            assert cands["pure"].token_id == s.token_id != cands["rag"].token_id
            assert s.signals["benefit"] is False
            assert _margin(r, s) < 0
        else:
            raise AssertionError(f"unexpected source {s.source}")
        if s.disagreement:
            L = 30
            assert 1 <= s.signals["l_star"] <= L
            if r.trace.options.get("fixed_layer") is None:
                assert s.signals["l_star"] == (s.signals["fusion_attn_layer"] + s.signals["fusion_jsd_layer"]) // 2


def test_tokrag_trace_is_consistent_on_benefit_and_detriment(lm):
    for q, ps in [(FICTION_Q, FICTION_P), (CONTRA_Q, CONTRA_P)]:
        r = generate(lm, q, ps, policy="tokrag", max_new_tokens=24)
        assert r.trace.steps, "no tokens generated"
        assert r.trace.disagreement_steps, "expected the two contexts to disagree somewhere"
        _check_trace(r)
        json.loads(r.trace.to_json())  # serialisable


#: Facts only the passage has (the pure model cannot know them): README's "benefit" rows.
BENEFIT_CASES = [
    (FICTION_Q, FICTION_P[0], "Pistachio"),
    ("What is the capital of Drelmoria?", "Drelmoria is a small island nation. Its capital is Vostrany.", "Vostrany"),
    ("Who founded Quillfeather Aerospace?",
     "Quillfeather Aerospace was founded in 1994 by Ottoline Varga, a former propulsion engineer.", "Ottoline Varga"),
    ("In which year did the Veltrano Bridge open?", "The Veltrano Bridge opened to traffic in 1873.", "1873"),
]


#: Eq. 19 as the paper writes it: no function-word gate, threshold 0, every retrieved token in p_R
#: and the rising token under DoLa's own plausibility constraint α = 0.1 (the corrected
#: readings of Eq. 14-15 stay on).
PAPER_RULE = {
    "function_word_gate": False, "verdict_gate": None, "rising_gate": False, "punctuation_gate": False, "threshold": 0.0,
    "plausibility_alpha": 0.1, "pr_skip": None,
}


@pytest.mark.parametrize("options", [{}, PAPER_RULE], ids=["default", "paper-rule"])
@pytest.mark.parametrize("question,passage,fact", BENEFIT_CASES, ids=["cat", "capital", "founder", "year"])
def test_tokrag_answers_passage_only_facts_from_the_passage(lm, question, passage, fact, options):
    r = generate(lm, question, [passage], policy="tokrag", max_new_tokens=24, policy_options=options)
    assert fact in r.text, r.text
    assert any(s.source == "rag" for s in r.trace.disagreement_steps)


@pytest.mark.parametrize("options", [{}, PAPER_RULE], ids=["default", "paper-rule"])
def test_tokrag_keeps_the_known_fact_against_a_contradicting_passage(lm, options):
    assert "Marseille" in generate(lm, CONTRA_Q, CONTRA_P, policy="rag", max_new_tokens=12).text
    r = generate(lm, CONTRA_Q, CONTRA_P, policy="tokrag", max_new_tokens=12, policy_options=options)
    assert "Paris" in r.text and "Marseille" not in r.text, r.text
    paris = [s for s in r.trace.disagreement_steps if s.source == "pure"]
    assert paris and paris[0].signals["benefit"] is False


#: Yes/no questions whose passage settles the verdict: RAG answers "No, ..." and the pure
#: model opens with a restatement; Eq. 19 alone gives the restatement the first step.
VERDICT_CASES = [
    ("Is the headquarters of Quillfeather Aerospace near a beach?",
     "Quillfeather Aerospace is headquartered in Harrowgate, an inland town 200 km from the nearest coast."),
    ("Is menthol associated with Christmas?",
     "Menthol is an organic compound obtained from mint oils, used in cough drops and cigarettes; it has "
     "no particular link to any holiday."),
]


@pytest.mark.parametrize("question,passage", VERDICT_CASES, ids=["beach", "menthol"])
def test_verdict_gate_keeps_rags_verdict_that_eq19_drops(lm, question, passage):
    assert generate(lm, question, [passage], policy="rag", max_new_tokens=8).text.startswith("No")
    plain = generate(lm, question, [passage], policy="tokrag", max_new_tokens=8, policy_options={"verdict_gate": None, "rising_gate": False})
    assert not plain.text.startswith("No") and plain.trace.steps[0].signals["benefit"] is False
    r = generate(lm, question, [passage], policy="tokrag", max_new_tokens=8)  # the default gate
    assert r.trace.options["verdict_gate"] == "either" and r.text.startswith("No"), r.text
    first = r.trace.steps[0]
    assert first.source == "rag" and first.signals == {"note": "gated: verdict word"}
    assert first.candidates["rag"].text == "No" != first.candidates["pure"].text
    _check_trace(r)


def test_verdict_gate_on_rags_side_leaves_the_pure_models_verdict_to_eq19(lm):
    """The passage does not say she was a chef: RAG opens "Ottoline ..." (and goes on to say
    she was one), the pure model "No". With ``"rag"`` Eq. 19 compares the two and keeps "No";
    ``"either"`` gates the pure model's verdict word too and takes RAG's opening."""
    q = "Was Ottoline Varga a chef before founding Quillfeather Aerospace?"
    p = ["Ottoline Varga founded Quillfeather Aerospace in 2009 after twelve years as a propulsion engineer."]
    r = generate(lm, q, p, policy="tokrag", max_new_tokens=8, policy_options={"verdict_gate": "rag"})
    assert r.text.startswith("No") and "benefit" in r.trace.steps[0].signals
    e = generate(lm, q, p, policy="tokrag", max_new_tokens=8, policy_options={"verdict_gate": "either"})
    assert not e.text.startswith("No") and e.trace.steps[0].signals == {"note": "gated: verdict word"}
    _check_trace(r), _check_trace(e)


def test_rags_only_plausible_token_is_kept_without_signals_as_the_signals_would(lm, monkeypatch):
    """Where RAG's argmax is its only plausible token, it is x^{l'-l*} whatever l* is, so the
    rising gate keeps it: the rule skips the signals there. Computing them anyway (the check
    turned off) gives the same tokens, and RAG's token at each such step."""
    from tokrag_integrations.policies.tokrag import TokRAG

    cases = [(FICTION_Q, FICTION_P), (CONTRA_Q, CONTRA_P), *[(q, [p]) for q, p, _ in BENEFIT_CASES]]
    fast = [generate(lm, q, p, policy="tokrag", max_new_tokens=24) for q, p in cases]
    monkeypatch.setattr(TokRAG, "_rising_is_rags_token", lambda self, rag: False)
    full = [generate(lm, q, p, policy="tokrag", max_new_tokens=24) for q, p in cases]
    skipped = 0
    for f, g in zip(fast, full, strict=True):
        assert f.token_ids == g.token_ids
        for a, b in zip(f.trace.steps, g.trace.steps, strict=True):
            if a.signals.get("note") == "gated: RAG alone plausible":
                skipped += 1
                assert b.source == "rag" and b.signals["rising_token"] == b.text
                assert b.signals["benefit"] is True
            else:
                assert (a.source, a.signals.get("benefit")) == (b.source, b.signals.get("benefit"))
        _check_trace(f)
    assert skipped >= 3


def test_punctuation_gate_keeps_rags_token_where_the_pure_model_offers_punctuation(lm):
    """Eq. 19 ends the sentence with the pure model's "." where RAG goes on with ","; the
    punctuation gate (default) keeps RAG's token without comparing."""
    q = "Would a Muslim eat a McRib sandwich?"
    p = ["The McRib is a pork sandwich sold by McDonald's. Islamic dietary law forbids eating pork."]
    plain = generate(lm, q, p, policy="tokrag", max_new_tokens=10, policy_options={"punctuation_gate": False})
    gated = generate(lm, q, p, policy="tokrag", max_new_tokens=10)
    assert plain.trace.options["punctuation_gate"] is False and gated.trace.options["punctuation_gate"] is True
    (i,) = [s.index for s in gated.trace.steps if s.signals.get("note") == "gated: pure punctuation"]
    before, after = plain.trace.steps[i], gated.trace.steps[i]
    assert before.candidates["pure"].text == after.candidates["pure"].text == "."
    assert before.source == "pure" and before.signals["benefit"] is False
    assert after.source == "rag" and after.token_id == after.candidates["rag"].token_id != before.token_id
    assert [s.token_id for s in plain.trace.steps[:i]] == [s.token_id for s in gated.trace.steps[:i]]
    _check_trace(plain), _check_trace(gated)


def test_verdict_mask_covers_verdicts_and_negators_whole_tokens_only(lm):
    from tokrag_integrations.policies.vocab import verdict_mask, vocab_texts

    texts = vocab_texts(lm.tokenizer)
    mask = verdict_mask(lm.tokenizer, vocab_size=len(texts) + 3, texts=texts)
    marked = {texts[i] for i in mask.nonzero().flatten().tolist()}
    assert {"No", " no", " Yes", " not", " never", " cannot", "'t", " nor"} <= marked
    assert not {" Not", " nothing"} - marked
    assert not any(t.strip().lower() in {"know", "note", "nothingness", "yesterday", "the"} for t in marked)
    assert not mask[-3:].any()  # ids beyond the tokenizer


def test_literal_reading_stays_reachable_and_misses_the_passage_fact(lm):
    """The old all-layer, unconstrained, un-normed reading (spec §3) as options: it answers the
    Drelmoria case from the pure model's hallucination, the reason it is not the default."""
    literal = {**PAPER_RULE, "min_fusion_layer": 0, "plausibility_alpha": None, "lens_norm": False}
    q, p, fact = BENEFIT_CASES[1]
    r = generate(lm, q, [p], policy="tokrag", max_new_tokens=24, policy_options=literal)
    assert fact not in r.text
    assert all(r.trace.options[k] == v for k, v in literal.items())
    assert all(s.signals["fusion_attn_layer"] < 15 or s.signals["fusion_jsd_layer"] < 15
               for s in r.trace.disagreement_steps)


@pytest.mark.parametrize(
    "options",
    [
        {"pr_norm": "softmax"},
        {"top_k": None},
        {"min_fusion_layer": 10},
        {"min_fusion_layer": 0.3125},
        {"lens_norm": False},
        {"scorer": "distribution"},
        {"fixed_layer": 15},
        {"function_word_gate": True},
        {"pr_skip": None},
        {"pr_skip": "authors"},
        {"verdict_gate": "either"},
        {"punctuation_gate": False},
        {"verdict_gate": "rag"},
    ],
)
def test_tokrag_options_run_and_are_recorded(lm, options):
    r = generate(lm, CONTRA_Q, CONTRA_P, policy="tokrag", max_new_tokens=12, policy_options=options)
    _check_trace(r)
    for k, v in options.items():
        assert r.trace.options[k] == v
    if "min_fusion_layer" in options:
        lo = 10 if options["min_fusion_layer"] == 10 else round(30 * 10 / 32)  # 0.3125 of 30 layers: 9
        for s in r.trace.disagreement_steps:
            assert s.signals["fusion_attn_layer"] >= lo and s.signals["fusion_jsd_layer"] >= lo
    if "fixed_layer" in options:
        assert all(s.signals["l_star"] == 15 for s in r.trace.disagreement_steps)
    if options.get("function_word_gate"):
        from tokrag_integrations.policies.vocab import gate_mask

        gate = gate_mask(lm.tokenizer)
        for s in r.trace.disagreement_steps:
            assert bool(gate[s.candidates["rag"].token_id]) == (s.signals.get("note") == "gated: function word")


def test_reference_variant_compares_at_every_step(lm):
    r = generate(lm, CONTRA_Q, CONTRA_P, policy="tokrag_authors", max_new_tokens=12)
    assert r.trace.policy == "tokrag_authors"
    gated = [s for s in r.trace.steps if s.signals.get("note") == "gated: function word"]
    compared = [s for s in r.trace.steps if "cos_ir" in s.signals]
    assert len(gated) + len(compared) == len(r.trace.steps)  # also at agreeing steps
    assert any(s.source == "agree" for s in compared)
    # Their 0-based layer 20 of 32, scaled to 30 layers: 0-based 19, l* = 20.
    assert all(s.signals["l_star"] == 20 for s in compared)
    assert all(s.source != "pure" for s in gated)


def test_tokrag_equals_rag_when_contexts_agree_everywhere(lm):
    q, ps = "What color is the sky on a clear day?", ["On a clear day the sky is blue."]
    t = generate(lm, q, ps, policy="tokrag", max_new_tokens=10)
    assert {s.source for s in t.trace.steps} == {"agree"}, t.trace.counts()
    assert t.token_ids == generate(lm, q, ps, policy="rag", max_new_tokens=10).token_ids


@pytest.mark.parametrize("policy", ["no_rag", "rag", "tokrag"])
def test_streaming_equals_non_streaming(lm, policy):
    r = generate(lm, CONTRA_Q, CONTRA_P, policy=policy, max_new_tokens=20)
    s = stream(lm, CONTRA_Q, CONTRA_P, policy=policy, max_new_tokens=20)
    events = list(s)
    assert "".join(e.text for e in events) == r.text == s.result.text
    assert [e.source for e in events] == [st.source for st in r.trace.steps]


def test_stop_strings_stop_and_stream_without_the_stop(lm):
    full = generate(lm, CONTRA_Q, CONTRA_P, policy="rag", max_new_tokens=24).text
    word = full.split()[2]
    s = stream(lm, CONTRA_Q, CONTRA_P, policy="rag", max_new_tokens=24, stop=[word])
    streamed = "".join(e.text for e in s)
    assert s.result.stop_reason == "stop"
    assert word not in s.result.text and streamed == s.result.text
    assert full.startswith(s.result.text)


@pytest.mark.parametrize(
    # llm's batch takes the same rows path as rag's: slow (make test-all).
    "policy", [pytest.param("no_rag", marks=pytest.mark.slow), "rag", "tokrag"]
)
def test_batch_equals_one_at_a_time(lm, policy):
    qs = [FICTION_Q, CONTRA_Q, "Who wrote Romeo and Juliet?"]
    ps = [FICTION_P, CONTRA_P, ["Romeo and Juliet was written by William Shakespeare.", "It premiered in 1597."]]
    batch = generate_batch(lm, qs, ps, policy=policy, max_new_tokens=16)
    for q, p, b in zip(qs, ps, batch, strict=True):
        one = generate(lm, q, p, policy=policy, max_new_tokens=16)
        assert b.token_ids == one.token_ids
        assert [s.source for s in b.trace.steps] == [s.source for s in one.trace.steps]


# ----------------------------------------------------------------------------- bad input


def test_empty_passages_fall_back_to_pure_context(lm):
    r = generate(lm, CONTRA_Q, [], policy="tokrag", max_new_tokens=8)
    assert any("pure context" in w for w in r.trace.warnings)
    assert r.token_ids == generate(lm, CONTRA_Q, None, policy="no_rag", max_new_tokens=8).token_ids
    # A blank passage is skipped with a warning, and so is the RAG context it leaves empty
    # (each expected warning captured here, so none reaches the test run's summary).
    with pytest.warns(UserWarning) as record:
        r2 = generate(lm, CONTRA_Q, ["   "], policy="rag", max_new_tokens=8)
    messages = [str(w.message) for w in record]
    assert len(messages) == 3, messages
    assert "passage 0 is empty" in messages[0]
    assert "No passage could be used" in messages[1]
    assert "no usable passages, answered from the pure context" in messages[2]
    assert r2.token_ids == r.token_ids


def test_empty_query_and_unknown_policy_are_clear_errors(lm):
    with pytest.raises(ValueError, match="query is empty"):
        generate(lm, "  ", CONTRA_P)
    with pytest.raises(ValueError, match="Unknown policy 'tokrog'.*tokrag"):
        generate(lm, CONTRA_Q, CONTRA_P, policy="tokrog")
    with pytest.raises(ValueError, match="pr_norm"):
        generate(lm, CONTRA_Q, CONTRA_P, policy_options={"pr_norm": "max"})
    with pytest.raises(ValueError, match="Bad options"):
        generate(lm, CONTRA_Q, CONTRA_P, policy="rag", policy_options={"no_such_option": 1})
    with pytest.raises(TypeError, match="no_such_option"):
        generate(lm, CONTRA_Q, CONTRA_P, policy="rag", no_such_option=1)


def test_passages_larger_than_the_window_are_dropped_lowest_first(lm):
    filler = "The archive contains many unrelated records about shipping schedules. " * 40
    ps = [Passage(FICTION_P[0], score=0.9)] + [Passage(filler, score=0.5 - i / 10) for i in range(3)]
    with pytest.warns(UserWarning, match="do not fit"):
        r = generate(lm, FICTION_Q, ps, policy="rag", max_new_tokens=24, max_context_tokens=700)
    recs = r.trace.passages
    # The top passage is whole; the second fits whole; the third is cut; the last is dropped.
    assert [(p.kept, p.cut) for p in recs] == [(True, False), (True, False), (True, True), (False, False)]
    assert any("do not fit" in w for w in r.trace.warnings)
    assert r.trace.prompt_tokens["rag"] <= 700 - 24
    assert "Pistachio" in r.text


def test_question_that_cannot_fit_is_a_clear_error(lm):
    with pytest.raises(ValueError, match="question alone takes"):
        generate(lm, "why " * 400, CONTRA_P, max_context_tokens=300)


def test_prompt_positions_are_exact(lm):
    ps = ["Alpha passage text.", "Beta passage, second."]
    plan = _plan(lm, "Which passage?", ps)
    tok = lm.tokenizer
    for (s, e), p in zip(plan.passage_spans, ps, strict=True):
        assert tok.decode(plan.rag_ids[s:e]) == p
        assert tok.decode(plan.rag_ids[s - 3 : s]).endswith("Passage]\n")
    # Both contexts end in the same question and assistant prefix.
    n = len(plan.pure_ids) - len(plan.head_ids)
    assert plan.rag_ids[-n:] == plan.pure_ids[-n:]
    assert plan.rag_ids[: len(plan.head_ids)] == plan.pure_ids[: len(plan.head_ids)]


def test_plain_prompt_fallback_without_chat_template(lm):
    tok = lm.tokenizer
    saved = tok.chat_template
    try:
        tok.chat_template = None
        plan = PromptBuilder(tok, context_window=2048).build("Q?", ["P."])
        text = tok.decode(plan.rag_ids)
        assert "[Retrieved Passage]\nP." in text and text.endswith("Question: Q?\nAnswer:")
        assert tok.decode(plan.pure_ids).endswith("Question: Q?\nAnswer:")
    finally:
        tok.chat_template = saved


def test_chat_history_is_in_both_contexts(lm):
    msgs = [{"role": "user", "content": "Hi, I am Ada."}, {"role": "assistant", "content": "Hello Ada!"}]
    plan = _plan(lm, "What is my name?", ["Ada is a name."], messages=msgs)
    for ids in (plan.pure_ids, plan.rag_ids):
        assert "Hello Ada!" in lm.tokenizer.decode(ids)


def test_async_and_batch_validation(lm):
    import asyncio

    from tokrag_integrations import agenerate

    r = asyncio.run(agenerate(lm, CONTRA_Q, CONTRA_P, policy="rag", max_new_tokens=8))
    assert r.token_ids == generate(lm, CONTRA_Q, CONTRA_P, policy="rag", max_new_tokens=8).token_ids
    with pytest.raises(ValueError, match="passage lists"):
        generate_batch(lm, ["a", "b"], [[]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert generate_batch(lm, [], []) == []


def test_punctuation_mask_marks_tokens_without_letters_or_digits(lm):
    from tokrag_integrations.policies.vocab import punctuation_mask

    tok = lm.tokenizer
    mask = punctuation_mask(tok, vocab_size=lm.vocab_size)
    assert mask.shape == (lm.vocab_size,)

    def one(text):
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == 1, (text, ids)
        return ids[0]

    for t in [".", ",", " (", "'", " ", " **", "..."]:
        assert mask[one(t)], t
    for t in [" Paris", "1", "7", " the", "é"]:
        assert not mask[one(t)], t


@pytest.mark.parametrize("pr_skip", ["punctuation", "authors"])
def test_pr_skip_leaves_skipped_tokens_out_of_p_r(lm, pr_skip):
    """p_R (Eq. 16) holds no skipped retrieved token, and skipping changes it where the
    passage's punctuation drew attention; f of Eq. 14 is left as it was (same l* inputs)."""
    from tokrag_integrations.policies.vocab import punctuation_mask, skip_mask

    build = punctuation_mask if pr_skip == "punctuation" else skip_mask
    mask = build(lm.tokenizer, vocab_size=lm.vocab_size)
    q, p, _ = BENEFIT_CASES[2]
    base = generate(lm, q, [p + " (See: records, 1994.)"], policy="tokrag", max_new_tokens=16, policy_options={"function_word_gate": False, "pr_skip": None})
    skip = generate(lm, q, [p + " (See: records, 1994.)"], policy="tokrag", max_new_tokens=16, policy_options={"function_word_gate": False, "pr_skip": pr_skip})
    compared = [(a, b) for a, b in zip(base.trace.steps, skip.trace.steps, strict=False) if "p_r_top" in b.signals]
    assert compared
    for a, b in compared:
        for text, _ in b.signals["p_r_top"]:
            tid = lm.tokenizer.convert_tokens_to_ids(lm.tokenizer.tokenize(text))
            assert not (len(tid) == 1 and mask[tid[0]]), (text, b.signals["p_r_top"])
        if a.token_id != b.token_id:
            break
        assert a.signals["fusion_attn_layer"] == b.signals["fusion_attn_layer"]
    assert any(a.signals["p_r_top"] != b.signals["p_r_top"] for a, b in compared)


def test_rising_gate_keeps_rags_token_where_it_is_the_rising_token(lm):
    """RAG's " total" (the question's word; the passage says "full") loses Eq. 19 to the pure
    model's " control" although it is x^{l'-l*}, the token RAG's later layers raised most;
    ``rising_gate=True`` keeps it and says why, and leaves the signals as computed."""
    q = "When did the Venetians take total control of Cyprus?"
    p = ["The Venetians took full control of Cyprus in 1489 after Queen Catherine Cornaro abdicated."]
    off = generate(lm, q, p, policy="tokrag", max_new_tokens=12, policy_options={"rising_gate": False})
    on = generate(lm, q, p, policy="tokrag", max_new_tokens=12)  # the default
    lost = next(s for s in off.trace.steps if s.source == "pure")
    assert lost.candidates["rag"].text == " total" == lost.signals["rising_token"]
    assert lost.signals["benefit"] is False and "note" not in lost.signals
    kept = on.trace.steps[lost.index]
    assert kept.source == "rag" and kept.text == " total"
    assert kept.signals["note"] == "gated: RAG's rising token" and kept.signals["benefit"] is True
    assert kept.signals["cos_ir"] == pytest.approx(lost.signals["cos_ir"])
    assert "rising_id" not in kept.signals  # internal: the trace keeps the decoded token only
    assert on.trace.options["rising_gate"] is True
    _check_trace(off), _check_trace(on)
