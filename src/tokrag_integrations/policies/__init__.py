"""Decoding policies: one rule per module over the shared loop in :mod:`..decoding`.

``get_policy(name, **options)`` builds a policy by name; ``POLICIES`` lists the names.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..decoding import Policy

#: name -> "module:Class". A new policy is a new small module plus one line here.
_REGISTRY: dict[str, str] = {
    "llm": "baselines:PureLLM",
    "rag": "baselines:StandardRAG",
    "floor": "baselines:TwoContextFloor",
    "tokrag": "tokrag:TokRAG",
    "logprob": "selection:LogprobSelection",
    "entropy": "selection:EntropySelection",
    "cad": "cad:CAD",
    "adacad": "cad:AdaCAD",
    "rag_token": "rag_token:RAGToken",
    "rag_sequence": "rag_sequence:RAGSequence",
}


def register_policy(name: str, target: str) -> None:
    """Register ``"module:Class"`` (module relative to this package, or absolute) as ``name``."""
    _REGISTRY[name] = target


def available_policies() -> list[str]:
    return sorted(_REGISTRY)


def get_policy(name: str | Policy, **options: Any) -> Policy:
    """Instantiate a policy by name with its options.

    Raises:
        ValueError: unknown name (the message lists the known ones) or bad options.
    """
    if isinstance(name, Policy):
        if options:
            raise ValueError("options cannot be given together with a Policy instance")
        return name
    if name not in _REGISTRY:
        raise ValueError(
            f"Unknown policy {name!r}. Available policies: {', '.join(available_policies())}."
        )
    mod_name, cls_name = _REGISTRY[name].split(":")
    mod = importlib.import_module(mod_name if "." in mod_name and not mod_name.startswith(".") else f"{__name__}.{mod_name}")
    cls = getattr(mod, cls_name)
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"Bad options for policy {name!r}: {e}") from e
