"""Route between a direct-LLM engine and a RAG engine with a retrieval gate (LlamaIndex).

python examples/router_llamaindex.py "Who founded Quillfeather Aerospace?"
python examples/router_llamaindex.py --max-new-tokens 12 --calibration 4   # quick run
"""

from __future__ import annotations

import argparse
import json

from llama_index.core.query_engine import RetrieverQueryEngine, RouterQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, TextNode
from llama_index.core.tools import QueryEngineTool

from tokrag_integrations import load_model
from tokrag_integrations.gating import ConfidenceGate
from tokrag_integrations.llama_index import TokRAGLLM, TokRAGSynthesizer
from tokrag_integrations.llama_index.gated_engine import gate_selector
from tokrag_integrations.retrieval import (
    build_retriever,
    get_sample_docs_path,
    get_sample_questions,
)


class SampleDocsRetriever(BaseRetriever):
    """The project's dense retriever over the packaged sample documents."""

    def __init__(self, top_k: int = 5) -> None:
        super().__init__()
        self._ret = build_retriever(get_sample_docs_path(), "dense")
        self._top_k = top_k

    def _retrieve(self, query_bundle):
        hits = self._ret.retrieve(query_bundle.query_str, top_k=self._top_k)
        return [NodeWithScore(node=TextNode(text=h.text), score=h.score) for h in hits]


class NoRetriever(BaseRetriever):
    def _retrieve(self, query_bundle):
        return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("question", nargs="?", default="Who founded Quillfeather Aerospace?")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="answer length")
    ap.add_argument("--calibration", type=int, default=10, help="sample questions to calibrate")
    ap.add_argument("--top-k", type=int, default=5, help="chunks retrieved (default 5, as tokrag ask)")
    args = ap.parse_args()
    question = args.question
    lm = load_model("default")
    gate = ConfidenceGate(lm, metric="self_certainty", max_new_tokens=min(16, args.max_new_tokens))
    # Calibrate on questions about your documents; percentile = the share of them you accept
    # answering without retrieval. A document assistant wants a small share: the model cannot
    # know company facts, so only questions it is more sure of than 90 % of those go direct.
    calib = [q["question"] for q in get_sample_questions()][: args.calibration]
    gate.calibrate(calib, percentile=10)
    synth = TokRAGSynthesizer(lm, policy="tokrag", max_new_tokens=args.max_new_tokens)
    direct = RetrieverQueryEngine(retriever=NoRetriever(), response_synthesizer=synth)
    rag = RetrieverQueryEngine(retriever=SampleDocsRetriever(args.top_k), response_synthesizer=synth)
    router = RouterQueryEngine(
        selector=gate_selector(gate),
        llm=TokRAGLLM(lm),  # else LlamaIndex resolves Settings.llm (OpenAI) at construction
        query_engine_tools=[
            QueryEngineTool.from_defaults(direct, description="the model alone"),
            QueryEngineTool.from_defaults(rag, description="retrieved passages"),
        ],
    )
    resp = router.query(question)
    print(f"Q: {question}\nA: {str(resp).strip()}")
    decision = json.loads(resp.metadata["selector_result"].selections[0].reason)
    print(
        "route:",
        decision["route"],
        "| score:",
        decision["score"],
        "| threshold:",
        decision["threshold"],
    )
    # The same routing as one engine, without RouterQueryEngine (decision in metadata["gate"]):
    #   from tokrag_integrations.llama_index.gated_engine import gated_query_engine
    #   gated_query_engine(gate, SampleDocsRetriever(), synth).query(question)


if __name__ == "__main__":
    main()
