"""Ingest the sample handbook into Postgres + pgvector and ask it through LangChain.

    pip install 'tokrag-integrations[postgres,langchain]'
    python examples/postgres_langchain.py ["your question"] [--dsn postgresql://...]

The table is written in LlamaIndex's ``PGVectorStore`` layout and read here by
``langchain-postgres``'s ``PGEngine`` / ``PGVectorStore`` with custom column names
(``node_id``, ``text``, ``embedding``, ``metadata_``): one table, both frameworks. With no
--dsn (and no TOKRAG_PG_DSN) an embedded PostgreSQL from ``pgserver`` is used.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "question",
        nargs="?",
        default="What is the guest Wi-Fi network at the Dundee office called?",
    )
    parser.add_argument("--dsn", help="postgresql://USER:PASSWORD@HOST:5432/DB (default: embedded)")
    parser.add_argument("--table", default="handbook")
    parser.add_argument("--policy", default="tokrag", help="tokrag, rag, no_rag, ...")
    parser.add_argument("--filter", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--search", choices=("vector", "text", "hybrid"), default="vector")
    args = parser.parse_args()

    from tokrag_integrations import load_model
    from tokrag_integrations.langchain import create_tokrag_chain
    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest
    from tokrag_integrations.retrieval import get_sample_docs_path

    summary = ingest([get_sample_docs_path()], dsn=args.dsn, table=args.table)
    print(summary.to_text())

    with PostgresKnowledgeBase(args.dsn, args.table) as kb:
        # A plain LangChain VectorStoreRetriever over langchain_postgres.PGVectorStore.
        retriever = kb.langchain_retriever(k=3, filters=args.filter, search=args.search)
        for doc in retriever.invoke(args.question):
            print(f"  retrieved {doc.metadata['file_name']} chunk {doc.metadata['chunk']}")

        lm = load_model("default")
        chain = create_tokrag_chain(retriever, lm, policy=args.policy, max_tokens=48)
        out = chain.invoke(args.question)
        answer = out if isinstance(out, str) else out.get("answer", out)
        print(f"\nQ: {args.question}\nA: {str(answer).strip()}")


if __name__ == "__main__":
    main()
