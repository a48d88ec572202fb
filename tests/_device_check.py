"""A CPU stand-in for a GPU's device checks, so that CI (no GPU) catches a tensor left on the
host where the model's device is needed.

Inside :class:`DeviceCheck`, every tensor is tagged: ``device`` for the model's parameters and
buffers, for tensors made with ``device=`` and for ``.to(<device or tensor>)``; ``host`` for a
factory call without ``device=`` (``torch.tensor``, ``torch.empty``, ...) and for ``.cpu()``.
An op's result takes ``device`` if any input has it, else ``host`` if any input has it. An op
that mixes a ``device`` tensor with a ``host`` tensor of one or more dimensions raises, as
CUDA does ("Expected all tensors to be on the same device"); so does indexing a ``host`` tensor
with ``device`` indices. Copies (``copy_``, assignment into a slice) may cross devices, as on
CUDA. Found by the GPU check of ``benchmarks/gpu_check.py`` on an H200: three such tensors
(the attention rows' buffer, RAG-Token's weights, p_R's skip mask) failed every Tok-RAG and
RAG-Token decode on CUDA while every CPU test passed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_FACTORIES = {
    torch.tensor, torch.as_tensor, torch.empty, torch.zeros, torch.ones, torch.full,
    torch.arange, torch.linspace, torch.eye, torch.randn, torch.rand, torch.randint,
}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}
_COPIES = _INDEXING | {torch.Tensor.copy_}
_TAG = "_device_check_tag"


def _tensors(x: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _tensors(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _tensors(y, out)
    return out


def _tag(x: Any) -> str | None:
    return getattr(x, _TAG, None)


class DeviceCheck(TorchFunctionMode):
    """``with DeviceCheck(model): ...`` raises ``RuntimeError`` at the first op that would mix
    devices on a GPU."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        for t in [*model.parameters(), *model.buffers()]:
            setattr(t, _TAG, "device")

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        inputs = _tensors(list(args), []) + _tensors(kwargs, [])
        tags = [_tag(t) for t in inputs]
        name = getattr(func, "__name__", str(func))
        if func in _INDEXING and inputs and tags[0] == "host" and inputs[0].dim() > 0:
            if any(_tag(t) == "device" for t in _tensors([args[1]], [])):
                raise RuntimeError(f"device check: a host tensor {tuple(inputs[0].shape)} indexed by device indices")
        if func not in _COPIES and "device" in tags:
            host = [tuple(t.shape) for t, g in zip(inputs, tags, strict=True) if g == "host" and t.dim() > 0]
            if host:
                raise RuntimeError(f"device check: {name} mixes device tensors with host tensors {host}")
        out = func(*args, **kwargs)
        moved = kwargs.get("device") is not None or (
            name == "to" and any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args[1:])
        )
        if func in _FACTORIES:
            tag = "device" if kwargs.get("device") is not None else "host"
        elif name == "cpu":
            tag = "host"
        elif moved or "device" in tags:
            tag = "device"
        else:
            tag = "host" if "host" in tags else None
        if tag:
            for t in _tensors(out, []):
                try:
                    setattr(t, _TAG, tag)
                except (AttributeError, RuntimeError):
                    pass
        return out
