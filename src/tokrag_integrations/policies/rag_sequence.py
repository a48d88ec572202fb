"""RAG-Sequence (seed 001): one answer per passage, rescored under every passage.

1. For each kept passage z, greedy-decode an answer y_z from a context holding only z
   (standard RAG over single-passage prompts, all passages of all queries in one batch).
2. Score each distinct candidate y under every passage by teacher forcing:
   p(y|x) = Σ_z p(z|x)·Π_i p(y_i|x, z, y<i), with p(z|x) as in RAG-Token (softmax of the
   retrieval scores, uniform when any is missing).
3. Return the candidate with the highest p(y|x), replayed token by token so that streams and
   traces look like any other policy's. Step 0 of the trace carries every candidate, the
   passage that produced it and its log-scores (``signals["rag_sequence"]``).

A candidate that ended with EOS is scored with its EOS (so an empty answer pays for stopping
at once); one cut by ``max_new_tokens`` or a stop string is scored on its tokens only.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..engine.loop import StepEvent, decode_loop, teacher_force
from ..models import LoadedModel
from ..prompts import PromptPlan
from ..trace import TraceStep
from .base import Policy
from .baselines import PureLLM, StandardRAG
from .rag_token import RAGToken, passage_role


def single_passage_plan(plan: PromptPlan, j: int) -> PromptPlan:
    """A copy of ``plan`` whose RAG context holds only kept passage ``j``."""
    ids, rt = plan.single_passage_context(j)
    span = [(rt[0], rt[-1] + 1)] if rt else []
    return dataclasses.replace(
        plan,
        rag_ids=ids,
        passage_spans=span,
        passage_segments=[plan.passage_segments[j]],
        kept_passages=[plan.kept_passages[j]],
    )


class RAGSequence(Policy):
    """RAG-Sequence decoding (thorough: every candidate scored under every passage).

    Args:
        temperature: divides the retrieval scores before the softmax giving p(z|x).
    """

    name = "rag_sequence"
    roles = ()

    def __init__(self, temperature: float = 1.0):
        self._scorer = RAGToken(temperature=temperature)
        self.temperature = float(temperature)

    def options(self) -> dict[str, Any]:
        return {"temperature": self.temperature}

    def choose(self, views, lm):  # pragma: no cover - decode() replaces the step rule
        raise RuntimeError("rag_sequence is a sequence-level rule; it decodes through decode()")

    def decode(
        self,
        lm: LoadedModel,
        plans: Sequence[PromptPlan],
        *,
        max_new_tokens: int,
        stop: Sequence[str] = (),
        timings: dict[str, float] | None = None,
    ) -> Iterator[StepEvent]:
        timings = timings if timings is not None else {}
        eos = set(lm.eos_token_ids)
        tok = lm.tokenizer
        # 1. one greedy answer per (query, passage); queries without passages use the pure context.
        sub_plans: list[PromptPlan] = []
        owner: list[tuple[int, int]] = []
        for q, p in enumerate(plans):
            for j in range(len(p.passage_spans)):
                sub_plans.append(single_passage_plan(p, j))
                owner.append((q, j))
        gen: dict[int, list[int]] = {i: [] for i in range(len(sub_plans))}
        reason: dict[int, str] = {}
        if sub_plans:
            for ev in decode_loop(lm, sub_plans, StandardRAG(), max_new_tokens=max_new_tokens, stop=stop, timings=timings):
                if ev.step.token_id not in eos:
                    gen[ev.query_idx].append(ev.step.token_id)
                if ev.finished:
                    reason[ev.query_idx] = ev.stop_reason
        cands: list[list[dict[str, Any]]] = [[] for _ in plans]
        for i, (q, j) in enumerate(owner):
            if not any(c["ids"] == gen[i] for c in cands[q]):
                cands[q].append({"ids": gen[i], "from_passage": j, "stop_reason": reason.get(i, "length")})
        no_passage = [q for q, p in enumerate(plans) if not p.passage_spans]
        if no_passage:
            out: dict[int, list[int]] = {q: [] for q in no_passage}
            why: dict[int, str] = {}
            for ev in decode_loop(lm, [plans[q] for q in no_passage], PureLLM(), max_new_tokens=max_new_tokens, stop=stop, timings=timings):
                q = no_passage[ev.query_idx]
                if ev.step.token_id not in eos:
                    out[q].append(ev.step.token_id)
                if ev.finished:
                    why[q] = ev.stop_reason
            for q in no_passage:
                cands[q].append({"ids": out[q], "from_passage": None, "stop_reason": why.get(q, "length")})

        # 2. cross-score every candidate under every passage of its query (teacher forcing).
        t0 = time.perf_counter()
        for q in range(len(plans)):
            for cd in cands[q]:
                cd["target"] = cd["ids"] + ([lm.eos_token_ids[0]] if cd["stop_reason"] == "eos" else [])
        rows = [(q, c) for q in range(len(plans)) if plans[q].passage_spans for c in range(len(cands[q])) if cands[q][c]["target"]]
        logp: dict[tuple[int, int], dict[str, float]] = {r: {} for r in rows}
        if rows:
            for r, i, views in teacher_force(lm, [plans[q] for q, _ in rows], self._scorer, [cands[q][c]["target"] for q, c in rows]):
                q, c = rows[r]
                y = cands[q][c]["target"][i]
                for role, v in views.items():
                    lp = float(torch.log_softmax(v.logits.float(), dim=-1)[y].item())
                    logp[(q, c)][role] = logp[(q, c)].get(role, 0.0) + lp
        timings["score_s"] = timings.get("score_s", 0.0) + time.perf_counter() - t0

        # 3. p(y|x) = Σ_z p(z|x) p(y|x,z); replay the best candidate.
        for q, p in enumerate(plans):
            weights = self._scorer.contexts(p)
            for c, cand in enumerate(cands[q]):
                per = [logp.get((q, c), {}).get(passage_role(j), 0.0) for j in range(len(weights))]
                cand["log_p_passages"] = [round(x, 4) for x in per]
                terms = [math.log(s.weight) + lp for s, lp in zip(weights.values(), per, strict=True) if s.weight]
                cand["log_p"] = torch.logsumexp(torch.tensor(terms), 0).item() if terms else 0.0
            best = max(range(len(cands[q])), key=lambda c: cands[q][c]["log_p"])
            chosen = cands[q][best]
            summary = [
                {
                    "text": tok.decode(cd["ids"], skip_special_tokens=True),
                    "from_passage": cd["from_passage"],
                    "log_p": round(cd["log_p"], 4),
                    "log_p_passages": cd.get("log_p_passages", []),
                    "chosen": c == best,
                }
                for c, cd in enumerate(cands[q])
            ]
            source = "llm" if chosen["from_passage"] is None else passage_role(chosen["from_passage"])
            ids = chosen["ids"]
            steps = ids + ([lm.eos_token_ids[0]] if chosen["stop_reason"] == "eos" or not ids else [])
            for i, tid in enumerate(steps):
                is_eos = tid in eos
                step = TraceStep(
                    index=i,
                    token_id=tid,
                    text="" if is_eos else tok.decode([tid]),
                    source=source,
                    signals={"rag_sequence": summary} if i == 0 else {},
                )
                last = i == len(steps) - 1
                yield StepEvent(q, step, finished=last, stop_reason=("eos" if is_eos else chosen["stop_reason"]) if last else "")
