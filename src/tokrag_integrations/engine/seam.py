"""The one place the engine reaches the speed paths (:mod:`..accel`): every choice comes from
the :class:`..speed.Speed` a decode was given, and only from it.

:class:`SpeedPaths` is what one decode gets: its prefill (packed / fused contexts, split
prefill: :func:`..accel.packed.prefill`), how an admitted query's rows join a running batch
(:func:`..accel.packed.join_batches`), the LM-head product of its logit lens
(:func:`..accel.packed_head.packed_head`) and :meth:`SpeedPaths.scope`, inside which its model
calls run (the stock kernels where ``Speed.cpu_kernels`` is ``off``:
:func:`..accel.cpu_kernels.stock_kernels`). The CPU kernels and attention are installed on a
model before its first decode that uses them (:func:`prepare`), as ``load_model(...,
cpu_kernels=)`` and that decode's ``Speed`` say. :func:`speed_paths` reports which paths a
model (and a decode's ``Speed``) gets.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..accel import cpu_kernels, install, packed, packed_head, static_state
from ..models import LoadedModel
from ..speed import Speed

__all__ = ["SpeedPaths", "prepare", "speed_paths", "speed_paths_off", "static_decode"]

#: On a model: the ``cpu_kernels`` mode its CPU paths were installed with (set by
#: :func:`prepare`, once per model).
_PREPARED = "_tokrag_prepared"
_PREPARE_LOCK = threading.Lock()


def prepare(lm: LoadedModel, speed: Speed) -> None:
    """Install the CPU speed paths on ``lm``'s model once, before its first decode that uses
    them: the mode is ``load_model(..., cpu_kernels=)``'s where given, else this decode's
    ``speed.cpu_kernels`` (``auto``: measured plans, ``on``: the transposed product). A model
    loaded with ``cpu_kernels="off"`` stays stock; a decode whose ``Speed.cpu_kernels`` is
    ``off`` installs nothing (it runs the stock paths, :meth:`SpeedPaths.scope`)."""
    model = lm.model
    if getattr(model, _PREPARED, None) is not None:
        return
    mode = lm.cpu_kernels or speed.cpu_kernels
    if lm.cpu_kernels is None and mode == "off":
        return  # this decode asks for the stock paths; a later one may install them
    with _PREPARE_LOCK:
        if getattr(model, _PREPARED, None) is None:
            install.maybe_install(model, mode, cache=speed.kernel_plan_cache)
            setattr(model, _PREPARED, mode)


class SpeedPaths:
    """The speed paths of one decode of ``lm`` under ``speed`` (the module docstring)."""

    def __init__(self, lm: LoadedModel, speed: Speed) -> None:
        self.lm, self.speed = lm, speed
        prepare(lm, speed)
        self.stock = speed.cpu_kernels == "off"
        #: The decoder's prefill: packed / fused / split as ``speed`` allows.
        self.prefill = functools.partial(packed.prefill, speed=speed)
        #: A query admitted while others decode is prefilled as rows :attr:`join` can merge.
        self.join_prefill = functools.partial(packed.prefill, speed=speed, pack=False)
        #: Merges a newly prefilled batch into a running one (None: contexts not fused).
        self.join: Callable[[Any, Any], Any] | None = packed.join_batches if speed.fuse else None
        self._head: Callable[[torch.Tensor], torch.Tensor] | None | bool = False

    def head_product(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The LM-head product of this decode's logit lens (None: the head's own forward):
        the packed head as ``speed.packed_head`` says, never with the stock paths. Measured
        (``auto``) on first use, inside :meth:`scope`."""
        if self._head is False:
            head = self.lm.model.get_output_embeddings()
            self._head = (
                None
                if self.stock or not isinstance(head, torch.nn.Linear)
                else packed_head.packed_head(
                    head, self.speed.packed_head, cache=self.speed.kernel_plan_cache
                )
            )
        return self._head  # type: ignore[return-value]

    def lens_product(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [n, d] times the LM head by :meth:`head_product` (the lens's ``product``)."""
        product = self.head_product()
        return product(x) if product is not None else self.lm.model.get_output_embeddings()(x)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """The model calls of this decode run in here: the stock kernels and attention where
        ``speed.cpu_kernels`` is ``off``, the installed paths otherwise."""
        with cpu_kernels.stock_kernels(self.stock):
            yield


def speed_paths(lm: LoadedModel, speed: Speed | None = None) -> dict[str, str]:
    """Each speed path of ``lm`` (``cpu_kernels``, ``packed_prefill``, ``packed_head``,
    ``fused_contexts``): ``"on"`` or ``"off: <reason>"``, as a decode with ``speed`` gets
    them (None: as installed) (:func:`..accel.install.speed_paths`)."""
    return install.speed_paths(lm.model, speed)


def speed_paths_off(lm: LoadedModel, speed: Speed) -> dict[str, str]:
    """``{path: reason}`` for each speed path off for a decode of ``lm`` under ``speed`` now
    (non-CPU device, non-float32 dtype, an architecture outside the tested matrix, measured
    slower here, a field of ``speed`` set off): the trace's ``speed["speed_paths_off"]``."""
    # "on" may carry what was measured ("on (...)"): only the paths that are off count.
    return {
        k: v.removeprefix("off: ")
        for k, v in speed_paths(lm, speed).items()
        if v.startswith("off")
    }


def static_decode(
    lm: LoadedModel, policy: Any, speed: Speed, *, max_new_tokens: int, citations: bool | None
) -> tuple[Any, str | None]:
    """The static decode state of ``speed="cuda"`` (``Speed.static``) for ``policy`` on ``lm``
    (:func:`..accel.static_state.static_decode_for`), or None; and why it does not apply
    where ``speed`` asked for it."""
    return static_state.static_decode_for(
        lm, policy, speed, max_new_tokens=max_new_tokens, citations=citations
    )
