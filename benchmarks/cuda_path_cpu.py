"""Thread time per token of ``speed="cuda"`` on CPU, on a tiny random model shaped like SmolLM2
(30 layers, small hidden size: arithmetic negligible, so a token costs what its operations
and host reads cost, as a small model on a GPU; issue 56).

Interleaved in one run, on the same prompts (the RAG prompt of each question, greedy):
``tokrag`` and ``rag`` with ``speed="cuda"``, Hugging Face ``model.generate`` (greedy, dynamic
cache) and the default path (``speed="auto"``: on CPU the view path with fused contexts).
Each arm's thread time (``time.thread_time``) per generated token, the median over rounds,
and the ratios the issue asks for: tokrag / rag (<= 1.3) and rag / HF generate (<= 1).

    python benchmarks/cuda_path_cpu.py [--rounds 5] [--tokens 48] [--compiled]

``--compiled`` adds the two ``speed="cuda"`` arms with ``graphs="on"`` (``torch.compile`` of
the step on CPU; the warm-up compiles it, several minutes on 2 cores).

A last arm, ``tokrag's lens arithmetic``, times only what exact Eq. 13 computes at a step
where the signals decide, on this model's shapes: the logit lens of the 2 x (L - lo + 2)
rows the device searches (:func:`...accel.rules.common.lens`), their log-softmax and the JSDs
of consecutive layers (:func:`...accel.rules.tokrag_rule.layer_shifts`). Its ratio to rag's
ms / token is a lower bound on tokrag / rag's excess for any rule that computes Eq. 13-14
exactly on those steps, whatever else it saves.

Run it alone on the machine (other model jobs paused): it is a cost figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _helpers import tiny_smollm2  # noqa: E402

from tokrag_integrations import generate, load_model  # noqa: E402
from tokrag_integrations.accel.rules.common import lens  # noqa: E402
from tokrag_integrations.accel.rules.tokrag_rule import layer_shifts  # noqa: E402
from tokrag_integrations.policies.tokrag import TokRAG  # noqa: E402
from tokrag_integrations.prompts import PromptBuilder  # noqa: E402

QUESTIONS = [
    ("Who founded Quillfeather Aerospace, and where?",
     ["Quillfeather Aerospace was founded by Ada Brandt in Tromso in 2011.",
      "The company builds small satellites for weather agencies."]),
    ("What is the capital of France?", ["The capital of France is Marseille."]),
    ("How many days of annual leave do employees get?",
     ["Employees get 25 days of annual leave, plus public holidays.",
      "Leave requests go to the line manager two weeks ahead."]),
]  # fmt: skip


def hf_generate(tiny, ids: list[int], n: int) -> int:
    """Greedy ``model.generate`` on ``ids``; returns the tokens it generated."""
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = tiny.model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=n,
            pad_token_id=tiny.pad_token_id,
            top_p=None,
            top_k=None,
            temperature=None,
        )
    return int(out.shape[1] - x.shape[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--compiled", action="store_true", help="add the compiled step's arms")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args()
    torch.set_num_threads(1)
    packaged = load_model("default", device="cpu")
    tiny = tiny_smollm2(packaged.tokenizer)
    builder = PromptBuilder(tiny.tokenizer, context_window=tiny.context_window)
    cuda = {"static": "on", "fuse": True, "graphs": "off"}
    compiled = {**cuda, "graphs": "on"}
    n = args.tokens

    #: tokrag's steps on the static path: all, where the contexts disagree, where the signals
    #: (Eq. 13-19) decided (no gate did): what a rule skipping agree / gated steps would save.
    kinds = {"steps": 0, "disagree": 0, "signals": 0}

    def ours(policy: str, speed):
        def run(q: str, ps: list[str]) -> tuple[int, dict]:
            r = generate(tiny, q, ps, policy=policy, speed=speed, max_new_tokens=n, citations=None)
            if policy == "tokrag" and speed is cuda:
                for s in r.trace.steps:
                    kinds["steps"] += 1
                    kinds["disagree"] += s.source != "agree"
                    kinds["signals"] += "l_star" in s.signals
            return len(r.trace.steps), r.trace.timings

        return run

    def hf(q: str, ps: list[str]) -> tuple[int, dict]:
        return hf_generate(tiny, builder.build(q, ps).rag_ids, n), {}

    policy = TokRAG()
    policy.prepare(tiny)
    lens_rows = 2 * (policy._L - max(1, policy._lo) + 2)
    hidden = torch.randn(1, lens_rows, policy._A.shape[1])

    def arithmetic(q: str, ps: list[str]) -> tuple[int, dict]:
        """Exact Eq. 13 at one signal step (the lens, its log-softmax, the JSDs): one "token"."""
        with torch.inference_mode():
            logp = torch.log_softmax(lens(policy._parts, hidden, policy.lens_norm), dim=-1)
            layer_shifts(logp.reshape(1, 2, lens_rows // 2, -1))
        return 1, {}

    arms = {
        "tokrag (cuda)": ours("tokrag", cuda),
        "rag (cuda)": ours("rag", cuda),
        "HF generate": hf,
        "tokrag (default)": ours("tokrag", "auto"),
        "rag (default)": ours("rag", "auto"),
    }
    if args.compiled:
        arms["tokrag (compiled)"] = ours("tokrag", compiled)
        arms["rag (compiled)"] = ours("rag", compiled)
    arms["tokrag's lens arithmetic"] = arithmetic
    for run in arms.values():  # warm every path (and compile, with --graphs on)
        run(*QUESTIONS[0])
    per_token: dict[str, list[float]] = {a: [] for a in arms}
    static: dict[str, float] = {}
    for _ in range(args.rounds):
        for q, ps in QUESTIONS:
            for name, run in arms.items():
                t0 = time.thread_time()
                toks, timings = run(q, ps)
                per_token[name].append((time.thread_time() - t0) / max(toks, 1))
                static[name] = timings.get("static", 0.0)
    med = {a: statistics.median(v) * 1e3 for a, v in per_token.items()}
    print(f"thread ms per token, median of {args.rounds} rounds x {len(QUESTIONS)} prompts, "
          f"{n} new tokens")  # fmt: skip
    for a, v in med.items():
        print(f"  {a:26s} {v:8.2f}  (static state: {'yes' if static.get(a) else 'no'})")
    ratios = {
        "tokrag / rag (cuda)": med["tokrag (cuda)"] / med["rag (cuda)"],
        "rag (cuda) / HF generate": med["rag (cuda)"] / med["HF generate"],
        "rag (default) / HF generate": med["rag (default)"] / med["HF generate"],
        "tokrag (default) / rag (default)": med["tokrag (default)"] / med["rag (default)"],
        "rag (cuda) / rag (default)": med["rag (cuda)"] / med["rag (default)"],
        # Exact Eq. 13 alone at a signal step, over rag's whole token.
        "lens arithmetic / rag (cuda)": med["tokrag's lens arithmetic"] / med["rag (cuda)"],
    }
    if args.compiled:
        ratios["tokrag / rag (compiled)"] = med["tokrag (compiled)"] / med["rag (compiled)"]
        ratios["rag (compiled) / HF generate"] = med["rag (compiled)"] / med["HF generate"]
    for k, v in ratios.items():
        print(f"  {k:34s} {v:6.2f}x")
    steps = max(kinds["steps"], 1)
    shares = {k: kinds[k] / steps for k in ("disagree", "signals")}
    print(f"  tokrag (cuda) steps: {kinds['steps']}, contexts disagree {shares['disagree']:.0%}, "
          f"signals decided {shares['signals']:.0%}")  # fmt: skip
    share = shares["signals"] * ratios["lens arithmetic / rag (cuda)"]
    print(f"  lens rows a signal step: {lens_rows}; so tokrag / rag >= 1 + {share:.2f} on these "
          "prompts for any rule computing Eq. 13-14 exactly where the signals decide")  # fmt: skip
    if args.json:
        out = {"ms_per_token": med, "ratios": ratios, "tokrag_steps": kinds, "lens_rows": lens_rows}
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
