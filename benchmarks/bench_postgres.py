"""Postgres + pgvector benchmark: ingest throughput, query latency, HNSW recall, vs SimpleVectorStore.

    nice -n 10 python benchmarks/bench_postgres.py                 # 10k and 100k chunks
    nice -n 10 python benchmarks/bench_postgres.py --sizes 10000 --queries 50
    python benchmarks/bench_postgres.py --dsn postgresql://...     # an external server

What is measured (figures are printed as a Markdown table and written as JSON):

* **Embedding throughput**: all-MiniLM-L6-v2 (packaged) over ``--embed-sample`` synthetic
  handbook-like chunks (~300 characters), chunks/s, batch 64, CPU.
* **Writing throughput**: the real ingestion write path (:func:`ingestion._write_file`: one
  transaction per file of 100 chunks, advisory lock, delete + ``executemany`` insert into
  the LlamaIndex ``PGVectorStore`` table with its HNSW index already in place), chunks/s.
* **Corpora**: by default both corpora use **random unit vectors** (dim 384) instead of
  embeddings, so that the run does not spend its time embedding (``--real-upto 10000`` embeds
  the 10k corpus for real). Random vectors have no cluster structure, which is the hard case
  for HNSW, so their recall is a lower bound. Corpora up to 20k go through the ingestion
  write path (HNSW maintained on insert); larger ones are bulk-loaded (``COPY``) and indexed
  afterwards, and the index build time is reported.
* **Query latency** p50/p95 (ms) through LlamaIndex ``PGVectorStore.query`` with a
  precomputed query embedding (HNSW ``m=16, ef_construction=64, ef_search=40``), through
  exact search (index scans disabled), and through LlamaIndex's in-memory
  ``SimpleVectorStore`` over the same vectors.
* **Recall@10** of HNSW against exact search.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

DIM = 384
WORDS = (
    "pump valve sensor orbit thruster telemetry crane bracket relay manifold harness gimbal "
    "antenna firmware battery panel radiator gyroscope bearing clamp nozzle regulator cable "
    "payload mission launch review approval incident escalation rotation leave policy office "
    "visitor badge network engineer runbook postmortem budget supplier calibration tolerance"
).split()


def synthetic_chunks(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        sentences = []
        for _ in range(4):
            words = rng.choices(WORDS, k=rng.randint(8, 14))
            sentences.append(" ".join(words).capitalize() + f" (item {i}-{rng.randint(0, 999)}).")
        out.append(" ".join(sentences))
    return out


def random_unit(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def load_table(
    db: Any, table: str, texts: list[str], vectors: np.ndarray, via_ingest: bool
) -> dict:
    """Fill ``data_<table>``; returns timing figures."""
    from tokrag_integrations.postgres import TableLayout, ingestion
    from tokrag_integrations.postgres.connection import connect
    from tokrag_integrations.postgres.frameworks import (
        close_llamaindex_store,
        make_llamaindex_store,
    )
    from tokrag_integrations.retrieval.embedder import DEFAULT_EMBED_MODEL_NAME

    layout = TableLayout.for_target(table)
    with connect(db.dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {layout.table}")
    store = make_llamaindex_store(db, layout, DIM, setup=True)
    store.add([])
    close_llamaindex_store(store)
    figures: dict[str, float] = {}
    with connect(db.dsn, autocommit=True) as conn:
        if via_ingest:
            t0 = time.perf_counter()
            per_file = 100
            for f in range(0, len(texts), per_file):
                prep = ingestion._PreparedFile(
                    source=f"/bench/file_{f // per_file:05d}.md",
                    content_hash=f"h{f}",
                    chunker="800/100",
                    chunks=texts[f : f + per_file],
                    metadata={"file_name": f"file_{f // per_file:05d}.md", "format": "md"},
                    index_texts=texts[f : f + per_file],
                )
                ingestion._write_file(
                    conn, layout, prep, DEFAULT_EMBED_MODEL_NAME, vectors[f : f + per_file]
                )
            figures["write_s"] = time.perf_counter() - t0
            figures["write_chunks_per_s"] = len(texts) / figures["write_s"]
        else:
            conn.execute(f"DROP INDEX IF EXISTS {layout.table}_embedding_idx")
            t0 = time.perf_counter()
            with (
                conn.cursor() as cur,
                cur.copy(
                    f"COPY {layout.table} (node_id, text, metadata_, embedding) FROM STDIN"
                ) as copy,
            ):
                for i, (text, vec) in enumerate(zip(texts, vectors, strict=True)):
                    meta = json.dumps({"source": f"/bench/{i // 100}", "chunk": i % 100})
                    copy.write_row(
                        (f"n{i}", text, meta, "[" + ",".join(f"{x:.6f}" for x in vec) + "]")
                    )
            figures["copy_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            conn.execute("SET maintenance_work_mem = '512MB'")
            conn.execute(
                f"CREATE INDEX {layout.table}_embedding_idx ON {layout.table} "
                "USING hnsw (embedding vector_cosine_ops) WITH (m = 16, ef_construction = 64)"
            )
            figures["hnsw_build_s"] = time.perf_counter() - t0
        conn.execute(f"ANALYZE {layout.table}")
    return figures


def query_figures(
    db: Any, table: str, queries: np.ndarray, n_simple: int, vectors: np.ndarray
) -> dict:
    from llama_index.core.schema import TextNode
    from llama_index.core.vector_stores import SimpleVectorStore
    from llama_index.core.vector_stores.types import VectorStoreQuery

    from tokrag_integrations.postgres import TableLayout
    from tokrag_integrations.postgres.connection import connect
    from tokrag_integrations.postgres.frameworks import (
        close_llamaindex_store,
        make_llamaindex_store,
    )

    layout = TableLayout.for_target(table)
    store = make_llamaindex_store(db, layout, DIM, ef_search=40)
    hnsw_ms, hnsw_ids = [], []
    for q in queries:
        t0 = time.perf_counter()
        res = store.query(VectorStoreQuery(query_embedding=q.tolist(), similarity_top_k=10))
        hnsw_ms.append((time.perf_counter() - t0) * 1000)
        hnsw_ids.append([n.node_id for n in res.nodes])
    close_llamaindex_store(store)

    exact_ms, exact_ids = [], []
    with connect(db.dsn, autocommit=True) as conn:
        conn.execute("SET enable_indexscan = off")
        for q in queries:
            t0 = time.perf_counter()
            rows = conn.execute(
                f"SELECT node_id FROM {layout.table} ORDER BY embedding <=> %s LIMIT 10", (q,)
            ).fetchall()
            exact_ms.append((time.perf_counter() - t0) * 1000)
            exact_ids.append([r[0] for r in rows])
        id_of_row = None
        if n_simple:
            id_of_row = [
                r[0]
                for r in conn.execute(f"SELECT node_id FROM {layout.table} ORDER BY id").fetchall()
            ]
    recall = statistics.mean(
        len(set(h) & set(e)) / max(1, len(e)) for h, e in zip(hnsw_ids, exact_ids, strict=True)
    )
    out = {
        "hnsw_p50_ms": pct(hnsw_ms, 0.5),
        "hnsw_p95_ms": pct(hnsw_ms, 0.95),
        "exact_p50_ms": pct(exact_ms, 0.5),
        "exact_p95_ms": pct(exact_ms, 0.95),
        "recall_at_10": recall,
    }
    if n_simple:
        simple = SimpleVectorStore()
        t0 = time.perf_counter()
        simple.add(
            [
                TextNode(id_=id_of_row[i], text="", embedding=vectors[i].tolist())
                for i in range(len(vectors))
            ]
        )
        out["simple_build_s"] = time.perf_counter() - t0
        simple_ms = []
        for q in queries[:n_simple]:
            t0 = time.perf_counter()
            simple.query(VectorStoreQuery(query_embedding=q.tolist(), similarity_top_k=10))
            simple_ms.append((time.perf_counter() - t0) * 1000)
        out["simple_p50_ms"] = pct(simple_ms, 0.5)
        out["simple_p95_ms"] = pct(simple_ms, 0.95)
        out["simple_queries"] = len(simple_ms)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--simple-queries", type=int, default=30)
    parser.add_argument(
        "--real-upto",
        type=int,
        default=0,
        help="corpora up to this size use real MiniLM embeddings (default: random vectors)",
    )
    parser.add_argument("--embed-sample", type=int, default=512, help="chunks to time embedding on")
    parser.add_argument("--dsn", help="external Postgres (default: embedded in a temp folder)")
    parser.add_argument("--json", default="benchmarks/bench_postgres.json")
    args = parser.parse_args()

    from tokrag_integrations.postgres.connection import ResolvedDatabase
    from tokrag_integrations.postgres.embedded import start_embedded
    from tokrag_integrations.retrieval.embedder import load_embedder

    if args.dsn:
        db = ResolvedDatabase(args.dsn, "argument")
    else:
        tmp = tempfile.mkdtemp(prefix="tokrag_bench_")
        dsn, server = start_embedded(Path(tmp) / "pg")
        db = ResolvedDatabase(dsn, "embedded", server)
    import torch

    results: dict[str, Any] = {
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
    }
    embedder = load_embedder()
    sample = synthetic_chunks(args.embed_sample, seed=3)
    embedder.encode(sample[:64])  # warm-up
    t0 = time.perf_counter()
    embedder.encode(sample, batch_size=64)
    results["embed_sample"] = args.embed_sample
    results["embed_chunks_per_s"] = args.embed_sample / (time.perf_counter() - t0)
    print(f"embedding: {results['embed_chunks_per_s']:.1f} chunks/s", flush=True)
    for size in args.sizes:
        key = f"{size // 1000}k"
        print(f"== {key} chunks", flush=True)
        texts = synthetic_chunks(size, seed=size)
        if size <= args.real_upto:
            embedder.encode(texts[:64])  # warm-up
            t0 = time.perf_counter()
            vectors = embedder.encode(texts, batch_size=64)
            embed_s = time.perf_counter() - t0
            queries = embedder.encode(synthetic_chunks(args.queries, seed=7)[: args.queries])
            res: dict[str, Any] = {
                "vectors": "MiniLM embeddings of synthetic text",
                "embed_s": embed_s,
                "embed_chunks_per_s": size / embed_s,
            }
            res.update(load_table(db, f"bench_{key}", texts, vectors, via_ingest=True))
        elif size <= 20_000:
            vectors = random_unit(size, seed=size)
            queries = random_unit(args.queries, seed=1)
            res = {"vectors": "random unit vectors"}
            res.update(load_table(db, f"bench_{key}", texts, vectors, via_ingest=True))
        else:
            vectors = random_unit(size, seed=size)
            queries = random_unit(args.queries, seed=1)
            res = {"vectors": "random unit vectors"}
            res.update(load_table(db, f"bench_{key}", texts, vectors, via_ingest=False))
        print(json.dumps(res, indent=1), flush=True)
        res.update(query_figures(db, f"bench_{key}", queries, args.simple_queries, vectors))
        results[key] = res
        print(json.dumps(res, indent=1), flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(
        "\n| corpus | vectors | HNSW p50/p95 ms | exact p50/p95 ms | recall@10 | SimpleVectorStore p50/p95 ms |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for key, r in results.items():
        if not isinstance(r, dict):
            continue
        print(
            f"| {key} | {r['vectors']} | {r['hnsw_p50_ms']:.1f} / {r['hnsw_p95_ms']:.1f} | "
            f"{r['exact_p50_ms']:.1f} / {r['exact_p95_ms']:.1f} | {r['recall_at_10']:.3f} | "
            f"{r.get('simple_p50_ms', float('nan')):.1f} / {r.get('simple_p95_ms', float('nan')):.1f} |"
        )


if __name__ == "__main__":
    main()
