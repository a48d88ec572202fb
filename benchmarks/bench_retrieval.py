"""Retrieval quality and growth of :class:`PostgresKnowledgeBase` search (vector, text, hybrid).

    nice -n 10 python benchmarks/bench_retrieval.py --json benchmarks/results/retrieval.json
    nice -n 10 python benchmarks/bench_retrieval.py --sizes 1000 10000 100000 --plot docs/retrieval.png

What is measured (a Markdown report on stdout; ``--json`` keeps the numbers):

* **SQuAD dev recall** (``/work/shared/data/squad_dev.jsonl``, the project's fixed 300-question
  dev split): every paragraph of the split (each question's gold paragraph and its BM25 hard
  negatives, deduplicated) is written as one ``.txt`` file and ingested with
  :func:`~tokrag_integrations.postgres.ingest` (chunks of 800 characters, packaged MiniLM).
  Each question is a query; a hit is a chunk of its gold paragraph's file. Recall@1/5/10 and
  MRR@10 for ``search="vector" | "text" | "hybrid"`` (RRF ``k=60``, weights 1/1, 50
  candidates per ranking). End-to-end ingestion chunks/s (parse, chunk, embed, write).
* **Growth**: tables of ``--sizes`` chunks built from the SQuAD chunks repeated with distinct
  ids; each copy's embedding gets Gaussian noise (sigma 0.02, renormalised) so the copies are
  not identical points (HNSW over exact duplicates is a degenerate case). Rows go through the
  ingestion write path (:func:`ingestion._write_file`: one transaction per 100-chunk file,
  HNSW and GIN indexes maintained on insert) with the embeddings precomputed, so the
  chunks/s are Postgres's, not the embedder's. Query latency p50/p95 of
  :meth:`PostgresKnowledgeBase.retrieve` (top 10, through the shared pool) per mode, with the
  query embeddings precomputed (the MiniLM query embedding time is reported separately).
* **HNSW ef_search**: recall@10 of the HNSW vector search against exact search (index scans
  off) for several ``ef_search`` values, on the SQuAD table and on the largest growth table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

MODES = ("vector", "text", "hybrid")
SQUAD = Path("/work/shared/data/squad_dev.jsonl")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def load_squad(path: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """(paragraphs, [(question, index of its gold paragraph)])."""
    paragraphs: list[str] = []
    index: dict[str, int] = {}
    questions = []
    for line in path.read_text(encoding="utf-8").splitlines():
        item = json.loads(line)
        for text in [*item["positives"], *item["negatives"]]:
            if text not in index:
                index[text] = len(paragraphs)
                paragraphs.append(text)
        questions.append((item["question"], index[item["positives"][0]]))
    return paragraphs, questions


def squad_recall(dsn: str, folder: Path) -> dict[str, Any]:
    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest

    paragraphs, questions = load_squad(SQUAD)
    files = []
    for i, text in enumerate(paragraphs):
        path = folder / f"p{i:05d}.txt"
        path.write_text(text + "\n", encoding="utf-8")
        files.append(str(path.resolve()))
    summary = ingest([folder], dsn=dsn, table="squad_dev", progress=False)
    out: dict[str, Any] = {
        "paragraphs": len(paragraphs),
        "questions": len(questions),
        "chunks": summary.chunks_written,
        "ingest_seconds": round(summary.seconds, 1),
        "embed_seconds": round(summary.embed_seconds, 1),
        "write_seconds": round(summary.write_seconds, 1),
        "ingest_chunks_per_s": round(summary.chunks_written / summary.seconds, 1),
    }
    kb = PostgresKnowledgeBase(dsn, "squad_dev")
    t0 = time.perf_counter()
    embeddings = {q: kb.embedder.embed_query(q) for q, _ in questions}
    out["query_embed_ms"] = round(1000 * (time.perf_counter() - t0) / len(questions), 1)
    kb.embedder.embed_query = embeddings.__getitem__  # precomputed from here on
    all_ranks: dict[str, list[int | None]] = {}
    for mode in MODES:
        ranks = []
        for question, gold in questions:
            hits = kb.retrieve(question, top_k=10, search=mode)
            sources = [h.source for h in hits]
            ranks.append(sources.index(files[gold]) + 1 if files[gold] in sources else None)
        all_ranks[mode] = ranks
        n = len(ranks)
        out[mode] = {
            **{f"recall@{k}": round(sum(1 for r in ranks if r and r <= k) / n, 3) for k in (1, 5, 10)},
            "mrr@10": round(sum(1 / r for r in ranks if r) / n, 3),
        }
    out["paired_recall@5"] = {m: paired(all_ranks[m], all_ranks["vector"], 5) for m in ("text", "hybrid")}
    out["ef_search"] = ef_recall(kb, [embeddings[q] for q, _ in questions])
    kb.close()
    return out


def paired(ranks: list[int | None], base: list[int | None], k: int, resamples: int = 2000) -> dict[str, Any]:
    """Recall@k of ``ranks`` minus that of ``base`` on the same questions: the difference,
    a 95 % percentile-bootstrap interval over questions (fixed seed), and the questions only
    one of the two finds."""
    import numpy as np

    a = np.array([1.0 if r and r <= k else 0.0 for r in ranks])
    b = np.array([1.0 if r and r <= k else 0.0 for r in base])
    rng = np.random.default_rng(20240917)
    idx = rng.integers(0, len(a), size=(resamples, len(a)))
    diffs = (a[idx] - b[idx]).mean(axis=1)
    return {
        "difference": round(float((a - b).mean()), 3),
        "ci95": [round(float(np.percentile(diffs, 2.5)), 3), round(float(np.percentile(diffs, 97.5)), 3)],
        "only_this": int(((a == 1) & (b == 0)).sum()),
        "only_vector": int(((a == 0) & (b == 1)).sum()),
    }


def ef_recall(kb: Any, query_vectors: list[Any], efs: tuple[int, ...] = (10, 20, 40, 100, 200)) -> dict[str, float]:
    """Recall@10 of HNSW (per ef_search) against exact search, over ``query_vectors``."""
    import numpy as np
    from psycopg import sql

    from tokrag_integrations.postgres.connection import pooled

    lay = kb.layout
    statement = sql.SQL(
        "SELECT {id} FROM {t} ORDER BY {e} <=> %s LIMIT 10"
    ).format(id=sql.Identifier(lay.key_column), t=sql.Identifier(lay.table), e=sql.Identifier(lay.embedding_column))
    vectors = [np.asarray(v, dtype=np.float32) for v in query_vectors]

    def run(settings: list[tuple[str, str]]) -> list[set[Any]]:
        out = []
        with pooled(kb.db.dsn) as conn:
            for v in vectors:
                with conn.transaction():
                    for name, value in settings:
                        conn.execute("SELECT set_config(%s, %s, true)", (name, value))
                    out.append({r[0] for r in conn.execute(statement, (v,))})
        return out

    exact = run([("enable_indexscan", "off")])
    result = {}
    for ef in efs:
        approx = run([("hnsw.ef_search", str(ef))])
        result[str(ef)] = round(statistics.fmean(len(a & e) / len(e) for a, e in zip(approx, exact, strict=True) if e), 3)
    return result


def growth(dsn: str, sizes: list[int], queries: int, seed: int = 0) -> dict[str, Any]:
    import numpy as np
    from psycopg import sql

    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingestion
    from tokrag_integrations.postgres.connection import pooled, resolve_dsn
    from tokrag_integrations.postgres.layout import TableLayout, ensure_table
    from tokrag_integrations.retrieval.embedder import load_embedder

    source = PostgresKnowledgeBase(dsn, "squad_dev")
    with pooled(dsn) as conn:
        rows = conn.execute(
            sql.SQL("SELECT text, embedding FROM {} ORDER BY id").format(sql.Identifier(source.layout.table))
        ).fetchall()
    texts = [r[0] for r in rows]
    base = np.stack([np.asarray(r[1], dtype=np.float32) for r in rows])
    _, questions = load_squad(SQUAD)
    qtexts = [q for q, _ in questions[:queries]]
    qvecs = {q: source.embedder.embed_query(q) for q in qtexts}
    source.close()
    embedder = load_embedder()
    db = resolve_dsn(dsn)
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {}
    for size in sizes:
        layout = TableLayout.for_target(f"grow_{size}", "llamaindex")
        with pooled(dsn) as conn:  # a fresh table each run
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(layout.table)))
        ensure_table(db, layout, embedder)
        write_s = 0.0
        written = 0
        with pooled(dsn) as conn:
            for first in range(0, size, 100):
                n = min(100, size - first)
                idx = [(first + j) % len(texts) for j in range(n)]
                vecs = base[idx]
                if first >= len(texts):  # a copy: distinct ids, jittered embedding
                    vecs = vecs + rng.normal(0, 0.02, vecs.shape).astype(np.float32)
                    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
                prep = ingestion._PreparedFile(
                    source=f"/bench/grow/{first // 100:06d}.txt",
                    content_hash=uuid.uuid4().hex,
                    chunker="800/100",
                    chunks=[texts[i] for i in idx],
                    metadata={"file_name": f"{first // 100:06d}.txt", "embed_model": embedder.name},
                    index_texts=[texts[i] for i in idx],
                )
                t0 = time.perf_counter()
                ingestion._write_file(conn, layout, prep, embedder.name, vecs)
                write_s += time.perf_counter() - t0
                written += n
        kb = PostgresKnowledgeBase(dsn, f"grow_{size}")
        kb.embedder.embed_query = qvecs.__getitem__
        figures: dict[str, Any] = {"chunks": written, "write_seconds": round(write_s, 1),
                                   "write_chunks_per_s": round(written / write_s, 1)}
        for mode in MODES:
            kb.retrieve(qtexts[0], top_k=10, search=mode)  # warm
            times = []
            for q in qtexts:
                t0 = time.perf_counter()
                kb.retrieve(q, top_k=10, search=mode)
                times.append(1000 * (time.perf_counter() - t0))
            figures[mode] = {"p50_ms": round(_pct(times, 0.5), 1), "p95_ms": round(_pct(times, 0.95), 1)}
        if size == max(sizes):
            figures["ef_search"] = ef_recall(kb, list(qvecs.values()))
        kb.close()
        out[str(size)] = figures
        print(f"size {size}: {json.dumps(figures)}", file=sys.stderr, flush=True)
    return out


def report(res: dict[str, Any]) -> str:
    lines = []
    sq = res.get("squad")
    if sq:
        lines += [
            f"SQuAD dev: {sq['questions']} questions, {sq['paragraphs']} paragraphs -> {sq['chunks']} chunks; "
            f"ingest {sq['ingest_seconds']} s ({sq['ingest_chunks_per_s']} chunks/s end to end; embedding "
            f"{sq['embed_seconds']} s, writing {sq['write_seconds']} s); query embedding {sq['query_embed_ms']} ms",
            "",
            "| search | recall@1 | recall@5 | recall@10 | MRR@10 |",
            "| --- | --- | --- | --- | --- |",
        ]
        for mode in MODES:
            m = sq[mode]
            lines.append(f"| {mode} | {m['recall@1']:.3f} | {m['recall@5']:.3f} | {m['recall@10']:.3f} | {m['mrr@10']:.3f} |")
        for mode, p in sq.get("paired_recall@5", {}).items():
            lines.append(
                f"{mode} - vector, recall@5: {p['difference']:+.3f} [{p['ci95'][0]:+.3f}, {p['ci95'][1]:+.3f}] "
                f"({p['only_this']} questions found only by {mode} in the top 5, {p['only_vector']} only by vector)"
            )
        lines += ["", "HNSW recall@10 vs exact (SQuAD table): " + ", ".join(f"ef {k}: {v}" for k, v in sq["ef_search"].items())]
    gr = res.get("growth")
    if gr:
        lines += ["", "| chunks | write chunks/s | vector p50/p95 ms | text p50/p95 ms | hybrid p50/p95 ms |",
                  "| --- | --- | --- | --- | --- |"]
        for size, f in gr.items():
            cells = " | ".join(f"{f[m]['p50_ms']} / {f[m]['p95_ms']}" for m in MODES)
            lines.append(f"| {size} | {f['write_chunks_per_s']} | {cells} |")
            if "ef_search" in f:
                lines.append("")
                lines.append(f"HNSW recall@10 vs exact ({size} chunks): " + ", ".join(f"ef {k}: {v}" for k, v in f["ef_search"].items()))
                lines.append("")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gr = res["growth"]
    sizes = [int(s) for s in gr]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for mode in MODES:
        ax1.plot(sizes, [gr[str(s)][mode]["p50_ms"] for s in sizes], marker="o", label=f"{mode} p50")
        ax1.plot(sizes, [gr[str(s)][mode]["p95_ms"] for s in sizes], marker="x", linestyle="--", label=f"{mode} p95")
    ax1.set(xscale="log", yscale="log", xlabel="chunks in table", ylabel="query latency (ms)", title="Query latency (top 10)")
    ax1.legend(fontsize=7)
    ax2.plot(sizes, [gr[str(s)]["write_chunks_per_s"] for s in sizes], marker="o")
    ax2.set(xscale="log", xlabel="chunks in table", ylabel="chunks/s", title="Ingestion write path")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dsn", help="an external Postgres (default: a fresh embedded server)")
    p.add_argument("--sizes", type=int, nargs="*", default=[1000, 10000], help="growth table sizes (none: SQuAD only)")
    p.add_argument("--queries", type=int, default=100, help="queries per size for latency")
    p.add_argument(
        "--data-dir",
        type=Path,
        help="keep the embedded server and the SQuAD files here (a second run then finds the "
        "SQuAD table unchanged and skips its embedding)",
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_retrieval_") as tmp:
        work = args.data_dir.resolve() if args.data_dir else Path(tmp)
        server = None
        dsn = args.dsn
        if not dsn:
            from tokrag_integrations.postgres.embedded import start_embedded

            dsn, server = start_embedded(work / "pg")
        folder = work / "squad"
        folder.mkdir(parents=True, exist_ok=True)
        res: dict[str, Any] = {"squad": squad_recall(dsn, folder)}
        print(report(res), flush=True)
        if args.sizes:
            res["growth"] = growth(dsn, args.sizes, args.queries)
        print(report(res))
        if args.json:
            args.json.write_text(json.dumps(res, indent=2) + "\n")
        if args.plot and args.sizes:
            plot(res, args.plot)
        if server is not None:
            from tokrag_integrations.postgres.connection import close_pools

            close_pools()
            server.cleanup()


if __name__ == "__main__":
    main()
