"""Counting host reads: a :class:`torch.overrides.TorchFunctionMode` that records every call
that makes the host wait for a tensor's value (``.item()``, ``.tolist()``, ``bool`` / ``int``
/ ``float`` / ``index`` of a tensor, ``.cpu()``, ``.numpy()``, ``nonzero``, ``torch.equal``,
``masked_select``, indexing with a boolean mask, formatting a tensor)."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

#: The calls that read a tensor's value on the host (by ``__name__``).
READS = frozenset(
    {
        "item",
        "tolist",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "__format__",
        "cpu",
        "numpy",
        "nonzero",
        "argwhere",
        "equal",
        "masked_select",
        "unique",
        "allclose",
    }
)


def _has_bool_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class HostReads(TorchFunctionMode):
    """``with HostReads() as reads: ...``; ``reads.calls``: the reads seen, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in READS:
            self.calls.append(name)
        elif name in ("__getitem__", "__setitem__", "index_put_", "index_put") and len(args) > 1:
            if _has_bool_index(args[1]):
                self.calls.append(f"{name}[bool mask]")
        return func(*args, **(kwargs or {}))
