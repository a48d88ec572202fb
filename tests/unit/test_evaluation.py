"""Evaluation harness: passage mixing, metrics, resume, and a tiny real-model run.

This file holds the cases that need a model, a database or a server are in
``tests/integration/test_evaluation.py``."""

from __future__ import annotations

import json
import math
import random
import re
from types import SimpleNamespace

import pytest

from tokrag_eval import (
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
from tokrag_eval.metrics import macro_f1


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


def test_load_items_reads_the_shared_format(tmp_path, eval_data):
    items = load_items(eval_data("rgb_en_fact_dev.jsonl"), limit=3)
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
        self.options: list[dict] = []  # the policy options of each call (max_new_tokens, stop dropped)
        self.prefill: list[int | None] = []  # id of the active shared-prefill store of each call
        self.fail_after = fail_after

    def __call__(self, lm, queries, passages, *, policy, **kw):
        from tokrag_integrations.contexts.prefill import _SHARED_PREFILL

        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise KeyboardInterrupt
        self.calls.append((policy, list(queries), [list(p) for p in passages]))
        self.options.append(dict(kw.get("policy_options") or {}))
        store = _SHARED_PREFILL.get()
        self.prefill.append(None if store is None else id(store))
        out = []
        for ps in passages:
            text = "Paris" if any(p.startswith("pos") for p in ps) else "Lyon"
            trace = SimpleNamespace(counts=lambda: {"agree": 1}, to_dict=lambda: {"steps": []}, timings={})
            out.append(SimpleNamespace(text=text, stop_reason="eos", trace=trace))
        return out


LM = SimpleNamespace(name="fake")


def test_noise_sweep_passages_identical_across_policies_and_no_rag_decoded_once(tmp_path):
    items = [_item(i) for i in range(3)]
    dec = FakeDecode()
    s = run_noise_sweep(LM, items, records_path=tmp_path / "r.jsonl", policies=["no_rag", "rag", "tokrag"],
                        ratios=[0.0, 0.6, 1.0], progress=False, decode=dec)
    seen: dict[tuple[str, str], list[str]] = {}
    for policy, qs, ps in dec.calls:
        if policy == "no_rag":
            assert ps == [[]]
            continue
        for q, p in zip(qs, ps, strict=True):
            seen.setdefault((q, policy), []).append(tuple(p))
    for it in items:
        assert seen[(it.question, "rag")] == seen[(it.question, "tokrag")]
    assert sum(1 for c in dec.calls if c[0] == "no_rag") == 3
    assert s["accuracy"]["rag"] == {"0": 100.0, "0.6": 100.0, "1": 0.0}
    assert s["accuracy"]["no_rag"]["0.6"] == 0.0 and s["n"]["no_rag"]["1"] == 3


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


def test_evidence_sentence_picks_the_answer_bearing_sentence():
    from tokrag_eval.token_level import evidence_sentence

    it = _item()
    it.positives = ["Lyon is big. The capital is Paris, of course. Other text.", "pos 2"]
    assert evidence_sentence(it) == "The capital is Paris, of course."
    it.answers = ["yes"]
    assert evidence_sentence(it) == "Lyon is big."
    it.positives = []
    assert evidence_sentence(it) == "yes"


# --------------------------------------------------------------------------- policy specs
def test_spec_parsing_and_normalisation():
    from tokrag_eval.specs import (
        parse_spec,
        parse_specs,
        parse_value,
        split_specs,
    )

    assert split_specs("no_rag, rag,tokrag[min_fusion_layer=0,lens_norm=false],adacad") == [
        "no_rag", "rag", "tokrag[min_fusion_layer=0,lens_norm=false]", "adacad"]
    s = parse_spec("tokrag[min_fusion_layer=0, lens_norm=FALSE, rise=logit, alpha=0.1, top_k=None, x='1']")
    assert s.name == "tokrag"
    assert s.options == {"min_fusion_layer": 0, "lens_norm": False, "rise": "logit", "alpha": 0.1, "top_k": None, "x": "1"}
    assert str(s) == "tokrag[alpha=0.1,lens_norm=False,min_fusion_layer=0,rise=logit,top_k=None,x='1']"
    assert parse_spec(str(s)) == s  # the label reads back as the same spec
    assert [parse_value(v) for v in ("3", "-2.5", "True", "none", "abc")] == [3, -2.5, True, None, "abc"]
    assert [str(x) for x in parse_specs("tokrag,tokrag[]")] == ["tokrag"]  # duplicates dropped
    for bad in ("tokrag[min_fusion_layer=0", "tokrag]", "tokrag[x]", "tokrag[x=1,x=2]", "[x=1]"):
        with pytest.raises(ValueError):
            parse_specs(bad)


def test_cli_validates_specs_before_loading_a_model(monkeypatch, tmp_path, capsys):
    import tokrag_integrations.models as models
    from tokrag_integrations.cli import main as tokrag

    def main(argv):  # `tokrag eval ARGV`
        return tokrag(["eval", *argv])


    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    base = ["noise", "--data", str(tmp_path / "none.jsonl"), "--records", str(tmp_path), "--no-progress"]
    cases = [
        ([*base, "--policies", "rag,tokrog[top_k=3]"], r"Unknown policy 'tokrog'.*available: .*tokrag"),
        ([*base, "--policies", "rag,tokrag[no_such_option=1]"], r"Bad options in 'tokrag\[no_such_option=1\]'"),
        ([*base, "--policies", "tokrag[pr_norm=bad]"], r"Bad options in 'tokrag\[pr_norm=bad\]'.*pr_norm"),
        (["token", *base[1:], "--scorers", "tokrag[no_such_option=1]"], "Bad options"),
        (["token", *base[1:], "--scorers", "tokrag,rag"], "Unknown policy 'rag'"),
    ]
    for argv, match in cases:  # issue 29.16: the usual one-line error and exit status 2
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("tokrag: error: ") and len(err.splitlines()) == 1
        assert re.search(match, err), err
    with pytest.raises(SystemExit):
        main([*base, "--policies", "tokrag[pr_norm=sum"])
    assert "unclosed '['" in capsys.readouterr().err


def test_specs_in_the_runner_share_the_prefill_and_pass_options(tmp_path):
    items = [_item(i) for i in range(3)]
    dec = FakeDecode()
    specs = ["cad", "tokrag[min_fusion_layer=0,lens_norm=false]", "tokrag", "no_rag"]
    s = run_noise_sweep(LM, items, records_path=tmp_path / "r.jsonl", policies=specs, ratios=[0.0, 1.0],
                        batch_size=3, progress=False, decode=dec, policy_options={"cad": {"alpha": 0.3}})
    label = "tokrag[lens_norm=False,min_fusion_layer=0]"
    assert s["policies"] == ["cad", label, "tokrag", "no_rag"]
    assert set(s["accuracy"]) == set(s["policies"]) and s["accuracy"][label] == {"0": 100.0, "1": 0.0}
    assert {r["policy"] for r in RecordStore(tmp_path / "r.jsonl").values()} == set(s["policies"])
    with_passages = [(c[0], o, pf) for c, o, pf in zip(dec.calls, dec.options, dec.prefill, strict=True) if c[0] != "no_rag"]
    # Per (batch, condition): both tokrag specs (probing) first, then rag, all in one shared prefill.
    for cond in range(2):
        group = with_passages[3 * cond : 3 * cond + 3]
        assert [(p, o) for p, o, _ in group] == [
            ("tokrag", {"min_fusion_layer": 0, "lens_norm": False}), ("tokrag", {}), ("cad", {"alpha": 0.3})]
        assert len({pf for _, _, pf in group}) == 1 and group[0][2] is not None
    # Resume keys on the normalised label: the same specs written differently decode nothing.
    dec2 = FakeDecode()
    run_noise_sweep(LM, items, records_path=tmp_path / "r.jsonl", ratios=[0.0, 1.0], progress=False, decode=dec2,
                    policies=["cad", "tokrag[lens_norm=false, min_fusion_layer=0]", "tokrag", "no_rag"])
    assert dec2.calls == []


# --------------------------------------------------------------------------- intervals
def _rows(n: int, p: float, seed: int, conds: int = 3) -> list[list[float]]:
    rng = random.Random(seed)
    return [[100.0 * (rng.random() < p) for _ in range(conds)] for _ in range(n)]


def test_bootstrap_ci_contains_the_mean_and_narrows_with_more_items():
    from tokrag_eval.metrics import bootstrap_ci, mean_over_conditions

    small, large = _rows(20, 0.4, 1), _rows(400, 0.4, 1)
    for m in (small, large):
        lo, hi = bootstrap_ci(m)
        assert lo <= mean_over_conditions(m) <= hi
    assert bootstrap_ci(small) == bootstrap_ci(small)  # fixed seed
    assert (lambda c: c[1] - c[0])(bootstrap_ci(large)) < 0.5 * (lambda c: c[1] - c[0])(bootstrap_ci(small))
    assert bootstrap_ci([[100.0, 0.0]] * 5) == (50.0, 50.0)
    # NaN cells are skipped, like a condition without a record.
    assert mean_over_conditions([[100.0, math.nan], [0.0, 100.0]]) == pytest.approx(75.0)


def test_paired_difference():
    from tokrag_eval.metrics import paired_bootstrap_diff

    a = _rows(60, 0.5, 2)
    same = paired_bootstrap_diff(a, a)
    assert same["diff"] == 0.0 and same["ci"] == [0.0, 0.0]
    better = [[min(100.0, v + 100.0 * (i % 4 == 0)) for v in row] for i, row in enumerate(a)]
    d = paired_bootstrap_diff(better, a)
    assert d["diff"] > 0 and 0 < d["ci"][0] <= d["diff"] <= d["ci"][1]
    # Pairing: a policy equal to the other on every item but one has a narrow interval.
    with pytest.raises(ValueError, match="same items"):
        paired_bootstrap_diff(a, a[:-1])


def test_summary_has_intervals_and_paired_table(tmp_path):
    from tokrag_eval.report import (
        accuracy_table,
        paired_table,
        write_accuracy_report,
    )

    items = [_item(i, n_pos=1 + i % 2) for i in range(12)]

    class Half(FakeDecode):  # "cad" loses the odd items' right answers
        def __call__(self, lm, queries, passages, *, policy, **kw):
            out = super().__call__(lm, queries, passages, policy=policy, **kw)
            if policy == "cad":
                for q, r in zip(queries, out, strict=True):
                    r.text = r.text if int(q.split()[1][:-1]) % 2 == 0 else "Lyon"
            return out

    s = run_misleading(LM, items, records_path=tmp_path / "m.jsonl", policies=["rag", "cad", "no_rag"],
                       cf_ratios=[0.0, 1.0], progress=False, decode=Half())
    assert s["accuracy_mean"]["rag"] == 50.0 and s["accuracy_ci"]["rag"]["cf=0"] == [100.0, 100.0]
    lo, hi = s["accuracy_mean_ci"]["cad"]
    assert lo < s["accuracy_mean"]["cad"] == 25.0 < hi
    assert s["cf_repeat_mean_ci"]["rag"] == [50.0, 50.0]
    d = s["paired"]["cad"]["accuracy"]
    assert d["diff"] == -25.0 and d["ci"][1] < 0
    assert s["paired"]["no_rag"]["accuracy"]["diff"] == -50.0 and "rag" not in s["paired"]
    table = accuracy_table(s)
    assert "| cad | 50.0 [" in table and "| 25.0 [" in table
    assert "| cad | -25.0 [" in paired_table(s) and "below rag" in paired_table(s)
    files = write_accuracy_report(s, tmp_path / "res", "m", "misleading")
    md = (tmp_path / "res" / "m.md").read_text()
    assert "Paired differences to rag" in md and all(f.exists() for f in files)
    assert json.loads((tmp_path / "res" / "m.json").read_text())["paired"]["cad"]["accuracy"]["diff"] == -25.0


def test_yes_no_summary_reports_verdict_rate_accuracy_among_verdicts_and_length_ratio(tmp_path):
    from tokrag_eval.report import write_accuracy_report

    items = [
        EvalItem(id=f"yn{i}", question=f"question {i}?", answers=["yes"], positives=[f"pos {i}"],
                 counterfactuals=[f"cf {i}"], counterfactual_answers=["no"])
        for i in range(8)
    ]

    class Verdicts(FakeDecode):  # rag: "Yes, ..." on every item; cad: no verdict on odd items
        def __call__(self, lm, queries, passages, *, policy, **kw):
            out = super().__call__(lm, queries, passages, policy=policy, **kw)
            for q, r in zip(queries, out, strict=True):
                odd = int(q.split()[1][:-1]) % 2
                r.text = "It is hard to say." if policy == "cad" and odd else "Yes, it is."
                n = 6 if policy == "cad" else 3  # cad's answers are twice as long
                r.trace = SimpleNamespace(counts=lambda n=n: {"rag": n}, to_dict=lambda: {"steps": []}, timings={})
            return out

    s = run_misleading(LM, items, records_path=tmp_path / "m.jsonl", policies=["rag", "cad"],
                       cf_ratios=[0.0, 1.0], progress=False, decode=Verdicts())
    assert s["n_yes_no_items"] == 8
    assert s["verdict_rate_mean"] == {"rag": 100.0, "cad": 50.0}
    assert s["accuracy_mean"]["cad"] == 50.0 and s["verdict_accuracy_mean"]["cad"] == 100.0
    assert s["mean_tokens"] == {"rag": 3.0, "cad": 6.0} and s["length_ratio"] == {"cad": 2.0}
    write_accuracy_report(s, tmp_path / "res", "m", "misleading")
    md = (tmp_path / "res" / "m.md").read_text()
    assert "answers stating a verdict" in md and "Accuracy among the answers that state a verdict" in md
    assert "against rag on the same answers: cad 2.00x" in md
    # Items that are not yes/no get no verdict figures.
    s2 = run_misleading(LM, [_item(i) for i in range(3)], records_path=tmp_path / "m2.jsonl",
                        policies=["rag"], cf_ratios=[1.0], progress=False, decode=FakeDecode())
    assert "verdict_rate" not in s2 and s2["mean_tokens"] == {"rag": 1.0}


# --------------------------------------------------------------------------- token level
def _popqa_item(i: int, prop: str, subj: str, answers: list[str], pop: float, pop_bin: int) -> EvalItem:
    return EvalItem(id=f"popqa_{i}", question=f"q {subj}?", answers=answers, source="popqa", popularity=pop,
                    meta={"prop": prop, "subj": subj, "pop_bin": pop_bin})


def test_synthetic_popqa_passages():
    from tokrag_eval.data import is_popqa, select_popular, synthesize_popqa

    items = [
        _popqa_item(0, "capital", "Belarus", ["Minsk", "Мінск"], 5e4, 4),
        _popqa_item(1, "capital", "Canada", ["Ottawa"], 8e5, 4),
        _popqa_item(2, "capital", "Texas", ["Austin"], 10.0, 0),
        _popqa_item(3, "capital", "Georgia", ["Atlanta, Georgia"], 100.0, 1),
        _popqa_item(4, "director", "Spy", ["Paul Feig"], 9e4, 4),
        _popqa_item(5, "no such relation", "X", ["Y"], 1.0, 4),
    ]
    assert is_popqa(items) and not is_popqa([_item()])
    syn = {it.id: it for it in synthesize_popqa(items)}
    be = syn["popqa_0"]
    assert be.positives == ["The capital of Belarus is Minsk."]
    assert be.counterfactual_answers[0] in {"Ottawa", "Austin", "Atlanta, Georgia"}
    assert be.counterfactuals == [f"The capital of Belarus is {be.counterfactual_answers[0]}."]
    assert not cover_em(be.counterfactuals[0], be.answers) and cover_em(be.counterfactuals[0], be.counterfactual_answers)
    assert syn["popqa_4"].positives == ["Spy was directed by Paul Feig."]
    assert syn["popqa_4"].counterfactuals == []  # no other director to borrow
    assert syn["popqa_5"].positives == ['The answer to "q X?" is Y.']
    assert synthesize_popqa(items)[0].counterfactuals == be.counterfactuals  # seeded
    assert [it.id for it in select_popular(list(syn.values()))] == ["popqa_1", "popqa_4", "popqa_0", "popqa_5"]
    assert [it.id for it in select_popular(items, min_pop_bin=1)] == ["popqa_1", "popqa_4", "popqa_0", "popqa_3", "popqa_5"]
    m = mix_counterfactuals(be, 0.5, k=2)
    assert m.counts == {"pos": 1, "neg": 0, "cf": 1}


def test_synthetic_popqa_on_the_dev_file(eval_data):
    from tokrag_eval.data import select_popular, synthesize_popqa

    every = load_items(eval_data("popqa_dev.jsonl"))
    top = select_popular(synthesize_popqa(every), 4)
    assert len(top) == 120 and top[0].popularity >= top[-1].popularity
    with_cf = [it for it in top if it.counterfactuals]
    assert len(with_cf) >= 110
    for it in with_cf:
        assert cover_em(it.positives[0], it.answers) and not cover_em(it.counterfactuals[0], it.answers)


def test_target_kind_and_evidence_for_yes_no():
    from tokrag_eval.token_level import evidence_sentence, target_kind

    yn = _item()
    yn.answers, yn.positives = ["yes"], ["His eyes are blue. Yes, it is."]
    assert evidence_sentence(yn) == "His eyes are blue."
    assert target_kind(yn) == "answer" and target_kind(_item()) == "evidence"
    assert target_kind(_item(), "answer") == "answer"
    pop = _item()
    pop.meta = {"synthetic_passages": True}
    assert target_kind(pop) == "answer"
    with pytest.raises(ValueError, match="target must be one of"):
        target_kind(yn, "sentence")


def _token_records(source: str, n_items: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    recs = []
    for i in range(n_items):
        samples = []
        for pos in range(3):
            label = int(rng.random() < 0.6)
            x = rng.gauss(0.5 if label else -0.5, 1.0)
            samples.append({"pos": pos, "label": label, "scores": {"tokrag": x, "logprob": -x, "entropy": 0.0}})
        recs.append({"task": "token", "item": f"{source}_{i}", "condition": "cf=1", "policy": "token", "samples": samples})
    return recs


def test_token_summary_counts_labels_per_source_and_pooled(tmp_path):
    from tokrag_integrations.cli import main as tokrag

    def main(argv):  # `tokrag eval ARGV`
        return tokrag(["eval", *argv])

    from tokrag_eval import pool_token_records, summarize_token_level

    paths = []
    for src, seed in (("rgb", 1), ("popqa", 2)):
        paths.append(tmp_path / f"token_{src}.jsonl")
        store = RecordStore(paths[-1])
        for r in _token_records(src, 30, seed):
            store.add({**r, "source": src} if src == "popqa" else r)  # rgb: an older run without source
    recs = pool_token_records(paths)
    assert {r["source"] for r in recs} == {"token_rgb", "popqa"} and len(recs) == 60
    s = summarize_token_level(recs)
    assert set(s["sources"]) == {"token_rgb", "popqa"}
    assert s["n_label1"] + s["n_label0"] == s["n_samples"] == 180
    assert s["n_label1"] == sum(src["n_label1"] for src in s["sources"].values())
    t = s["scorers"]["tokrag"]
    assert t["n_label1"] == s["n_label1"] and t["n_label0"] == s["n_label0"]
    assert t["auc_ci"][0] <= t["auc"] <= t["auc_ci"][1] and t["auc"] > 60
    assert s["scorers"]["logprob"]["auc"] == pytest.approx(100 - t["auc"])
    assert s["scorers"]["entropy"]["auc"] == 50.0
    # The CLI pools the same files into one table.
    argv = ["token-pool", "--records", *map(str, paths), "--out", str(tmp_path / "res"), "--name", "pool"]
    assert main(argv) == 0
    md = (tmp_path / "res" / "pool.md").read_text()
    assert "| source | label 1 | label 0 |" in md and "| popqa |" in md and "| pooled |" in md
    assert f"| tokrag | {t['auc']:.1f} [{t['auc_ci'][0]:.1f}, {t['auc_ci'][1]:.1f}]" in md
    assert main(["token-pool", "--records", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "res")]) == 2


def test_auc_interval_groups_samples_by_item():
    from tokrag_eval.metrics import bootstrap_auc_ci

    rng = random.Random(3)
    ys = [rng.randint(0, 1) for _ in range(300)]
    xs = [rng.gauss(y, 1.0) for y in ys]
    a = auc(xs, ys)
    lo, hi = bootstrap_auc_ci(xs, ys)
    assert lo <= a <= hi
    # The same samples repeated 5 times per item: as independent samples the interval would
    # shrink; grouped by item it stays as wide as one copy's.
    lo5, hi5 = bootstrap_auc_ci(xs * 5, ys * 5, list(range(300)) * 5)
    assert (hi5 - lo5) == pytest.approx(hi - lo, rel=0.25)
    lo_ind, hi_ind = bootstrap_auc_ci(xs * 5, ys * 5)
    assert (hi_ind - lo_ind) < 0.7 * (hi - lo)
    assert all(math.isnan(v) for v in bootstrap_auc_ci([1.0, 2.0], [1, 1]))


def test_scorer_configs():
    from tokrag_eval.token_level import DEFAULT_SCORER_CONFIGS, scorer_configs

    assert scorer_configs(None) == DEFAULT_SCORER_CONFIGS
    # The built-in labels are the specs that reproduce them.
    assert scorer_configs(list(DEFAULT_SCORER_CONFIGS)) == DEFAULT_SCORER_CONFIGS
    cfg = scorer_configs("tokrag,tokrag[min_fusion_layer=0,lens_norm=false]")
    assert cfg == {"tokrag": {}, "tokrag[lens_norm=False,min_fusion_layer=0]": {"min_fusion_layer": 0, "lens_norm": False}}
    with pytest.raises(ValueError, match="Bad options"):
        scorer_configs("tokrag[pr_norm=nope]")
