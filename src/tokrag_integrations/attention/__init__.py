"""Reading a model's layers without eager attention.

At a disagreement step Tok-RAG needs the last position's residual stream after every layer
(the logit lens, Eq. 13) and its attention row in the RAG context at every layer (f(l) and
Att, Eq. 14-15). Instead of running eager attention, the wrapped decoder layers leave the
last position's residual state and rotary embedding in the active probe's tap during the
ordinary (SDPA) pass; an attention row is then one ``q·K`` per layer against the keys already
in the KV cache, the query taken from the CPU attention kernel where it left one, else
recomputed from the layer's input norm as the model's own attention module computes it
(q_norm, rotary function, scaling, soft-capping, sliding window).

:mod:`.parts` finds what a model is made of, :mod:`.probe` holds the taps and records of a
forward pass, :mod:`.rows` computes attention rows and the logit lens.
"""
