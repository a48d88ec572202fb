"""The contexts of a decode as the model runs them: a role batch (:mod:`.batch`: every
context of one role across the queries, left-padded, with its KV cache), the KV cache layer
that grows in place (:mod:`.kv_cache`) and the prefill of the role batches (:mod:`.prefill`:
prompt-head reuse, the evaluation harness's shared-prefill store).

Below both the engine and its speed paths (``accel``): they build on these batches, and
nothing here imports either of them."""
