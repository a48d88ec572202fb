"""Tok-RAG (seed 000, Sections 3.1–3.2): keep the RAG token where benefit outweighs detriment.

At every step the pure LLM proposes ``a`` and RAG proposes ``b``. Where they agree the token
is taken at once (no signals: this is where most of the speed comes from). Where they differ,
the policy estimates the distribution of the retrieved texts p_R from the model's own layers
and attention (Eq. 13–16) and keeps ``b`` iff cos(w_RAG, w_IR) − cos(w_RAG, w_LLM) >= the
threshold (Eq. 19: 0).

Defaults, each chosen on the dev sets (docs/results.md, "Choosing the defaults"): l* searched
from L/2 (the "middle-layer maximum" of docs/algorithm.md, "Eq. 14"), the rising token on log-probabilities over
DoLa-plausible tokens with the final norm (α = 0.5: among RAG's leading candidates), the
retrieved punctuation left out of p_R (the authors' code skips it too), RAG's function words
kept without comparing (the authors' released decoder does so), RAG's token kept without
comparing where either candidate is a verdict word (yes / no and negators; :mod:`.verdict`:
w_IR cannot stand for them) or the pure model's is punctuation, RAG's token kept where it is
x^{l'-l*} itself and threshold −0.1. The paper's rule as written is
``function_word_gate=False, verdict_gate=None, rising_gate=False, punctuation_gate=False,
threshold=0, plausibility_alpha=0.1, pr_skip=None`` (DoLa's α); the literal reading of Eq.
14-15 adds ``min_fusion_layer=0, plausibility_alpha=None, lens_norm=False``.

``variant="reference"`` reproduces what the authors' released decoder does instead
(:mod:`.tokrag_reference`, with file and line citations): RAG's token taken at once when it
is a function word, else a fixed attention layer, no WordSim / p_R but the best single-token
cosine around the 3 most-attended retrieved positions, and a comparison at every step. Its
known first-token bug (the attention row of the wrong query position) is not copied.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .. import signals as S
from ..attention import logit_lens, model_parts
from ..models import LoadedModel
from ..trace import AGREE, FROM_LLM, FROM_RAG
from . import tokrag_reference as REF
from . import vocab
from .base import Choice, Policy, View
from .legacy_speed import legacy_speed_options
from .verdict import verdict_mask

#: Layers per logit-lens product, from the start of the l* search: the first one and the later
#: ones (each product reads the LM head once for both contexts plus the rows x^{l'-l*} may
#: need; the search stops at the first crossing of Eq. 14's threshold).
_LENS_FIRST = 5
_LENS_CHUNK = 3

#: Eq. 19's margin threshold: benefit wins iff the margin >= this. Fixed on the dev sets
#: (docs/results.md, "Choosing the defaults"); the paper's rule is 0.
DEFAULT_THRESHOLD = -0.1

#: α of DoLa's plausibility constraint on x^{l'-l*}: the rising token is searched among the
#: tokens with p_final >= α·max p_final. Fixed on the dev sets (docs/results.md, "The rising
#: token among RAG's leading candidates"); DoLa's own value, the paper rule's (docs/algorithm.md, "Presets"), is 0.1.
DEFAULT_PLAUSIBILITY_ALPHA = 0.5

#: Which retrieved tokens Eq. 15-16 leave out of p_R: those with no letter or digit. Attention
#: sinks on punctuation otherwise carry most of p_R on some models. Fixed on the dev sets
#: (docs/results.md, "Punctuation out of p_R"); the paper keeps every retrieved token (None).
DEFAULT_PR_SKIP = "punctuation"

#: Where either candidate is a verdict word (yes / no, a negator) RAG's token is kept without
#: comparing: a verdict is inferred from the passage, not copied from it, so w_IR cannot stand
#: for it, and the answer states RAG's verdict. Fixed on the dev sets (docs/results.md, "Verdict
#: words", "`verdict_gate="either"` and the punctuation gate"); the paper compares there (None).
DEFAULT_VERDICT_GATE = "either"

#: Where Eq. 19 would drop RAG's token although it is x^{l'-l*} (the token RAG's layers after
#: the fusion layer raised most among its plausible ones), RAG's token is kept: Eq. 19 then
#: overrules RAG only where RAG's own later layers did not single out its token. Fixed on the
#: dev sets (docs/results.md, "RAG's rising token"); the paper lets Eq. 19 decide (False).
DEFAULT_RISING_GATE = True

#: Where the pure model's token is punctuation, RAG's is kept without comparing (see
#: ``punctuation_gate``). Fixed on the dev sets (docs/results.md, "`verdict_gate="either"` and
#: the punctuation gate"); the paper compares there (False).
DEFAULT_PUNCTUATION_GATE = True


class TokRAG(Policy):
    """Tok-RAG decoding.

    Args:
        variant: ``"paper"`` (Eq. 13–19, docs/algorithm.md) or ``"reference"`` (authors' code,
            docs/algorithm.md, "The authors' released rule").
        min_fusion_layer: first layer searched by both terms of Eq. 14: an int is a layer
            (0 = the literal all-layer argmax), a float in (0, 1) a fraction of the depth L
            (0.3125 = round(L·10/32), the authors' end of the shallow stage), None = L/2, the
            start that measured best on dev (:data:`..signals.DEFAULT_FUSION_FRACTION`).
        fixed_layer: paper variant: use this l* instead of Eq. 14 (None = Eq. 14); reference
            variant: the 1-based layer whose attention it reads (default: their 0-based
            layer 20 of 32 scaled to L, plus one).
        plausibility_alpha: x^{l'−l*} is searched among the tokens with p_final >= α·max
            p_final (DoLa's constraint; None = the whole vocabulary, the literal reading). The
            default, 0.5, keeps the search among RAG's own leading candidates and was fixed on
            the dev sets; DoLa (and the paper rule) use 0.1.
        lens_norm: apply the final norm in the logit lens of the middle layers (True = the
            usual lens, the paper; False = the authors' code). The final layer is always the
            model's own (normed) output distribution when ``plausibility_alpha`` is set.
        pr_norm: ``"sum"`` (Att⊙WordSim divided by its sum) or ``"softmax"`` (Eq. 16 literal).
        pr_skip: which retrieved positions Eq. 15-16 leave out of p_R (f of Eq. 14 still
            counts them all): ``"punctuation"`` (default, fixed on the dev sets) = the tokens
            with no letter or digit (:func:`.vocab.punctuation_mask`), None = none (the paper),
            ``"reference"`` = the authors' skip list (punctuation pieces and single digits,
            :func:`.vocab.skip_mask`). Where every retrieved token is skipped,
            none is.
        top_k: truncate w_RAG / w_LLM to the top-k tokens (None = full vocabulary).
        scorer: ``"cosine"`` (Eq. 17-19: cos(w_RAG, w_IR) >= cos(w_RAG, w_LLM)) or
            ``"distribution"`` (Theorem 3 on the distributions: JSD(p_RAG, p_R) <=
            JSD(p_RAG, p_LLM), :func:`..signals.distribution_scores`).
        threshold: benefit wins iff the scorer's margin is >= this. Eq. 19 uses 0; Theorem 2
            only orders the margin, so the default, -0.1, was fixed on the dev sets
            (docs/results.md, "Choosing the defaults"); ``threshold=0`` is the paper's rule.
        jsd_threshold: Eq. 14's a, per vocabulary entry.
        function_word_gate: paper variant: where RAG's token is a function word (the authors'
            list, :func:`.vocab.gate_mask`) keep it without comparing, as their
            released decoder does (its step 1); the comparison of Eq. 19 is then made only
            where the candidates differ in content (default, chosen on the dev sets). False:
            Eq. 19 at every disagreement, the paper's loop.
        verdict_gate: paper variant: where a disagreement decides the answer's polarity, keep
            RAG's token without comparing (:mod:`.verdict`: w_IR, a mixture of retrieved
            tokens, cannot stand for a verdict or a negation). ``"either"`` (default, chosen
            on the dev sets): where either candidate is a verdict word (it overrides a
            pure-model "No" too, so the answer states RAG's verdict); ``"rag"``: where RAG's
            token is one; None: Eq. 19 decides (the paper).
        punctuation_gate: paper variant: where the pure model's token has no letter or digit
            (:func:`.vocab.punctuation_mask`) and RAG's differs, keep RAG's token without
            comparing: a punctuation token states nothing the pure model knows, so Eq. 19 can
            only change the answer's framing there (quoting the question instead of answering
            it). The authors' gate does the same for RAG's punctuation. Default True (chosen on
            the dev sets); False: Eq. 19 decides (the paper).
        rising_gate: paper variant: where Eq. 19 would keep the pure model's token but RAG's
            token is x^{l'−l*} itself (of RAG's plausible tokens, the one its layers after the
            fusion layer l* raised most), keep RAG's token (default True, chosen on the dev
            sets); False: Eq. 19 decides (the paper).
        **legacy_speed: deprecated (``speculative``, ``block``, ``drafter``, ``fuse``): speed
            choices, now ``speed={...}`` of :func:`..api.generate` and the runner; given here
            they still apply, with a ``DeprecationWarning``.
    """

    name = "tokrag"
    roles = ("pure", "rag")
    probe_roles = frozenset({"pure", "rag"})

    def __init__(
        self,
        variant: str = "paper",
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
        **legacy_speed: Any,
    ):
        if variant not in ("paper", "reference"):
            raise ValueError(f"variant must be 'paper' or 'reference', got {variant!r}")
        if pr_norm not in ("sum", "softmax"):
            raise ValueError(f"pr_norm must be 'sum' or 'softmax', got {pr_norm!r}")
        if pr_skip not in (None, "punctuation", "reference"):
            raise ValueError(f"pr_skip must be None, 'punctuation' or 'reference', got {pr_skip!r}")
        if scorer not in ("cosine", "distribution"):
            raise ValueError(f"scorer must be 'cosine' or 'distribution', got {scorer!r}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
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
            raise ValueError(f"plausibility_alpha must be in (0, 1] or None, got {plausibility_alpha!r}")
        if not isinstance(function_word_gate, bool):
            raise ValueError(f"function_word_gate must be True or False, got {function_word_gate!r}")
        if verdict_gate not in (None, "rag", "either"):
            raise ValueError(f"verdict_gate must be None, 'rag' or 'either', got {verdict_gate!r}")
        if not isinstance(rising_gate, bool):
            raise ValueError(f"rising_gate must be True or False, got {rising_gate!r}")
        if not isinstance(punctuation_gate, bool):
            raise ValueError(f"punctuation_gate must be True or False, got {punctuation_gate!r}")
        if not isinstance(lens_norm, bool):
            raise ValueError(f"lens_norm must be True or False, got {lens_norm!r}")
        if jsd_threshold < 0:
            raise ValueError(f"jsd_threshold must be >= 0, got {jsd_threshold}")
        if fixed_layer is not None and (isinstance(fixed_layer, bool) or not isinstance(fixed_layer, int)):
            raise ValueError(f"fixed_layer must be an int or None, got {fixed_layer!r}")
        self.variant = variant
        self.pr_norm = pr_norm
        self.pr_skip = pr_skip if variant == "paper" else None
        self.scorer = scorer
        self.threshold = float(threshold)
        self.top_k = top_k if variant == "paper" else None  # the reference uses 2 and 3
        self.min_fusion_layer = min_fusion_layer
        self.lens_norm = lens_norm if variant == "paper" else False
        self.plausibility_alpha = None if plausibility_alpha is None else float(plausibility_alpha)
        self.jsd_threshold = float(jsd_threshold)
        self.fixed_layer = fixed_layer
        self.function_word_gate = function_word_gate if variant == "paper" else True
        self.verdict_gate = verdict_gate if variant == "paper" else None
        self.rising_gate = rising_gate if variant == "paper" else False
        self.punctuation_gate = punctuation_gate if variant == "paper" else False
        self.legacy_speed = legacy_speed_options(self.name, legacy_speed)

    def options(self) -> dict[str, Any]:
        paper = self.variant == "paper"
        return {
            "variant": self.variant,
            **(
                {"scorer": self.scorer, "threshold": self.threshold, "pr_norm": self.pr_norm, "pr_skip": self.pr_skip}
                if paper
                else {}
            ),
            **({"top_k": self.top_k} if paper else {}),
            **(
                {
                    "min_fusion_layer": self.min_fusion_layer,
                    "plausibility_alpha": self.plausibility_alpha,
                    "lens_norm": self.lens_norm,
                    "jsd_threshold": self.jsd_threshold,
                    "function_word_gate": self.function_word_gate,
                    "verdict_gate": self.verdict_gate,
                    "rising_gate": self.rising_gate,
                    "punctuation_gate": self.punctuation_gate,
                }
                if paper
                else {}
            ),
            **({"fixed_layer": self.fixed_layer} if self.fixed_layer is not None or not paper else {}),
        }

    def prepare(self, lm: LoadedModel) -> None:
        self._parts = model_parts(lm.model)
        self._A = self._parts.embedding_matrix.detach()
        self._L = self._parts.num_layers
        m = self.min_fusion_layer
        if m is None:
            self._lo = S.default_min_fusion_layer(self._L)
        elif isinstance(m, float):
            self._lo = S.default_min_fusion_layer(self._L, m)
        else:
            self._lo = m
        if self._lo > self._L:
            raise ValueError(
                f"min_fusion_layer={self._lo} exceeds the model's {self._L} layers"
            )
        if self.variant == "paper" and self.fixed_layer is not None and not 1 <= self.fixed_layer <= self._L:
            raise ValueError(f"fixed_layer must be in [1, {self._L}], got {self.fixed_layer}")
        if self.variant == "reference":
            fl = self.fixed_layer if self.fixed_layer is not None else REF.reference_layer(self._L) + 1
            if not 1 <= fl <= self._L:
                raise ValueError(f"fixed_layer must be in [1, {self._L}], got {fl}")
            self._fixed = fl
        # Vocabulary masks depend only on the tokenizer: built once per model. Each reads every
        # token decoded; the decoding is shared by the masks built in this call.
        V = self._A.shape[0]
        key = (id(lm.tokenizer), len(lm.tokenizer), V)
        texts = functools.cache(lambda: vocab.vocab_texts(lm.tokenizer))

        if self.variant == "reference":
            self._skip = lm.memo(("skip_mask", *key), lambda: vocab.skip_mask(lm.tokenizer, vocab_size=V))
        if self.pr_skip == "punctuation" or self.punctuation_gate:
            self._punct = lm.memo(
                ("pr_skip:punctuation", *key), lambda: vocab.punctuation_mask(lm.tokenizer, vocab_size=V, texts=texts())
            )
        if self.pr_skip == "punctuation":
            self._pr_skip = self._punct
        elif self.pr_skip == "reference":
            self._pr_skip = lm.memo(("skip_mask", *key), lambda: vocab.skip_mask(lm.tokenizer, vocab_size=V))
        if self.function_word_gate:
            self._gate = lm.memo(
                ("gate_mask", *key), lambda: vocab.gate_mask(lm.tokenizer, vocab_size=V, texts=texts())
            )
        if self.verdict_gate is not None:
            self._verdict = lm.memo(
                ("verdict_mask", *key), lambda: verdict_mask(lm.tokenizer, vocab_size=V, texts=texts())
            )
        self._tok = lm.tokenizer

    # ------------------------------------------------------------------ rule
    def choose(self, views: dict[str, View], lm: LoadedModel) -> Choice:
        gated = self.choice_without_signals(views)
        if gated is not None:
            return gated
        pure, rag = views["pure"], views["rag"]
        a = int(torch.argmax(pure.logits).item())
        b = int(torch.argmax(rag.logits).item())
        sig = (
            self.reference_signals(pure, rag)
            if self.variant == "reference"
            else self.signals(pure, rag)
        )
        rising = sig.pop("rising_id", None)
        if a == b:
            return Choice(a, AGREE, sig)
        if self.rising_gate and not sig["benefit"] and rising == b:
            sig = {**sig, "benefit": True, "note": "gated: RAG's rising token"}
        return Choice(b if sig["benefit"] else a, FROM_RAG if sig["benefit"] else FROM_LLM, sig)

    def first_lens_rows(self, views: dict[str, View]) -> torch.Tensor | None:
        """The rows of the l* search's first logit-lens product (:meth:`_first_chunk`) where
        this step searches l* (the paper variant without a fixed layer), else None."""
        if self.variant != "paper" or self.fixed_layer is not None:
            return None
        return self._first_chunk(views["pure"], views["rag"])

    def _first_chunk(self, pure: View, rag: View) -> torch.Tensor:
        """The hidden-state rows of :meth:`_fusion_layer`'s first logit-lens product."""
        attn = rag.attention_all()
        f = S.retrieved_attention_mass(attn, rag.rt_positions)
        lo = max(1, self._lo)
        f_arg = lo + int(torch.argmax(f[lo - 1 :]).item())
        rows, *_ = self._chunk_rows(pure, rag, f_arg, lo - 1, lo - 2, True, {})
        return torch.cat(rows)

    def _chunk_rows(
        self,
        pure: View,
        rag: View,
        f_arg: int,
        start: int,
        done_to: int,
        first: bool,
        rag_logp: dict[int, torch.Tensor],
    ) -> tuple[list[torch.Tensor], list[int], list[int], bool, int]:
        """The rows of one logit-lens product of the l* search (layers ``done_to + 1`` to the
        chunk's end): the pure rows (layer 0 shared with the RAG row when both contexts were
        fed the same token), the RAG rows, the extra RAG rows; with the chunk's layers, its
        extra layers, whether layer 0 is shared and the number of pure rows."""
        L = self._L
        h_pure = pure.record.resid[:, 0]  # [L+1, d]
        h_rag = rag.record.resid[:, 0]
        stop = min(start + (_LENS_FIRST if first else _LENS_CHUNK) - 1, L)
        layers = list(range(done_to + 1, stop + 1))
        # Extra RAG rows for x^{l'-l*}: the final layer (when it is not the model's own
        # output) and every l* a crossing in this chunk would give, so that no second
        # read of the LM head is needed.
        lo = max(1, self._lo)
        extra = [L] if not self.lens_norm else []
        extra += [(f_arg + c) // 2 for c in range(max(start, lo), stop + 1)]
        extra = sorted({x for x in extra if x not in rag_logp and x not in layers})
        # Layer 0 is the embedding of the token both contexts were fed: one row for both.
        share0 = layers[0] == 0 and torch.equal(h_pure[0], h_rag[0])
        p_layers = layers[1:] if share0 else layers
        rows = [h_pure[p_layers], h_rag[layers], h_rag[extra]]
        return rows, layers, extra, share0, len(p_layers)

    def choice_without_signals(self, views: dict[str, View]) -> Choice | None:
        """The choice made without the signals (the contexts agree, no retrieved tokens, a
        gated word), or None where the signals decide."""
        pure, rag = views["pure"], views["rag"]
        a = int(torch.argmax(pure.logits).item())
        b = int(torch.argmax(rag.logits).item())
        if self.variant == "paper" and a == b:
            return Choice(a, AGREE)
        if rag.spec.rt_positions == []:
            return Choice(a, AGREE if a == b else FROM_LLM, {"note": "no retrieved tokens"})
        if self.function_word_gate and bool(self._gate[b]):  # the authors' function-word gate
            return Choice(b, AGREE if a == b else FROM_RAG, {"note": "gated: function word"})
        if self.verdict_gate is not None and (
            bool(self._verdict[b]) or (self.verdict_gate == "either" and bool(self._verdict[a]))
        ):
            return Choice(b, AGREE if a == b else FROM_RAG, {"note": "gated: verdict word"})
        if self.punctuation_gate and a != b and bool(self._punct[a]):
            return Choice(b, FROM_RAG, {"note": "gated: pure punctuation"})
        if a != b and self._rising_is_rags_token(rag):
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

    def score(self, pure: View, rag: View) -> float:
        """A number > 0 where benefit wins (token-level AUC): cos(w_RAG, w_IR) − cos(w_RAG,
        w_LLM) for the cosine scorer, JSD(p_RAG, p_LLM) − JSD(p_RAG, p_R) for the distribution
        scorer."""
        if self.variant == "reference":
            return self.reference_signals(pure, rag)["margin"]
        sig = self.signals(pure, rag)
        if self.scorer == "distribution":
            return sig["jsd_llm"] - sig["jsd_ir"]
        return sig["cos_ir"] - sig["cos_llm"]

    # ------------------------------------------------------------------ signals (Eq. 13–18)
    def signals(self, pure: View, rag: View) -> dict[str, Any]:
        L, A, parts = self._L, self._A, self._parts
        rt = rag.rt_positions
        rt_ids = rag.rt_token_ids
        h_rag = rag.record.resid[:, 0]  # [L+1, d]
        if self.fixed_layer is not None:
            l_star, f_layer, g_layer, rag_logp = self.fixed_layer, None, None, {}
            attn_star = rag.attention(l_star - 1)
        else:
            attn = rag.attention_all()  # [L, H, T]
            l_star, f_layer, g_layer, rag_logp = self._fusion_layer(pure, rag, attn)
            attn_star = attn[l_star - 1]

        # Eq. 15–16: Att ⊙ WordSim over the retrieved positions -> p_R -> w_IR.
        if self.pr_skip is not None:
            keep = ~self._pr_skip[rt_ids]
            if bool(keep.any()):
                rt, rt_ids = rt[keep], rt_ids[keep]
        att = S.renormalised_attention(attn_star, rt)
        if L not in rag_logp:  # the final layer: the model's own output unless lens_norm=False
            final = rag.logits if self.lens_norm else logit_lens(parts, h_rag[L], final_norm=False)
            rag_logp[L] = torch.log_softmax(final.float(), dim=-1)
        if l_star not in rag_logp:
            lens = logit_lens(parts, h_rag[l_star], final_norm=self.lens_norm)
            rag_logp[l_star] = torch.log_softmax(lens, dim=-1)
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
    ) -> tuple[int, int, int, dict[int, torch.Tensor]]:
        """l* of Eq. 14 searched from ``self._lo``; also returns the RAG context's lensed
        log-probabilities computed on the way ({layer: [V]}), reused for x^{l'-l*}."""
        L, A, parts = self._L, self._A, self._parts
        f = S.retrieved_attention_mass(attn, rag.rt_positions)
        # g(l), Eq. 13, computed lazily: only up to the first layer crossing the threshold,
        # a few layers per LM-head product (each product reads the LM head once).
        lo = max(1, self._lo)
        bound = self.jsd_threshold * A.shape[0]
        g = torch.full((L,), float("nan"))
        f_arg = lo + int(torch.argmax(f[lo - 1 :]).item())
        rag_logp: dict[int, torch.Tensor] = {}  # layer -> log phi(h~^l)
        prev_p = prev_r = None
        start, done_to = lo - 1, lo - 2  # lens rows of layers start..stop, then stop+1...
        while done_to < L:
            rows, layers, extra, share0, n_p = self._chunk_rows(
                pure, rag, f_arg, start, done_to, prev_p is None, rag_logp
            )
            stop = layers[-1]
            n = len(layers)
            if prev_p is None and rag.lens_first is not None:
                logp = rag.lens_first  # the same rows, lensed with other queries' (first_lens_rows)
            else:
                logp = torch.log_softmax(
                    logit_lens(parts, torch.cat(rows), final_norm=self.lens_norm), dim=-1
                )
            lp, lr = logp[:n_p], logp[n_p : n_p + n]
            if share0:
                lp = torch.cat([lr[:1], lp])
            for j, layer in enumerate(layers):
                rag_logp[layer] = lr[j]
            for j, layer in enumerate(extra):
                rag_logp[layer] = logp[n_p + n + j]
            if prev_p is not None:
                lp = torch.cat([prev_p[None], lp])
                lr = torch.cat([prev_r[None], lr])
            shift = S.layer_shift_jsd_logp(torch.stack([lr, lp]))  # both contexts at once
            gap = S.distribution_change_gap(shift[0], shift[1])
            first = layers[0] + (1 if prev_p is None else 0)  # 1-based layer of gap[0]
            g[first - 1 : stop] = gap.float()
            prev_p, prev_r = lp[-1], lr[-1]
            done_to = stop
            if S.first_crossing(g[:stop], bound, start_layer=lo) is not None:
                break
            start = stop + 1
        l_star, f_layer, g_layer = S.fusion_layer(
            f, g, vocab_size=A.shape[0], threshold=self.jsd_threshold, min_fusion_layer=self._lo
        )
        return l_star, f_layer, g_layer, rag_logp

    def reference_signals(self, pure: View, rag: View) -> dict[str, Any]:
        """The authors' released-code rule (docs/algorithm.md, "The authors' released rule")."""
        sig = REF.reference_signals(
            rag.attention(self._fixed - 1),
            rag.rt_positions,
            rag.rt_token_ids,
            rag.probs,
            pure.probs,
            self._A,
            skip=self._skip,
            **REF.preset_kwargs("generation"),
        )
        return {
            "l_star": self._fixed,
            "cos_ir": sig["cos_ir"],
            "cos_llm": sig["cos_llm"],
            "benefit": sig["benefit"],
            "margin": sig["margin"],
            "attended": [self._tok.decode([t]) for t in sig["attended"]],
        }
