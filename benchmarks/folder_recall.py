"""Recall of the folder retrievers (``tokrag ask --docs --retriever``, ``FolderRetriever``):
dense, BM25 and hybrid side by side, on two sets.

    nice -n 10 python benchmarks/folder_recall.py --json benchmarks/results/folder_recall.json

* **SQuAD dev** (``/work/shared/data/squad_dev.jsonl``, 300 questions): the paragraphs of the
  split (each question's gold paragraph and its 5 BM25 hard negatives, deduplicated), one
  ``.txt`` file each, as in ``bench_retrieval.py``'s Postgres measurement; a hit is any
  chunk of the gold paragraph's file.
* **This repository's documents**: README.md and docs/*.md as of the commit named in
  ``benchmarks/folder_questions.json`` (exported with ``git show``, so later edits do not
  move the figures), and that file's questions, written before any run; a hit is a chunk of
  the question's file whose text holds its quote (whitespace collapsed, case ignored).

Every retriever is built by :func:`tokrag_integrations.retrieval.build_retriever` as
``ask --docs`` builds it (800-character chunks, top 10, embeddings cached). Printed: recall@1/5/10
with 95 % Wilson intervals, MRR@10, and paired differences of recall@5 (95 % percentile
bootstrap over questions, with the questions only one of the two finds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_retrieval import SQUAD, load_squad, paired  # noqa: E402

KINDS = ("dense", "bm25", "hybrid")
QUESTIONS = ROOT / "benchmarks" / "folder_questions.json"


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion ``hits / n``."""
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def evaluate(folder: Path, questions: list[tuple[str, Any]], is_hit: Any) -> dict[str, Any]:
    """Ranks of the first hit (``None``: not in the top 10) per retriever, and the figures."""
    from tokrag_integrations.retrieval import build_retriever

    out: dict[str, Any] = {"questions": len(questions)}
    ranks: dict[str, list[int | None]] = {}
    for kind in KINDS:
        retriever = build_retriever(folder, kind=kind, cache=True)
        out["chunks"] = len(retriever.chunks)
        ranks[kind] = []
        for question, gold in questions:
            hits = retriever.retrieve(question, top_k=10)
            first = next((r for r, h in enumerate(hits, 1) if is_hit(h, gold)), None)
            ranks[kind].append(first)
        n = len(questions)
        figures: dict[str, Any] = {}
        for k in (1, 5, 10):
            found = sum(1 for r in ranks[kind] if r and r <= k)
            figures[f"recall@{k}"] = round(found / n, 3)
            figures[f"recall@{k}_ci95"] = [round(x, 3) for x in wilson(found, n)]
        figures["mrr@10"] = round(sum(1 / r for r in ranks[kind] if r) / n, 3)
        out[kind] = figures
    out["paired_recall@5"] = {
        f"{a} - {b}": paired(ranks[a], ranks[b], 5)
        for a, b in (("bm25", "dense"), ("hybrid", "dense"), ("hybrid", "bm25"))
    }
    out["ranks"] = ranks
    return out


def squad_set(folder: Path) -> dict[str, Any]:
    paragraphs, questions = load_squad(SQUAD)
    files = []
    for i, text in enumerate(paragraphs):
        path = folder / f"p{i:05d}.txt"
        path.write_text(text + "\n", encoding="utf-8")
        files.append(str(path))
    gold = [(q, files[p]) for q, p in questions]
    return evaluate(folder, gold, lambda hit, file: hit.source == file)


def docs_set(folder: Path) -> dict[str, Any]:
    spec = json.loads(QUESTIONS.read_text(encoding="utf-8"))
    for name in spec["files"]:
        text = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{spec['rev']}:{name}"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text, encoding="utf-8")
    gold = [
        (q["question"], (str(folder / q["file"]), _norm(q["quote"]))) for q in spec["questions"]
    ]

    def is_hit(hit: Any, want: tuple[str, str]) -> bool:
        return hit.source == want[0] and want[1] in _norm(hit.text)

    out = evaluate(folder, gold, is_hit)
    from tokrag_integrations.retrieval import chunk_documents, load_documents

    chunks = chunk_documents(load_documents(folder))
    out["quotes_cut_by_chunker"] = sum(
        1
        for _, want in gold
        if not any(c.source == want[0] and want[1] in _norm(c.text) for c in chunks)
    )
    out["rev"] = spec["rev"]
    return out


def report(name: str, res: dict[str, Any]) -> None:
    print(f"\n### {name}: {res['questions']} questions, {res['chunks']} chunks\n")
    print("| retriever | recall@1 | recall@5 | recall@10 | MRR@10 |")
    print("| --- | --- | --- | --- | --- |")
    for kind in KINDS:
        f = res[kind]
        cells = [
            f"{f[f'recall@{k}']:.3f} [{f[f'recall@{k}_ci95'][0]:.2f}, {f[f'recall@{k}_ci95'][1]:.2f}]"
            for k in (1, 5, 10)
        ]
        print(f"| {kind} | {' | '.join(cells)} | {f['mrr@10']:.3f} |")
    for pair, d in res["paired_recall@5"].items():
        lo, hi = d["ci95"]
        a, b = pair.split(" - ")
        print(
            f"\n{pair}, recall@5: {d['difference']:+.3f} [{lo:+.3f}, {hi:+.3f}] "
            f"({d['only_this']} questions only {a} finds, {d['only_vector']} only {b})"
        )
    if "quotes_cut_by_chunker" in res:
        print(f"\nQuotes lying whole in no chunk (misses for all): {res['quotes_cut_by_chunker']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the figures (and ranks) here")
    parser.add_argument("--sets", nargs="+", choices=("squad", "docs"), default=["squad", "docs"])
    args = parser.parse_args()
    results: dict[str, Any] = {}
    for name in args.sets:
        with tempfile.TemporaryDirectory(prefix=f"folder-recall-{name}-") as tmp:
            folder = Path(tmp).resolve()
            results[name] = squad_set(folder) if name == "squad" else docs_set(folder)
        report("SQuAD dev" if name == "squad" else "Repository docs", results[name])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
