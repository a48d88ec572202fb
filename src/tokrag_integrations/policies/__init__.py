"""Decoding policies: one rule per module, over the engine's step loop.

``get_policy(name, **options)`` builds a policy by name and is the one place a policy's
options are checked; ``available_policies()`` lists the names; ``register_policy(name,
"module:Class")`` adds a rule. The contract a rule is written against is in :mod:`.base`.
Importing this package stays cheap (no torch: the CLI lists names without it).
"""

from __future__ import annotations

import importlib
import inspect
import numbers
import re
from typing import TYPE_CHECKING, Any

from ..config import bool_word

if TYPE_CHECKING:
    from .base import Policy

__all__ = [
    "available_policies",
    "get_policy",
    "policy_options",
    "register_policy",
    "unknown_policy",
    "uses_passages",
]


_P = "tokrag_integrations.policies"
#: name -> "module:Class" (full dotted module names).
_REGISTRY: dict[str, str] = {
    "no_rag": f"{_P}.baselines:NoRAG",
    "rag": f"{_P}.baselines:StandardRAG",
    "floor": f"{_P}.baselines:TwoContextFloor",
    "tokrag": f"{_P}.tokrag:TokRAG",
    "tokrag_authors": f"{_P}.tokrag_authors:TokRAGAuthors",
    "logprob": f"{_P}.selection:LogprobSelection",
    "entropy": f"{_P}.selection:EntropySelection",
    "cad": f"{_P}.cad:CAD",
    "adacad": f"{_P}.cad:AdaCAD",
    "rag_token": f"{_P}.rag_token:RAGToken",
    "rag_sequence": f"{_P}.rag_sequence:RAGSequence",
}
#: Old names of renamed policies -> today's, for the error an old name gets (CHANGELOG).
_RENAMED = {"llm": "no_rag", "tokrag_reference": "tokrag_authors"}


def register_policy(name: str, target: str) -> None:
    """Register ``"module:Class"`` (a full dotted module name) as ``name``."""
    _REGISTRY[name] = target


def uses_passages(policy: Policy) -> bool:
    """Whether ``policy`` reads passages at all (``no_rag`` does not: its only role is pure)."""
    return tuple(policy.roles) != ("pure",)


def available_policies() -> list[str]:
    return sorted(_REGISTRY)


def get_policy(name: str | Policy, **options: Any) -> Policy:
    """Instantiate a policy by name with its options.

    Raises:
        ValueError: unknown name (the message lists the known ones) or bad options.
    """
    from .base import Policy

    if isinstance(name, Policy):
        if options:
            raise ValueError("options cannot be given together with a Policy instance")
        return name
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(unknown_policy(name))
    mod_name, cls_name = _REGISTRY[name].split(":")
    cls = getattr(importlib.import_module(mod_name), cls_name)
    options = _checked_options(name, cls, options)
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"Bad options for policy {name!r}: {e}") from e


def unknown_policy(name: Any) -> str:
    """The error for a name that is no policy: the known names, and the new name of a renamed
    one."""
    listed = f"Available policies: {', '.join(available_policies())}."
    if isinstance(name, str) and name in _RENAMED:
        return f"Unknown policy {name!r}: it is renamed {_RENAMED[name]!r}. {listed}"
    return f"Unknown policy {name!r}. {listed}"


def policy_options(cls: type) -> dict[str, inspect.Parameter] | None:
    """The keyword options a policy class takes (None when it accepts any ``**kwargs``)."""
    if cls.__init__ is object.__init__:
        return {}
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {
        p.name: p
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }


def _checked_options(name: str, cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """Refuse unknown options and read bool options strictly (True/False, 1/0 or the strings
    ``true``/``false``/``1``/``0``; anything else, e.g. ``"yes"`` or ``"False!"``, is an error)."""
    known = policy_options(cls)
    if known is None:
        return options
    out = dict(options)
    for key, value in options.items():
        if key not in known:
            listed = ", ".join(known) if known else "none"
            raise ValueError(
                f"Bad options for policy {name!r}: unknown option {key!r}; options: {listed}"
            )
        if _is_nan(value):
            raise ValueError(
                f"option {key!r} of policy {name!r} must be a number, got NaN (not a number)"
            )
        param = known[key]
        if (
            value is not None
            and _is_numeric(param)
            and (isinstance(value, bool) or not isinstance(value, numbers.Real))
        ):
            raise ValueError(f"option {key!r} of policy {name!r} must be a number, got {value!r}")
        if param.annotation in (bool, "bool") or (
            param.annotation is inspect.Parameter.empty and isinstance(param.default, bool)
        ):
            out[key] = _as_bool(name, key, value)
    return out


def _is_numeric(param: inspect.Parameter) -> bool:
    """Whether the option ``param`` takes numbers only (annotated ``int`` or ``float``, maybe
    ``| None``; the annotations may be strings)."""
    ann = param.annotation
    text = ann.__name__ if isinstance(ann, type) else ann if isinstance(ann, str) else ""
    names = set(re.findall(r"[A-Za-z_]\w*", text))
    return bool(names) and names <= {"int", "float", "None", "Optional"}


def _is_nan(value: Any) -> bool:
    """``value`` is NaN, or a string that ``float()`` reads as NaN."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return False
    # ``value != value`` rather than math.isnan: an integer too large for a float overflows it.
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value != value


def _as_bool(policy: str, key: str, value: Any) -> bool:
    got = bool_word(value)
    if got is None:
        raise ValueError(
            f"option {key!r} of policy {policy!r} must be true or false (or 1/0), got {value!r}"
        )
    return got
