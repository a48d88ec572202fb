"""GECEGate: long-tail detection with Generative Expected Calibration Error (seed 004, Eq. 2).

    GECE = |M(pred, ref) - (1/n) sum_i p(t_i)| / (alpha * [E(grad) . grad_ins])

* ``M``: METEOR (:func:`meteor`), exact and Porter-stem stages only (no WordNet data is
  shipped and nothing is downloaded), F_mean = 10PR / (R + 9P), penalty 0.5 (chunks/matches)^3.
* ``(1/n) sum p(t_i)``: mean probability of the generated tokens (the decoder's step stats).
* ``alpha``: mean ``wordfreq`` frequency (English) of the words of query + answer.
* ``grad_ins``: gradient of the LM loss of (query -> answer) w.r.t. the FFN weights of the
  last eighth of the layers; ``E(grad)``: its mean over a calibration set. ``sketch_dim=k``
  replaces each gradient by a CountSketch S g in R^k (coordinate hashed to one of k buckets
  with a random sign, fixed by ``seed``): E[<S a, S b>] = <a, b>, variance about
  (|a|^2 |b|^2 + <a, b>^2) / k; ``sketch_dim=None`` uses exact gradients. The denominator
  uses ``max(dot, 1e-3 * |E(grad)|^2)``, so a dot product <= 0 scores as the most long-tail.

Modes: ``gold`` is Eq. 2 with gold answers (``score(query, reference=[...])``); ``self``
(inference, no gold answer) takes ref = ``n_samples`` sampled answers (temperature 0.6,
top-p 0.9), pred = the greedy answer, M = mean METEOR of pred against the samples. Larger
GECE = more long-tail = retrieve; the default threshold is the 80th percentile.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from ..policies.base import Choice, ContextSpec, Lens, Policy, View
from ..prompts import PromptPlan
from ..trace import FROM_PURE
from .confidence import draft_answer
from .gate_base import Gate

_WORD = re.compile(r"[A-Za-z0-9]+(?:'[A-Za-z]+)?")


def _words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text or "")]


@lru_cache(maxsize=1)
def _stemmer() -> Any:
    from nltk.stem.porter import PorterStemmer

    return PorterStemmer()


def meteor(
    pred: str, ref: str, *, alpha: float = 0.9, beta: float = 3.0, gamma: float = 0.5
) -> float:
    """METEOR (Banerjee & Lavie 2005) with exact and Porter-stem matching stages only.

    Unigrams are aligned in two stages (exact surface form, then Porter stem), each word at
    most once, preferring the alignment with fewer crossings (leftmost unmatched candidate).
    F_mean = P R / (alpha P + (1 - alpha) R) (= 10PR/(R+9P) at alpha 0.9);
    penalty = gamma (chunks / matches)^beta; score = F_mean (1 - penalty).
    """
    h, r = _words(pred), _words(ref)
    if not h or not r:
        return 0.0
    stem = _stemmer().stem
    h_used = [False] * len(h)
    r_used = [False] * len(r)
    align: list[tuple[int, int]] = []
    for key in (lambda w: w, stem):
        hk = [key(w) for w in h]
        rk = [key(w) for w in r]
        for i, w in enumerate(hk):
            if h_used[i]:
                continue
            for j, v in enumerate(rk):
                if not r_used[j] and v == w:
                    h_used[i] = r_used[j] = True
                    align.append((i, j))
                    break
    m = len(align)
    if m == 0:
        return 0.0
    p, rc = m / len(h), m / len(r)
    fmean = p * rc / (alpha * p + (1 - alpha) * rc)
    align.sort()
    chunks = 1
    for (i0, j0), (i1, j1) in zip(align, align[1:], strict=False):
        if not (i1 == i0 + 1 and j1 == j0 + 1):
            chunks += 1
    penalty = gamma * (chunks / m) ** beta
    return fmean * (1 - penalty)


def average_word_frequency(text: str, lang: str = "en") -> float:
    """alpha of Eq. 2: mean ``wordfreq`` frequency of the words of ``text`` (0 if none)."""
    try:
        from wordfreq import word_frequency
    except ImportError as e:  # pragma: no cover - optional extra
        raise ImportError("GECE needs wordfreq: pip install 'tokrag-integrations[gating]'") from e
    ws = _words(text)
    if not ws:
        return 0.0
    return sum(word_frequency(w, lang) for w in ws) / len(ws)


def ffn_parameters(model: Any, fraction: float = 1 / 8) -> list[torch.nn.Parameter]:
    """FFN weight matrices of the last ``ceil(fraction * L)`` decoder layers."""
    from ..attention.parts import model_parts

    layers = model_parts(model).layers
    n = max(1, math.ceil(fraction * len(layers)))
    out: list[torch.nn.Parameter] = []
    for li in range(len(layers) - n, len(layers)):
        mlp = getattr(layers[li], "mlp", None)
        if mlp is None:
            raise ValueError(f"layer {li} has no .mlp: GECE's gradient term needs an FFN block.")
        out += [prm for pname, prm in mlp.named_parameters() if pname.endswith("weight")]
    return out


class CountSketch:
    """A fixed random linear map R^D -> R^k: coordinate d goes to bucket h(d) with sign s(d)."""

    def __init__(self, sizes: Sequence[int], dim: int, seed: int = 0):
        if dim < 1:
            raise ValueError(f"sketch_dim must be >= 1, got {dim}")
        self.dim = int(dim)
        g = torch.Generator().manual_seed(int(seed))
        self.idx = [torch.randint(0, dim, (n,), generator=g) for n in sizes]
        self.sign = [torch.randint(0, 2, (n,), generator=g).float() * 2 - 1 for n in sizes]

    def __call__(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(self.dim, dtype=torch.float64)
        for x, i, s in zip(parts, self.idx, self.sign, strict=True):
            out.index_add_(0, i, (x.reshape(-1).float() * s).double())
        return out.float()


def _pure_ids(lm: Any, query: str, max_new_tokens: int) -> list[int]:
    from ..prompts import PromptBuilder

    builder = PromptBuilder(lm.tokenizer, context_window=lm.context_window)
    return builder.build(query, None, max_new_tokens=max_new_tokens).pure_ids


def answer_gradient(
    lm: Any, query: str, answer: str, params: Sequence[torch.nn.Parameter]
) -> list[torch.Tensor]:
    """d loss / d params for the LM loss of ``answer`` given the pure prompt of ``query``.

    The loss is the mean token cross-entropy of the answer tokens (prompt tokens are
    context only), as in fine-tuning on (query -> answer).
    """
    from ..engine.passes import loss_gradient

    prompt_ids = _pure_ids(lm, query, 1)
    ans_ids = list(
        lm.tokenizer(
            " " + answer.strip() if not answer.startswith(" ") else answer, add_special_tokens=False
        )["input_ids"]
    )
    if not ans_ids:
        ans_ids = [lm.eos_token_ids[0]]
    return loss_gradient(lm, prompt_ids, ans_ids, params)


@dataclass
class _RowSpec(ContextSpec):
    """The pure context of one sampled answer, with its row in the joint draw."""

    row: int = 0


class SampledAnswers(Policy):
    """Self mode's reference answers: ``n`` answers of the pure model sampled together, as
    transformers' sampling draws them (temperature, then nucleus/top-p: its own warpers, then
    one ``torch.multinomial`` over all ``n`` rows per step, a finished row included, so that
    a seeded draw gives what ``model.generate(..., num_return_sequences=n)`` gives). Decoded on
    the engine's step loop (:func:`..engine.scheduler.generate_batch`, ``n`` copies of the
    query); not registered (GECE builds it)."""

    name = "gece_samples"
    roles = ("pure",)

    def __init__(self, n: int, temperature: float, top_p: float) -> None:
        from transformers.generation.logits_process import (
            LogitsProcessorList,
            TemperatureLogitsWarper,
            TopPLogitsWarper,
        )

        self.n = int(n)
        self.temperature, self.top_p = float(temperature), float(top_p)
        self._warp = LogitsProcessorList(
            [TemperatureLogitsWarper(self.temperature), TopPLogitsWarper(self.top_p)]
        )
        self._rows = 0

    def contexts(self, plan: PromptPlan) -> dict[str, ContextSpec]:
        spec = _RowSpec(plan.pure_ids, row=self._rows % self.n)
        self._rows += 1
        return {"pure": spec}

    def choose(self, views: list[dict[str, View]], lens: Lens) -> list[Choice]:
        first = views[0]["pure"].logits
        # A finished row's draw is made and dropped (uniform scores), as transformers does.
        scores = torch.zeros(self.n, first.shape[-1], dtype=torch.float32, device=first.device)
        for v in views:
            scores[v["pure"].spec.row] = v["pure"].logits.float()  # type: ignore[attr-defined]
        probs = torch.softmax(self._warp(None, scores), dim=-1)
        tokens = torch.multinomial(probs, num_samples=1).squeeze(1).tolist()
        return [Choice(int(tokens[v["pure"].spec.row]), FROM_PURE) for v in views]  # type: ignore[attr-defined]

    def options(self) -> dict[str, Any]:
        return {"n": self.n, "temperature": self.temperature, "top_p": self.top_p}


class GECEGate(Gate):
    """Retrieve for long-tail queries: GECE above the calibrated percentile (default 80th).

    Args:
        lm: a ``LoadedModel``.
        mode: ``"self"`` (inference; sampled answers as reference) or ``"gold"``
            (gold answers passed to :meth:`score` / :meth:`calibrate`).
        n_samples: self mode: number of sampled reference answers.
        max_new_tokens: length of the greedy and sampled answers.
        layer_fraction: share of the last layers whose FFN weights enter the gradient.
        sketch_dim: CountSketch size (None: exact gradients).
        seed: seed of the sketch and of the sampling.
    """

    name = "gece"
    retrieve_when = "above"
    default_percentile = 80.0
    config_keys = (
        "mode",
        "n_samples",
        "max_new_tokens",
        "layer_fraction",
        "sketch_dim",
        "seed",
        "temperature",
        "top_p",
    )

    def __init__(
        self,
        lm: Any,
        mode: str = "self",
        *,
        n_samples: int = 3,
        max_new_tokens: int = 16,
        layer_fraction: float = 1 / 8,
        sketch_dim: int | None = 16384,
        seed: int = 0,
        temperature: float = 0.6,
        top_p: float = 0.9,
        threshold: float | None = None,
    ):
        super().__init__(threshold)
        if mode not in ("self", "gold"):
            raise ValueError(f"mode must be 'self' or 'gold', got {mode!r}")
        if n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        self.lm = lm
        self.mode = mode
        self.n_samples = int(n_samples)
        self.max_new_tokens = int(max_new_tokens)
        self.layer_fraction = float(layer_fraction)
        self.sketch_dim = sketch_dim
        self.seed = int(seed)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.params = ffn_parameters(lm.model, layer_fraction)
        self.sketch = (
            CountSketch([p.numel() for p in self.params], sketch_dim, seed) if sketch_dim else None
        )
        self.mean_grad: torch.Tensor | None = None

    # ------------------------------------------------------------------ terms
    def gradient(self, query: str, answer: str) -> torch.Tensor:
        """grad_ins (flattened, or its sketch)."""
        grads = answer_gradient(self.lm, query, answer, self.params)
        if self.sketch is not None:
            return self.sketch(grads)
        return torch.cat([g.reshape(-1) for g in grads])

    def samples(self, query: str) -> list[str]:
        """``n_samples`` sampled answers of the pure model (self mode's references)."""
        from ..engine.scheduler import generate_batch

        lm = self.lm
        rule = SampledAnswers(self.n_samples, self.temperature, self.top_p)
        with lm.lock:  # the seed and the draws, with no other decode in between
            torch.manual_seed(self.seed + zlib.crc32(query.encode("utf-8")))
            results = generate_batch(
                lm, [query] * self.n_samples, None, policy=rule, max_new_tokens=self.max_new_tokens
            )
        texts = [lm.tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in results]
        return [t.split("\n")[0].strip() for t in texts]

    def terms(self, query: str, reference: Sequence[str] | str | None = None) -> dict[str, Any]:
        """Everything Eq. 2 needs except E(grad): M, mean p, alpha, grad_ins."""
        r = draft_answer(self.lm, query, max_new_tokens=self.max_new_tokens)
        pred = r.text.strip()
        probs = [math.exp(s.stats["pure"]["logp"]) for s in r.trace.steps if s.stats]
        mean_p = sum(probs) / len(probs) if probs else 0.0
        if self.mode == "gold":
            if reference is None:
                raise ValueError(
                    "GECE 'gold' mode needs the gold answers: score(query, reference=[...]); "
                    "use mode='self' at inference."
                )
            refs = [reference] if isinstance(reference, str) else list(reference)
            m = max(meteor(pred, x) for x in refs) if refs else 0.0
            grad_answer = refs[0] if refs else pred
        else:
            refs = self.samples(query)
            m = sum(meteor(pred, x) for x in refs) / len(refs)
            grad_answer = pred or "I don't know"
        alpha = average_word_frequency(f"{query} {pred}")
        return {
            "pred": pred,
            "refs": refs,
            "meteor": m,
            "mean_p": mean_p,
            "alpha": alpha,
            "grad": self.gradient(query, grad_answer),
            "draft": r,
        }

    def gece(self, terms: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        """Eq. 2 from :meth:`terms` and the calibrated E(grad)."""
        if self.mean_grad is None:
            raise RuntimeError("GECE needs E(grad): call calibrate(queries) or load(path) first.")
        eg = self.mean_grad
        dot = float(torch.dot(eg.double(), terms["grad"].double()))
        floor = 1e-3 * float(torch.dot(eg.double(), eg.double()))
        alpha = max(terms["alpha"], 1e-9)
        num = abs(terms["meteor"] - terms["mean_p"])
        val = num / (alpha * max(dot, floor))
        shown = {k: terms[k] for k in ("pred", "refs", "meteor", "mean_p", "alpha")}
        return val, {"mode": self.mode, **shown, "grad_dot": dot, "numerator": num}

    def score(
        self, query: str, reference: Sequence[str] | str | None = None
    ) -> tuple[float, dict[str, Any]]:
        return self.gece(self.terms(query, reference))

    # ------------------------------------------------------------------ calibration
    def fit_mean_gradient(
        self, queries: Sequence[str], references: Sequence[Any] | None = None
    ) -> list[dict[str, Any]]:
        """E(grad) over ``queries``; returns their terms (reused when scoring them)."""
        all_terms = [
            self.terms(q, references[i] if references is not None else None)
            for i, q in enumerate(queries)
        ]
        acc = torch.zeros_like(all_terms[0]["grad"])
        for t in all_terms:
            acc += t["grad"]
        self.mean_grad = acc / len(all_terms)
        return all_terms

    def calibration_scores(
        self, queries: list[str], references: Sequence[Any] | None = None, **kwargs: Any
    ) -> list[float]:
        if self.mode == "gold" and references is None:
            raise ValueError(
                "GECE 'gold' mode calibrates with references=[gold answers per query]."
            )
        return [self.gece(t)[0] for t in self.fit_mean_gradient(queries, references)]

    def state(self) -> dict[str, Any]:
        if self.mean_grad is None:
            return {}
        if self.sketch is not None:
            return {"mean_grad_sketch": self.mean_grad.tolist()}
        return {"mean_grad_file": getattr(self, "_grad_file", None)}

    def save(self, path: str | Path) -> Path:
        """JSON calibration; exact-gradient mode also writes ``<path>.grad.pt`` (E(grad))."""
        path = Path(path)
        if self.sketch is None and self.mean_grad is not None:
            grad_file = path.with_suffix(path.suffix + ".grad.pt")
            torch.save(self.mean_grad, grad_file)
            self._grad_file = grad_file.name
        return super().save(path)

    def set_state(self, state: dict[str, Any], folder: Path) -> None:
        if "mean_grad_sketch" in state:
            self.mean_grad = torch.tensor(state["mean_grad_sketch"], dtype=torch.float32)
        elif state.get("mean_grad_file"):
            # weights_only: torch < 2.6 (allowed by pyproject) unpickles by default.
            self.mean_grad = torch.load(folder / state["mean_grad_file"], weights_only=True)
