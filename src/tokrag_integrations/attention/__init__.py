"""Reading a model's layers without eager attention.

Tok-RAG needs, at a disagreement step, the residual stream of the last position after every
layer (for the logit lens, Eq. 13) and the attention row of the last position of the RAG
context at every layer (f(l) and Att, Eq. 14–15). Running the whole model with eager
attention to get those rows would slow every prefill by about 50 %, so instead:

* the decoder layers' forwards (wrapped once per model: a plain function call, not module
  hooks, so an unprobed pass pays one context-variable read per layer) leave the last
  position's residual state and rotary embedding of every layer in the active probe's tap
  during the ordinary (SDPA) forward pass (a few KB per step); the attention input is
  derived from the residual on demand (the layer's input norm);
* on CPU, the attention function (:func:`.accel.cpu_kernels.few_query_attention`) also leaves
  each probed row's rotated query in the tap, so at a disagreement step an attention row is
  one ``q·K`` per layer with the keys already in the KV cache
  (:func:`attention_from_queries`);
* elsewhere, the attention row is recomputed from that attention input and the cached keys:
  one query projection and one ``q·K`` per layer.

The recomputation follows the model's own attention module (q_norm where the model has it,
its rotary function, its scaling, soft-capping and sliding window) and is tested against
``output_attentions=True`` of an eager model to 1e-4.

The work is split by job: :mod:`.parts` (what a model is made of), :mod:`.probe` (the taps
and records of a forward pass), :mod:`.rows` (attention rows and the logit lens). Import each
name from the module that defines it.
"""
