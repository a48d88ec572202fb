"""What the LlamaIndex and LangChain adapters share, framework-free: the translation of
results, usage and options (:mod:`.translate`) and LlamaIndex's multi-call synthesis
(:mod:`.synthesis`)."""
