"""Every device rule (``accel/rules``, issue 56 item 3) against its policy's own ``choose``
and the engine's ``step_event``, on the packaged model over real decodes.

Each prompt set is decoded with ``speed="reference"`` (the policy choosing, as today); at
every step the views the policy read are turned into a :class:`StepTensors`
(:func:`step_tensors_from_views`), the device rule runs on them, and its decoded record
must give the same token, source, signals, candidates, statistics and citation as the
policy and the engine wrote (ints exact, floats within 1e-5 relative), for the queries
alone and four at a time. The model is a copy with the CPU speed paths off, as the
reference of ``test_stock_exactness``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from tokrag_integrations import load_model
from tokrag_integrations.accel.step_tensors import (
    DecodedStep,
    device_rule_for,
    step_tensors_from_views,
)
from tokrag_integrations.engine.decoder import Decoder
from tokrag_integrations.policies import get_policy
from tokrag_integrations.prompts import PromptBuilder

from .test_stock_exactness import exactness_prompts

REL = 1e-5


@pytest.fixture(scope="module")
def stock():
    return load_model("default", device="cpu", cpu_kernels="off")


@pytest.fixture(scope="module")
def prompts():
    return exactness_prompts()


def close(got: Any, want: Any, where: str) -> None:
    """Equal, floats within :data:`REL` (relative, 1e-7 absolute near 0)."""
    if isinstance(want, bool) or isinstance(got, bool):
        assert got == want and type(got) is type(want), (where, got, want)
    elif isinstance(want, float):
        assert isinstance(got, float), (where, got, want)
        assert math.isclose(got, want, rel_tol=REL, abs_tol=1e-7), (where, got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (where, got, want)
        for k in want:
            close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            close(g, w, f"{where}[{i}]")
    else:
        assert got == want and type(got) is type(want), (where, got, want)


def compare(got: DecodedStep, ev, choice, where: str) -> None:
    step = ev.step
    assert got.token_id == step.token_id == choice.token_id, where
    assert got.source == choice.source, (where, got.source, choice.source)
    close(got.signals, choice.signals, f"{where} signals")
    assert set(got.candidates) == set(step.candidates), where
    for role, c in step.candidates.items():
        g = got.candidates[role]
        assert (g.token_id, g.text) == (c.token_id, c.text), (where, role)
        close(g.prob, c.prob, f"{where} {role} prob")
    assert set(got.stats) == set(step.stats), where
    for role, s in step.stats.items():
        close(got.stats[role], s, f"{where} {role} stats")
    close(got.citation, list(step.citation), f"{where} citation")
    close(got.logprob, step.logprob, f"{where} logprob")


def check_rule(
    lm,
    prompts,
    policy_name: str,
    options: dict[str, Any] | None = None,
    *,
    batch: int = 1,
    new_tokens: int = 6,
    citations: bool | None = True,
) -> dict[str, int]:
    """Decode ``prompts`` (``batch`` at a time) with the policy on the reference path and
    check its device rule at every step; returns counts (steps, and per source)."""
    policy = get_policy(policy_name, **(options or {}))
    rule = device_rule_for(policy, lm, citations=citations)
    assert rule is not None, f"{policy_name} {options} has no device rule"
    counts: dict[str, int] = {"steps": 0}
    for start in range(0, len(prompts), batch):
        group = prompts[start : start + batch]
        builder = PromptBuilder(lm.tokenizer, context_window=lm.context_window)
        plans = [builder.build(q, ps, max_new_tokens=new_tokens) for q, ps in group]
        dec = Decoder(lm, policy, max_new_tokens=new_tokens, speed="reference", citations=citations)
        seen: list = []
        inner = policy.choose

        def spy(views, lens, inner=inner, seen=seen):
            out = inner(views, lens)
            seen.append((views, out))
            return out

        policy.choose = spy  # type: ignore[method-assign]
        try:
            dec.admit(plans)
            while dec.active:
                active = dec.active
                seen.clear()
                events = dec.choose()
                ((views, choices),) = seen
                with torch.inference_mode():
                    t = step_tensors_from_views(views, [dec._cite[q] for q in active])
                    ids, record, _ = rule(t)
                assert ids.dtype == torch.long and ids.shape == (len(active),)
                assert record.dtype == torch.float32
                assert record.shape == (len(active), rule.record_width)
                rows = record.tolist()
                for i, (q, ev, ch) in enumerate(zip(active, events, choices, strict=True)):
                    where = f"{policy_name} q{start + q} step {ev.step.index}"
                    assert int(ids[i]) == ch.token_id, where
                    got = rule.decode(rows[i], lm.tokenizer)
                    compare(got, ev, ch, where)
                    counts["steps"] += 1
                    counts["signals"] = counts.get("signals", 0) + ("l_star" in ch.signals)
                    counts[ch.source] = counts.get(ch.source, 0) + 1
                dec.advance()
        finally:
            del policy.choose
    return counts


#: The rules without layer signals, and where each decides (a source other than agree).
SIMPLE = ["no_rag", "rag", "floor", "cad", "adacad", "logprob", "entropy", "rag_token"]


@pytest.mark.parametrize("name", SIMPLE)
def test_each_rule_equals_its_policy(stock, prompts, name):
    counts = check_rule(stock, prompts[:4], name, new_tokens=4)
    assert counts["steps"] >= 12, counts


@pytest.mark.parametrize("name", SIMPLE)
def test_each_rule_batched_equals_its_policy(stock, prompts, name):
    counts = check_rule(stock, prompts[:4], name, batch=4, new_tokens=4)
    assert counts["steps"] >= 12, counts


def test_cad_with_its_options_equals_the_policy(stock, prompts):
    counts = check_rule(stock, prompts[:4], "cad", {"alpha": 2.0}, new_tokens=4, citations=None)
    assert counts.get("mix", 0) + counts.get("pure", 0) >= 1, counts


def test_rag_token_with_its_options_equals_the_policy(stock, prompts):
    counts = check_rule(stock, prompts[:4], "rag_token", {"temperature": 0.1}, new_tokens=4)
    assert counts["steps"] >= 12, counts


#: Tok-RAG option sets: the defaults, the paper's rule, its literal reading, and the others
#: the policy's tests exercise (fixed l*, the distribution scorer, Eq. 16's softmax...).
PAPER = {
    "function_word_gate": False,
    "verdict_gate": None,
    "rising_gate": False,
    "punctuation_gate": False,
    "threshold": 0.0,
    "plausibility_alpha": 0.1,
    "pr_skip": None,
}
TOKRAG_OPTIONS = [
    pytest.param({}, id="defaults"),
    pytest.param(PAPER, id="paper"),
    pytest.param(
        {**PAPER, "min_fusion_layer": 0, "plausibility_alpha": None, "lens_norm": False},
        id="literal",
    ),
    pytest.param(
        {
            "fixed_layer": 20,
            "scorer": "distribution",
            "pr_norm": "softmax",
            "top_k": None,
            "pr_skip": "authors",
            "verdict_gate": "rag",
            "threshold": 0.0,
        },
        id="fixed-distribution-softmax",
    ),
    pytest.param(
        {"min_fusion_layer": 0.3125, "rising_gate": False, "fixed_layer": 30, "top_k": 5},
        id="fixed-last-layer",
    ),
    pytest.param(
        {**PAPER, "min_fusion_layer": 0.3125, "scorer": "distribution", "lens_norm": False},
        id="shallow-distribution-nonorm",
    ),
]


@pytest.mark.parametrize("options", TOKRAG_OPTIONS)
def test_the_tokrag_rule_equals_the_policy(stock, prompts, options):
    counts = check_rule(stock, prompts[:5], "tokrag", options, new_tokens=5)
    assert counts["signals"] >= 1, counts  # Eq. 19 decided some steps
    assert counts["steps"] >= 20


def test_the_tokrag_rule_batched_equals_the_policy(stock, prompts):
    counts = check_rule(stock, prompts[:8], "tokrag", PAPER, batch=4, new_tokens=5)
    assert counts["signals"] >= 5 and counts["rag"] and counts["pure"], counts


@pytest.mark.slow
@pytest.mark.parametrize("options", [TOKRAG_OPTIONS[0], TOKRAG_OPTIONS[1]])
def test_the_tokrag_rule_over_every_exactness_prompt(stock, prompts, options):
    counts = check_rule(stock, prompts, "tokrag", options, new_tokens=8)
    assert counts["signals"] >= 10 and counts["rag"] and counts["pure"], counts


def test_the_tokrag_rule_without_citations(stock, prompts):
    counts = check_rule(stock, prompts[:4], "tokrag", citations=False, new_tokens=4)
    assert counts["steps"] >= 12


def one_step(lm, prompts, policy, citations=True):
    """The StepTensors of the first step of ``prompts`` decoded together under ``policy``."""
    builder = PromptBuilder(lm.tokenizer, context_window=lm.context_window)
    plans = [builder.build(q, ps, max_new_tokens=4) for q, ps in prompts]
    dec = Decoder(lm, policy, max_new_tokens=4, speed="reference", citations=citations)
    dec.admit(plans)
    from tokrag_integrations.engine.decoder import views_for

    with torch.inference_mode():
        views = [views_for(dec.rows, q) for q in dec.active]
        return step_tensors_from_views(views, [dec._cite[q] for q in dec.active])


@pytest.fixture(scope="module")
def two_context_step(stock, prompts):
    """One step of four queries with both contexts probed (what tokrag reads)."""
    return one_step(stock, prompts[:4], get_policy("tokrag"))


@pytest.fixture(scope="module")
def passage_step(stock, prompts):
    """One step of four queries with one context per passage (RAG-Token's)."""
    return one_step(stock, prompts[:4], get_policy("rag_token"))


def first_queries(t, n: int):
    """``t`` cut to its first ``n`` queries (the rows stay)."""
    return dataclasses.replace(
        t,
        rows={role: r[:n] for role, r in t.rows.items()},
        rt_pos=t.rt_pos[:n],
        rt_ids=t.rt_ids[:n],
        rt_valid=t.rt_valid[:n],
        rt_passage=t.rt_passage[:n],
        weights=None if t.weights is None else t.weights[:n],
        cite_passages=None if t.cite_passages is None else t.cite_passages[:n],
    )


HOST_READ_CASES = [pytest.param(name, {}, id=name) for name in SIMPLE] + [
    pytest.param("tokrag", p.values[0], id=f"tokrag-{p.id}") for p in TOKRAG_OPTIONS
]


@pytest.mark.parametrize(("name", "options"), HOST_READ_CASES)
def test_each_rule_reads_nothing_on_the_host(stock, two_context_step, passage_step, name, options):
    from _host_reads import HostReads

    rule = device_rule_for(get_policy(name, **options), stock, citations=True)
    t = passage_step if name == "rag_token" else two_context_step
    with torch.inference_mode(), HostReads() as reads:
        ids, record, _ = rule(t)
    assert reads.calls == []
    assert ids.shape == (4,) and record.shape == (4, rule.record_width)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("name", ["rag", "tokrag"])
def test_the_rag_and_tokrag_rules_trace_without_graph_breaks(stock, two_context_step, name, batch):
    rule = device_rule_for(get_policy(name), stock, citations=True)
    t = first_queries(two_context_step, batch)
    torch._dynamo.reset()
    with torch.inference_mode():
        explained = torch._dynamo.explain(rule.__call__)(t)
        want_ids, want_record, _ = rule(t)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    compiled = torch.compile(rule.__call__, backend="eager", fullgraph=True)
    with torch.inference_mode():
        ids, record, _ = compiled(t)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(record, want_record, rtol=1e-6, atol=0, equal_nan=True)
