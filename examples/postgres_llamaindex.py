"""Ingest the sample handbook into Postgres + pgvector and ask it through LlamaIndex.

    pip install 'tokrag-integrations[postgres,llamaindex]'
    python examples/postgres_llamaindex.py ["your question"] [--dsn postgresql://...]

With no --dsn (and no TOKRAG_PG_DSN) an embedded PostgreSQL with pgvector is started from
the ``pgserver`` package in the per-user data folder (``$TOKRAG_DATA_DIR/pg``, else
``~/.local/share/tokrag/pg``; ``/var/lib/tokrag/pg`` as root) and stopped at exit.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "question", nargs="?", default="How many approvals does a change to flight software need?"
    )
    parser.add_argument("--dsn", help="postgresql://USER:PASSWORD@HOST:5432/DB (default: embedded)")
    parser.add_argument("--table", default="handbook")
    parser.add_argument("--policy", default="tokrag", help="tokrag, rag, no_rag, ...")
    parser.add_argument("--filter", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--search", choices=("vector", "text", "hybrid"), default="vector")
    args = parser.parse_args()

    from llama_index.core.query_engine import RetrieverQueryEngine

    from tokrag_integrations import load_model
    from tokrag_integrations.llama_index import TokRAGSynthesizer
    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest
    from tokrag_integrations.retrieval import get_sample_docs_path

    # 1. Ingest (idempotent: a second run skips unchanged files).
    summary = ingest([get_sample_docs_path()], dsn=args.dsn, table=args.table)
    print(summary.to_text())

    # 2. A LlamaIndex retriever over the pgvector table (HNSW, metadata filters bound safely).
    with PostgresKnowledgeBase(args.dsn, args.table) as kb:
        retriever = kb.llamaindex_retriever(top_k=3, filters=args.filter, search=args.search)

        # 3. Tok-RAG decoding as the response synthesizer.
        lm = load_model("default")
        engine = RetrieverQueryEngine(
            retriever,
            response_synthesizer=TokRAGSynthesizer(lm, policy=args.policy, max_new_tokens=48),
        )
        response = engine.query(args.question)
        print(f"\nQ: {args.question}\nA: {str(response).strip()}")
        print(f"tokens by source: {response.metadata.get('counts')}")
        for node in response.source_nodes:
            meta = node.node.metadata
            print(f"  {node.score:.3f}  {meta['file_name']} chunk {meta['chunk']}")


if __name__ == "__main__":
    main()
