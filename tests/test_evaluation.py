"""Evaluation harness: passage mixing, metrics, resume, and a tiny real-model run."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from tokrag_integrations.evaluation import (
    EvalItem,
    RecordStore,
    auc,
    cover_em,
    f1_score,
    load_items,
    mix_counterfactuals,
    mix_passages,
    normalize_answer,
    run_misleading,
    run_noise_sweep,
)
from tokrag_integrations.evaluation.metrics import macro_f1

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
RGB = DATA / "rgb_en_fact_dev.jsonl"
# The evaluation sets live beside the repository (shared/data, as in CI); a checkout
# without them skips the tests that read them instead of failing on a missing file.
needs_data = pytest.mark.skipif(not RGB.exists(), reason=f"evaluation data not found at {DATA}")


def _item(i: int = 0, n_pos: int = 4, n_neg: int = 6, n_cf: int = 3) -> EvalItem:
    return EvalItem(
        id=f"it{i}",
        question=f"question {i}?",
        answers=["Paris"],
        positives=[f"pos {j}" for j in range(n_pos)],
        negatives=[f"neg {j}" for j in range(n_neg)],
        counterfactuals=[f"cf {j}" for j in range(n_cf)],
        counterfactual_answers=["Lyon"] if n_cf else [],
    )


# --------------------------------------------------------------------------- mixing
@pytest.mark.parametrize("ratio,pos,neg", [(0.0, 5, 0), (0.2, 4, 1), (0.4, 3, 2), (0.6, 2, 3), (0.8, 1, 4), (1.0, 0, 5)])
def test_mix_counts(ratio, pos, neg):
    m = mix_passages(_item(n_pos=5, n_neg=6), ratio, k=5)
    assert m.counts == {"pos": pos, "neg": neg, "cf": 0}
    assert len(m.passages) == 5 and not m.short
    assert all(p.startswith(k) for p, k in zip(m.passages, m.kinds, strict=True))


def test_mix_uses_what_the_item_has_and_says_so():
    m = mix_passages(_item(n_pos=1, n_neg=5), 0.2, k=5)  # wants 4 positives, has 1
    assert m.counts == {"pos": 1, "neg": 1, "cf": 0} and m.short
    m = mix_counterfactuals(_item(n_pos=1, n_cf=1), 1.0, k=2)
    assert m.counts == {"pos": 0, "neg": 0, "cf": 1} and m.short
    assert mix_counterfactuals(_item(), 0.5, k=2).counts == {"pos": 1, "neg": 0, "cf": 1}


def test_mix_is_seed_stable_and_seed_dependent():
    it = _item()
    a = mix_passages(it, 0.4, k=5, seed=7)
    assert a.passages == mix_passages(it, 0.4, k=5, seed=7).passages
    others = {tuple(mix_passages(it, 0.4, k=5, seed=s).passages) for s in range(20)}
    assert len(others) > 1
    # Independent of global random state.
    random.seed(123)
    assert mix_passages(it, 0.4, k=5, seed=7).passages == a.passages


def test_mix_rejects_bad_arguments():
    with pytest.raises(ValueError, match="noise ratio must be in"):
        mix_passages(_item(), 1.5)
    with pytest.raises(ValueError, match="k must be >= 1"):
        mix_passages(_item(), 0.5, k=0)


# --------------------------------------------------------------------------- metrics
@pytest.mark.parametrize(
    "output,answers,ok",
    [
        ("The Eiffel Tower!", ["eiffel tower"], True),
        ("I think it is Paris, France.", ["Paris"], True),
        ("It was at a party.", ["art"], False),
        ("  THE   answer:  an  Apple ", ["apple"], True),
        ("Facebook's purchase", ["Facebook"], True),
        ("In 2012.", ["2012", "April 2012"], True),
        ("", ["x"], False),
        ("Yes, there is no doubt.", ["yes"], True),
        ("No, yes-men aside.", ["yes"], False),
        ("Maybe.", ["no"], False),
    ],
)
def test_cover_em(output, answers, ok):
    assert cover_em(output, answers) is ok


def test_normalize_answer():
    assert normalize_answer("The  Quick, brown fox.") == "quick brown fox"
    assert normalize_answer("“An” apple—pie") == "apple pie"


def test_auc_against_hand_computation():
    # positives 0.35, 0.8 vs negatives 0.1, 0.4: pairs won 1 + 2 of 4.
    assert auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert auc([0.5, 0.5], [1, 0]) == pytest.approx(0.5)  # tie counts half
    assert auc([1, 2, 3], [0, 0, 1]) == 1.0
    assert math.isnan(auc([1, 2], [1, 1]))


def test_auc_matches_pairwise_definition_on_random_data():
    rng = random.Random(0)
    xs = [rng.choice([0.0, 0.5, 1.0, rng.random()]) for _ in range(200)]
    ys = [rng.randint(0, 1) for _ in range(200)]
    pos = [x for x, y in zip(xs, ys, strict=True) if y]
    neg = [x for x, y in zip(xs, ys, strict=True) if not y]
    want = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))
    assert auc(xs, ys) == pytest.approx(want)


def test_f1():
    assert f1_score([1, 1, 0, 0], [1, 0, 1, 0]) == pytest.approx(0.5)
    assert f1_score([0, 0], [1, 0]) == 0.0
    assert macro_f1([1, 1, 0, 0], [1, 0, 1, 0]) == pytest.approx(0.5)


@needs_data
def test_load_items_reads_the_shared_format(tmp_path):
    items = load_items(RGB, limit=3)
    assert len(items) == 3 and items[0].answers and items[0].counterfactuals
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "question": "q"}\n')
    with pytest.raises(ValueError, match="lacks required field"):
        load_items(bad)
    with pytest.raises(FileNotFoundError, match="Evaluation data not found"):
        load_items(tmp_path / "none.jsonl")


# --------------------------------------------------------------------------- runner
class FakeDecode:
    """Stands in for generate_batch: answers "Paris" with rag-like policies, records calls."""

    def __init__(self, fail_after: int | None = None):
        self.calls: list[tuple[str, list[str], list[list[str]]]] = []
        self.fail_after = fail_after

    def __call__(self, lm, queries, passages, *, policy, **kw):
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise KeyboardInterrupt
        self.calls.append((policy, list(queries), [list(p) for p in passages]))
        out = []
        for ps in passages:
            text = "Paris" if any(p.startswith("pos") for p in ps) else "Lyon"
            trace = SimpleNamespace(counts=lambda: {"agree": 1}, to_dict=lambda: {"steps": []})
            out.append(SimpleNamespace(text=text, stop_reason="eos", trace=trace))
        return out


LM = SimpleNamespace(name="fake")


def test_noise_sweep_passages_identical_across_policies_and_llm_decoded_once(tmp_path):
    items = [_item(i) for i in range(3)]
    dec = FakeDecode()
    s = run_noise_sweep(LM, items, records_path=tmp_path / "r.jsonl", policies=["llm", "rag", "tokrag"],
                        ratios=[0.0, 0.6, 1.0], progress=False, decode=dec)
    seen: dict[tuple[str, str], list[str]] = {}
    for policy, qs, ps in dec.calls:
        if policy == "llm":
            assert ps == [[]]
            continue
        for q, p in zip(qs, ps, strict=True):
            seen.setdefault((q, policy), []).append(tuple(p))
    for it in items:
        assert seen[(it.question, "rag")] == seen[(it.question, "tokrag")]
    assert sum(1 for c in dec.calls if c[0] == "llm") == 3
    assert s["accuracy"]["rag"] == {"0": 100.0, "0.6": 100.0, "1": 0.0}
    assert s["accuracy"]["llm"]["0.6"] == 0.0 and s["n"]["llm"]["1"] == 3


def test_resume_after_interruption(tmp_path):
    items = [_item(i) for i in range(4)]
    path = tmp_path / "r.jsonl"
    kw = dict(records_path=path, policies=["rag", "cad"], ratios=[0.0, 1.0], progress=False)
    with pytest.raises(KeyboardInterrupt):
        run_noise_sweep(LM, items, decode=FakeDecode(fail_after=5), **kw)
    assert len(RecordStore(path)) == 5
    with path.open("a") as fh:  # a line cut by the interruption
        fh.write('{"task": "noise", "item": "it3", "cond')
    dec = FakeDecode()
    s = run_noise_sweep(LM, items, decode=dec, **kw)
    assert len(dec.calls) == 16 - 5
    store = RecordStore(path)
    assert len(store) == 16
    assert s["n"]["rag"] == {"0": 4, "1": 4} and s["n"]["cad"] == {"0": 4, "1": 4}
    # A third run does nothing.
    dec3 = FakeDecode()
    run_noise_sweep(LM, items, decode=dec3, **kw)
    assert dec3.calls == []


def test_misleading_reports_counterfactual_repeats(tmp_path):
    items = [_item(i) for i in range(2)] + [_item(9, n_cf=0)]
    s = run_misleading(LM, items, records_path=tmp_path / "m.jsonl", policies=["rag"], cf_ratios=[0.0, 1.0],
                       progress=False, decode=FakeDecode())
    assert s["n_items"] == 2
    assert s["accuracy"]["rag"] == {"cf=0": 100.0, "cf=1": 0.0}
    assert s["cf_repeat"]["rag"] == {"cf=0": 0.0, "cf=1": 100.0}


# --------------------------------------------------------------------------- real model
@needs_data
def test_tiny_end_to_end_cli_and_resume(tmp_path, capsys):
    from tokrag_integrations.cli_eval import main

    argv = ["noise", "--data", str(RGB), "--limit", "2", "--policies", "llm,rag,tokrag", "--ratios", "0,1",
            "--k", "2", "--max-new-tokens", "8", "--out", str(tmp_path / "res"), "--records", str(tmp_path / "runs"),
            "--no-progress"]
    assert main(argv) == 0
    res = json.loads((tmp_path / "res" / "noise_rgb_en_fact_dev.json").read_text())
    assert res["n"]["tokrag"] == {"0": 2, "1": 2} and res["n"]["llm"] == {"0": 2, "1": 2}
    assert (tmp_path / "res" / "noise_rgb_en_fact_dev.png").stat().st_size > 1000
    assert "| tokrag |" in (tmp_path / "res" / "noise_rgb_en_fact_dev.md").read_text()
    recs = [json.loads(x) for x in (tmp_path / "runs" / "noise_rgb_en_fact_dev.jsonl").read_text().splitlines()]
    assert len(recs) == 2 + 2 * 2 * 2 and all("trace" in r for r in recs)
    assert main(argv) == 0  # resumes: nothing left to decode
    assert len((tmp_path / "runs" / "noise_rgb_en_fact_dev.jsonl").read_text().splitlines()) == len(recs)
    with pytest.raises(SystemExit, match="other settings"):
        main([*argv[:-1], "--max-new-tokens", "9", "--no-progress"])


@needs_data
def test_token_level_on_the_real_model(lm, tmp_path):
    from tokrag_integrations.evaluation import run_token_level

    items = load_items(RGB, limit=1)
    s = run_token_level(lm, items, records_path=tmp_path / "t.jsonl", ratios=[1.0], cf_ratios=[1.0],
                        tokrag_configs={"tokrag (default)": {}}, progress=False)
    rec = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert {r["condition"] for r in rec} == {"1", "cf=1"}
    assert s["n_records"] == 2
    for smp in (x for r in rec for x in r["samples"]):
        assert smp["label"] in (0, 1) and set(smp["scores"]) == {"tokrag (default)", "logprob", "entropy"}


def test_evidence_sentence_picks_the_answer_bearing_sentence():
    from tokrag_integrations.evaluation.runner import evidence_sentence

    it = _item()
    it.positives = ["Lyon is big. The capital is Paris, of course. Other text.", "pos 2"]
    assert evidence_sentence(it) == "The capital is Paris, of course."
    it.answers = ["yes"]
    assert evidence_sentence(it) == "Lyon is big."
    it.positives = []
    assert evidence_sentence(it) == "yes"
