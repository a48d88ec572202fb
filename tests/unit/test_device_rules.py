"""The device rules' shared parts (``accel/rules/common.py``) and the rules that need no
model, on hand-made tensors: the same values as the policy / engine functions they mirror,
and no host read (``tests/integration/test_device_rules.py`` checks every rule on the
packaged model)."""

from __future__ import annotations

import math

import pytest
import torch
from _host_reads import HostReads

from tokrag_integrations.accel.rules import rule_for
from tokrag_integrations.accel.rules.baselines_rule import FloorRule, NoRAGRule, StandardRAGRule
from tokrag_integrations.accel.rules.cad_rule import CADRule
from tokrag_integrations.accel.rules.common import (
    Layout,
    TraceParts,
    join_double,
    split_double,
)
from tokrag_integrations.accel.rules.rag_token_rule import RAGTokenRule
from tokrag_integrations.accel.rules.selection_rule import MarginRule
from tokrag_integrations.accel.rules.tokrag_rule import distribution_scores_rows
from tokrag_integrations.accel.step_tensors import StepTensors, device_rule_for
from tokrag_integrations.attention.citations import citation_layers, passage_scores
from tokrag_integrations.engine.stats import distribution_stats_rows
from tokrag_integrations.policies import get_policy
from tokrag_integrations.policies import signals as S
from tokrag_integrations.policies.rag_token import passage_posterior
from tokrag_integrations.policies.tokrag import TokRAG

V, L, H, T = 50, 5, 3, 24


class Tok:
    def decode(self, ids):
        return f"<{ids[0]}>"


def tensors(q: int = 3, seed: int = 0, rows: dict[str, list[int]] | None = None) -> StepTensors:
    """Q queries over 2·Q + 1 rows (pure at even rows, rag at odd) unless ``rows`` says."""
    g = torch.Generator().manual_seed(seed)
    R = 2 * q + 1  # one row no query names
    logits = torch.randn(R, V, generator=g) * 3
    attn = torch.rand(R, L, H, T, generator=g) ** 4
    attn = attn / attn.sum(-1, keepdim=True)
    named = rows or {"pure": [2 * i for i in range(q)], "rag": [2 * i + 1 for i in range(q)]}
    P = 8
    rt_pos = torch.zeros(q, P, dtype=torch.long)
    rt_ids = torch.zeros(q, P, dtype=torch.long)
    rt_valid = torch.zeros(q, P, dtype=torch.bool)
    rt_passage = torch.zeros(q, P, dtype=torch.long)
    for i in range(q):
        m = P - i  # 8, 7, 6 retrieved tokens
        rt_pos[i, :m] = torch.arange(4, 4 + m) + i
        rt_ids[i, :m] = torch.randint(0, V, (m,), generator=g)
        rt_valid[i, :m] = True
        rt_passage[i, :m] = torch.tensor([0] * 3 + [1] * (m - 3))
    return StepTensors(
        logits=logits,
        resid=None,
        attn=attn,
        rows={k: torch.tensor(v) for k, v in named.items()},
        rt_pos=rt_pos,
        rt_ids=rt_ids,
        rt_valid=rt_valid,
        rt_passage=rt_passage,
        cite_passages=torch.tensor([2] * q),
    )


def test_floor_on_hand_made_logits_gives_the_tokens_sources_and_stats():
    t = tensors()
    t.logits[1] = t.logits[0]  # query 0: the contexts agree
    rule = FloorRule(None, ("pure", "rag"), cite=None, passages=4)
    ids, record, _ = rule(t)
    assert record.shape == (3, rule.record_width)
    for q in range(3):
        pure, rag = t.logits[2 * q], t.logits[2 * q + 1]
        b = int(rag.argmax())
        assert int(ids[q]) == b
        got = rule.decode(record[q].tolist(), Tok())
        assert got.token_id == b
        assert got.source == ("agree" if int(pure.argmax()) == b else "rag")
        assert got.signals == {} and got.citation == []
        want, probs = distribution_stats_rows(torch.stack([pure, rag]), b)
        for i, role in enumerate(("pure", "rag")):
            assert got.stats[role] == pytest.approx(want[i], rel=1e-6)
            top = int(probs[i].argmax())
            assert got.candidates[role].token_id == top
            assert got.candidates[role].text == f"<{top}>"
            assert got.candidates[role].prob == pytest.approx(float(probs[i, top]), rel=1e-6)


def test_a_role_a_query_lacks_is_left_out_of_its_candidates():
    t = tensors(rows={"pure": [0, 2, 4], "rag": [1, -1, 5]})
    rule = NoRAGRule(None, ("pure", "rag"), cite=None, passages=4)
    ids, record, _ = rule(t)
    got = rule.decode(record[1].tolist(), Tok())
    assert set(got.candidates) == {"pure"} and got.source == "pure"
    assert got.token_id == int(t.logits[2].argmax())


def _scores_of(t: StepTensors, q: int, token: int) -> list[float]:
    rows = t.attn[int(t.rows["rag"][q])][citation_layers(L)]
    valid = t.rt_valid[q]
    pos, ids, passage = t.rt_pos[q][valid], t.rt_ids[q][valid], t.rt_passage[q][valid]
    n = int(t.cite_passages[q])
    spans = [pos[passage == j] for j in range(n)]
    return passage_scores(rows, spans, [ids[passage == j] for j in range(n)], token)


@pytest.mark.parametrize("case", ["mass", "copy", "no attention", "not cited"])
def test_the_citation_equals_passage_scores(case):
    t = tensors(seed=3)
    layout = Layout()
    parts = TraceParts(L, ("rag",), layout, cite="attention", passages=4)
    ids = torch.tensor([7, 8, 9])
    layers = citation_layers(L)
    if case == "copy":  # two heads of query 0 copy token 7 from passage 1, one from passage 0
        t.rt_ids[0, 5] = 7
        t.rt_ids[0, 1] = 7
        r = int(t.rows["rag"][0])
        t.attn[r, layers[0], 0, int(t.rt_pos[0, 5])] = 5.0
        t.attn[r, layers[0], 1, int(t.rt_pos[0, 5])] = 5.0
        t.attn[r, layers[-1], 2, int(t.rt_pos[0, 1])] = 5.0
    if case == "no attention":
        t.attn[int(t.rows["rag"][1])] = 0.0
        t.attn[int(t.rows["rag"][1]), :, :, 0] = 1.0  # all on a column outside the passages
    if case == "not cited":
        t.cite_passages = torch.tensor([2, -1, 0])
    pieces = parts.compute(t, ids)
    record = layout.pack(pieces)
    for q in range(3):
        out = type("O", (), {})()
        out.candidates, out.stats, out.citation = {}, {}, None
        parts.decode_into(record[q].tolist(), Tok(), out)
        n = int(t.cite_passages[q])
        want = [] if n <= 0 else _scores_of(t, q, int(ids[q]))
        assert out.citation == pytest.approx(want, rel=1e-6, abs=1e-7), (case, q)
    if case == "copy":
        assert out.citation is not None
        got0 = type("O", (), {})()
        got0.candidates, got0.stats, got0.citation = {}, {}, None
        parts.decode_into(record[0].tolist(), Tok(), got0)
        assert got0.citation == pytest.approx([1 / 3, 2 / 3])
    if case == "no attention":
        assert _scores_of(t, 1, 8) == [0.5, 0.5]


def test_rag_token_on_hand_made_passages_equals_the_policy_formulas():
    t = tensors(q=2, rows={"passage:0": [0, 2], "passage:1": [1, -1], "passage:2": [3, -1]})
    t.weights = torch.tensor([[0.5, 0.3, 0.2], [1.0, 0.0, 0.0]])
    rule = RAGTokenRule(get_policy("rag_token"), None, citations=True, passages=4)
    ids, record, _ = rule(t)
    for q, rows in enumerate(([0, 1, 3], [2])):
        probs = torch.softmax(t.logits[rows], dim=-1)
        w = t.weights[q, : len(rows)]
        mixed = w @ probs
        tid = int(mixed.argmax())
        per = probs[:, tid]
        got = rule.decode(record[q].tolist(), Tok())
        assert int(ids[q]) == got.token_id == tid
        assert got.source == f"passage:{int((w * per).argmax())}"
        assert got.signals["p_mix"] == pytest.approx(float(mixed[tid]), rel=1e-6)
        assert got.signals["p_passage"] == [round(float(x), 4) for x in per]
        want = passage_posterior([float(x) for x in w], [float(x) for x in per])
        assert got.citation == pytest.approx(want, rel=1e-6)
        assert set(got.candidates) == {f"passage:{j}" for j in range(len(rows))}


@pytest.mark.parametrize("name", ["logprob", "entropy"])
def test_the_margins_are_the_policy_margins(name):
    from tokrag_integrations.policies.selection import entropy_margin, logprob_margin

    t = tensors(seed=5)
    rule = MarginRule(get_policy(name), None, citations=False, passages=4)
    ids, record, _ = rule(t)
    margin = logprob_margin if name == "logprob" else entropy_margin
    for q in range(3):
        pure = torch.softmax(t.logits[2 * q], -1)
        rag = torch.softmax(t.logits[2 * q + 1], -1)
        m = margin(pure, rag)
        got = rule.decode(record[q].tolist(), Tok())
        assert got.signals["margin"] == pytest.approx(m, rel=1e-12)
        assert got.source == ("rag" if m >= 0 else "pure")


def test_split_double_keeps_a_float64_to_48_bits():
    x = torch.tensor([math.pi, -1e-9 / 3, 0.0, 123456.789012345], dtype=torch.float64)
    back = [join_double(p) for p in split_double(x).tolist()]
    assert back == pytest.approx(x.tolist(), rel=1e-14, abs=0)


def test_distribution_scores_of_rows_equal_the_policy_function():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(3, 3, V, generator=g) * 2, dim=-1)
    jsd_ir, jsd_llm = distribution_scores_rows(p[:, 0], p[:, 1], p[:, 2])
    for q in range(3):
        want = S.distribution_scores(p[q, 0], p[q, 1], p[q, 2])
        assert (float(jsd_ir[q]), float(jsd_llm[q])) == pytest.approx(want, rel=1e-5)


def test_plausible_tokens_over_rows_is_the_one_row_result_per_row():
    g = torch.Generator().manual_seed(2)
    logp = torch.log_softmax(torch.randn(4, V, generator=g), -1)
    rows = S.plausible_tokens(logp, 0.3)
    assert torch.equal(rows, torch.stack([S.plausible_tokens(r, 0.3) for r in logp]))


def _rules_without_a_model():
    return [
        NoRAGRule(None, ("pure", "rag"), cite=None, passages=4),
        StandardRAGRule(None, ("rag",), cite=None, passages=4),
        FloorRule(None, ("pure", "rag"), cite=None, passages=4),
        CADRule(get_policy("cad"), None, citations=False, passages=4),
        CADRule(get_policy("adacad"), None, citations=False, passages=4),
        MarginRule(get_policy("logprob"), None, citations=False, passages=4),
        MarginRule(get_policy("entropy"), None, citations=False, passages=4),
    ]


@pytest.mark.parametrize("index", range(7))
def test_a_rule_reads_nothing_on_the_host(index):
    rule = _rules_without_a_model()[index]
    t = tensors()
    with HostReads() as reads:
        ids, record, _ = rule(t)
    assert reads.calls == []
    assert ids.shape == (3,) and record.shape == (3, rule.record_width)


def test_the_citation_and_rag_token_read_nothing_on_the_host():
    t = tensors()
    layout = Layout()
    parts = TraceParts(L, ("pure", "rag"), layout, cite="attention", passages=4)
    with HostReads() as reads:
        layout.pack(parts.compute(t, torch.tensor([1, 2, 3])))
    assert reads.calls == []
    t = tensors(q=2, rows={"passage:0": [0, 2], "passage:1": [1, -1]})
    t.weights = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    rule = RAGTokenRule(get_policy("rag_token"), None, citations=True, passages=4)
    with HostReads() as reads:
        rule(t)
    assert reads.calls == []


def test_the_counter_counts_host_reads():
    x = torch.arange(4.0)
    with HostReads() as reads:
        x.sum().item()
        bool(x[0] > 0)
        x[x > 1]
        x.tolist()
    assert reads.calls == ["item", "__bool__", "__getitem__[bool mask]", "tolist"]


def test_policies_without_a_rule_get_none():
    assert device_rule_for(get_policy("rag_sequence"), None, citations=False) is None
    assert device_rule_for(get_policy("tokrag_authors"), None, citations=False) is None

    class Mine(TokRAG):  # a subclass may change the rule: no device rule for it
        pass

    assert rule_for(Mine(), None, citations=False, passages=4) is None


def test_rag_token_refuses_a_step_with_more_passages_than_its_slots():
    t = tensors(q=1, rows={"passage:0": [0], "passage:1": [1], "passage:2": [2]})
    t.weights = torch.tensor([[0.5, 0.3, 0.2]])
    rule = RAGTokenRule(get_policy("rag_token"), None, citations=True, passages=2)
    with pytest.raises(ValueError, match="2 passage slots.*'passage:2'"):
        rule(t)
