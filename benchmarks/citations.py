"""Which reading of the attention cites an answer's passage best (issue 46), against two
baselines, with a tuning / held-out split of the dev items.

Protocol (fixed before any reading was scored on it):

* Items: SQuAD dev and RGB dev (``../shared/data``), one positive passage among k in random
  order (``mix_passages``), over the noise sweep k = 2, 3, 5 (r = 0.5, 0.67, 0.8). Each item
  is **tuning** or **held out** by its id alone: ``sha256(id)`` mod 2 (:func:`held_out`).
* One decode per (item, k) with ``tokrag`` (16 new tokens). At every step the RAG context's
  generating position's attention row is read at every layer and head, and kept as
  per-passage masses [L, H, P] (all passage tokens; punctuation left out; the rule's skip
  words and punctuation left out), the passage of each head's argmax position and whether that
  position holds the generated token (a copy hit), and per layer the mass on all passages.
  Every reading is then scored offline from those files: no reading costs a decode.
* Unit: an answer that holds a gold answer (cover EM) with the gold string found among its
  tokens (the answer span) and a gold passage in the mix. A reading cites the span to one
  passage; correct when that passage holds a gold answer. Baselines on the same answers: the
  first passage (top-ranked) and the passage closest to the answer's sentence by the packaged
  MiniLM embedder.
* Selection: the reading with the most correct on the tuning part (ties: the earlier in
  :func:`readings`, which lists cheaper and simpler readings first); retrieval heads are ranked
  by their copy score on the tuning part only (Wu et al. 2024, arXiv 2404.15574). The chosen
  reading is then scored once on the held-out part: shares with Wilson 95 % intervals and the
  paired difference to each baseline with a bootstrap 95 % interval (10,000 resamples of
  items, seed 0; an item's k's stay together).

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/citations.py --record runs/cite  # resumable
    python benchmarks/citations.py --score runs/cite               # tuning table and choice
    python benchmarks/citations.py --score runs/cite --held-out    # then, once: held out
    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/citations.py --cost 20 --max-new-tokens 24

``--cost N``: the cost of citations: N SQuAD questions (k = 5) decoded with citations on and
off, interleaved (the order alternating per question), for ``tokrag`` and ``rag``; prints ms
per generated token (decode time only) and on/off.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tokrag_eval.data import load_items, mix_passages
from tokrag_eval.metrics import cover_em
from tokrag_integrations import generate, load_model
from tokrag_integrations.policies import vocab
from tokrag_integrations.policies.tokrag import TokRAG
from tokrag_integrations.retrieval.embedder import load_embedder

DATA = Path(__file__).resolve().parents[1] / "../shared/data"
SETS = (("squad", "squad_dev.jsonl"), ("rgb", "rgb_en_fact_dev.jsonl"))
SWEEP = ((0.5, 2), (0.67, 3), (0.8, 5))  # (noise ratio, k): one positive each
#: ``--extend``, after the choice: k = 4 and 6 for the held-out items only (a larger test of
#: the chosen reading; the tuning part, hence the choice, is unchanged).
EXTEND = ((0.75, 4), (0.83, 6))


def held_out(item_id: str) -> bool:
    """The split: by the item id's hash alone, so every k of an item is on the same side."""
    return int(hashlib.sha256(item_id.encode()).hexdigest(), 16) % 2 == 1


# ------------------------------------------------------------------------------ recording
class Recording(TokRAG):
    """``tokrag`` that also keeps, per step, what every reading needs (see the docstring)."""

    def __init__(self, punct: torch.Tensor, skip: torch.Tensor) -> None:
        super().__init__()
        self._punct_all, self._skip_all = punct, skip
        self.lengths: list[int] = []
        self.steps: list[dict[str, torch.Tensor]] = []

    def contexts(self, plan: Any) -> Any:
        self.lengths = [e - s for s, e in plan.passage_spans]
        return super().contexts(plan)

    def choose(self, views: Any, lens: Any) -> Any:
        out = super().choose(views, lens)
        for v, c in zip(views, out, strict=True):
            rag = v["rag"]
            attn = rag.attention_all().float()  # [L, H, T]
            rt, ids = rag.rt_positions, rag.rt_token_ids
            which = torch.repeat_interleave(
                torch.arange(len(self.lengths)), torch.tensor(self.lengths)
            )
            onehot = torch.nn.functional.one_hot(which, len(self.lengths)).float()  # [R, P]
            punct = self._punct_all[ids].float()[:, None]
            skip = torch.maximum(punct, self._skip_all[ids].float()[:, None])
            sub = attn[:, :, rt]  # [L, H, R]
            masses = torch.stack(
                [sub @ onehot, sub @ (onehot * (1 - punct)), sub @ (onehot * (1 - skip))]
            )
            # each head's argmax over the whole row: its passage (-1 outside) and a copy hit
            where = torch.full((attn.shape[-1],), -1, dtype=torch.long)
            where[rt] = which
            tok = torch.full((attn.shape[-1],), -1, dtype=torch.long)
            tok[rt] = ids
            top = attn.argmax(-1)  # [L, H]
            token = int(c.token_id)
            self.steps.append(
                {
                    "mass": masses.half(),  # [3, L, H, P]
                    "argpass": where[top].to(torch.int8),
                    "hit": tok[top] == token,
                    "copyable": torch.tensor(bool((ids == token).any())),
                    "f": attn[:, :, rt].sum(-1).mean(-1).half(),  # [L]
                    "l_star": torch.tensor(int(c.signals.get("l_star") or 0)),
                    "token": torch.tensor(token),
                    "punct": self._punct_all[token],
                    "skip": self._skip_all[token] | self._punct_all[token],
                }
            )
        return out


def _span(texts: list[str], answers: list[str]) -> range | None:
    """Token indices overlapping the first gold answer found in the generated text."""
    full = "".join(texts)
    low = full.lower()
    for a in sorted(answers, key=len, reverse=True):
        at = low.find(a.lower().strip())
        if at < 0 or not a.strip():
            continue
        end, pos, idx = at + len(a.strip()), 0, []
        for i, t in enumerate(texts):
            if pos < end and pos + len(t) > at:
                idx.append(i)
            pos += len(t)
        return range(idx[0], idx[-1] + 1)
    return None


def _sentence(texts: list[str], span: range) -> range:
    """The steps of the sentence holding ``span`` (cut after '.', '!', '?' or a newline)."""
    ends = [i for i, t in enumerate(texts) if re.search(r"[.!?\n]", t)]
    lo = max([i + 1 for i in ends if i < span.start], default=0)
    hi = min([i + 1 for i in ends if i >= span.stop - 1], default=len(texts))
    return range(lo, max(hi, span.stop))


def record(
    lm: Any,
    emb: Any,
    out: Path,
    data: Path,
    limits: dict[str, int],
    tokens: int,
    extend: bool = False,
) -> None:
    """One file per (set, item, k) under ``out``; files already there are kept (resumable).
    ``extend``: :data:`EXTEND`'s k for the held-out items instead of :data:`SWEEP`."""
    tok, size = lm.tokenizer, lm.model.get_output_embeddings().weight.shape[0]
    punct = vocab.punctuation_mask(tok, vocab_size=size)
    skip = vocab.skip_mask(tok, vocab_size=size)
    for name, file in SETS:
        if not limits.get(name):
            continue
        (out / name).mkdir(parents=True, exist_ok=True)
        for it in load_items(data / file, limits[name]):
            if extend and not held_out(it.id):
                continue
            for ratio, k in EXTEND if extend else SWEEP:
                path = out / name / f"{hashlib.sha1(it.id.encode()).hexdigest()[:12]}_k{k}.pt"
                if path.exists():
                    continue
                mix = mix_passages(it, ratio, k)
                pol = Recording(punct, skip)
                r = generate(lm, it.question, mix.passages, policy=pol, max_new_tokens=tokens)
                texts = [s.text for s in r.trace.steps]
                em = cover_em(r.text, it.answers)
                span = _span(texts, it.answers) if em else None
                gold = [j for j, p in enumerate(mix.passages) if cover_em(p, it.answers)]
                rec: dict[str, Any] = {
                    "id": it.id, "k": k, "answer": r.text, "em": em, "texts": texts,
                    "gold": gold, "held_out": held_out(it.id),
                    "steps": {key: torch.stack([s[key] for s in pol.steps]) for key in pol.steps[0]}
                    if pol.steps else {},
                }  # fmt: skip
                if span is not None and gold:
                    sent = _sentence(texts, span)
                    e = emb.encode(["".join(texts[sent.start : sent.stop]), *mix.passages])
                    cited = r.trace.cite(span.start, span.stop)
                    rec.update(
                        span=(span.start, span.stop),
                        sentence=(sent.start, sent.stop),
                        embedder=int((e[1:] @ e[0]).argmax()),
                        engine=None if cited is None else cited[0],
                    )
                torch.save(rec, path)


# ------------------------------------------------------------------------------ scoring
def upper_middle(n: int) -> list[int]:
    low = int(0.6 * n)
    return list(range(low, max(int(0.8 * n), low + 1)))


def copy_scores(records: list[dict]) -> torch.Tensor:
    """[L, H] retrieval score of every head (Wu et al. 2024): over the steps whose generated
    token is in the passages, the share where the head's argmax holds that token."""
    hits, n = None, 0
    for r in records:
        s = r["steps"]
        if not s:
            continue
        c = s["copyable"].bool()
        h = s["hit"][c].float().sum(0)
        hits = h if hits is None else hits + h
        n += int(c.sum())
    assert hits is not None
    return hits / max(n, 1)


Reading = Callable[[dict, range], torch.Tensor]  # (steps, step indices) -> [P] score


def _mass_reading(
    layers: Callable[[int], list[int]],
    heads: str = "mean",
    mask: int = 0,
    top: torch.Tensor | None = None,
    weight: str = "uniform",
) -> Reading:
    """Σ_t w_t · s_t over the steps, s_t = the step's per-passage mass aggregated over the
    layers' heads (``mean``, ``max``, or the mean of the heads in ``top`` [L, H] bool),
    normalised over passages; w_t = 1 or f_t (the mass on all passages)."""

    def read(s: dict, steps: range) -> torch.Tensor:
        m = s["mass"][list(steps), mask].float()  # [S, L, H, P]
        lay = layers(m.shape[1])
        if heads == "mean":
            row = m[:, lay].mean((1, 2))
        elif heads == "max":
            row = m[:, lay].amax(2).mean(1)
        else:
            assert top is not None
            row = m[:, top].mean(1)
        row = row / row.sum(-1, keepdim=True).clamp_min(1e-30)
        if weight == "f":
            row = row * s["f"][list(steps)].float()[:, lay].mean(1, keepdim=True)
        return row.sum(0)

    return read


def _vote_reading(top: torch.Tensor | None, hits_only: bool, fallback: Reading) -> Reading:
    """Σ_t s_t with s_t,j = v_t,j / Σ_k v_t,k, v_t,j = #{(l,h) ∈ heads: the argmax of head
    (l,h) at step t lies in passage j (and holds the generated token, ``hits_only``)}; at a
    step where no head votes, s_t is ``fallback``'s (as the engine records a step)."""

    def read(s: dict, steps: range) -> torch.Tensor:
        idx = list(steps)
        arg = s["argpass"][idx].long()  # [S, L, H]
        ok = arg >= 0
        if hits_only:
            ok &= s["hit"][idx].bool()
        if top is not None:
            ok &= top[None]
        p = s["mass"].shape[-1]
        total = torch.zeros(p)
        for i, t in enumerate(idx):
            votes = torch.zeros(p).scatter_add_(0, arg[i][ok[i]], torch.ones(int(ok[i].sum())))
            if votes.sum() > 0:
                total += votes / votes.sum()
            else:
                total += fallback(s, range(t, t + 1))
        return total

    return read


def _lstar_reading(s: dict, steps: range) -> torch.Tensor:
    idx = list(steps)
    m = s["mass"][idx, 0].float().mean(2)  # [S, L, P]
    ls = s["l_star"][idx].long()
    f_arg = s["f"][idx].float()[:, : m.shape[1]].argmax(1)
    lay = torch.where(ls > 0, ls - 1, f_arg)
    row = m[torch.arange(len(idx)), lay]
    return (row / row.sum(-1, keepdim=True).clamp_min(1e-30)).sum(0)


def readings(tuning: list[dict]) -> dict[str, tuple[Reading, str]]:
    """name -> (reading, steps) for every reading compared; ``steps``: ``span`` (the answer
    span), ``span-words`` (its steps that are not punctuation or skip words), ``first`` (its
    first step) or ``sentence``. Cheaper and simpler first (ties go to the earlier)."""
    um = upper_middle
    out: dict[str, tuple[Reading, str]] = {}
    current = _mass_reading(um)
    out["current: mean heads, layers 0.6L-0.8L"] = (current, "span")
    out["current, passage punctuation left out"] = (_mass_reading(um, mask=1), "span")
    out["current, passage skip words + punctuation left out"] = (_mass_reading(um, mask=2), "span")
    out["current, span steps that are words only"] = (current, "span-words")
    out["current, first span step only"] = (current, "first")
    out["current, whole sentence"] = (current, "sentence")
    out["current, steps weighted by f_t"] = (_mass_reading(um, weight="f"), "span")
    out["last layer"] = (_mass_reading(lambda n: [n - 1]), "span")
    out["last 4 layers"] = (_mass_reading(lambda n: list(range(n - 4, n))), "span")
    out["fusion layer l* of the step"] = (_lstar_reading, "span")
    out["max over heads, layers 0.6L-0.8L"] = (_mass_reading(um, heads="max"), "span")
    out["max over heads, all layers"] = (_mass_reading(lambda n: list(range(n)), "max"), "span")
    out["all layers, mean"] = (_mass_reading(lambda n: list(range(n))), "span")
    score = copy_scores(tuning)
    flat = score.flatten().argsort(descending=True)
    for k in (1, 3, 5, 10, 20, 40):
        top = torch.zeros(score.numel(), dtype=torch.bool)
        top[flat[:k]] = True
        top = top.view_as(score)
        for mask, what in ((0, ""), (1, ", punctuation left out")):
            out[f"top-{k} retrieval heads, mean mass{what}"] = (
                _mass_reading(um, heads="top", top=top, mask=mask),
                "span",
            )
        out[f"top-{k} retrieval heads, argmax vote"] = (_vote_reading(top, False, current), "span")
    out["copy vote, heads of layers 0.6L-0.8L"] = (
        _vote_reading(_layer_mask(score, um), True, current),
        "span",
    )
    out["copy vote: every head whose argmax holds the token"] = (
        _vote_reading(None, True, current),
        "span",
    )
    return out


def _layer_mask(score: torch.Tensor, layers: Callable[[int], list[int]]) -> torch.Tensor:
    m = torch.zeros_like(score, dtype=torch.bool)
    m[layers(score.shape[0])] = True
    return m


def _steps(r: dict, which: str) -> range:
    span = range(*r["span"])
    if which == "first":
        return range(span.start, span.start + 1)
    if which == "sentence":
        return range(*r["sentence"])
    if which == "span-words":
        words = [i for i in span if not bool(r["steps"]["skip"][i])]
        return words or span  # type: ignore[return-value]
    return span


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (c - h, c + h)


def paired_bootstrap(
    ids: list[str], a: list[bool], b: list[bool], n: int = 10_000, seed: int = 0
) -> tuple[float, float, float]:
    """Mean of a − b and its bootstrap 95 % interval, resampling items (clusters)."""
    groups: dict[str, list[int]] = {}
    for i, key in enumerate(ids):
        groups.setdefault(key, []).append(i)
    keys = list(groups)
    diff = torch.tensor([float(x) - float(y) for x, y in zip(a, b, strict=True)])
    sums = torch.tensor([float(diff[groups[k]].sum()) for k in keys])
    counts = torch.tensor([float(len(groups[k])) for k in keys])
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(len(keys), (n, len(keys)), generator=g)
    boot = sums[pick].sum(1) / counts[pick].sum(1)
    lo, hi = torch.quantile(boot, torch.tensor([0.025, 0.975])).tolist()
    return float(diff.mean()), lo, hi


def load_records(root: Path, name: str) -> list[dict]:
    return [torch.load(p, weights_only=False) for p in sorted((root / name).glob("*.pt"))]


def _hits(rows: list[dict], read: Reading, which: str) -> list[bool]:
    return [int(read(r["steps"], _steps(r, which)).argmax()) in r["gold"] for r in rows]


def score(root: Path, choose: str | None = None, report: bool = False) -> None:
    """The tuning table (every reading) and the choice; ``report``: also the held-out
    comparison of the choice (run once, after the choice)."""
    recs = {name: load_records(root, name) for name, _ in SETS}
    tune_all = [r for rs in recs.values() for r in rs if not r["held_out"]]
    table = readings(tune_all)
    for name, rs in recs.items():
        usable = [r for r in rs if "span" in r]
        t = sum(1 for r in rs if not r["held_out"])
        print(f"{name}: {len(rs)} decodes ({t} tuning), {len(usable)} answers with a span")
    tuning = [r for rs in recs.values() for r in rs if "span" in r and not r["held_out"]]
    print(f"\nTuning part (SQuAD + RGB, n = {len(tuning)}):\n| reading | correct |\n| --- | --- |")
    best, best_k = None, -1
    for key, (read, which) in table.items():
        k = sum(_hits(tuning, read, which))
        lo, hi = wilson(k, len(tuning))
        print(f"| {key} | {k}/{len(tuning)} = {k / len(tuning):.3f} [{lo:.2f}, {hi:.2f}] |")
        if k > best_k:
            best, best_k = key, k
    for b in ("top_ranked", "embedder", "engine"):
        k = sum(_base(r, b) for r in tuning)
        print(f"| baseline: {b} | {k}/{len(tuning)} = {k / len(tuning):.3f} |")
    chosen = choose or best
    assert chosen is not None
    print(f"\nChosen on the tuning part: {chosen}")
    read, which = table[chosen]
    sets = [*recs.items(), ("squad + rgb", [r for rs in recs.values() for r in rs])]
    for name, rs in sets if report else ():
        rows = [r for r in rs if "span" in r and r["held_out"]]
        if not rows:
            continue
        att = _hits(rows, read, which)
        ids = [r["id"] for r in rows]
        print(f"\nHeld out, {name} (n = {len(rows)} answers, {len(set(ids))} items):")
        for label, hits in (
            ("attention (chosen)", att),
            ("attention (current)", _hits(rows, *table[next(iter(table))])),
            ("baseline: top-ranked", [_base(r, "top_ranked") for r in rows]),
            ("baseline: embedder", [_base(r, "embedder") for r in rows]),
        ):
            k = sum(hits)
            lo, hi = wilson(k, len(rows))
            print(f"| {label} | {k}/{len(rows)} = {k / len(rows):.3f} [{lo:.2f}, {hi:.2f}] |")
        um = _layer_mask(rows[0]["steps"]["hit"][0], upper_middle)
        voted = [
            bool((r["steps"]["hit"][i].bool() & um).any()) for r in rows for i in range(*r["span"])
        ]
        print(f"(span steps with a copying head in layers 0.6L-0.8L: {sum(voted)}/{len(voted)})")
        for b in ("top_ranked", "embedder"):
            d, lo, hi = paired_bootstrap(ids, att, [_base(r, b) for r in rows])
            print(f"| chosen − {b} | {d:+.3f} [{lo:+.3f}, {hi:+.3f}] |")


def _base(r: dict, which: str) -> bool:
    pick = 0 if which == "top_ranked" else r[which]
    return pick in r["gold"]


# ------------------------------------------------------------------------------ cost
def run_cost(lm: Any, path: Path, n: int, noise: float, k: int, tokens: int) -> None:
    items = load_items(path, n)
    for policy in ("tokrag", "rag"):
        t = {True: 0.0, False: 0.0}
        toks = {True: 0, False: 0}
        for i, it in enumerate(items):
            mix = mix_passages(it, noise, k)
            for on in (True, False) if i % 2 else (False, True):
                r = generate(
                    lm,
                    it.question,
                    mix.passages,
                    policy=policy,
                    max_new_tokens=tokens,
                    stop=[],
                    citations=on,
                )
                t[on] += r.trace.timings["decode_s"]
                toks[on] += len(r.trace.steps)
        ms = {on: 1000 * t[on] / max(toks[on], 1) for on in t}
        print(
            f"{policy}: citations on {ms[True]:.2f} ms/token, off {ms[False]:.2f} ms/token, "
            f"on/off {ms[True] / ms[False]:.3f} ({n} questions, {toks[True]} tokens each way)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", type=Path, help="decode and write the records to this folder")
    ap.add_argument("--score", type=Path, help="score the readings from this folder")
    ap.add_argument("--choose", help="the reading to report (default: the best on tuning)")
    ap.add_argument("--held-out", action="store_true", help="also report the held-out part")
    ap.add_argument(
        "--extend", action="store_true", help="with --record: k = 4, 6 for the held-out items"
    )
    ap.add_argument("--squad", type=int, default=300, help="SQuAD dev items")
    ap.add_argument("--rgb", type=int, default=50, help="RGB dev items")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--cost", type=int, default=0, help="measure the cost on N questions")
    a = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.time()
    if a.score:
        score(a.score, a.choose, a.held_out)
    elif a.cost:
        lm = load_model("default")
        run_cost(lm, a.data / "squad_dev.jsonl", a.cost, 0.8, 5, a.max_new_tokens)
    elif a.record:
        lm = load_model("default")
        limits = {"squad": a.squad, "rgb": a.rgb}
        record(lm, load_embedder(), a.record, a.data, limits, a.max_new_tokens, a.extend)
    else:
        ap.error("one of --record, --score, --cost")
    print(f"{time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
