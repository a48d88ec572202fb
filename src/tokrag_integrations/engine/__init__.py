"""The decoding engine: role batches and their KV cache (:mod:`.batch`), their prefill
(:mod:`.prefill`), what a policy sees (:mod:`.view`), the step loop (:mod:`.decoder`), the
loops on it (:mod:`.loop`: a whole decode, teacher forcing, RAG-Sequence), distribution
statistics (:mod:`.stats`) and ``speed=`` (:mod:`.speed`). The one scheduler every entry
point uses is :mod:`.scheduler`."""
