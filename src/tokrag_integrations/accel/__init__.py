"""The speed paths, behind one seam: chosen by :class:`..speed.Speed` only (the
algorithm never imports this package; the engine reaches it through ``engine/seam.py``).

* :mod:`.install`: which CPU paths a model gets (:func:`.install.maybe_install`, the one
  function ``load_model`` calls) and why some are off (:func:`.install.speed_paths`);
* :mod:`.cpu_kernels`: few-row linear layers routed to the fastest measured kernel, checked
  on the whole model, and the packed LM head of the logit lens;
* :mod:`.sdpa`: the ``tokrag_sdpa`` attention (grouped, row-wise, packed two-context prefill);
* :mod:`.packed`: all contexts of a decode in one pass per step (packed or fused);
  :func:`.packed.prefill` is the decoder's prefill.

It builds on the role batches of :mod:`..contexts` and never imports the engine.
"""
