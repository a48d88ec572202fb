"""Route a question to a direct chain or a RAG chain with a retrieval gate (LangChain).

python examples/router_langchain.py "Who founded Quillfeather Aerospace?"
"""

from __future__ import annotations

import sys

from langchain_core.documents import Document
from langchain_core.runnables import RunnableLambda

from tokrag_integrations import load_model
from tokrag_integrations.gating import CtrlAGate
from tokrag_integrations.gating.langchain import gated_router
from tokrag_integrations.langchain import ChatTokRAG, create_tokrag_chain
from tokrag_integrations.retrieval import (
    build_retriever,
    get_sample_docs_path,
    get_sample_questions,
)


def main() -> None:
    question = sys.argv[1] if len(sys.argv) > 1 else "Who founded Quillfeather Aerospace?"
    lm = load_model("default")
    ret = build_retriever(get_sample_docs_path(), "bm25")
    retriever = RunnableLambda(
        lambda q: [Document(page_content=h.text) for h in ret.retrieve(q, top_k=3)]
    )
    gate = CtrlAGate(lm)  # confidence directions from the project's statement set
    gate.calibrate([q["question"] for q in get_sample_questions()], percentile=50)
    router = gated_router(
        gate,
        direct=ChatTokRAG(lm=lm, policy="llm", max_tokens=48),
        rag=create_tokrag_chain(retriever, lm, policy="tokrag", max_tokens=48),
    )
    out = router.invoke({"question": question})
    print(out["answer"])
    print(
        "route:",
        out["route"],
        "| score:",
        out["gate"]["score"],
        "| threshold:",
        out["gate"]["threshold"],
    )


if __name__ == "__main__":
    main()
