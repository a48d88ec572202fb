"""Runners: noise sweep (Table 1) and misleading passages; token level is :mod:`.token_level`.

Each runner appends one JSON line per (item id, condition, policy) to ``records_path`` as
soon as it is known and skips the keys already there, so an interrupted run continues where
it stopped. Policies are specs, ``name`` or ``name[key=value,...]`` (:mod:`.specs`): the
normalised spec is the record's ``policy`` and the table label, its options go to
``generate_batch(..., policy_options=...)``.

Shared between policies: the seeded passage mix of an (item, condition); the prefill of an
item batch's contexts (:func:`..contexts.prefill.shared_prefill`), charged to every policy that
reuses it in ``time_s``; and the ``no_rag`` answer, decoded once per item for every condition.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tokrag_integrations.config import require_bool

from .accuracy import summarize_accuracy
from .data import (
    DEFAULT_RATIOS,
    DEFAULT_SEED,
    Conditions,
    EvalItem,
    Mix,
    cf_conditions,
    noise_conditions,
)
from .metrics import cover_em
from .records import NO_PASSAGES, RecordStore, progress_bar
from .specs import parse_specs

DEFAULT_POLICIES = ("no_rag", "rag", "tokrag", "cad", "adacad", "logprob", "entropy", "rag_token")
DEFAULT_CF_RATIOS = (0.0, 0.5, 1.0)


def run_noise_sweep(
    lm: Any,
    items: Sequence[EvalItem],
    *,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    k: int = 5,
    seed: int = DEFAULT_SEED,
    **options: Any,
) -> dict[str, Any]:
    """Table 1 protocol: accuracy (cover EM) per policy and noise ratio. Returns the summary
    (:func:`.accuracy.summarize_accuracy`); ``options`` are :func:`run_generation`'s."""
    return run_generation("noise", lm, items, noise_conditions(ratios, k, seed), **options)


def run_misleading(
    lm: Any,
    items: Sequence[EvalItem],
    *,
    cf_ratios: Sequence[float] = DEFAULT_CF_RATIOS,
    k: int = 2,
    seed: int = DEFAULT_SEED,
    **options: Any,
) -> dict[str, Any]:
    """Positives mixed with counterfactual passages (ratio 1.0 = counterfactuals only) on the
    items that have counterfactuals: accuracy and the rate of answers repeating the
    counterfactual answer; ``options`` are :func:`run_generation`'s."""
    items = [it for it in items if it.counterfactuals]
    if not items:
        raise ValueError(
            "no item has counterfactual passages: use rgb_en_fact or conflictqa_strategyqa data"
        )
    return run_generation("misleading", lm, items, cf_conditions(cf_ratios, k, seed), **options)


def run_generation(
    task: str,
    lm: Any,
    items: Sequence[EvalItem],
    conditions: Conditions,
    *,
    records_path: str | Path,
    policies: Sequence[str] = DEFAULT_POLICIES,
    max_new_tokens: int = 24,
    stop: Sequence[str] = ("\n",),
    batch_size: int = 1,
    policy_options: dict[str, dict[str, Any]] | None = None,
    keep_traces: bool = True,
    progress: bool = True,
    decode: Callable[..., list[Any]] | None = None,
) -> dict[str, Any]:
    """Every policy on every (item, condition) not yet in ``records_path``; the summary.

    ``policy_options`` gives options per policy name (``{"cad": {"alpha": 0.3}}``) or spec
    label, a spec's own options override them; ``decode`` replaces
    ``engine.scheduler.generate_batch``; ``keep_traces`` stores each answer's trace.
    """
    from tokrag_integrations.contexts.prefill import shared_prefill
    from tokrag_integrations.engine.scheduler import generate_batch
    from tokrag_integrations.policies import get_policy, uses_passages

    require_bool(keep_traces, "keep_traces")
    require_bool(progress, "progress")
    store = RecordStore(records_path)
    decode = decode or generate_batch
    policy_options = policy_options or {}
    options: dict[str, tuple[str, dict[str, Any]]] = {}
    for spec in parse_specs(list(policies)):
        label = str(spec)
        opts = {**policy_options.get(spec.name, {}), **policy_options.get(label, {})}
        options[label] = (spec.name, {**opts, **spec.options})
    pols = {label: get_policy(name, **opts) for label, (name, opts) in options.items()}
    # Probing policies first (the most probed roles first), so the prefill they leave behind
    # serves every other policy: a probed prefill serves a non-probing decode, not the reverse.
    empty = SimpleNamespace(pure_ids=[], rag_ids=[], retrieved_positions=[], kept_passages=[])
    order = sorted(pols, key=lambda p: -sum(s.probe for s in pols[p].contexts(empty).values()))
    no_passages = [p for p in order if not uses_passages(pols[p])]
    with_passages = [p for p in order if uses_passages(pols[p])]
    total = len(items) * (len(no_passages) + len(with_passages) * len(conditions))
    done = sum(1 for it in items for p in no_passages if (it.id, NO_PASSAGES, p) in store)
    done += sum(
        1 for it in items for p in with_passages for c, _ in conditions if (it.id, c, p) in store
    )
    bar = progress_bar(total, done, f"{task} ({getattr(lm, 'name', 'model')})", progress)

    def run(policy: str, cond: str, batch: list[EvalItem], mixes: list[Mix]) -> None:
        t0 = time.perf_counter()
        results = decode(
            lm,
            [it.question for it in batch],
            [m.passages for m in mixes],
            policy=options[policy][0],
            max_new_tokens=max_new_tokens,
            stop=list(stop),
            policy_options=options[policy][1],
        )
        elapsed = time.perf_counter() - t0
        for it, mix, res in zip(batch, mixes, results, strict=True):
            rec: dict[str, Any] = {
                "task": task,
                "item": it.id,
                "condition": cond,
                "policy": policy,
                "text": res.text,
                "correct": cover_em(res.text, it.answers),
                "cf_repeat": cover_em(res.text, it.counterfactual_answers)
                if it.counterfactual_answers
                else None,
                "passages": mix.counts,
                "short": mix.short,
                "counts": res.trace.counts(),
                "stop_reason": res.stop_reason,
                # The prefill a policy took from another's decode is charged to it too, so
                # that the order of the policies does not make one of them look cheaper.
                "time_s": (elapsed + res.trace.timings.get("prefill_reused_s", 0.0)) / len(batch),
                "batch": len(batch),
            }
            if keep_traces:
                rec["trace"] = res.trace.to_dict()
            store.add(rec)
            bar.update(1)

    try:
        for policy in no_passages:  # ignores passages: once per item, valid for every condition
            todo = [it for it in items if (it.id, NO_PASSAGES, policy) not in store]
            for s in range(0, len(todo), batch_size):
                batch = todo[s : s + batch_size]
                run(policy, NO_PASSAGES, batch, [Mix([], [], {}, False) for _ in batch])
        for cond, mixer in conditions:
            todo = [it for it in items if any((it.id, cond, p) not in store for p in with_passages)]
            for s in range(0, len(todo), batch_size):
                batch = todo[s : s + batch_size]
                mixes = [mixer(it) for it in batch]
                # One prefill of each (item batch, condition) serves every policy.
                with shared_prefill():
                    for policy in with_passages:
                        sub = [
                            (it, m)
                            for it, m in zip(batch, mixes, strict=True)
                            if (it.id, cond, policy) not in store
                        ]
                        if sub:
                            run(policy, cond, [it for it, _ in sub], [m for _, m in sub])
    finally:
        bar.close()
    return summarize_accuracy(store.values(), items, list(options), [c for c, _ in conditions])
