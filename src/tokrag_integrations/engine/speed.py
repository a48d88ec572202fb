"""How fast a decode runs, chosen apart from what it decides: the ``speed=`` argument.

The runner (:func:`..runner.decode_loop`) and every entry point of :mod:`..api` take one
``speed=``: a :class:`Speed`, a preset name or a dict of its fields. Every choice gives the
same tokens, sources and decisions as the step-by-step loop (the exactness benchmark,
``benchmarks/exactness.py``, checks it); they differ in time only.

Presets:

* ``"auto"`` (the default): contexts fused into one batch where the model allows it (one
  forward pass per step), the step-by-step loop otherwise; no blockwise verification.
* ``"reference"``: the step-by-step loop as written: one forward pass per context per step,
  no fusing, no blockwise verification, no logit-lens rows shared between the queries of a
  batch.

This module imports nothing of the package: the policies' deprecated speed options are
validated here too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["PRESETS", "Speed", "speed_of"]

_BOOL_WORDS = {"true": True, "1": True, "false": False, "0": False}
_BOOL_FIELDS = ("fuse", "speculative", "share_lens")


@dataclass(frozen=True)
class Speed:
    """The speed paths of one decode.

    Args:
        fuse: decode the contexts of a query as one batch (one forward pass per step, the
            shorter rows left-padded) where the model allows it; ``False`` runs one pass per
            context role.
        speculative: decode a pure/RAG rule by blockwise verification
            (:mod:`..accel.speculative`): one context drafts a block of tokens, the other
            checks it in one forward pass. Off by default: on the CPUs measured the fused
            step-by-step loop is faster.
        block: fixed block length for ``speculative`` (None: adaptive, 2-16).
        drafter: which context drafts: ``"auto"`` (the one winning more disagreements),
            ``"rag"`` or ``"pure"``.
        share_lens: in a batch, compute the first logit-lens rows of every query that needs
            them in one product (the LM head read once per step, not once per query).
    """

    fuse: bool = True
    speculative: bool = False
    block: int | None = None
    drafter: str = "auto"
    share_lens: bool = True

    def __post_init__(self) -> None:
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        block = self.block
        if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
            raise ValueError(f"block must be a positive int or None, got {block!r}")
        if self.drafter not in ("auto", "pure", "rag"):
            raise ValueError(f"drafter must be 'auto', 'pure' or 'rag', got {self.drafter!r}")

    def options(self) -> dict[str, Any]:
        """The speed as the trace records it (``Trace.options``)."""
        if self.speculative:
            return {"speculative": True, "block": self.block, "drafter": self.drafter}
        return {"speculative": False, "fuse": self.fuse}


#: The named presets of ``speed=``.
PRESETS: dict[str, Speed] = {
    "auto": Speed(),
    "reference": Speed(fuse=False, speculative=False, share_lens=False),
}


def _as_bool(name: str, value: Any) -> bool:
    """``value`` read strictly as a bool: True/False, 1/0 or the strings true/false/1/0 (a
    dict of options may come from a command line); anything else is an error."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _BOOL_WORDS:
        return _BOOL_WORDS[value.strip().lower()]
    raise ValueError(f"{name} must be True or False (or 1/0), got {value!r}")


def speed_of(value: Speed | str | Mapping[str, Any] | None = None) -> Speed:
    """``speed=`` as a :class:`Speed`: a Speed as is, None or a preset name (``"auto"``,
    ``"reference"``), or a dict of fields (``{"speculative": True, "block": 4}``; the fields
    not named keep the ``"auto"`` values; a bool field may be given as ``"true"``/``"0"``...).

    Raises:
        ValueError: an unknown preset or field, or a field's bad value (one sentence).
    """
    if value is None:
        return PRESETS["auto"]
    if isinstance(value, Speed):
        return value
    if isinstance(value, str):
        if value not in PRESETS:
            raise ValueError(
                f"unknown speed preset {value!r}; presets: {', '.join(PRESETS)} "
                "(or a dict of Speed fields)"
            )
        return PRESETS[value]
    if isinstance(value, Mapping):
        fields = {f.name for f in dataclasses.fields(Speed)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(
                f"unknown speed option {unknown[0]!r}; options: {', '.join(sorted(fields))}"
            )
        given = {k: _as_bool(k, v) if k in _BOOL_FIELDS else v for k, v in value.items()}
        return Speed(**given)
    raise TypeError(
        f"speed must be a Speed, a preset name or a dict, got {type(value).__name__}"
    )
