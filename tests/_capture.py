"""A CPU stand-in for the CUDA side of ``graphs="capture"`` (``accel.static_graphs``) with a
CUDA graph's semantics: recording traces the step into a graph of aten operations
(``make_fx``) on copies of its arguments, so nothing of the decode's state changes and every
Python value the step computes is fixed at that moment, as in a recorded CUDA graph; a
replay runs that graph, and only it, on the real arguments (the buffers it was recorded on).
:func:`recorded_on_cpu` puts it in place for one test."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

#: What a loaded model keeps across decodes for ``graphs="capture"``.
KEPT = ("_tokrag_step_graphs", "_tokrag_device_rules")


class TracedGraphs:
    made: list[TracedGraphs] = []

    def __init__(self, device: Any) -> None:
        self.recorded = 0
        TracedGraphs.made.append(self)

    def eager(self, fn, args):
        return fn(*args)

    def record(self, fn, args):
        leaves, spec = pytree.tree_flatten(args)
        at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

        def flat(*tensors):
            given = list(leaves)
            for i, t in zip(at, tensors, strict=True):
                given[i] = t
            return fn(*pytree.tree_unflatten(given, spec))

        graph = make_fx(flat)(*[leaves[i].clone() for i in at])
        tensors = [leaves[i] for i in at]
        self.recorded += 1
        return lambda: graph(*tensors)


@contextlib.contextmanager
def recorded_on_cpu(monkeypatch: Any, *models: Any) -> Iterator[type[TracedGraphs]]:
    """While open, ``graphs="capture"`` records the step on a CPU with :class:`TracedGraphs`;
    the graphs and cached rules ``models`` keep are dropped before and after."""
    from tokrag_integrations.accel import static_state

    TracedGraphs.made = []
    monkeypatch.setattr(static_state, "CudaGraphs", TracedGraphs)
    monkeypatch.setattr(static_state, "capture_off_reason", lambda device: None)
    for lm in models:
        for name in KEPT:
            lm.__dict__.pop(name, None)
    try:
        yield TracedGraphs
    finally:
        for lm in models:
            for name in KEPT:
                lm.__dict__.pop(name, None)
