"""CtrlAGate: confidence monitoring from the model's own representations (seed 002, CtrlA).

1. **Directions** (:func:`extract_directions`): for each statement s_i (:mod:`.statements`),
   the last-token residual r^l after every layer l of "Pretend you're {a confident | an
   unconfident} person making statements about the world." + s_i ({an honest | a dishonest}
   for honesty); v_i^l = r_i^{l,+} - r_i^{l,-}; per layer, the first principal component of
   {v_i^l} (pair signs randomly flipped before centring, as RepE does), oriented so the mean
   of v_i^l . v^l is positive (positive side = confident / honest), unit norm.
2. **Monitoring** (:class:`CtrlAMonitorPolicy`): at decoding step k the last position's
   residual (the state that chooses token k) gives m~_k = meanpool_l(r_k^l . v_c^l) over the
   read band; z_k is its z-score over the calibration answers' content tokens. A content
   token (not a stopword, not a word of the question) with z_k < tau, or a refusal phrase,
   triggers retrieval mid-answer: the decode stops at that token.
3. **CAQ** (:func:`masked_query`): the query plus the generated text with the new,
   unconfident tokens masked out; the answer is regenerated from the retrieved passages.
4. **Honesty steering** (optional, :func:`steering`): lambda * v_h^l is added to the output
   of every layer of the steer band (lambda = 0.3 in the paper's best run).

Bands are fractions of depth: the public CtrlA config reads layers -10..-24 and steers -5..-17
of Mistral-7B's 32. The score is min_k z_k over content tokens (-inf on a refusal, +inf with
no content token); retrieve when below tau, the calibrated threshold.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ..config import require_bool
from ..engine.passes import last_token_states
from ..models import LoadedModel
from ..policies.base import Choice, ContextSpec, Lens, Policy, View
from ..prompts import render_chat_template
from ..trace import FROM_PURE
from .gate_base import Gate
from .statements import INSTRUCTION, PERSONAS, STATEMENTS

#: A small English stopword list (function words, auxiliaries, common fillers).
STOPWORDS = frozenset(
    """a about above after again against all am an and any are as at be because been before
    being below between both but by can could did do does doing down during each few for from
    further had has have having he her here hers herself him himself his how i if in into is it
    its itself just me more most my myself no nor not now of off on once only or other our ours
    ourselves out over own same she should so some such than that the their theirs them
    themselves then there these they this those through to too under until up very was we were
    what when where which while who whom why will with would you your yours yourself
    yourselves also answer question yes well one may might must shall like known called""".split()
)

#: Phrases of a refusal (lower case); one in the answer triggers retrieval.
REFUSALS = tuple(
    "i don't know|i do not know|i'm not sure|i am not sure|not sure|no information|i cannot|"
    "i can't|unknown|i'm sorry|i am sorry".split("|")
)

_WORD = re.compile(r"[A-Za-z0-9]+")


def layer_band(num_layers: int, band: tuple[float, float]) -> list[int]:
    """1-based layers l with band[0] <= l / L <= band[1] (at least one)."""
    lo, hi = band
    if not 0 <= lo <= hi <= 1:
        raise ValueError(f"a layer band is (lo, hi) with 0 <= lo <= hi <= 1, got {band}")
    out = [li for li in range(1, num_layers + 1) if lo <= li / num_layers <= hi]
    return out or [max(1, round(hi * num_layers))]


def _persona_prompt(lm: LoadedModel, persona: str, statement: str) -> list[int]:
    tok = lm.tokenizer
    instr = INSTRUCTION.format(persona=persona)
    if getattr(tok, "chat_template", None):
        head = render_chat_template(
            tok, [{"role": "user", "content": instr}], tokenize=False, add_generation_prompt=True
        )
        text = head + statement
    else:
        text = f"{instr}\n{statement}"
    return list(tok(text, add_special_tokens=False)["input_ids"])


def contrast_differences(
    lm: LoadedModel, statements: Sequence[str], kind: str = "confidence"
) -> torch.Tensor:
    """[S, L+1, d]: r^+ - r^- per statement and layer (last token of each prompt)."""
    if kind not in PERSONAS:
        raise ValueError(f"kind must be one of {sorted(PERSONAS)}, got {kind!r}")
    pos, neg = PERSONAS[kind]
    a = last_token_states(lm, [_persona_prompt(lm, pos, s) for s in statements])
    b = last_token_states(lm, [_persona_prompt(lm, neg, s) for s in statements])
    return a - b


def pca_directions(diffs: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """First principal component per layer of the differences, sign oriented, unit norm.

    Args:
        diffs: [S, L+1, d] pair differences (positive minus negative).

    Returns:
        [L+1, d] directions (row 0, the embeddings, is included for indexing convenience).
    """
    if diffs.ndim != 3 or diffs.shape[0] < 2:
        raise ValueError(f"need [S >= 2, L+1, d] differences, got {tuple(diffs.shape)}")
    g = torch.Generator().manual_seed(seed)
    flips = (torch.randint(0, 2, (diffs.shape[0],), generator=g).float() * 2 - 1).view(-1, 1)
    out = []
    for li in range(diffs.shape[1]):
        d = diffs[:, li, :].double()
        x = d * flips.double()
        x = x - x.mean(0, keepdim=True)
        _, _, vh = torch.linalg.svd(x, full_matrices=False)
        v = vh[0]
        if (d @ v).mean() < 0:
            v = -v
        out.append((v / v.norm()).float())
    return torch.stack(out)


def extract_directions(
    lm: LoadedModel, statements: Sequence[str] = STATEMENTS, kind: str = "confidence", seed: int = 0
) -> torch.Tensor:
    """[L+1, d] CtrlA directions of ``kind`` ("confidence" or "honesty")."""
    return pca_directions(contrast_differences(lm, statements, kind), seed)


@contextlib.contextmanager
def steering(
    lm: LoadedModel, direction: torch.Tensor, lam: float, layers: Sequence[int]
) -> Iterator[None]:
    """Add ``lam * direction[l]`` to the output of each 1-based layer l in ``layers``."""
    from ..attention.parts import model_parts

    parts = model_parts(lm.model)
    handles = []
    for li in layers:
        vec = (lam * direction[li]).to(lm.model.dtype).to(lm.model.device)

        def hook(_m: Any, _inp: Any, out: Any, vec: torch.Tensor = vec) -> Any:
            if isinstance(out, (tuple, list)):
                return (out[0] + vec, *out[1:])
            return out + vec

        handles.append(parts.layers[li - 1].register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _words(text: str) -> set[str]:
    return {w.lower() for w in _WORD.findall(text)}


def _refuses(text: str) -> bool:
    low = text.lower()
    return any(p in low for p in REFUSALS)


class CtrlAMonitorPolicy(Policy):
    """Greedy decoding of the pure context that records CtrlA's per-token confidence.

    Each step's ``signals`` carry ``ctrla_m`` (the pooled projection m~_k), ``ctrla_z``
    (its z-score, when calibrated) and ``ctrla_content``. With ``stop_on_trigger`` the
    decode ends (EOS) at the first content token whose z-score is below ``tau``.
    """

    name = "ctrla_monitor"
    roles = ("pure",)

    def __init__(
        self,
        direction: torch.Tensor,
        layers: Sequence[int],
        question: str,
        *,
        mean: float | None = None,
        std: float | None = None,
        tau: float | None = None,
        stop_on_trigger: bool = False,
        eos_id: int = 0,
    ):
        self.direction = direction
        self.layers = list(layers)
        self.question_words = _words(question)
        self.mean, self.std, self.tau = mean, std, tau
        self.stop_on_trigger = require_bool(stop_on_trigger, "stop_on_trigger")
        self.eos_id = eos_id
        self.triggered_at: int | None = None
        self.tokens: list[dict[str, Any]] = []

    def options(self) -> dict[str, Any]:
        return {"layers": self.layers, "tau": self.tau}

    def contexts(self, plan: Any) -> dict[str, ContextSpec]:
        return {"pure": ContextSpec(plan.pure_ids, probe=True)}  # reads the pure layers

    def prepare(self, lm: LoadedModel) -> None:
        self._lm = lm

    def choose(self, views: list[dict[str, View]], lens: Lens) -> list[Choice]:
        return [self._one(v["pure"], self._lm) for v in views]

    def _one(self, v: View, lm: LoadedModel) -> Choice:
        tid = int(torch.argmax(v.logits).item())
        resid = v.record.resid[self.layers, 0, :].float()  # [band, d]
        dirs = self.direction[self.layers].to(resid.device)
        m = float((resid * dirs).sum(-1).mean())
        text = lm.tokenizer.decode([tid])
        # content: a word that is neither a stopword nor a word of the question
        content = tid not in lm.eos_token_ids and any(
            w not in STOPWORDS and w not in self.question_words for w in _words(text)
        )
        z = (m - self.mean) / self.std if self.mean is not None and self.std else None
        sig: dict[str, Any] = {"ctrla_m": m, "ctrla_content": content}
        if z is not None:
            sig["ctrla_z"] = z
        self.tokens.append({"text": text, "m": m, "z": z, "content": content})
        if (
            self.stop_on_trigger
            and self.triggered_at is None
            and content
            and z is not None
            and self.tau is not None
            and z < self.tau
        ):
            self.triggered_at = len(self.tokens) - 1
            return Choice(self.eos_id, FROM_PURE, {**sig, "ctrla_trigger": True})
        return Choice(tid, FROM_PURE, sig)


def masked_query(query: str, tokens: Sequence[dict[str, Any]], tau: float) -> str:
    """CAQ: ``query`` + the answer with new unconfident content tokens masked out."""
    qwords = _words(query)
    seen: set[str] = set()
    kept: list[str] = []
    for t in tokens:
        words = _words(t["text"])
        new = bool(words) and not (words <= qwords or words <= seen)
        unconfident = t["content"] and t["z"] is not None and t["z"] < tau
        if not (new and unconfident):
            kept.append(t["text"])
        seen |= words
    masked = re.sub(r"\s+", " ", "".join(kept)).strip()
    return f"{query.strip()} {masked}".strip()


class CtrlAGate(Gate):
    """Retrieve when the model's confidence representation drops on a content token.

    Args:
        lm: a ``LoadedModel``.
        read_band / steer_band: relative layer bands (fractions of depth).
        lam: honesty steering strength (0 = off; the paper's best: 0.3).
        max_new_tokens: answer length while monitoring.
        statements: the contrastive statement set (default: :data:`.statements.STATEMENTS`).
        directions: precomputed ``{"confidence": [L+1, d], "honesty": [L+1, d]}``.
    """

    name = "ctrla"
    retrieve_when = "below"
    config_keys = ("read_band", "steer_band", "lam", "max_new_tokens", "seed")

    def __init__(
        self,
        lm: Any,
        *,
        read_band: tuple[float, float] = (0.28, 0.72),
        steer_band: tuple[float, float] = (0.50, 0.88),
        lam: float = 0.0,
        max_new_tokens: int = 16,
        statements: Sequence[str] | None = None,
        directions: dict[str, Any] | None = None,
        seed: int = 0,
        threshold: float | None = None,
    ):
        super().__init__(threshold)
        self.lm = lm
        self.read_band = tuple(read_band)
        self.steer_band = tuple(steer_band)
        self.read_layers = layer_band(lm.num_layers, self.read_band)
        self.steer_layers = layer_band(lm.num_layers, self.steer_band)
        self.lam = float(lam)
        self.max_new_tokens = int(max_new_tokens)
        self.statements = list(statements) if statements is not None else list(STATEMENTS)
        self.seed = seed
        self.directions: dict[str, torch.Tensor] = {}
        if directions:
            self.directions = {
                k: torch.as_tensor(v, dtype=torch.float32) for k, v in directions.items()
            }
        self.mean: float | None = None
        self.std: float | None = None

    def state(self) -> dict[str, Any]:
        return {
            "mean": self.mean,
            "std": self.std,
            "directions": {k: v.tolist() for k, v in self.directions.items()},
        }

    def set_state(self, state: dict[str, Any], folder: Path) -> None:
        self.mean = state.get("mean")
        self.std = state.get("std")
        for k, v in (state.get("directions") or {}).items():
            self.directions[k] = torch.tensor(v, dtype=torch.float32)

    # ------------------------------------------------------------------ directions
    def fit_directions(self) -> dict[str, torch.Tensor]:
        kinds = ["confidence"] + (["honesty"] if self.lam else [])
        for k in kinds:
            if k not in self.directions:
                self.directions[k] = extract_directions(self.lm, self.statements, k, self.seed)
        return self.directions

    # ------------------------------------------------------------------ monitoring
    def monitor(
        self, query: str, *, stop_on_trigger: bool = False, max_new_tokens: int | None = None
    ) -> tuple[Any, CtrlAMonitorPolicy]:
        """One monitored greedy decode of the pure context (steered if ``lam``)."""
        from ..engine.scheduler import generate

        self.fit_directions()
        pol = CtrlAMonitorPolicy(
            self.directions["confidence"],
            self.read_layers,
            query,
            mean=self.mean,
            std=self.std,
            tau=self.threshold,
            stop_on_trigger=stop_on_trigger,
            eos_id=self.lm.eos_token_ids[0],
        )
        ctx = (
            steering(self.lm, self.directions["honesty"], self.lam, self.steer_layers)
            if self.lam
            else contextlib.nullcontext()
        )
        with ctx:
            r = generate(
                self.lm,
                query,
                None,
                policy=pol,
                max_new_tokens=max_new_tokens or self.max_new_tokens,
                stop=["\n"],
            )
        return r, pol

    def score_tokens(self, text: str, tokens: Sequence[dict[str, Any]]) -> float:
        """min z over content tokens; -inf on a refusal, +inf without a content token."""
        if _refuses(text):
            return -math.inf
        zs = [t["z"] for t in tokens if t["content"] and t["z"] is not None]
        return min(zs) if zs else math.inf

    def score(self, query: str) -> tuple[float, dict[str, Any]]:
        if self.mean is None:
            raise RuntimeError(
                "CtrlAGate needs calibration (token statistics): call calibrate(queries) or load(path)."
            )
        r, pol = self.monitor(query)
        s = self.score_tokens(r.text, pol.tokens)
        return s, {
            "draft": r.text,
            "tokens": pol.tokens,
            "read_layers": self.read_layers,
        }

    def calibration_scores(self, queries: list[str], **kwargs: Any) -> list[float]:
        """Fits the z-score statistics on the calibration answers' content tokens."""
        runs = [self.monitor(q) for q in queries]
        ms = [t["m"] for _, pol in runs for t in pol.tokens if t["content"]]
        if len(ms) < 2:
            ms = [t["m"] for _, pol in runs for t in pol.tokens]
        t = torch.tensor(ms, dtype=torch.float64)
        self.mean, self.std = float(t.mean()), float(t.std().clamp(min=1e-6))
        scores = []
        for r, pol in runs:
            for tk in pol.tokens:
                tk["z"] = (tk["m"] - self.mean) / self.std
            scores.append(self.score_tokens(r.text, pol.tokens))
        return scores

    # ------------------------------------------------------------------ the pipeline
    def answer(
        self,
        query: str,
        retriever: Any = None,
        *,
        top_k: int = 3,
        policy: str = "rag",
        max_new_tokens: int = 64,
    ) -> dict[str, Any]:
        """CtrlA inference: decode while monitoring; on a trigger stop, form the CAQ query,
        retrieve and regenerate with the passages. Returns the answer, the decision and
        (when it retrieved) the CAQ query and passages."""
        from ..engine.scheduler import generate

        if self.threshold is None or self.mean is None:
            raise RuntimeError("CtrlAGate needs calibrate(queries) or load(path) before answer().")
        r, pol = self.monitor(query, stop_on_trigger=True, max_new_tokens=max_new_tokens)
        triggered = pol.triggered_at is not None or _refuses(r.text)
        out: dict[str, Any] = {
            "retrieve": triggered,
            "trigger_step": pol.triggered_at,
            "score": self.score_tokens(r.text, pol.tokens),
            "threshold": self.threshold,
            "draft": r.text,
            "tokens": pol.tokens,
        }
        if not triggered:
            out["text"], out["result"] = r.text, r
            return out
        caq = masked_query(query, pol.tokens, self.threshold)
        out["query"] = caq
        passages: list[Any] = []
        if retriever is not None:
            hits = retriever.retrieve(caq, top_k=top_k)
            passages = [getattr(h, "text", h) for h in hits]
        out["passages"] = passages
        res = generate(
            self.lm, query, passages, policy=policy, max_new_tokens=max_new_tokens, stop=["\n"]
        )
        out["text"], out["result"] = res.text, res
        return out
