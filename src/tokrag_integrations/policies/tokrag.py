"""Tok-RAG (seed 000, Sections 3.1–3.2): keep the RAG token where benefit outweighs detriment.

At every step the pure LLM proposes ``a`` and RAG proposes ``b``. Where they agree the token
is taken at once, with no signals. Where they differ, the policy estimates the distribution of
the retrieved texts p_R from the model's own layers and attention (Eq. 13–16) and keeps ``b``
iff cos(w_RAG, w_IR) − cos(w_RAG, w_LLM) >= the threshold (Eq. 19: 0).

The defaults (:class:`TokRAG`'s Args) were chosen on the dev sets (docs/results.md, "Choosing
the defaults"). The paper's rule as written is ``function_word_gate=False, verdict_gate=None,
rising_gate=False, punctuation_gate=False, threshold=0, plausibility_alpha=0.1, pr_skip=None``;
the literal reading of Eq. 14-15 adds ``min_fusion_layer=0, plausibility_alpha=None,
lens_norm=False``. The authors' released rule is the policy ``tokrag_authors``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Generator
from typing import Any

import torch

from ..attention.parts import model_parts
from ..models import LoadedModel
from ..trace import AGREE, FROM_PURE, FROM_RAG
from . import signals as S
from . import vocab
from .base import Choice, ContextSpec, Lens, Policy, Signals, View, lens_rounds

#: Layers per logit-lens request of the l* search: the first one and the later ones (the search
#: stops at the first crossing of Eq. 14's threshold).
_LENS_FIRST = 5
_LENS_CHUNK = 3

#: The defaults that differ from the paper's rule (the class docstring says what each does).
DEFAULT_THRESHOLD = -0.1  # Eq. 19's margin threshold (paper: 0)
DEFAULT_PLAUSIBILITY_ALPHA = 0.5  # DoLa's α on x^{l'-l*} (paper rule: 0.1)
DEFAULT_PR_SKIP = "punctuation"  # retrieved tokens left out of p_R (paper: None)
DEFAULT_VERDICT_GATE = "either"  # (paper: None)
DEFAULT_RISING_GATE = True  # (paper: False)
DEFAULT_PUNCTUATION_GATE = True  # (paper: False)


class TokRAG(Policy):
    """Tok-RAG decoding.

    Args:
        min_fusion_layer: first layer searched by both terms of Eq. 14: an int is a layer
            (0 = the literal all-layer argmax), a float in (0, 1) a fraction of the depth L
            (0.3125 = round(L·10/32), the authors' end of the shallow stage), None = L/2
            (:data:`.signals.DEFAULT_FUSION_FRACTION`).
        fixed_layer: use this l* instead of Eq. 14 (None = Eq. 14).
        plausibility_alpha: x^{l'−l*} is searched among the tokens with p_final >= α·max
            p_final (DoLa's constraint; None = the whole vocabulary, the literal reading).
            0.5 keeps the search among RAG's own leading candidates; DoLa uses 0.1.
        lens_norm: apply the final norm in the logit lens of the middle layers (True = the
            usual lens, the paper; False = the authors' code). The final layer is always the
            model's own (normed) output distribution when ``plausibility_alpha`` is set.
        pr_norm: ``"sum"`` (Att⊙WordSim divided by its sum) or ``"softmax"`` (Eq. 16 literal).
        pr_skip: which retrieved positions Eq. 15-16 leave out of p_R (f of Eq. 14 still
            counts them all): ``"punctuation"`` = the tokens with no letter or digit
            (:func:`.vocab.punctuation_mask`), None = none (the paper), ``"authors"`` = the
            authors' skip list (:func:`.vocab.skip_mask`). Where every retrieved token is
            skipped, none is.
        top_k: truncate w_RAG / w_LLM to the top-k tokens (None = full vocabulary).
        scorer: ``"cosine"`` (Eq. 17-19: cos(w_RAG, w_IR) >= cos(w_RAG, w_LLM)) or
            ``"distribution"`` (Theorem 3 on the distributions: JSD(p_RAG, p_R) <=
            JSD(p_RAG, p_LLM), :func:`.signals.distribution_scores`).
        threshold: benefit wins iff the scorer's margin is >= this (Eq. 19: 0; Theorem 2
            only orders the margin).
        jsd_threshold: Eq. 14's a, per vocabulary entry.
        function_word_gate: where RAG's token is a function word (the authors' list,
            :func:`.vocab.gate_mask`) keep it without comparing, as their released decoder
            does; False: Eq. 19 at every disagreement (the paper).
        verdict_gate: keep RAG's token without comparing where a disagreement decides the
            answer's polarity (:func:`.vocab.verdict_mask`: w_IR, a mixture of retrieved tokens, cannot
            stand for a verdict or a negation): ``"either"`` where either candidate is a
            verdict word, ``"rag"`` where RAG's token is one, None: Eq. 19 decides (the paper).
        punctuation_gate: where the pure model's token has no letter or digit
            (:func:`.vocab.punctuation_mask`) keep RAG's token without comparing (a
            punctuation token states nothing the pure model knows); False: Eq. 19 decides.
        rising_gate: where Eq. 19 would keep the pure model's token but RAG's token is
            x^{l'−l*} itself (of RAG's plausible tokens, the one its layers after l* raised
            most), keep RAG's token; False: Eq. 19 decides (the paper).
    """

    name = "tokrag"
    roles = ("pure", "rag")

    def __init__(
        self,
        pr_norm: str = "sum",
        pr_skip: str | None = DEFAULT_PR_SKIP,
        top_k: int | None = 3,
        min_fusion_layer: int | float | None = None,
        lens_norm: bool = True,
        plausibility_alpha: float | None = DEFAULT_PLAUSIBILITY_ALPHA,
        scorer: str = "cosine",
        threshold: float = DEFAULT_THRESHOLD,
        jsd_threshold: float = S.DEFAULT_JSD_THRESHOLD,
        fixed_layer: int | None = None,
        function_word_gate: bool = True,
        verdict_gate: str | None = DEFAULT_VERDICT_GATE,
        rising_gate: bool = DEFAULT_RISING_GATE,
        punctuation_gate: bool = DEFAULT_PUNCTUATION_GATE,
    ):
        if pr_norm not in ("sum", "softmax"):
            raise ValueError(f"pr_norm must be 'sum' or 'softmax', got {pr_norm!r}")
        if pr_skip not in (None, "punctuation", "authors"):
            raise ValueError(f"pr_skip must be None, 'punctuation' or 'authors', got {pr_skip!r}")
        if scorer not in ("cosine", "distribution"):
            raise ValueError(f"scorer must be 'cosine' or 'distribution', got {scorer!r}")
        if verdict_gate not in (None, "rag", "either"):
            raise ValueError(f"verdict_gate must be None, 'rag' or 'either', got {verdict_gate!r}")
        if top_k is not None and (
            isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1
        ):
            raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
        if fixed_layer is not None and (
            isinstance(fixed_layer, bool) or not isinstance(fixed_layer, int)
        ):
            raise ValueError(f"fixed_layer must be an int or None, got {fixed_layer!r}")
        if min_fusion_layer is not None and (
            isinstance(min_fusion_layer, bool)
            or not isinstance(min_fusion_layer, int | float)
            or min_fusion_layer < 0
            or (isinstance(min_fusion_layer, float) and not 0.0 < min_fusion_layer < 1.0)
        ):
            raise ValueError(
                "min_fusion_layer must be a layer (int >= 0), a fraction of the depth (float in "
                f"(0, 1)) or None, got {min_fusion_layer!r}"
            )
        if plausibility_alpha is not None and not 0.0 < float(plausibility_alpha) <= 1.0:
            raise ValueError(
                f"plausibility_alpha must be in (0, 1] or None, got {plausibility_alpha!r}"
            )
        flags = {
            "function_word_gate": function_word_gate,
            "rising_gate": rising_gate,
            "punctuation_gate": punctuation_gate,
            "lens_norm": lens_norm,
        }
        for key, value in flags.items():
            if not isinstance(value, bool):
                raise ValueError(f"{key} must be True or False, got {value!r}")
        if jsd_threshold < 0:
            raise ValueError(f"jsd_threshold must be >= 0, got {jsd_threshold}")
        self.pr_norm, self.pr_skip, self.scorer = pr_norm, pr_skip, scorer
        self.threshold, self.top_k = float(threshold), top_k
        self.min_fusion_layer, self.lens_norm = min_fusion_layer, lens_norm
        self.plausibility_alpha = None if plausibility_alpha is None else float(plausibility_alpha)
        self.jsd_threshold, self.fixed_layer = float(jsd_threshold), fixed_layer
        self.function_word_gate, self.verdict_gate = function_word_gate, verdict_gate
        self.rising_gate, self.punctuation_gate = rising_gate, punctuation_gate

    def options(self) -> dict[str, Any]:
        """Every constructor argument (``fixed_layer`` only where it is set)."""
        keys = list(inspect.signature(TokRAG.__init__).parameters)[1:]
        out = {k: getattr(self, k) for k in keys}
        return (
            out
            if self.fixed_layer is not None
            else {k: v for k, v in out.items() if k != "fixed_layer"}
        )

    def contexts(self, plan: Any) -> dict[str, ContextSpec]:
        """Both contexts, probed (the signals read their layers)."""
        return {
            "pure": ContextSpec(plan.pure_ids, probe=True),
            "rag": ContextSpec(plan.rag_ids, plan.retrieved_positions, probe=True),
        }

    def prepare(self, lm: LoadedModel) -> None:
        self._parts = model_parts(lm.model)
        self._A = self._parts.embedding_matrix.detach()
        self._L = self._parts.num_layers
        m = self.min_fusion_layer
        fraction = S.DEFAULT_FUSION_FRACTION if m is None else m
        self._lo = m if isinstance(m, int) else S.default_min_fusion_layer(self._L, fraction)
        if self._lo > self._L:
            raise ValueError(f"min_fusion_layer={self._lo} exceeds the model's {self._L} layers")
        if self.fixed_layer is not None and not 1 <= self.fixed_layer <= self._L:
            raise ValueError(f"fixed_layer must be in [1, {self._L}], got {self.fixed_layer}")
        # The vocabulary masks, built once per tokenizer (the decoded vocabulary shared).
        tok, V = lm.tokenizer, self._A.shape[0]
        texts = functools.cache(lambda: vocab.vocab_texts(tok))

        def mask(name: str, build: Any) -> torch.Tensor:
            return lm.memo(
                (name, id(tok), len(tok), V), lambda: build(tok, vocab_size=V, texts=texts())
            )

        if self.pr_skip == "punctuation" or self.punctuation_gate:
            self._punct = mask("pr_skip:punctuation", vocab.punctuation_mask)
        # p_R's skip mask is indexed by the retrieved tokens' ids, which live on the model's
        # device; the gates' masks are read one token at a time and stay on the CPU.
        if self.pr_skip == "authors":
            skip = lm.memo(
                ("skip_mask", id(tok), len(tok), V), lambda: vocab.skip_mask(tok, vocab_size=V)
            )
            self._pr_skip = skip.to(self._A.device)
        elif self.pr_skip == "punctuation":
            self._pr_skip = self._punct.to(self._A.device)
        if self.function_word_gate:
            self._gate = mask("gate_mask", vocab.gate_mask)
        if self.verdict_gate is not None:
            self._verdict = mask("verdict_mask", vocab.verdict_mask)
        self._tok = lm.tokenizer

    # ------------------------------------------------------------------ rule
    def choose(self, views: list[dict[str, View]], lens: Lens) -> list[Choice]:
        """The gates first; where none decides, Eq. 19 on the signals (one lens request of
        every query left per round, :func:`.base.lens_rounds`)."""
        out = [self._gated(v["pure"], v["rag"]) for v in views]
        todo = [i for i, c in enumerate(out) if c is None]
        sigs = lens_rounds(
            [self.signals(views[i]["pure"], views[i]["rag"]) for i in todo], lens, self.lens_norm
        )
        for i, sig in zip(todo, sigs, strict=True):
            out[i] = self._decide(views[i]["pure"], views[i]["rag"], sig)
        for c, v in zip(out, views, strict=True):  # the chosen source's distribution
            c.logits = v["pure" if c.source == FROM_PURE else "rag"].logits  # type: ignore[union-attr]
        return out  # type: ignore[return-value]

    def _decide(self, pure: View, rag: View, sig: dict[str, Any]) -> Choice:
        """Eq. 19 (and the rising gate) on one query's signals."""
        a = int(torch.argmax(pure.logits).item())
        b = int(torch.argmax(rag.logits).item())
        rising = sig.pop("rising_id", None)
        if self.rising_gate and not sig["benefit"] and rising == b:
            sig = {**sig, "benefit": True, "note": "gated: RAG's rising token"}
        return Choice(b if sig["benefit"] else a, FROM_RAG if sig["benefit"] else FROM_PURE, sig)

    def _gated(self, pure: View, rag: View) -> Choice | None:
        """The choice made without the signals (the contexts agree, no retrieved tokens, a
        gated word), or None where the signals decide."""
        a = int(torch.argmax(pure.logits).item())
        b = int(torch.argmax(rag.logits).item())
        if a == b:
            return Choice(a, AGREE)
        if not rag.spec.rt_positions:
            return Choice(a, FROM_PURE, {"note": "no retrieved tokens"})
        if self.function_word_gate and bool(self._gate[b]):  # the authors' function-word gate
            return Choice(b, FROM_RAG, {"note": "gated: function word"})
        if self.verdict_gate is not None and (
            bool(self._verdict[b]) or (self.verdict_gate == "either" and bool(self._verdict[a]))
        ):
            return Choice(b, FROM_RAG, {"note": "gated: verdict word"})
        if self.punctuation_gate and bool(self._punct[a]):
            return Choice(b, FROM_RAG, {"note": "gated: pure punctuation"})
        if self._rising_is_rags_token(rag):
            return Choice(b, FROM_RAG, {"note": "gated: RAG alone plausible"})
        return None

    def _rising_is_rags_token(self, rag: View) -> bool:
        """Whether the rising gate keeps RAG's token whatever the signals say: x^{l'-l*} is
        searched among RAG's plausible tokens (p_RAG >= α·max p_RAG, the final layer being the
        model's own output), so where RAG's argmax is the only one, it is x^{l'-l*} for every
        l*, and the gate keeps it whether Eq. 19 does or not."""
        if not (self.rising_gate and self.lens_norm and self.plausibility_alpha is not None):
            return False
        final = torch.log_softmax(rag.logits.float(), dim=-1)  # as :meth:`signals` computes it
        return int(S.plausible_tokens(final, self.plausibility_alpha).sum()) == 1

    def score(self, pure: View, rag: View, lens: Lens) -> float:
        """A number > 0 where benefit wins (token-level AUC): cos(w_RAG, w_IR) − cos(w_RAG,
        w_LLM) for the cosine scorer, JSD(p_RAG, p_LLM) − JSD(p_RAG, p_R) for the distribution
        scorer."""
        sig = lens_rounds([self.signals(pure, rag)], lens, self.lens_norm)[0]
        if self.scorer == "distribution":
            return sig["jsd_llm"] - sig["jsd_ir"]
        return sig["cos_ir"] - sig["cos_llm"]

    # ------------------------------------------------------------------ signals (Eq. 13–18)
    def signals(self, pure: View, rag: View) -> Signals:
        """Eq. 13-18 at one step where the candidates differ (a :data:`Signals` generator)."""
        L, A = self._L, self._A
        rt, rt_ids = rag.rt_positions, rag.rt_token_ids
        h_rag = rag.record.resid[:, 0]  # [L+1, d]
        if self.fixed_layer is not None:
            l_star, f_layer, g_layer, rag_logp = self.fixed_layer, None, None, {}
            attn_star = rag.attention(l_star - 1)
        else:
            attn = rag.attention_all()  # [L, H, T]
            l_star, f_layer, g_layer, rag_logp = yield from self._fusion_layer(pure, rag, attn)
            attn_star = attn[l_star - 1]

        # Eq. 15–16: Att ⊙ WordSim over the retrieved positions -> p_R -> w_IR.
        if self.pr_skip is not None:
            keep = ~self._pr_skip[rt_ids]
            if bool(keep.any()):
                rt, rt_ids = rt[keep], rt_ids[keep]
        att = S.renormalised_attention(attn_star, rt)
        if L not in rag_logp and self.lens_norm:  # the final layer: the model's own output
            rag_logp[L] = torch.log_softmax(rag.logits.float(), dim=-1)
        need = [x for x in dict.fromkeys((L, l_star)) if x not in rag_logp]
        if need:
            rag_logp.update(zip(need, (yield h_rag[need]), strict=True))
        x_rise = S.rising_token(rag_logp[L], rag_logp[l_star], alpha=self.plausibility_alpha)
        wordsim = S.word_similarity(A, x_rise, rt_ids)
        p_r = S.retrieval_distribution(att, wordsim, pr_norm=self.pr_norm)
        w_ir = S.retrieval_embedding(A, p_r, rt_ids)
        w_rag, w_llm = S.weighted_embedding(
            torch.stack([rag.probs, pure.probs]), A, top_k=self.top_k
        )
        cos_ir, cos_llm = S.cosine(w_rag, w_ir), S.cosine(w_rag, w_llm)
        p_r_vocab = S.positions_to_vocab(p_r, rt_ids, A.shape[0])
        out: dict[str, Any] = {
            "l_star": l_star,
            "fusion_attn_layer": f_layer,
            "fusion_jsd_layer": g_layer,
            "cos_ir": cos_ir,
            "cos_llm": cos_llm,
        }
        if self.scorer == "distribution":
            jsd_ir, jsd_llm = S.distribution_scores(rag.probs, pure.probs, p_r_vocab)
            out.update(jsd_ir=jsd_ir, jsd_llm=jsd_llm, benefit=jsd_llm - jsd_ir >= self.threshold)
        else:
            out["benefit"] = S.benefit_wins(cos_ir, cos_llm, self.threshold)
        top = torch.topk(p_r_vocab, k=min(3, rt_ids.numel()))
        out["rising_token"] = self._tok.decode([x_rise])
        out["rising_id"] = x_rise
        out["p_r_top"] = [
            [self._tok.decode([int(i)]), round(float(v), 4)]
            for v, i in zip(top.values, top.indices, strict=True)
        ]
        return out

    def _fusion_layer(
        self, pure: View, rag: View, attn: torch.Tensor
    ) -> Generator[torch.Tensor, torch.Tensor, tuple[int, int, int, dict[int, torch.Tensor]]]:
        """l* of Eq. 14 searched from ``self._lo``, and the RAG context's lensed
        log-probabilities computed on the way ({layer: [V]}), reused for x^{l'-l*}. g(l),
        Eq. 13, only up to the first crossing, a few layers per lens request: the pure rows
        (layer 0 shared with the RAG row where both contexts were fed the same token), the
        RAG rows, and the RAG rows x^{l'-l*} may need (the final layer when it is not the
        model's own output, and every l* a crossing in this request would give)."""
        L, V = self._L, self._A.shape[0]
        h_pure, h_rag = pure.record.resid[:, 0], rag.record.resid[:, 0]  # [L+1, d]
        f = S.retrieved_attention_mass(attn, rag.rt_positions)
        lo = max(1, self._lo)
        bound = self.jsd_threshold * V
        g = torch.full((L,), float("nan"))
        f_arg = lo + int(torch.argmax(f[lo - 1 :]).item())
        rag_logp: dict[int, torch.Tensor] = {}  # layer -> log phi(h~^l)
        prev: tuple[torch.Tensor, torch.Tensor] | None = None
        start, done_to = lo - 1, lo - 2  # lens rows of layers start..stop, then stop+1...
        while done_to < L:
            stop = min(start + (_LENS_FIRST if prev is None else _LENS_CHUNK) - 1, L)
            layers = list(range(done_to + 1, stop + 1))
            extra = ([L] if not self.lens_norm else []) + [
                (f_arg + c) // 2 for c in range(max(start, lo), stop + 1)
            ]
            extra = sorted({x for x in extra if x not in rag_logp and x not in layers})
            share0 = layers[0] == 0 and torch.equal(h_pure[0], h_rag[0])
            p_layers = layers[1:] if share0 else layers
            logp = yield torch.cat([h_pure[p_layers], h_rag[layers], h_rag[extra]])
            n_p = len(p_layers)
            lp, lr = logp[:n_p], logp[n_p : n_p + len(layers)]
            if share0:
                lp = torch.cat([lr[:1], lp])
            rag_logp.update(zip(layers + extra, logp[n_p:], strict=True))
            if prev is not None:
                lp, lr = torch.cat([prev[0][None], lp]), torch.cat([prev[1][None], lr])
            shift = S.layer_shift_jsd_logp(torch.stack([lr, lp]))  # both contexts at once
            first = layers[0] + (1 if prev is None else 0)  # 1-based layer of gap[0]
            g[first - 1 : stop] = S.distribution_change_gap(shift[0], shift[1]).float()
            prev, done_to = (lp[-1], lr[-1]), stop
            if S.first_crossing(g[:stop], bound, start_layer=lo) is not None:
                break
            start = stop + 1
        l_star, f_layer, g_layer = S.fusion_layer(
            f, g, vocab_size=V, threshold=self.jsd_threshold, min_fusion_layer=self._lo
        )
        return l_star, f_layer, g_layer, rag_logp
