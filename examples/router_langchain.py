"""Route a question to a direct chain or a RAG chain with a retrieval gate (LangChain).

python examples/router_langchain.py "Who founded Quillfeather Aerospace?"
python examples/router_langchain.py --max-new-tokens 12 --calibration 4 --statements 16  # quick
"""

from __future__ import annotations

import argparse

from langchain_core.documents import Document
from langchain_core.runnables import RunnableLambda

from tokrag_integrations import load_model
from tokrag_integrations.gating import CtrlAGate
from tokrag_integrations.gating.statements import STATEMENTS
from tokrag_integrations.langchain import ChatTokRAG, create_tokrag_chain
from tokrag_integrations.langchain.gated_router import gated_router
from tokrag_integrations.retrieval import (
    build_retriever,
    get_sample_docs_path,
    get_sample_questions,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("question", nargs="?", default="Who founded Quillfeather Aerospace?")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="answer length")
    ap.add_argument("--calibration", type=int, default=10, help="sample questions to calibrate")
    ap.add_argument("--statements", type=int, default=len(STATEMENTS), help="CtrlA statements")
    args = ap.parse_args()
    question = args.question
    lm = load_model("default")
    ret = build_retriever(get_sample_docs_path(), "bm25")
    retriever = RunnableLambda(
        lambda q: [Document(page_content=h.text) for h in ret.retrieve(q, top_k=3)]
    )
    # confidence directions from the project's statement set
    gate = CtrlAGate(
        lm,
        max_new_tokens=min(16, args.max_new_tokens),
        statements=STATEMENTS[: args.statements],
    )
    calib = [q["question"] for q in get_sample_questions()][: args.calibration]
    # percentile = share of calibration questions answered without retrieval (see
    # examples/router_llamaindex.py): small for a document assistant
    gate.calibrate(calib, percentile=10)
    n = args.max_new_tokens
    router = gated_router(
        gate,
        direct=ChatTokRAG(model=lm, policy="no_rag", max_tokens=n),
        rag=create_tokrag_chain(retriever, lm, policy="tokrag", max_tokens=n),
    )
    out = router.invoke({"question": question})
    print(f"Q: {question}\nA: {out['answer'].strip()}")
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
