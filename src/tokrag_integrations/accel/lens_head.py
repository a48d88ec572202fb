"""The packed LM head of the logit lens (CPU speed work): :func:`packed_head`.

The measured choices and the timer are read from :mod:`.cpu_kernels` (where the kernel
plans are kept), so that a test that swaps them there sees them here too.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import config
from ..attention.rows import set_lens_head_product
from . import cpu_kernels as K

#: Rows at which :func:`packed_head` compares the two products (a logit lens of one
#: disagreement step reads ~10-16 rows), and below which the routed product is kept.
HEAD_ROWS = 14
HEAD_MIN_ROWS = 6
#: The packed product replaces the routed one only below this share of its time (it costs a
#: second copy of the weight, so a marginal gain is not worth it).
HEAD_GAIN = 0.75
#: Interleaved rounds of that comparison (the median of the per-round ratios decides).
HEAD_ROUNDS = 5


def _head_file() -> Path | None:
    path = K._plan_file()
    return None if path is None else path.with_name(path.stem + ".head.json")


def _stored_head_choices() -> dict[str, Any]:
    path = _head_file()
    if path is None:
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _known_head_choice(key: str) -> bool | None:
    """The choice measured for ``key`` in this process or kept on disk, or None."""
    if key not in K._HEAD_CHOICE:
        stored = _stored_head_choices().get(key)
        if not isinstance(stored, bool):
            return None
        K._HEAD_CHOICE[key] = stored
    return K._HEAD_CHOICE[key]


def _remember_head_choice(key: str, choice: bool) -> None:
    K._HEAD_CHOICE[key] = choice
    path = _head_file()
    if path is not None:
        K._write_json(path, {**_stored_head_choices(), key: choice})


def packed_head(head: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A faster many-row product with a model's LM head, or None: the weight reordered once
    into oneDNN's blocked layout and multiplied by oneDNN's GEMM.

    The logit lens of a Tok-RAG disagreement step multiplies ~10-16 rows by the large head,
    a shape where oneDNN on a reordered weight can beat MKL by about 2x (figures in
    docs/results.md); at 1-2 rows the routed product stays faster. The copy costs the
    weight's size again, so it is made only where it is measured at :data:`HEAD_ROWS` rows to take less than :data:`HEAD_GAIN` of the
    routed product's time (kept per machine next to the kernel plans), and only for calls of
    at least :data:`HEAD_MIN_ROWS` rows. ``TOKRAG_PACKED_HEAD``: ``auto`` (default),
    ``on`` (always, where oneDNN is available), ``off``. The sums are the same dot products
    in another order (last-bit differences, as between any two BLAS kernels); the
    step-by-step and fast decoders share it, so their decisions stay identical.
    """
    cached = getattr(head, K._HEAD, None)
    if cached is not None:
        return cached or None
    mode = config.packed_head()
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"TOKRAG_PACKED_HEAD must be 'auto', 'on' or 'off', got {mode!r}")
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
        return None  # not cached: the environment variable may change between calls
    key = f"{w.shape[0]}x{w.shape[1]}:{torch.get_num_threads()}"
    known = _known_head_choice(key) if mode == "auto" else True
    if known is False:  # measured slower on this machine: no copy at all
        setattr(head, K._HEAD, False)
        return None
    with torch.inference_mode():
        packed = w.detach().to_mkldnn()
    bias = None if head.bias is None else head.bias.detach()

    def product(x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] < HEAD_MIN_ROWS or x.dtype != torch.float32 or x.requires_grad:
            return head(x)
        out = torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), packed, None).to_dense()
        return out + bias if bias is not None else out

    if known is None:  # auto, not measured yet on this machine
        x = torch.randn(HEAD_ROWS, w.shape[1])
        with torch.inference_mode():
            head(x), product(x)  # warm-up
            ratios = []
            for r in range(HEAD_ROUNDS):  # interleaved, the order alternating
                t = {}
                for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                    fn = product if which else head
                    t[which] = K._time(lambda fn=fn: fn(x), 1, warm=False)
                ratios.append(t[1] / t[0])
        faster = statistics.median(ratios) < HEAD_GAIN
        _remember_head_choice(key, faster)
        if not faster:
            del packed
            setattr(head, K._HEAD, False)
            return None
    setattr(head, K._HEAD, product)
    return product


# The logit lens of :mod:`.attention` reads many rows through the packed head where it is
# measured faster (the lens module does not import this one; see ``set_lens_head_product``).
set_lens_head_product(packed_head)
