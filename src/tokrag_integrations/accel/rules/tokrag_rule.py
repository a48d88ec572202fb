"""Device rule of :class:`...policies.tokrag.TokRAG` (its ``choose``: the gates, then Eq. 13-19
of :mod:`...policies.signals`), on Q queries at once, branch-free.

Where the CPU path searches l* a few layers at a time and stops at the first crossing of
Eq. 14, the device lenses every layer the search may read (``lo - 1 .. L`` of both contexts)
in one product, computes g(l) for all of them and takes the first crossing with a mask: the
same l* (the layers after the crossing only go unused). Which final-layer distribution
x^{l'-l*} reads follows the CPU search too: the lens of h^L where the search reached layer L,
else the model's own output. Every query's signals are computed, and ``torch.where`` keeps
them only where no gate decided.

The record's ``note`` slot says which branch decided (:data:`NOTES`); :meth:`decode` rebuilds
the signals dict as ``choose`` writes it (same keys and order, same rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...policies import signals as S
from ...policies.tokrag import TokRAG
from ..step_types import StepTensors
from .common import (
    AGREE_CODE,
    LLM_CODE,
    RAG_CODE,
    Layout,
    RecordRule,
    attention_cite,
    lens,
    role_logits,
    role_logp,
    role_rows,
)

#: The ``note`` codes: the gate that decided, or the signals (6; 7: the rising gate kept
#: RAG's token against Eq. 19).
NOTES: dict[int, str | None] = {
    0: None,  # the contexts agree: no signals
    1: "no retrieved tokens",
    2: "gated: function word",
    3: "gated: verdict word",
    4: "gated: pure punctuation",
    5: "gated: RAG alone plausible",
    6: None,
    7: "gated: RAG's rising token",
}
SIGNALS, RISING = 6, 7


class TokRAGRule(RecordRule):
    """Tok-RAG's ``choose`` on the device (every option of :class:`TokRAG`)."""

    def __init__(self, policy: TokRAG, lm: Any, *, citations: bool | None, passages: int):
        self.p = policy
        self.parts_ = policy._parts
        self.A = policy._A
        self.L, self.lo = policy._L, max(1, policy._lo)
        self.V = self.A.shape[0]
        dev = self.A.device
        self.gate = policy._gate.to(dev) if policy.function_word_gate else None
        self.verdict = policy._verdict.to(dev) if policy.verdict_gate is not None else None
        self.punct = policy._punct.to(dev) if policy.punctuation_gate else None
        self.pr_skip = policy._pr_skip.to(dev) if policy.pr_skip is not None else None
        super().__init__(
            lm, policy.roles, cite=attention_cite(policy.roles, citations), passages=passages
        )

    def add_signals(self, layout: Layout) -> None:
        for name in ("note", "l_star", "f_layer", "g_layer", "cos_ir", "cos_llm"):
            layout.add(name)
        if self.p.scorer == "distribution":
            layout.add("jsd_ir")
            layout.add("jsd_llm")
        for name in ("benefit", "rising", "pr_k"):
            layout.add(name)
        layout.add("pr_ids", 3)
        layout.add("pr_vals", 3)

    # ------------------------------------------------------------------ the rule
    def choose(
        self, t: StepTensors
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        p = self.p
        logit_pure, logit_rag = role_logits(t, "pure"), role_logits(t, "rag")
        a = torch.argmax(logit_pure, dim=-1)
        b = torch.argmax(logit_rag, dim=-1)
        rag_final = role_logp(t, "rag")  # the model's own output, log (the trace's too)
        # The gates, in the order of TokRAG._gated: the first that holds decides.
        gates = [a == b, ~t.rt_valid.any(-1)]
        false = torch.zeros_like(gates[0])
        gates.append(self.gate[b] if self.gate is not None else false)
        if self.verdict is not None:
            v = self.verdict[b]
            gates.append(v | self.verdict[a] if p.verdict_gate == "either" else v)
        else:
            gates.append(false)
        gates.append(self.punct[a] if self.punct is not None else false)
        if p.rising_gate and p.lens_norm and p.plausibility_alpha is not None:
            alone = S.plausible_tokens(rag_final, p.plausibility_alpha).sum(-1) == 1
            gates.append(alone)
        else:
            gates.append(false)
        note = torch.full_like(a, SIGNALS)
        for code in range(len(gates) - 1, -1, -1):  # the first gate that holds wins
            note = torch.where(gates[code], code, note)

        sig = self._signals(t, logit_pure, logit_rag, rag_final)
        benefit = sig["benefit"]
        rising = ~benefit & (sig["rising"] == b) if p.rising_gate else false
        note = torch.where((note == SIGNALS) & rising, RISING, note)
        keep_rag = torch.where(note >= SIGNALS, benefit | rising, note >= 2)
        ids = torch.where(keep_rag, b, a)
        source = torch.where(note == 0, AGREE_CODE, torch.where(keep_rag, RAG_CODE, LLM_CODE))
        sig["note"] = note
        sig["benefit"] = benefit
        # The chosen source's distribution (``agree``: RAG's).
        logits = torch.where((source == LLM_CODE)[:, None], logit_pure, logit_rag)
        return ids, source, sig, logits

    def _signals(
        self,
        t: StepTensors,
        logit_pure: torch.Tensor,
        logit_rag: torch.Tensor,
        rag_final: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """Eq. 13-18 for every query (used where no gate decided)."""
        p, L, lo, A = self.p, self.L, self.lo, self.A
        Q = t.num_queries
        if t.resid is None or t.attn is None:
            raise ValueError("the tokrag device rule needs the probed rows' resid and attn")
        rag_rows, _ = role_rows(t, "rag", Q)
        pure_rows, _ = role_rows(t, "pure", Q)
        h_rag = t.resid.index_select(0, rag_rows)  # [Q, L+1, d]
        attn = t.attn.index_select(0, rag_rows).float()  # [Q, L, H, T]
        H, P = attn.shape[2], t.rt_pos.shape[1]
        valid = t.rt_valid
        # Every layer's attention at the retrieved columns: [Q, L, H, P].
        sub_all = attn.gather(3, t.rt_pos[:, None, None, :].expand(Q, L, H, P))
        sub_all = sub_all * valid[:, None, None, :].float()
        qi = torch.arange(Q, device=a_dev(t))
        if p.fixed_layer is not None:
            l_star = torch.full((Q,), p.fixed_layer, dtype=torch.long, device=a_dev(t))
            f_layer = g_layer = torch.zeros_like(l_star)
            rows = [p.fixed_layer] if p.lens_norm else sorted({p.fixed_layer, L})
            got = torch.log_softmax(lens(self.parts_, h_rag[:, rows], p.lens_norm), dim=-1)
            fusion = got[:, rows.index(p.fixed_layer)]
            if p.lens_norm:
                final = rag_final
                if p.fixed_layer == L:  # the CPU path reads the model's output for both
                    fusion = rag_final
            else:
                final = got[:, rows.index(L)]
        else:
            # f(l) over every retrieved column (Eq. 14's first term).
            f = sub_all.sum(-1).mean(-1)  # [Q, L]
            f_layer = lo + torch.argmax(f[:, lo - 1 :], dim=-1)
            # g(l), Eq. 13, for l = lo..L from the lens of layers lo-1..L of both contexts.
            h_pure = t.resid.index_select(0, pure_rows)
            n = L - lo + 2
            rows_h = torch.cat([h_rag[:, lo - 1 :], h_pure[:, lo - 1 :]], dim=1)  # [Q, 2n, d]
            logp = torch.log_softmax(lens(self.parts_, rows_h, p.lens_norm), dim=-1)
            logp = logp.reshape(Q, 2, n, -1)
            shift = layer_shifts(logp)  # [Q, 2, n-1], Eq. 13's JSD of consecutive layers
            g = S.distribution_change_gap(shift[:, 0], shift[:, 1]).float()  # layers lo..L
            cross = g > p.jsd_threshold * self.V
            g_layer = torch.where(
                cross.any(-1), lo + torch.argmax(cross.int(), dim=-1), torch.full_like(f_layer, L)
            )
            l_star = torch.div(f_layer + g_layer, 2, rounding_mode="floor")
            lens_rag = logp[:, 0]  # [Q, n, V]: layer lo-1+i
            fusion = lens_rag[qi, l_star - (lo - 1)]
            if p.lens_norm:
                # The CPU search lensed layer L (and x^{l'-l*} reads it) where it got there.
                stop0 = min(lo + 3, L)
                chunks = torch.div((g_layer - stop0).clamp_min(0) + 2, 3, rounding_mode="floor")
                reached = (stop0 + 3 * chunks).clamp_max(L) >= L
                final = torch.where(reached[:, None], lens_rag[:, n - 1], rag_final)
            else:
                final = lens_rag[:, n - 1]
        # x^{l'-l*}: the rising token among the plausible ones.
        rise = final - fusion
        if p.plausibility_alpha is not None:
            plausible = S.plausible_tokens(final, p.plausibility_alpha)
            rise = rise.masked_fill(~plausible, float("-inf"))
        x_rise = torch.argmax(rise, dim=-1)
        # Eq. 15-16: Att ⊙ WordSim over the kept retrieved columns -> p_R -> w_IR.
        kept = valid
        if self.pr_skip is not None:
            keep = valid & ~self.pr_skip[t.rt_ids]
            kept = torch.where(keep.any(-1, keepdim=True), keep, valid)  # all skipped: none is
        m = kept.sum(-1, keepdim=True).clamp_min(1).float()
        keptf = kept.float()
        sub = sub_all[qi, l_star - 1] * keptf[:, None, :]  # [Q, H, P]
        total = sub.sum(-1, keepdim=True)
        per_head = torch.where(total > 0, sub / total.clamp_min(1e-30), 1.0 / m[:, None])
        att = (per_head * keptf[:, None, :]).mean(1)  # [Q, P]
        emb_rt = A[t.rt_ids].float()  # [Q, P, d]
        sim = (emb_rt @ A[x_rise].float()[:, :, None])[..., 0]
        wordsim = torch.softmax(sim.masked_fill(~kept, float("-inf")), dim=-1)
        prod = att * wordsim * keptf
        if p.pr_norm == "softmax":
            p_r = torch.softmax(prod.masked_fill(~kept, float("-inf")), dim=-1)
        else:
            tot = prod.sum(-1, keepdim=True)
            p_r = torch.where(tot > 0, prod / torch.where(tot > 0, tot, 1.0), keptf / m)
        p_r = p_r * keptf
        w_ir = (p_r[:, None, :] @ emb_rt)[:, 0]  # [Q, d]
        probs = torch.softmax(torch.stack([logit_rag, logit_pure], dim=1), dim=-1)  # [Q, 2, V]
        w = S.weighted_embedding(probs, A, top_k=p.top_k)  # [Q, 2, d]
        w_rag, w_llm = w[:, 0], w[:, 1]
        cos = torch.nn.functional.cosine_similarity
        cos_ir, cos_llm = cos(w_rag, w_ir, dim=-1), cos(w_rag, w_llm, dim=-1)
        p_r_vocab = torch.zeros_like(logit_rag).scatter_add_(1, t.rt_ids, p_r)
        out = {
            "l_star": l_star,
            "f_layer": f_layer,
            "g_layer": g_layer,
            "cos_ir": cos_ir,
            "cos_llm": cos_llm,
            "rising": x_rise,
        }
        if p.scorer == "distribution":
            jsd_ir, jsd_llm = distribution_scores_rows(probs[:, 0], probs[:, 1], p_r_vocab)
            out.update(jsd_ir=jsd_ir, jsd_llm=jsd_llm)
            out["benefit"] = jsd_llm.double() - jsd_ir.double() >= p.threshold
        else:
            out["benefit"] = cos_ir.double() - cos_llm.double() >= p.threshold
        top = torch.topk(p_r_vocab, k=3, dim=-1)
        out["pr_k"] = kept.sum(-1).clamp_max(3)
        out["pr_ids"], out["pr_vals"] = top.indices, top.values
        return out

    # ------------------------------------------------------------------ the host side
    def signals_of(self, row: Sequence[float], tokenizer: Any) -> dict[str, Any]:
        lay, p = self.layout, self.p
        note = int(lay.one(row, "note"))
        if note < SIGNALS:
            text = NOTES[note]
            return {} if text is None else {"note": text}
        search = p.fixed_layer is None
        out: dict[str, Any] = {
            "l_star": int(lay.one(row, "l_star")),
            "fusion_attn_layer": int(lay.one(row, "f_layer")) if search else None,
            "fusion_jsd_layer": int(lay.one(row, "g_layer")) if search else None,
            "cos_ir": lay.one(row, "cos_ir"),
            "cos_llm": lay.one(row, "cos_llm"),
        }
        if p.scorer == "distribution":
            out["jsd_ir"], out["jsd_llm"] = lay.one(row, "jsd_ir"), lay.one(row, "jsd_llm")
        out["benefit"] = lay.one(row, "benefit") > 0.5
        out["rising_token"] = tokenizer.decode([int(lay.one(row, "rising"))])
        k = int(lay.one(row, "pr_k"))
        ids, vals = lay.get(row, "pr_ids")[:k], lay.get(row, "pr_vals")[:k]
        out["p_r_top"] = [
            [tokenizer.decode([int(i)]), round(float(v), 4)] for i, v in zip(ids, vals, strict=True)
        ]
        if note == RISING:
            out = {**out, "benefit": True, "note": NOTES[RISING]}
        return out


def layer_shifts(logp: torch.Tensor) -> torch.Tensor:
    """:func:`...policies.signals.layer_shift_jsd_logp` ([..., n, V] float32 -> [..., n-1]).
    On a CPU, one pair of consecutive layers at a time with the same arithmetic on each entry
    (the same bits: ``tests/unit/test_device_rules.py``), into four buffers of one layer's
    rows reused across the layers: in cache, where every layer at once streams temporaries
    of n x V floats a row through memory. Elsewhere (few large kernels suit a GPU) the
    policy's function itself."""
    if logp.device.type != "cpu":
        return S.layer_shift_jsd_logp(logp)
    n = logp.shape[-2]
    shape = (*logp.shape[:-2], logp.shape[-1])
    probs = [logp.new_empty(shape), logp.new_empty(shape)]  # p of the previous / this layer
    logm, term = logp.new_empty(shape), logp.new_empty(shape)
    tiny = torch.finfo(torch.float32).tiny
    torch.exp(logp[..., 0, :], out=probs[0])
    out = []
    for i in range(1, n):
        logp_a, logp_b = logp[..., i - 1, :], logp[..., i, :]
        p_a, p_b = probs[(i - 1) % 2], probs[i % 2]
        torch.exp(logp_b, out=p_b)
        # m = (p_a + p_b) / 2; KL(p‖m) = Σ p·(log p − log m), as the policy's function.
        torch.add(p_a, p_b, out=logm).mul_(0.5).clamp_min_(tiny).log_()
        kl_a = torch.sub(logp_a, logm, out=term).mul_(p_a).sum(-1)
        kl_b = torch.sub(logp_b, logm, out=term).mul_(p_b).sum(-1)
        out.append((0.5 * (kl_a + kl_b)).clamp_min(0.0))
    return torch.stack(out, dim=-1)


def a_dev(t: StepTensors) -> torch.device:
    return t.logits.device


def distribution_scores_rows(
    p_rag: torch.Tensor, p_llm: torch.Tensor, p_r_vocab: torch.Tensor, support_k: int = 10
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`...policies.signals.distribution_scores` of Q rows at once ([Q, V] each ->
    two [Q]): the support is a mask over the vocabulary instead of an index list."""
    k = min(support_k, p_rag.shape[-1])
    idx = torch.cat(
        [torch.topk(x.float(), k, dim=-1).indices for x in (p_rag, p_llm, p_r_vocab)], 1
    )
    support = torch.zeros_like(p_rag, dtype=torch.bool).scatter_(1, idx, True)

    def restricted(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        ps = torch.where(support, p.float(), 0.0)
        qs = torch.where(support, q.float(), 0.0)
        ps = ps / ps.sum(-1, keepdim=True).clamp_min(1e-30)
        qs = qs / qs.sum(-1, keepdim=True).clamp_min(1e-30)
        return S.jsd(ps, qs)

    return restricted(p_rag, p_r_vocab), restricted(p_rag, p_llm)


def build(policy: Any, lm: Any, *, citations: bool | None, passages: int) -> TokRAGRule | None:
    if type(policy) is not TokRAG:
        return None
    policy.prepare(lm)
    return TokRAGRule(policy, lm, citations=citations, passages=passages)
