"""How fast a decode runs, chosen apart from what it decides: the ``speed=`` argument.

Every entry point takes one ``speed=``: a :class:`Speed`, a preset name or a dict of its
fields. Every choice gives the tokens, sources and decisions of the step-by-step loop
(``benchmarks/exactness.py`` checks it); they differ in time only.

Presets: ``"auto"`` (the default: every field at its default; on a CUDA device that is the
``"cuda"`` path, ``static="auto"`` turning on there), ``"reference"`` (the step-by-step loop
as written: one forward pass per context per step, no logit-lens rows shared between the
queries of a batch) and ``"cuda"`` (the path a GPU takes, selectable on any device: every
context of every query in one static batch, one captured step per token with the rule on
the device, one host read per step; :mod:`..accel.static_state`).

This is the one place where the ``TOKRAG_*`` speed variables are read: each is the default
of one field (read when the :class:`Speed` is made, so a variable set later applies to the
next decode). The speed paths read their choices from a :class:`Speed` only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import config
from .config import option_bool as _as_bool

__all__ = ["PRESETS", "Speed", "speed_of"]

_MODES = ("auto", "on", "off")
_MODE_FIELDS = ("cpu_kernels", "packed_head", "static", "graphs")
#: ``graphs`` has a fourth mode: the eager step recorded as CUDA graphs, no compiler.
_GRAPH_MODES = (*_MODES, "capture")


@dataclass(frozen=True)
class Speed:
    """The speed paths of one decode (and of a model's load: ``cpu_kernels``).

    Args:
        fuse: decode the contexts of a query as one batch (one forward pass per step)
            where the model allows it; False: one pass per context role
            (``TOKRAG_FUSE_CONTEXTS``, default on).
        packed_prefill: one query's two contexts as one packed sequence
            (``TOKRAG_PACKED_PREFILL``, default on; needs ``fuse``).
        split_prefill: on CPU, prefill a batch's queries a few at a time, then merge them
            (``TOKRAG_SPLIT_PREFILL``, default on).
        share_lens: in a batch, the first logit-lens rows of every query in one product.
        cpu_kernels: ``"auto"`` (measured few-row plans), ``"on"`` or ``"off"``: the CPU
            kernels a float32 model gets when loaded (``TOKRAG_CPU_KERNELS``).
        packed_head: ``"auto"`` (where measured faster), ``"on"`` or ``"off"``: the packed
            LM head of the logit lens on CPU (``TOKRAG_PACKED_HEAD``).
        kernel_plan_cache: keep measured kernel plans on disk for later processes
            (``TOKRAG_KERNEL_PLAN_CACHE``, default on).
        static: ``"auto"`` (on where the model is on a CUDA device), ``"on"`` or ``"off"``:
            decode on a static state (:mod:`..accel.static_state`: fixed row bucket and KV
            capacity, buffers updated in place) with one step function per token (forward,
            probes, the policy's device rule, the next-step update) and one host read per
            step. A policy without a device rule is decoded as without it (the trace's
            ``speed_paths_off`` says why).
        graphs: how the static step runs: ``"capture"`` (on CUDA the eager step recorded as
            a CUDA graph per row bucket and flags, no compiler: :mod:`..accel.static_graphs`;
            elsewhere eager, ``speed_paths_off["cuda_graphs"]`` says why), ``"on"``
            (compiled: on CUDA ``torch.compile(mode="reduce-overhead")``, i.e. Inductor then
            CUDA graphs; ``torch.compile`` on CPU), ``"off"`` (eager) or ``"auto"`` (eager for
            now: neither graph path has been measured on a device yet, and the first compile
            of the Tok-RAG step ran past 100 s on the H200, docs/results.md "On a GPU").
    """

    fuse: bool = field(default_factory=config.fuse_contexts)
    packed_prefill: bool = field(default_factory=config.packed_prefill)
    split_prefill: bool = field(default_factory=config.split_prefill)
    share_lens: bool = True
    cpu_kernels: str = field(default_factory=config.cpu_kernels)
    packed_head: str = field(default_factory=config.packed_head)
    kernel_plan_cache: bool = field(default_factory=config.kernel_plan_cache)
    static: str = "auto"
    graphs: str = "auto"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "graphs":
                if value not in _GRAPH_MODES:
                    raise ValueError(
                        f"graphs must be 'auto', 'on', 'off' or 'capture', got {value!r}"
                    )
            elif f.name in _MODE_FIELDS:
                if value not in _MODES:
                    raise ValueError(f"{f.name} must be 'auto', 'on' or 'off', got {value!r}")
            elif not isinstance(value, bool):
                raise ValueError(f"{f.name} must be True or False, got {value!r}")

    def wants_static(self, device_type: str) -> bool:
        """Whether this speed asks for the static state on a model on ``device_type``
        (``static="on"``, or ``"auto"`` on ``"cuda"``)."""
        return self.static == "on" or (self.static == "auto" and device_type == "cuda")

    def options(self) -> dict[str, Any]:
        """The speed as the trace records it (``Trace.speed``, never the rule's options)."""
        return {"fuse": self.fuse}


#: The named presets of ``speed=``: the fields each sets (the others keep their defaults).
PRESETS: dict[str, dict[str, Any]] = {
    "auto": {},
    "reference": {"fuse": False, "share_lens": False, "static": "off"},
    "cuda": {"fuse": True, "static": "on"},
}


def speed_of(value: Speed | str | Mapping[str, Any] | None = None) -> Speed:
    """``speed=`` as a :class:`Speed`: a Speed as is, None or a preset name (``"auto"``,
    ``"reference"``, ``"cuda"``), or a dict of fields (``{"fuse": False}``; the fields not named keep
    their defaults; a bool field may be given as ``"true"``/``"0"``...).

    Raises:
        ValueError: an unknown preset or field, or a field's bad value (one sentence).
    """
    if value is None:
        return Speed()
    if isinstance(value, Speed):
        return value
    if isinstance(value, str):
        if value not in PRESETS:
            raise ValueError(
                f"unknown speed preset {value!r}; presets: {', '.join(PRESETS)} "
                "(or a dict of Speed fields)"
            )
        return Speed(**PRESETS[value])
    if isinstance(value, Mapping):
        fields = {f.name: f for f in dataclasses.fields(Speed)}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise ValueError(
                f"unknown speed option {unknown[0]!r}; options: {', '.join(sorted(fields))}"
            )
        given = {
            k: str(v).strip().lower() if k in _MODE_FIELDS else _as_bool(k, v) for k, v in value.items()
        }
        return Speed(**given)
    raise TypeError(
        f"speed must be a Speed, a preset name or a dict, got {type(value).__name__}"
    )
