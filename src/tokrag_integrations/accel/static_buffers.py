"""The device buffers of the static decode state (:mod:`.static_state`): their layout
(:class:`StaticBuffers`), how a set is made (:func:`new_buffers`) or reset for another decode
(:func:`reset_buffers`), and the model's pool of free sets (:func:`pool_of`): a decode takes
a free set of its shape, so a captured graph reads and writes the same addresses again."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..sampling import bitmask_words

__all__ = ["POOL_SIZE", "StaticBuffers", "new_buffers", "pool_of", "reset_buffers"]

#: Free buffer sets a model keeps (one per shape, the most recently freed).
POOL_SIZE = 4
_POOL = "_tokrag_static_pool"


@dataclass
class StaticBuffers:
    """The device buffers of one state (R rows, C columns, Q query slots, P retrieved-token
    slots); every one is updated in place between and during steps."""

    ids: torch.Tensor  # [R] long: the token each row is fed next
    pos: torch.Tensor  # [R] long: its position id
    valid: torch.Tensor  # [R, C] bool: the columns each row attends to
    col: torch.Tensor  # 0-d long: the column the next step writes
    keys: list[torch.Tensor]  # per layer [R, kv_heads, C, hd]
    values: list[torch.Tensor]
    row_q: torch.Tensor  # [R] long: each row's query slot, -1 for a free row
    rows: dict[str, torch.Tensor]  # role -> [Q] long
    rt_pos: torch.Tensor  # [Q, P] long
    rt_ids: torch.Tensor  # [Q, P] long
    rt_valid: torch.Tensor  # [Q, P] bool
    rt_passage: torch.Tensor  # [Q, P] long
    cite: torch.Tensor  # [Q] long: passages cited per slot (0: not cited)
    # How each slot's token is taken (:func:`...sampling.draw`): [Q] each.
    temperature: torch.Tensor  # float32, 0: greedy
    top_p: torch.Tensor  # float32
    top_k: torch.Tensor  # long
    seed: torch.Tensor  # long
    step: torch.Tensor  # long: the slot's step index (the noise's counter)
    bits: torch.Tensor  # [Q, ceil(V/32)] int32: the constraint's allowed tokens
    constrained: torch.Tensor  # [Q] bool: whether ``bits`` applies to the slot
    weights: torch.Tensor | None = None  # [Q, K] float: p(z|x) of each passage context

    @property
    def shape(self) -> tuple[int, int, int]:
        return (int(self.valid.shape[0]), int(self.valid.shape[1]), int(self.rt_pos.shape[1]))

    def all(self) -> list[torch.Tensor]:
        return [
            self.ids, self.pos, self.valid, self.col, *self.keys, *self.values, self.row_q,
            *self.rows.values(), self.rt_pos, self.rt_ids, self.rt_valid, self.rt_passage,
            self.cite, self.temperature, self.top_p, self.top_k, self.seed, self.step,
            self.bits, self.constrained, *([] if self.weights is None else [self.weights]),
        ]  # fmt: skip


def new_buffers(
    R: int,
    C: int,
    P: int,
    *,
    roles: Sequence[str],
    layers: int,
    kv_shape: tuple[int, int],
    vocab: int,
    pad_id: int,
    passages: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> StaticBuffers:
    """A new set of R rows, C columns and P retrieved-token slots (``kv_shape``: the key /
    value heads and head size; ``passages``: a p(z|x) per ``roles`` entry)."""
    dev = device
    kv = (R, kv_shape[0], C, kv_shape[1])

    def longs(*shape: int, fill: int = 0) -> torch.Tensor:
        return torch.full(shape, fill, dtype=torch.long, device=dev)

    return StaticBuffers(
        ids=longs(R, fill=pad_id),
        pos=longs(R),
        valid=torch.zeros((R, C), dtype=torch.bool, device=dev),
        col=torch.zeros((), dtype=torch.long, device=dev),
        keys=[torch.zeros(kv, dtype=dtype, device=dev) for _ in range(layers)],
        values=[torch.zeros(kv, dtype=dtype, device=dev) for _ in range(layers)],
        row_q=longs(R, fill=-1),
        rows={r: longs(R, fill=-1) for r in roles},
        rt_pos=longs(R, P),
        rt_ids=longs(R, P),
        rt_valid=torch.zeros((R, P), dtype=torch.bool, device=dev),
        rt_passage=longs(R, P),
        cite=longs(R),
        temperature=torch.zeros(R, dtype=torch.float32, device=dev),
        top_p=torch.ones(R, dtype=torch.float32, device=dev),
        top_k=longs(R),
        seed=longs(R),
        step=longs(R),
        bits=torch.zeros((R, bitmask_words(vocab)), dtype=torch.int32, device=dev),
        constrained=torch.zeros(R, dtype=torch.bool, device=dev),
        weights=(
            torch.zeros((R, len(roles)), dtype=torch.float32, device=dev) if passages else None
        ),
    )


def reset_buffers(b: StaticBuffers, pad_id: int) -> None:
    """A pooled set made ready for another decode (no row, no slot in use)."""
    with torch.inference_mode():
        b.valid.zero_()
        b.ids.fill_(pad_id)
        b.pos.zero_()
        b.col.zero_()
        b.row_q.fill_(-1)
        for t in b.rows.values():
            t.fill_(-1)
        b.rt_valid.zero_()
        b.cite.zero_()
        b.temperature.zero_()
        b.step.zero_()
        b.constrained.zero_()
        if b.weights is not None:
            b.weights.zero_()


def pool_of(lm: Any) -> dict[tuple[Any, ...], StaticBuffers]:
    """The model's free static buffers by shape (used under the model's lock)."""
    return lm.__dict__.setdefault(_POOL, {})
