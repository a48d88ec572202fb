"""The pieces of ``benchmarks/gpu_check.py`` that need no model: the exactness comparison, the
host-read counter and the summary's tables (its CPU dry run, in its docstring, runs the rest)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import torch

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", _PATH)
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def _result(steps: list[tuple[int, str, int]]):
    """A GenerationResult-like answer: per step (token, source, the rag candidate's token)."""
    trace = SimpleNamespace(
        steps=[
            SimpleNamespace(token_id=t, source=s, candidates={"rag": SimpleNamespace(token_id=c)})
            for t, s, c in steps
        ]
    )
    return SimpleNamespace(token_ids=[t for t, _, _ in steps], trace=trace)


def test_compare_counts_identical_answers_and_the_equal_steps():
    ref = [_result([(1, "rag", 1), (2, "pure", 3)]), _result([(5, "rag", 5)])]
    same = [_result([(1, "rag", 1), (2, "pure", 3)]), _result([(5, "rag", 5)])]
    assert gpu_check.compare(same, ref) | {"different_prompts": None} == {
        "identical": 2, "of": 2, "different_prompts": None, "tokens_equal": 1.0,
        "sources_equal": 1.0, "candidates_equal": 1.0, "steps": 3,
    }
    # The second answer: same token from another source and candidate; the first: one step short.
    got = [_result([(1, "rag", 1)]), _result([(5, "pure", 4)])]
    out = gpu_check.compare(got, ref)
    assert (out["identical"], out["different_prompts"]) == (0, [0, 1])
    assert (out["tokens_equal"], out["sources_equal"], out["candidates_equal"]) == (2 / 3, 1 / 3, 1 / 3)


def test_host_reads_counts_every_read_of_a_value_on_the_host():
    t = torch.arange(6.0)
    with gpu_check.host_reads() as mode:
        t.sum().item()
        t.tolist()
        bool(t[0] > 1)
        int(t[1])
        t[t > 2]
        torch.nonzero(t)
        (t * 2).add_(1)  # arithmetic reads nothing
    assert mode.counts == {
        "item": 1, "tolist": 1, "__bool__": 1, "__int__": 1, "boolean-mask indexing": 1, "nonzero": 1,
    }


def test_the_summary_has_a_table_per_part_and_says_what_failed():
    res = {
        "device": "cuda", "gpu": "NVIDIA H200", "torch": "2.11", "transformers": "5.24",
        "cuda_preset": "available", "seconds": 400.0,
        "exactness": {"ok": False, "part_s": 90.0, "float32": {
            "dtype": "float32", "tokrag cuda batch": {"identical": 11, "of": 12, "tokens_equal": 0.99,
                                                       "sources_equal": 0.98, "candidates_equal": 0.97},
            "tokrag cuda solo": {"error": "Traceback ...\nRuntimeError: captured step failed\n"},
        }},
        "speed": {"ok": True, "part_s": 200.0, "table": {
            "rag@cuda": {"1": {"tokens_per_s": 250.0, "decode_tokens_per_s": 400.0},
                         "16": {"tokens_per_s": 1500.0, "decode_tokens_per_s": 2000.0},
                         "ms_per_token_batch1": 4.0, "decode_ms_per_token_batch1": 2.5},
        }},
        "syncs": {"ok": True, "tokrag@cuda": {"syncs_per_step": 1.0, "host_reads_per_step": 1.25, "steps": 32}},
        "busy": {"ok": True, "rag@cuda batch 1": {"busy_fraction": 0.61, "kernel_s": 0.061, "wall_s": 0.1,
                                                   "ms_per_step_profiled": 3.1}},
        "bench": {"ok": False, "skipped": "no time left in the 460 s budget"},
        "serve": {"ok": False, "error": "stopped at its time limit (60 s)", "part_s": 60.0},
    }
    md = gpu_check.summary(res)
    assert "- exactness: FAILED (90 s)" in md
    assert "| float32 | tokrag cuda batch | 11 / 12 | 0.990 | 0.980 | 0.970 |" in md
    assert "| float32 | tokrag cuda solo | error | | | |" in md
    assert "| rag@cuda | 4.0 | 2.5 | 250.0 | 1500.0 |" in md
    assert "| tokrag@cuda | 1.00 | 1.25 | 32 |" in md
    assert "| rag@cuda batch 1 | 0.610 |" in md
    assert "- bench: skipped: no time left in the 460 s budget" in md
    assert "  - error: stopped at its time limit (60 s)" in md


def test_the_summary_says_what_the_cuda_graphs_did():
    report = {"eager": 2, "recorded": 2, "replayed": 60, "kept": 2, "failed": []}
    res = {
        "device": "cuda", "torch": "2.11",
        "exactness": {"ok": True, "float32": {"dtype": "float32", "cuda_graphs": report}},
        "speed": {"ok": True, "cuda_graphs": {**report, "failed": ["RuntimeError: x"]}},
    }  # fmt: skip
    md = gpu_check.summary(res)
    assert "- exactness, graphs='capture': 2 steps eager, 2 recorded, 60 replayed, 2 kept; failed: none" in md
    assert "- speed, graphs='capture': 2 steps eager, 2 recorded, 60 replayed, 2 kept; failed: ['RuntimeError: x']" in md


def test_the_arms_of_the_paths_asked_for_in_their_order():
    from tokrag_eval import cost

    arms = gpu_check.register_arms("graph,cuda")
    assert arms == [f"{p}@{x}" for x in ("graph", "cuda") for p in gpu_check.POLICIES]
    assert cost.arm("tokrag@graph") == ("tokrag", {"speed": {"fuse": True, "static": "on", "graphs": "capture"}})
    assert cost.arm("rag@cuda") == ("rag", {"speed": "cuda"})
    assert gpu_check.register_arms()[:3] == [f"{p}@view" for p in gpu_check.POLICIES]
    assert gpu_check.graph_report(SimpleNamespace()) is None
