"""Which CPU speed paths a model gets (:func:`maybe_install`, called by the engine's seam,
``engine/seam.py``, before a model's first decode that uses them) and why some are off
(:func:`speed_paths`, :func:`fusion_off_reason`)."""

from __future__ import annotations

from typing import Any

import torch

from ..speed import Speed
from .cpu_kernels import (
    _HEAD,
    _HEAD_OK,
    _VERDICT,
    install,
    installed,
    verify_install,
)
from .packed_head import HEAD_MIN_ROWS
from .sdpa import ATTN_IMPLEMENTATION, install_attention
from .static_graphs import capture_off_reason

#: ``config.model_type`` of the architectures the speed paths are measured correct on: the
#: matrix of ``tests/integration/test_architectures.py`` (tiny random models, float32 and bfloat16) and
#: the packaged models (SmolLM2 is ``llama``, Gemma-3-270M ``gemma3_text``).
COVERED_ARCHITECTURES = frozenset(
    {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "phi3",
        "olmo2",
        "granite",
    }
)
#: Why :func:`maybe_install` left the CPU paths off on a model (read by :func:`speed_paths`).
_SPEED_OFF = "_tokrag_speed_off"


def _first_parameter(model: Any) -> torch.Tensor | None:
    try:
        return next(model.parameters())
    except StopIteration:
        return None


def _architecture_reason(model: Any) -> str | None:
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in COVERED_ARCHITECTURES:
        return f"architecture {kind!r} is not in the tested matrix (tests/integration/test_architectures.py)"
    return None


def speed_off_reason(model: Any) -> str | None:
    """Why the CPU speed paths (kernels, attention, packed prefill and head) do not apply to
    ``model``, or None: they are measured on CPU, in float32, on the matrix's architectures."""
    p = _first_parameter(model)
    if p is None:
        return "the model has no parameters"
    if p.device.type != "cpu":
        return f"device {p.device.type}: the CPU speed paths are measured on CPU only"
    if p.dtype != torch.float32:
        return f"dtype {str(p.dtype).removeprefix('torch.')}: the CPU speed paths are measured in float32 only"
    return _architecture_reason(model)


def fusion_off_reason(model: Any) -> str | None:
    """Why contexts are not fused into one batch on ``model``, or None: fusing is measured
    exact (float32 and bfloat16) for the matrix's architectures, on every device (a fused
    batch is plain left-padded rows: nothing in it is specific to a CPU)."""
    return _architecture_reason(model)


def _kernel_detail(model: Any) -> str:
    """The whole-model verdicts of :func:`verify_install`, e.g. ``rows 1 0.91x kept; rows
    3-4 1.01x -> stock``."""
    verdict = getattr(model, _VERDICT, None)
    if not verdict:
        return ""
    parts = [
        f"{label} {v['ratio']:.2f}x {'kept' if v['kept'] else '-> stock'}"
        for label, v in verdict.items()
    ]
    return " (model pass with plans / stock: " + "; ".join(parts) + ")"


def _head_detail(model: Any) -> str:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    choice = getattr(head, _HEAD, None)
    if choice is None:
        return f" (measured at the first logit lens of >= {HEAD_MIN_ROWS} rows)"
    return " (measured faster)" if choice else ""


def speed_paths(model: Any, speed: Speed | None = None) -> dict[str, str]:
    """Each speed path of ``model`` (``cpu_kernels``, ``packed_prefill``, ``packed_head``,
    ``fused_contexts``): ``"on"`` (with what was measured here) or ``"off: <reason>"``; with
    ``speed``, as a decode with that :class:`..speed.Speed` gets them (a field set off turns
    its path off: ``"off: speed cpu_kernels='off'"``; ``graphs="capture"`` adds
    ``cuda_graphs``)."""
    off = getattr(model, _SPEED_OFF, None)
    attention = getattr(model.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION
    kernels = installed(model)
    fusion = fusion_off_reason(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_ok = getattr(head, _HEAD_OK, False)
    if getattr(head, _HEAD, None) is False:
        head_state = "off: measured slower than the routed product on this machine"
    elif head_ok:
        head_state = "on" + _head_detail(model)
    else:
        head_state = f"off: {off or 'no few-row plan installed'}"
    detail = _kernel_detail(model)
    paths = {
        "cpu_kernels": ("on" + detail)
        if kernels
        else f"off: {off or 'no few-row plan installed' + detail}",
        "packed_prefill": "on"
        if attention
        else f"off: {off or 'attention is not ' + ATTN_IMPLEMENTATION}",
        "packed_head": head_state,
        "fused_contexts": "on" if fusion is None else f"off: {fusion}",
    }
    if speed is None:
        return paths
    asked = {
        "cpu_kernels": ("cpu_kernels", speed.cpu_kernels == "off"),
        "packed_prefill": (
            "cpu_kernels" if speed.cpu_kernels == "off" else "packed_prefill",
            speed.cpu_kernels == "off" or not speed.packed_prefill or not speed.fuse,
        ),
        "packed_head": (
            "cpu_kernels" if speed.cpu_kernels == "off" else "packed_head",
            speed.cpu_kernels == "off" or speed.packed_head == "off",
        ),
        "fused_contexts": ("fuse", not speed.fuse),
    }
    for path, (field, off_here) in asked.items():
        if off_here and paths[path].startswith("on"):
            value = getattr(speed, field)
            paths[path] = f"off: speed {field}={value!r}"
    if speed.graphs == "capture":  # reported where asked for
        why = capture_off_reason(model.device)
        paths["cuda_graphs"] = "on" if why is None else f"off: {why}"
    return paths


def maybe_install(model: Any, mode: str, *, cache: bool = True) -> bool:
    """On a float32 CPU model: the few-query attention path and, per ``mode``
    (``Speed.cpu_kernels``), the few-row linear plans. Returns whether any linear module was
    changed.

    ``mode``: ``auto`` (measured plans per weight shape), ``on`` (the transposed product for
    every few-row call) or ``off`` (stock paths throughout). ``cache``
    (``Speed.kernel_plan_cache``): plans and verdicts kept on disk between processes.
    """
    mode = mode.strip().lower()
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"cpu_kernels must be 'auto', 'on' or 'off', got {mode!r}")
    if mode == "off":
        setattr(model, _SPEED_OFF, "cpu_kernels='off'")
        return False
    reason = speed_off_reason(model)
    setattr(model, _SPEED_OFF, reason)
    if reason is not None:
        return False
    install_attention(model)
    changed = install(model, mode, cache=cache) > 0
    if changed and mode == "auto":
        verify_install(model, cache=cache)
        changed = installed(model)
    return changed
