"""The decoding engine: what a policy sees (:mod:`.view`), the step loop (:mod:`.decoder`),
the loops on it (:mod:`.loop`: a whole decode, teacher forcing, RAG-Sequence), distribution
statistics (:mod:`.stats`) and the one place the engine reaches the speed paths
(:mod:`.seam`). The one scheduler every entry point uses is :mod:`.scheduler`. The role
batches it decodes live in :mod:`..contexts`; ``speed=`` is :class:`..speed.Speed`."""
