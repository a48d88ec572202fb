"""A faster many-row product with a model's LM head (``Speed.packed_head``): the weight
reordered once into oneDNN's blocked layout, used where it measures faster than the routed
product of :mod:`.cpu_kernels` (whose timing and plan folder it shares).

The logit lens of one disagreement step multiplies a dozen hidden rows by the LM head, the
largest matrix of a small model; oneDNN's GEMM on a pre-packed weight can beat the
stock product there, by an amount that depends on the CPU, so it is measured once per
machine and weight shape."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from . import cpu_kernels as K

#: :func:`packed_head`'s measured choices per machine and weight shape, for the process.
_HEAD_CHOICE: dict[str, bool] = {}


#: Rows at which :func:`packed_head` compares the two products (a logit lens of one
#: disagreement step reads ~10-16 rows), and below which the routed product is kept.
HEAD_ROWS = 14
HEAD_MIN_ROWS = 6
#: The packed product replaces the routed one only below this share of its time (it costs a
#: second copy of the weight, so a marginal gain is not worth it).
HEAD_GAIN = 0.75
#: Interleaved rounds of that comparison (the median of the per-round ratios decides).
HEAD_ROUNDS = 5


def _known_head_choice(key: str, cache: bool) -> bool | None:
    """The choice measured for ``key`` in this process or kept on disk, or None."""
    if key not in _HEAD_CHOICE:
        stored = K._read_json(K._side_file("head", cache)).get(key)
        if not isinstance(stored, bool):
            return None
        _HEAD_CHOICE[key] = stored
    return _HEAD_CHOICE[key]


def _remember_head_choice(key: str, choice: bool, cache: bool) -> None:
    _HEAD_CHOICE[key] = choice
    path = K._side_file("head", cache)
    if path is not None:
        K._write_json(path, {**K._read_json(path), key: choice})


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` [n, d] times the oneDNN copy ``packed`` of an LM head's weight (plus ``bias``)."""
    out = torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), packed, None).to_dense()
    return out + bias if bias is not None else out


def packed_head(
    head: torch.nn.Linear, mode: str = "auto", *, cache: bool = True
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A faster many-row product with a model's LM head, or None: the weight reordered once
    into oneDNN's blocked layout and multiplied by oneDNN's GEMM (:func:`packed_product`).

    ``mode`` is the decode's ``Speed.packed_head``: ``off`` never, ``on`` always (where it
    applies), ``auto`` where it takes less than :data:`HEAD_GAIN` of the routed product's
    time at :data:`HEAD_ROWS` rows (measured once per machine and weight shape, kept next to
    the plans unless ``cache`` is off: the copy costs the weight's size again; the head's
    ``_tokrag_packed_head`` is then False). The product
    serves calls of at least :data:`HEAD_MIN_ROWS` rows (fewer: the head's own forward). It
    applies to a float32 CPU head set up by :func:`install`; the copy is made once per head.
    The step-by-step and fast decoders share it, so their decisions stay identical.
    """
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"packed_head must be 'auto', 'on' or 'off', got {mode!r}")
    w = head.weight
    usable = (
        mode != "off"
        and getattr(head, K._HEAD_OK, False)
        and w.device.type == "cpu"
        and w.dtype == torch.float32
        and w.dim() == 2
        and torch.backends.mkldnn.is_available()
    )
    if not usable:
        return None
    key = f"{w.shape[0]}x{w.shape[1]}:{torch.get_num_threads()}"
    known = _known_head_choice(key, cache) if mode == "auto" else True
    if known is False:  # measured slower on this machine: no copy at all
        setattr(head, K._HEAD, False)
        return None
    product = getattr(head, K._HEAD, None)
    if not callable(product):
        with torch.inference_mode():
            packed = w.detach().to_mkldnn()
        bias = None if head.bias is None else head.bias.detach()

        def product(x: torch.Tensor) -> torch.Tensor:
            if (
                x.dim() != 2
                or x.shape[0] < HEAD_MIN_ROWS
                or x.dtype != torch.float32
                or x.requires_grad
            ):
                return head(x)
            return packed_product(x, packed, bias)

    if known is None:  # auto, not measured yet on this machine
        x = torch.randn(HEAD_ROWS, w.shape[1])
        with torch.inference_mode():
            head(x), product(x)  # warm-up
            ratio = K._alternating_ratio(
                lambda on: functools.partial(product if on else head, x), HEAD_ROUNDS
            )
        faster = ratio < HEAD_GAIN
        _remember_head_choice(key, faster, cache)
        if not faster:
            setattr(head, K._HEAD, False)
            return None
    setattr(head, K._HEAD, product)
    return product
