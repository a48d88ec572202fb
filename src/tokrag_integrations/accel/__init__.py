"""The speed paths, behind one seam: chosen by :class:`..engine.speed.Speed` only (the
algorithm never imports this package).

* :mod:`.install`: which CPU paths a model gets (:func:`.install.maybe_install`, the one
  function ``load_model`` calls) and why some are off (:func:`.install.speed_paths`);
* :mod:`.cpu_kernels`: few-row linear layers routed to the fastest measured kernel, checked
  on the whole model, and the packed LM head of the logit lens;
* :mod:`.sdpa`: the ``tokrag_sdpa`` attention (grouped, row-wise, packed two-context prefill);
* :mod:`.kv_cache`: a KV cache layer that grows in place (every role batch uses it);
* :mod:`.packed`: all contexts of a decode in one pass per step (packed or fused);
  :func:`.packed.prefill` is the decoder's prefill.

This file imports nothing, so that importing :mod:`.kv_cache` (as the engine's batch does)
stays light.
"""
