"""Tok-RAG through ``Settings.llm`` against ``TokRAGSynthesizer``: time and tokens, side by side.

A LlamaIndex user who sets ``Settings.llm = TokRAGLLM(...)`` and calls
``index.as_query_engine()`` gets Tok-RAG through LlamaIndex's own synthesizer and templates
(the "Settings.llm path"); ``TokRAGSynthesizer`` is the package's own entry point. This script
asks the packaged sample questions through both, interleaved (A B A B ... on one loaded model,
same retriever, same nodes), and prints:

* ``same template``: ``TokRAGSynthesizer(text_qa_template=T)`` against the query engine with
  ``Settings.llm`` and the same ``T``: whether every answer is token for token the same, and
  the time ratio per question and per generated token;
* ``defaults``: ``TokRAGSynthesizer()`` (the package's own prompt) against the query engine
  with LlamaIndex's default templates: the time ratios, prompt tokens and answers covered.

    python benchmarks/settings_llm_path.py                 # 10 questions x 2 rounds
    python benchmarks/settings_llm_path.py --rounds 3 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from llama_index.core import PromptTemplate, Settings, SimpleDirectoryReader, VectorStoreIndex
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.query_engine import RetrieverQueryEngine

from tokrag_eval.metrics import cover_em
from tokrag_integrations import load_model
from tokrag_integrations.llama_index import TokRAGLLM, TokRAGSynthesizer, local_embedding
from tokrag_integrations.retrieval import get_sample_docs_path, get_sample_questions

TEMPLATE = PromptTemplate(
    "Company notes:\n{context_str}\n\nUsing only the notes, answer briefly.\n"
    "Question: {query_str}\nAnswer: "
)


def _tokens(response: Any) -> int:
    md = response.metadata or {}
    if "usage" in md:
        return int(md["usage"]["completion_tokens"])
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--top-k", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args()

    lm = load_model("default")
    docs = SimpleDirectoryReader(str(get_sample_docs_path())).load_data()
    nodes = SentenceSplitter(chunk_size=256, chunk_overlap=20).get_nodes_from_documents(docs)
    index = VectorStoreIndex(nodes, embed_model=local_embedding())
    retriever = index.as_retriever(similarity_top_k=args.top_k)
    questions = get_sample_questions()
    n = args.max_new_tokens

    def settings_engine(template: Any | None) -> Any:
        Settings.llm = TokRAGLLM(lm, max_new_tokens=n)
        kw = {"text_qa_template": template} if template is not None else {}
        return index.as_query_engine(similarity_top_k=args.top_k, **kw)

    def synth_engine(template: Any | None) -> Any:
        kw = {"text_qa_template": template} if template is not None else {}
        synth = TokRAGSynthesizer(lm, max_new_tokens=n, **kw)
        return RetrieverQueryEngine(retriever=retriever, response_synthesizer=synth)

    engines = {
        "same template": (settings_engine(TEMPLATE), synth_engine(TEMPLATE)),
        "defaults": (settings_engine(None), synth_engine(None)),
    }
    engines["same template"][0].query(questions[0]["question"])  # warm-up (kernels, masks)
    for label, (via_settings, via_synth) in engines.items():
        t_set: list[float] = []
        t_syn: list[float] = []
        tok_set = tok_syn = 0
        same = 0
        covered = [0, 0]
        for _ in range(args.rounds):
            for q in questions:
                t0 = time.perf_counter()
                a = via_settings.query(q["question"])
                t1 = time.perf_counter()
                b = via_synth.query(q["question"])
                t2 = time.perf_counter()
                t_set.append(t1 - t0)
                t_syn.append(t2 - t1)
                # The Settings.llm path's Response carries no usage: count its tokens.
                tok_set += len(lm.tokenizer(str(a), add_special_tokens=False)["input_ids"]) or 1
                tok_syn += _tokens(b) or len(lm.tokenizer(str(b), add_special_tokens=False)["input_ids"])
                same += str(a) == str(b)
                gold = [q["answer"], *q.get("aliases", [])]
                covered[0] += cover_em(str(a), gold)
                covered[1] += cover_em(str(b), gold)
        k = len(t_set)
        print(f"== {label}: {k} questions ({len(questions)} x {args.rounds} rounds), {n} new tokens max")
        print(f"  Settings.llm path  : {statistics.mean(t_set):.3f} s/question, covered {covered[0]}/{k}")
        print(f"  TokRAGSynthesizer  : {statistics.mean(t_syn):.3f} s/question, covered {covered[1]}/{k}")
        print(f"  ratio per question : {sum(t_set) / sum(t_syn):.3f} (Settings.llm / synthesizer)")
        print(
            f"  ratio per token    : {(sum(t_set) / tok_set) / (sum(t_syn) / tok_syn):.3f} "
            f"({tok_set} vs {tok_syn} tokens)"
        )
        print(f"  identical answers  : {same}/{k}")


if __name__ == "__main__":
    main()
