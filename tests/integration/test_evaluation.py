"""Evaluation harness: passage mixing, metrics, resume, and a tiny real-model run.

This file holds the cases that need the real model, a database, a server or a subprocess; the others are in
``tests/unit/test_evaluation.py``."""

from __future__ import annotations

import json

from tokrag_eval import (
    EvalItem,
    load_items,
)


def test_token_level_on_the_real_model(lm, tmp_path, eval_data):
    from tokrag_eval import run_token_level

    items = load_items(eval_data("rgb_en_fact_dev.jsonl"), limit=1)
    s = run_token_level(lm, items, records_path=tmp_path / "t.jsonl", ratios=[1.0], cf_ratios=[1.0],
                        tokrag_configs={"tokrag (default)": {}}, progress=False)
    rec = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert {r["condition"] for r in rec} == {"1", "cf=1"}
    assert s["n_records"] == 2
    for smp in (x for r in rec for x in r["samples"]):
        assert smp["label"] in (0, 1) and set(smp["scores"]) == {"tokrag (default)", "logprob", "entropy"}


# --------------------------------------------------------------------------- token level
def _popqa_item(i: int, prop: str, subj: str, answers: list[str], pop: float, pop_bin: int) -> EvalItem:
    return EvalItem(id=f"popqa_{i}", question=f"q {subj}?", answers=answers, source="popqa", popularity=pop,
                    meta={"prop": prop, "subj": subj, "pop_bin": pop_bin})


def test_token_level_popqa_on_the_real_model(lm, tmp_path):
    from tokrag_eval import run_token_level, scorer_configs, synthesize_popqa

    items = synthesize_popqa([
        _popqa_item(0, "capital", "France", ["Paris"], 1e6, 4),
        _popqa_item(1, "capital", "Italy", ["Rome"], 1e6, 4),
    ])
    s = run_token_level(lm, items[:1], records_path=tmp_path / "t.jsonl", ratios=[0.0], cf_ratios=[1.0],
                        target="auto", tokrag_configs=scorer_configs("tokrag[min_fusion_layer=0]"), progress=False)
    rec = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert {(r["condition"], r["source"], r["target"]) for r in rec} == {("0", "popqa", "answer"), ("cf=1", "popqa", "answer")}
    assert rec[1]["passages"] == {"pos": 0, "neg": 0, "cf": 1}
    assert s["n_label1"] + s["n_label0"] == s["n_samples"] and set(s["sources"]) == {"popqa"}
    for smp in (x for r in rec for x in r["samples"]):
        assert set(smp["scores"]) == {"tokrag[min_fusion_layer=0]", "logprob", "entropy"}


def test_tiny_end_to_end_cli_and_resume(tmp_path, capsys, eval_data, cli_shares_model):
    from tokrag_integrations.cli import main as tokrag

    def main(argv):  # `tokrag eval ARGV`
        return tokrag(["eval", *argv])


    argv = ["noise", "--data", str(eval_data("rgb_en_fact_dev.jsonl")), "--limit", "2", "--policies", "no_rag,rag,tokrag", "--ratios", "0,1",
            "--k", "2", "--max-new-tokens", "8", "--out", str(tmp_path / "res"), "--records", str(tmp_path / "runs"),
            "--no-progress"]
    assert main(argv) == 0
    res = json.loads((tmp_path / "res" / "noise_rgb_en_fact_dev.json").read_text())
    assert res["n"]["tokrag"] == {"0": 2, "1": 2} and res["n"]["no_rag"] == {"0": 2, "1": 2}
    assert (tmp_path / "res" / "noise_rgb_en_fact_dev.png").stat().st_size > 1000
    assert "| tokrag |" in (tmp_path / "res" / "noise_rgb_en_fact_dev.md").read_text()
    recs = [json.loads(x) for x in (tmp_path / "runs" / "noise_rgb_en_fact_dev.jsonl").read_text().splitlines()]
    assert len(recs) == 2 + 2 * 2 * 2 and all("trace" in r for r in recs)
    assert main(argv) == 0  # resumes: nothing left to decode
    assert len((tmp_path / "runs" / "noise_rgb_en_fact_dev.jsonl").read_text().splitlines()) == len(recs)
    assert main([*argv[:-1], "--max-new-tokens", "9", "--no-progress"]) == 2
