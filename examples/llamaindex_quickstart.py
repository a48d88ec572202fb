"""LlamaIndex quickstart: documents -> retriever -> query engine with TokRAGSynthesizer.

Everything runs locally and offline: the packaged MiniLM embeds the packaged sample
documents (a fictional company's handbook), the packaged SmolLM2-135M-Instruct answers, and
the answer's explanation (which token came from retrieval, which from the model) is printed
in the terminal and written as an HTML page (``out/llamaindex_quickstart.html``).

    pip install 'tokrag-integrations[llamaindex]'
    python examples/llamaindex_quickstart.py
    python examples/llamaindex_quickstart.py --docs ./my_docs --question "..." --policy rag

``FolderRetriever`` is ``tokrag ask --docs``'s retrieval (same chunks, same embeddings,
kept in the cache folder) and every setting left out is the package's default
(``tokrag_integrations.defaults``), so this script and ``tokrag ask QUESTION --docs FOLDER``
give the same answer (tests/integration/test_defaults.py). Any LlamaIndex retriever works in its place
(``VectorStoreIndex.as_retriever()``, BM25, Postgres...).

On the default question both ``--policy tokrag`` and ``--policy rag`` answer
"Bramblewick", the handbook's code name; the explanation shows which of its tokens came
from the passages and which both contexts agreed on (tests/integration/test_defaults.py checks both).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_QUESTION = "What is the code name of the Kestrel-7 programme?"


def main(argv: list[str] | None = None) -> None:
    from llama_index.core.query_engine import RetrieverQueryEngine

    from tokrag_integrations import Trace, load_model
    from tokrag_integrations.defaults import MAX_NEW_TOKENS, TOP_K
    from tokrag_integrations.llama_index import FolderRetriever, TokRAGSynthesizer
    from tokrag_integrations.retrieval import get_sample_docs_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", default=str(get_sample_docs_path()), help="folder of documents")
    ap.add_argument("--question", default=DEFAULT_QUESTION)
    ap.add_argument("--policy", default="tokrag", help="tokrag, rag, no_rag, ...")
    ap.add_argument("--top-k", type=int, default=TOP_K, help="chunks retrieved per question")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    ap.add_argument(
        "--html",
        default=os.path.join("out", "llamaindex_quickstart.html"),
        help="explanation page (default: out/llamaindex_quickstart.html, a git-ignored folder)",
    )
    args = ap.parse_args(argv)

    # 1. Documents -> chunks -> MiniLM embeddings, searched as `tokrag ask --docs` does.
    retriever = FolderRetriever(args.docs, top_k=args.top_k)

    # 2. A standard query engine whose synthesizer decodes with the chosen policy.
    lm = load_model("default")
    synthesizer = TokRAGSynthesizer(lm, policy=args.policy, max_new_tokens=args.max_new_tokens)
    engine = RetrieverQueryEngine(retriever=retriever, response_synthesizer=synthesizer)

    # 3. Ask, then explain.
    response = engine.query(args.question)
    md = response.metadata
    print(f"Q: {args.question}")
    print(f"A: {response.response}")
    print(
        f"policy: {md['policy']} (answered from {md['answered_from']}); tokens per source: {md['counts']}"
    )
    for n in response.source_nodes:
        used = "used" if n.node.node_id in md["nodes_used"] else "not used"
        name = os.path.basename(n.node.metadata.get("source", n.node.node_id))
        print(f"  source {name} score={n.score:.3f} ({used})")
    for w in md["warnings"]:
        print(f"  warning: {w}")

    trace = Trace.from_dict(md["trace"])
    trace.render()
    Path(args.html).parent.mkdir(parents=True, exist_ok=True)
    trace.to_html(args.html)
    print(f"explanation written to {Path(args.html).resolve()}")


if __name__ == "__main__":
    main()
