"""What each policy answers on the hand-made benefit / detriment cases (README table).

    python benchmarks/policy_cases.py [--model default] [--max-new-tokens 24]

"benefit": a fictional fact only the passage has (the pure model cannot know it);
"detriment": a passage contradicting a fact the model knows. Greedy decoding, one passage
each, ``generate(lm, question, [passage], policy=...)``; "verdict": a yes/no question whose passage
settles the answer. Prints a Markdown table with the
token counts per source of the Tok-RAG columns. The first three benefit cases and the
Marseille case are the ones asserted in tests/integration/test_engine.py.
"""

from __future__ import annotations

import argparse
import warnings

from tokrag_integrations import generate, load_model

CASES = [
    ("benefit", "What is the name of the cat owned by Zorbin Quell?", "Zorbin Quell owns a grey cat named Pistachio."),
    ("benefit", "What is the capital of Drelmoria?", "Drelmoria is a small island nation. Its capital is Vostrany."),
    ("benefit", "Who founded Quillfeather Aerospace?",
     "Quillfeather Aerospace was founded in 1994 by Ottoline Varga, a former propulsion engineer."),
    ("benefit", "In which year did the Veltrano Bridge open?", "The Veltrano Bridge opened to traffic in 1873."),
    ("detriment", "What is the capital of France?", "The capital of France is Marseille."),
    ("detriment", "What is the chemical symbol for gold?", "The chemical symbol for gold is Ag."),
    ("verdict", "Is the headquarters of Quillfeather Aerospace near a beach?",
     "Quillfeather Aerospace is headquartered in Harrowgate, an inland town 200 km from the nearest coast."),
    ("verdict", "Is menthol associated with Christmas?",
     "Menthol is an organic compound obtained from mint oils, used in cough drops and cigarettes; it has no "
     "particular link to any holiday."),
]

#: column label -> (policy, options)
COLUMNS = {
    "`no_rag`": ("no_rag", {}),
    "`rag`": ("rag", {}),
    "`tokrag` (default)": ("tokrag", {}),
    "`tokrag` paper rule (`function_word_gate=False, verdict_gate=None, rising_gate=False, punctuation_gate=False, threshold=0, plausibility_alpha=0.1, "
    "pr_skip=None`)": (
        "tokrag",
        {"function_word_gate": False, "verdict_gate": None, "rising_gate": False, "punctuation_gate": False, "threshold": 0.0, "plausibility_alpha": 0.1, "pr_skip": None},
    ),
    "`tokrag` literal reading (+ `min_fusion_layer=0, plausibility_alpha=None, lens_norm=False`)": (
        "tokrag",
        {"function_word_gate": False, "verdict_gate": None, "rising_gate": False, "punctuation_gate": False, "threshold": 0.0, "pr_skip": None, "min_fusion_layer": 0,
         "plausibility_alpha": None, "lens_norm": False},
    ),
    '`tokrag_authors`': ("tokrag_authors", {}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    lm = load_model(args.model)
    print("| case | passage | " + " | ".join(COLUMNS) + " |")
    print("|" + " --- |" * (2 + len(COLUMNS)))
    for kind, question, passage in CASES:
        cells = []
        for policy, opts in COLUMNS.values():
            r = generate(lm, question, [passage], policy=policy, max_new_tokens=args.max_new_tokens, policy_options=opts)
            text = r.text.strip().replace("|", "\\|").replace("\n", " ")
            if policy == "tokrag":
                counts = ", ".join(f"{k} {v}" for k, v in r.trace.counts().items() if v)
                text += f" ({counts})"
            cells.append(text)
        print(f"| {kind}: {question} | \"{passage}\" | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
