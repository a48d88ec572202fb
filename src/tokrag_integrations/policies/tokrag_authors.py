"""The Tok-RAG authors' released decision rule (public repo xsc1234/Tok-RAG, commit f78f1b3).

A port, written from scratch, of what their code computes at one decoding step; the citations
name the file and lines each step follows. Three places in their repository implement the
rule, with different settings (:data:`PRESETS`):

``"generation"`` (the default) — the collaborative decoding loop,
    ``my_transformers/generation/utils.py``, ``dola_greedy_decode_multi_ids`` (2877-3190),
    its comparison in ``get_predict_emb_contrastive`` (2822-2875). (No released script
    reaches it: ``generate`` dispatches to it only when ``no_rag_ids`` is passed (1600), and
    its ``rate`` has no default (``None``, 1197), which would fail at line 2872.)
``"odqa"`` — ``Open-domain-QA/Tok-RAG_for_ODQA.py`` (598-629 with 427-472): the same rule
    applied once per question, at the first content token after "is", as a classifier.
``"token_level"`` — ``Primary experiment/comparing_benefit_and_detriment.py`` (692-729): a
    teacher-forced, every-token classifier.

The steps (utils.py lines; the ODQA script's in brackets):

1. Gate (3070-3073): if the decoded RAG argmax token is in their ``filter_words``
   (2960-2964; ODQA 400-402), RAG's token is taken with no comparison. :func:`gate_mask`.
2. Attention (3083, 3086-3087 [605-608]): the post-softmax attention (``outputs.attentions``,
   modeling_llama.py 831-832) of the fixed 0-based decoder layer 20 of 32 (the ODQA script
   sweeps layers 0-31, 689/693/797), restricted to the retrieved prefix, *averaged over heads
   without renormalisation*. :func:`head_mean_attention`. (Their code reads query row 0
   (``[0, :, 0, :]``), which at the first generated token is the prompt's first token, a bug
   not copied: pass the last position's row.)
3. Ranking (3088 [609]): retrieved positions sorted by that attention, the top 100 (ODQA: all).
4. Selection (2853-2858 [452-456]): walk the ranking, skip a position whose token piece is
   one of ``skip_words`` (2824-2825; ODQA 405), stop after 3 positions not skipped.
   :func:`skip_mask`, :func:`select_attended`.
5. w_IR candidates (2859-2862 [457-461]): for each chosen position i the input embeddings of
   the retrieved tokens at i-2 ... i+1 (an asymmetric window clipped to the retrieved span;
   the neighbours are *not* checked against ``skip_words``).
6. cos_IR (2852, 2863-2866 [451, 463-466]): the maximum, over those single tokens, of
   cos(w_RAG, embedding); the running maximum starts at 0, so cos_IR >= 0.
7. w_RAG (3092, 2827-2832 [613, 429-435]): Σ p·E over the top-**2** RAG probabilities.
8. w_LLM, cos_LLM (2838-2848 [440-449]): the same over the top-**3** pure-LLM probabilities;
   cos_LLM = cos(w_RAG, w_LLM).
9. Decision (2872, 3102-3105 [469]): keep RAG's distribution iff ``rate * cos_IR > cos_LLM``
   (strict; ODQA: rate 1), else the pure LLM's. Steps 2-9 run at every step not gated by
   step 1, whether or not the two argmaxes differ (3063-3101).

Their token-level script differs: 0-based layer 16 (701), top-10 positions (703), no skip
list, single tokens (704-706), w_RAG and w_LLM both over the top-3 probabilities (685-722),
the maximum over attention ranks 3-7 only (``cos_sim[2:7]``, 715-716, no 0 floor), benefit
iff that maximum > cos_LLM (726-729), at every answer token (696).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..attention.parts import model_parts
from ..models import LoadedModel
from ..prompts import PromptPlan
from ..trace import AGREE, FROM_PURE, FROM_RAG
from .base import Choice, ContextSpec, Lens, Policy, View
from .vocab import gate_mask, skip_mask

#: Settings of the three places the rule is implemented (see the module docstring).
#: ``layer_fraction``: 0-based decoder layer / 32 (LLaMA-2-7B). ``max_ranked``: how many
#: ranked positions are walked (None = all). ``rank_offset``: leading ranks dropped.
_GENERATION: dict[str, Any] = dict(
    layer_fraction=20 / 32,
    max_ranked=100,
    rank_offset=0,
    n_positions=3,
    window=(2, 1),
    use_skip=True,
    top_k_rag=2,
    top_k_llm=3,
    floor=0.0,
    gate=True,
)
PRESETS: dict[str, dict[str, Any]] = {
    "generation": _GENERATION,
    "odqa": {**_GENERATION, "max_ranked": None},
    "token_level": dict(
        layer_fraction=16 / 32,
        max_ranked=10,
        rank_offset=2,
        n_positions=5,
        window=(0, 0),
        use_skip=False,
        top_k_rag=3,
        top_k_llm=3,
        floor=None,
        gate=False,
    ),
}


def preset_kwargs(preset: str = "generation") -> dict[str, Any]:
    """The :func:`authors_signals` keyword arguments of a preset: all its settings but the
    layer, the skip list and the gate, which the caller applies (pass :func:`skip_mask` as
    ``skip`` where ``PRESETS[preset]["use_skip"]``)."""
    caller = ("layer_fraction", "use_skip", "gate")
    return {k: v for k, v in PRESETS[preset].items() if k not in caller}


def authors_layer(num_layers: int, preset: str = "generation") -> int:
    """0-based decoder layer whose attention the rule reads: their layer 20 of 32 (utils.py
    3083; 16 of 32 in the token-level script, 701) scaled to ``num_layers`` and clipped.

    ``outputs.attentions[20]`` is the 21st decoder layer (one entry per layer,
    modeling_llama.py 831-832): pass ``ContextView.attention(authors_layer(L))``, not
    ``attention(round(20/32·L) - 1)``.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    return min(num_layers - 1, max(0, round(PRESETS[preset]["layer_fraction"] * num_layers)))


def head_mean_attention(attn_layer: torch.Tensor, rt_positions: torch.Tensor) -> torch.Tensor:
    """Step 2: [H, T] post-softmax attention of the current query -> [m], the mean over heads
    of the weights at the retrieved positions (no renormalisation over them, unlike
    :func:`..signals.renormalised_attention`; utils.py 3086-3087)."""
    if attn_layer.dim() != 2:
        raise ValueError(f"attn_layer must be [H, T], got shape {tuple(attn_layer.shape)}")
    return attn_layer.float().index_select(-1, rt_positions.to(attn_layer.device)).mean(0)


def select_attended(
    att: torch.Tensor,
    rt_token_ids: torch.Tensor,
    skip: torch.Tensor | None,
    *,
    n_positions: int = 3,
    max_ranked: int | None = 100,
    rank_offset: int = 0,
) -> list[int]:
    """Steps 3-4: indices into the retrieved span of the chosen positions, most attended
    first: rank by ``att`` (ties: the earlier position first), keep the first ``max_ranked``,
    drop the first ``rank_offset``, then take the first ``n_positions`` whose token is not in
    ``skip`` (skipped ones do not count; utils.py 3088, 2853-2858)."""
    m = int(att.numel())
    order = torch.sort(att.float(), descending=True, stable=True).indices.tolist()
    if max_ranked is not None:  # their topk(att, 100) fails for m < 100; here: min(100, m)
        order = order[: min(max_ranked, m)]
    order = order[rank_offset:]
    chosen: list[int] = []
    ids = rt_token_ids.tolist()
    for j in order:
        if len(chosen) == n_positions:
            break
        if skip is not None and 0 <= ids[j] < skip.numel() and bool(skip[ids[j]]):
            continue
        chosen.append(j)
    return chosen


def top_k_embedding(probs: torch.Tensor, embeddings: torch.Tensor, k: int) -> torch.Tensor:
    """Steps 7-8: Σ_{v in top-k} p(v)·A[v] (their sum is not divided by Σp; cosine is
    unaffected). ``probs`` are probabilities (their ``temp['logits']`` is a softmax)."""
    if k < 1:
        raise ValueError(f"top-k must be >= 1, got {k}")
    vals, idx = torch.topk(probs.float(), min(k, probs.shape[-1]))
    return vals.to(embeddings.device) @ embeddings[idx.to(embeddings.device)].float()


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def authors_signals(
    attn_layer: torch.Tensor,
    rt_positions: torch.Tensor,
    rt_token_ids: torch.Tensor,
    rag_probs: torch.Tensor,
    pure_probs: torch.Tensor,
    embeddings: torch.Tensor,
    *,
    skip: torch.Tensor | None = None,
    n_positions: int = 3,
    window: tuple[int, int] = (2, 1),
    top_k_rag: int = 2,
    top_k_llm: int = 3,
    max_ranked: int | None = 100,
    rank_offset: int = 0,
    floor: float | None = 0.0,
    rate: float = 1.0,
) -> dict[str, Any]:
    """One step of the authors' rule (steps 2-9 of the module docstring; step 1, the gate,
    is the caller's: :func:`gate_mask`). Defaults = the "generation" preset (utils.py); see
    :func:`preset_kwargs` for the others.

    Args:
        attn_layer: [H, T] post-softmax attention of the *current* (last) query position at
            the layer :func:`authors_layer` names (not row 0 at the first step: their bug).
        rt_positions: [m] long, positions of the retrieved tokens in ``attn_layer``'s key
            axis, in text order (windows run over this order).
        rt_token_ids: [m] long, their token ids.
        rag_probs / pure_probs: [V] next-token probabilities with / without retrieval.
        embeddings: [V, d] the *input* embedding matrix.
        skip: [V] bool from :func:`skip_mask` (None = skip nothing, the token-level script).
        n_positions: non-skipped positions used (3; 5 in the token-level script).
        window: (left, right) neighbours embedded around each chosen position: (2, 1) is
            their i-2 ... i+1 (utils.py 2859-2861); (0, 0) = the single token.
        top_k_rag / top_k_llm: tokens in w_RAG (2) and w_LLM (3).
        max_ranked: ranked positions walked (100; None = all, the ODQA script).
        rank_offset: leading ranks dropped (2 in the token-level script's ``cos_sim[2:7]``).
        floor: start value of the running maximum (0.0, utils.py 2852; None = no floor, and
            -1.0 when no position is chosen).
        rate: benefit iff ``rate * cos_ir > cos_llm`` (utils.py 2872; 1 in the ODQA script).

    Returns a dict: ``cos_ir``, ``cos_llm`` (floats), ``benefit`` (bool: keep RAG's token),
    ``margin`` (``rate * cos_ir - cos_llm``, > 0 where benefit wins), ``attended`` (token ids
    of the chosen positions, most attended first), ``attended_index`` (their indices in the
    retrieved span), ``best_token`` (token id giving cos_ir, None when the floor wins).
    """
    if rt_positions.numel() != rt_token_ids.numel():
        raise ValueError("rt_positions and rt_token_ids must have the same length")
    wl, wr = window
    if wl < 0 or wr < 0:
        raise ValueError(f"window must be two ints >= 0, got {window!r}")
    m = int(rt_token_ids.numel())
    A = embeddings
    w_rag = top_k_embedding(rag_probs, A, top_k_rag)
    w_llm = top_k_embedding(pure_probs, A, top_k_llm)
    cos_llm = float(_cos(w_rag, w_llm).item())

    chosen: list[int] = []
    best, best_token = (floor if floor is not None else -math.inf), None
    if m:
        att = head_mean_attention(attn_layer, rt_positions)
        chosen = select_attended(
            att,
            rt_token_ids,
            skip,
            n_positions=n_positions,
            max_ranked=max_ranked,
            rank_offset=rank_offset,
        )
    if chosen:
        ids = rt_token_ids.to(A.device)
        cand = sorted({c for j in chosen for c in range(max(0, j - wl), min(m - 1, j + wr) + 1)})
        cand_ids = ids[torch.tensor(cand, dtype=torch.long, device=A.device)]
        cos = _cos(w_rag[None], A[cand_ids].float())  # one cosine per single token
        k = int(torch.argmax(cos).item())
        if float(cos[k]) > best:  # their running max: strictly greater replaces
            best, best_token = float(cos[k]), int(cand_ids[k])
    if best == -math.inf:
        best = -1.0
    if math.isnan(best) or math.isnan(cos_llm):
        raise ValueError("cosine similarities must not be NaN")
    margin = rate * best - cos_llm
    return {
        "cos_ir": best,
        "cos_llm": cos_llm,
        "benefit": rate * best > cos_llm,
        "margin": margin,
        "attended": [int(rt_token_ids[j]) for j in chosen],
        "attended_index": chosen,
        "best_token": best_token,
    }


class TokRAGAuthors(Policy):
    """The authors' released rule as a decoder (the ``"generation"`` preset): RAG's token
    taken at once where it is a function word (step 1), else steps 2-9 at every step,
    whether or not the candidates differ (docs/algorithm.md, "The authors' released rule").
    Their first-token bug (the attention row of the wrong query position) is not copied.

    Args:
        fixed_layer: the 1-based layer whose attention the rule reads (default: their
            0-based layer 20 of 32 scaled to L, plus one; :func:`authors_layer`).
    """

    name = "tokrag_authors"
    roles = ("pure", "rag")

    def __init__(self, fixed_layer: int | None = None):
        if fixed_layer is not None and (
            isinstance(fixed_layer, bool) or not isinstance(fixed_layer, int)
        ):
            raise ValueError(f"fixed_layer must be an int or None, got {fixed_layer!r}")
        self.fixed_layer = fixed_layer

    def options(self) -> dict[str, Any]:
        return {"fixed_layer": self.fixed_layer}

    def contexts(self, plan: PromptPlan) -> dict[str, ContextSpec]:
        """Both contexts; the RAG one probed (the rule reads one layer's attention)."""
        return {
            "pure": ContextSpec(plan.pure_ids),
            "rag": ContextSpec(plan.rag_ids, plan.retrieved_positions, probe=True),
        }

    def prepare(self, lm: LoadedModel) -> None:
        parts = model_parts(lm.model)
        self._A = parts.embedding_matrix.detach()
        L = parts.num_layers
        self._fixed = self.fixed_layer if self.fixed_layer is not None else authors_layer(L) + 1
        if not 1 <= self._fixed <= L:
            raise ValueError(f"fixed_layer must be in [1, {L}], got {self._fixed}")
        tok, V = lm.tokenizer, self._A.shape[0]
        key = (id(tok), len(tok), V)
        self._gate = lm.memo(("gate_mask", *key), lambda: gate_mask(tok, vocab_size=V))
        self._skip = lm.memo(("skip_mask", *key), lambda: skip_mask(tok, vocab_size=V))
        self._tok = tok

    def choose(self, views: list[dict[str, View]], lens: Lens) -> list[Choice]:
        out = [self._one(v["pure"], v["rag"]) for v in views]
        for c, v in zip(out, views, strict=True):  # the chosen source's distribution
            c.logits = v["pure" if c.source == FROM_PURE else "rag"].logits
        return out

    def _one(self, pure: View, rag: View) -> Choice:
        a = int(torch.argmax(pure.logits).item())
        b = int(torch.argmax(rag.logits).item())
        if not rag.spec.rt_positions:
            return Choice(a, AGREE if a == b else FROM_PURE, {"note": "no retrieved tokens"})
        if bool(self._gate[b]):  # step 1: the function-word gate
            return Choice(b, AGREE if a == b else FROM_RAG, {"note": "gated: function word"})
        sig = self.signals(pure, rag)
        if a == b:
            return Choice(a, AGREE, sig)
        return Choice(b if sig["benefit"] else a, FROM_RAG if sig["benefit"] else FROM_PURE, sig)

    def score(self, pure: View, rag: View, lens: Lens) -> float:
        """``rate * cos_IR - cos_LLM`` (> 0 where benefit wins; token-level AUC)."""
        return self.signals(pure, rag)["margin"]

    def signals(self, pure: View, rag: View) -> dict[str, Any]:
        """Steps 2-9 at one step (:func:`authors_signals`, the "generation" preset)."""
        sig = authors_signals(
            rag.attention(self._fixed - 1),
            rag.rt_positions,
            rag.rt_token_ids,
            rag.probs,
            pure.probs,
            self._A,
            skip=self._skip,
            **preset_kwargs("generation"),
        )
        kept = {k: sig[k] for k in ("cos_ir", "cos_llm", "benefit", "margin")}
        attended = [self._tok.decode([t]) for t in sig["attended"]]
        return {"l_star": self._fixed, **kept, "attended": attended}
