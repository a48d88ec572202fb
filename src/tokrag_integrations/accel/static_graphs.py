"""The static step recorded as CUDA graphs without a compiler (``Speed.graphs="capture"``):
what SGLang's CUDA-graph runner and vLLM's capture do for a decode step, on the package's
step (:func:`.static_step.static_step`), which already has what a capture needs (buffers at
fixed addresses updated in place, no host read, no branch on a tensor's value).

``torch.compile(mode="reduce-overhead")`` (``graphs="on"``) records graphs too, but only
after Inductor has compiled the step, which took minutes for the 30-layer Tok-RAG step;
recording the eager step takes one step's time. The kernels in the graph are the eager
step's (no fusion); what a replay removes is the host's launch of each of them.

:class:`StepGraphs` keeps one graph per *signature* of the step's arguments: the flags and
sizes (bools, ints), the identity of the model and rule, and every tensor's address, shape
and dtype. The first step of a signature runs eagerly (the warm-up a capture needs: lazy
initialisations, workspace allocations; it is that step's real result), the second is
recorded and replayed, later ones are replayed. A new bucket, new buffers, a flag that
changes (a sampled or constrained query joins) give a new signature, hence a new graph; a
graph is never replayed on arguments other than those it was recorded on, and it keeps them
alive (no other tensor can take their addresses while it exists). A recording that fails
(an operation CUDA cannot record) warns once and leaves that signature eager: the step's
tokens do not depend on it.

A loaded model keeps its graphs across decodes (:func:`graphs_of`), as Hugging Face keeps a
compiled static-cache step: the next decode of the same shape takes the same pooled buffers
and (``graphs="capture"``) the same cached device rule, so its steps are replays from the
first. The graphs share one memory pool (they run one at a time under the model's lock, and
each step's output is read before the next replay)."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["StepGraphs", "capture_off_reason", "graphs_of", "kept_graphs"]

#: The entry of a signature whose recording failed: its steps run eagerly.
EAGER = "eager"
#: Graphs kept per model (the least recently replayed goes first beyond this): each keeps the
#: buffers it was recorded on.
MAX_GRAPHS = 8
_GRAPHS = "_tokrag_step_graphs"


def kept_graphs(lm: Any) -> StepGraphs | None:
    """The recorded steps the loaded model ``lm`` keeps across its decodes (None: none yet)."""
    return lm.__dict__.get(_GRAPHS)


def graphs_of(lm: Any, make: Callable[[], StepGraphs]) -> StepGraphs:
    """:func:`kept_graphs`, made by ``make()`` on first use."""
    graphs = kept_graphs(lm)
    if graphs is None:
        graphs = lm.__dict__[_GRAPHS] = make()
    return graphs


def capture_off_reason(device: torch.device) -> str | None:
    """Why the step cannot be recorded as a CUDA graph on ``device`` (None: it can)."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device (the model is on {device.type}): the step runs eagerly"
    return None


def signature(x: Any) -> Any:
    """What a recorded graph depends on in ``x``: a tensor's address, shape, dtype and device;
    a list, tuple or dict item by item; a module or rule by identity; a plain value as is."""
    if isinstance(x, torch.Tensor):
        return ("T", x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype, x.device)
    if isinstance(x, list | tuple):
        return tuple(signature(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, signature(v)) for k, v in x.items())
    if x is None or isinstance(x, bool | int | float | str):
        return x
    return ("id", id(x))


class CudaGraphs:
    """The CUDA side of :class:`StepGraphs`: the warm-up on a side stream and the recording
    into one shared pool (``torch.cuda.CUDAGraph``, as PyTorch's CUDA-graph notes lay out)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def eager(self, fn: Callable[..., torch.Tensor], args: tuple[Any, ...]) -> torch.Tensor:
        side = torch.cuda.Stream(self.device)
        main = torch.cuda.current_stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            out = fn(*args)
        main.wait_stream(side)
        return out

    def record(
        self, fn: Callable[..., torch.Tensor], args: tuple[Any, ...]
    ) -> Callable[[], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn(*args)  # recorded, not run

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class StepGraphs:
    """``fn`` (the static step) run as recorded CUDA graphs, one per argument signature (the
    module docstring). ``backend``: the object that runs a step eagerly and records one
    (:class:`CudaGraphs` on a CUDA device; a test may pass another)."""

    def __init__(
        self, fn: Callable[..., torch.Tensor], backend: Any, *, max_graphs: int = MAX_GRAPHS
    ) -> None:
        self.fn, self.backend, self.max_graphs = fn, backend, max_graphs
        #: signature -> None (seen once: eager) or the graph's replay and the arguments it was
        #: recorded on (kept alive).
        self.graphs: OrderedDict[Any, tuple[Callable[[], torch.Tensor], tuple] | None] = (
            OrderedDict()
        )
        #: Steps run eagerly, graphs recorded, replays (what the trace and the check report).
        self.counts = {"eager": 0, "recorded": 0, "replayed": 0}
        #: Why recordings failed (their signatures then run eagerly).
        self.failed: list[str] = []

    def __call__(self, *args: Any) -> torch.Tensor:
        key = signature(args)
        if key not in self.graphs:  # first step of this signature: the warm-up, run for real
            self._keep(key, None)
            self.counts["eager"] += 1
            return self.backend.eager(self.fn, args)
        entry = self.graphs[key]
        if entry is EAGER:
            self.counts["eager"] += 1
            return self.backend.eager(self.fn, args)
        if entry is None:
            try:
                entry = (self.backend.record(self.fn, args), args)
            except Exception as e:  # recording runs nothing: the step is still to be made
                self._keep(key, EAGER)
                self.failed.append(f"{type(e).__name__}: {e}")
                warnings.warn(
                    f"recording the decode step as a CUDA graph failed ({type(e).__name__}: "
                    f"{e}); this step shape runs eagerly (speed graphs='capture')",
                    RuntimeWarning,
                    stacklevel=3,
                )
                self.counts["eager"] += 1
                return self.backend.eager(self.fn, args)
            self._keep(key, entry)
            self.counts["recorded"] += 1
        self.graphs.move_to_end(key)
        self.counts["replayed"] += 1
        return entry[0]()

    def _keep(self, key: Any, entry: Any) -> None:
        self.graphs[key] = entry
        self.graphs.move_to_end(key)
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
