"""Decoding policies: one rule per module over the shared loop in :mod:`..engine.loop`.

``get_policy(name, **options)`` builds a policy by name and is the one place a policy's
options are checked (:func:`_checked_options`); ``available_policies()`` lists the names;
:func:`merge_policy_options` reads the ``policy_options=`` of the entry points (and their
deprecated ``**options``). For policy authors: :class:`Policy`, :class:`View`, :class:`Choice`
and :class:`ContextSpec` (defined in :mod:`.base`) are importable from here, and
``register_policy(name, "module:Class")`` adds a rule to the registry.
"""

from __future__ import annotations

import importlib
import inspect
import numbers
import re
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # importing this package stays cheap (the CLI lists names without torch)
    from .base import Choice, ContextSpec, ContextView, Policy, View

__all__ = [
    "Choice",
    "ContextSpec",
    "ContextView",
    "Policy",
    "View",
    "available_policies",
    "get_policy",
    "merge_policy_options",
    "policy_options",
    "register_policy",
]

#: The policy contract, loaded from :mod:`.base` on first access (it imports torch).
_CONTRACT = frozenset({"Choice", "ContextSpec", "ContextView", "Policy", "View"})


def __getattr__(name: str) -> Any:
    if name in _CONTRACT:
        from . import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

#: Strings accepted for a bool option (case-insensitive), e.g. from ``--option fuse=false``.
_BOOL_WORDS = {"true": True, "1": True, "false": False, "0": False}

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
    from .base import Policy

    if isinstance(name, Policy):
        if options:
            raise ValueError("options cannot be given together with a Policy instance")
        return name
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(
            f"Unknown policy {name!r}. Available policies: {', '.join(available_policies())}."
        )
    mod_name, cls_name = _REGISTRY[name].split(":")
    mod = importlib.import_module(mod_name if "." in mod_name and not mod_name.startswith(".") else f"{__name__}.{mod_name}")
    cls = getattr(mod, cls_name)
    options = _checked_options(name, cls, options)
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"Bad options for policy {name!r}: {e}") from e


def policy_options(cls: type) -> dict[str, inspect.Parameter] | None:
    """The keyword options a policy class takes (None when it accepts any ``**kwargs``)."""
    if cls.__init__ is object.__init__:
        return {}
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD and p.name != "legacy_speed" for p in params):
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
    if any(p.name == "legacy_speed" for p in inspect.signature(cls.__init__).parameters.values()):
        # The deprecated speed options (``fuse=False``...), read as before; the class warns.
        from .legacy_speed import SPEED_KEYS

        known = {**known, **{k: _legacy_speed_param(k, d) for k, d in SPEED_KEYS.items()}}
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
        if value is not None and _is_numeric(param) and (
            isinstance(value, bool) or not isinstance(value, numbers.Real)
        ):
            raise ValueError(
                f"option {key!r} of policy {name!r} must be a number, got {value!r}"
            )
        if param.annotation in (bool, "bool") or (
            param.annotation is inspect.Parameter.empty and isinstance(param.default, bool)
        ):
            out[key] = _as_bool(name, key, value)
    return out


def _is_numeric(param: inspect.Parameter) -> bool:
    """Whether the option ``param`` takes numbers only (annotated ``int`` or ``float``,
    maybe ``| None``; the annotations are strings under ``from __future__ import
    annotations``), so that ``"abc"`` is refused by name rather than by ``float()``."""
    ann = param.annotation
    text = ann.__name__ if isinstance(ann, type) else ann if isinstance(ann, str) else ""
    names = set(re.findall(r"[A-Za-z_]\w*", text))
    return bool(names) and names <= {"int", "float", "None", "Optional"}


def _legacy_speed_param(key: str, default: Any) -> inspect.Parameter:
    annotation = bool if isinstance(default, bool) else inspect.Parameter.empty
    return inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def _is_nan(value: Any) -> bool:
    """``value`` is NaN, or a string that ``float()`` reads as NaN (a NaN compares False with
    everything, so a NaN threshold would silently pick one side at every step)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return False
    # ``value != value`` rather than math.isnan: an integer too large for a float overflows it.
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value != value


def _as_bool(policy: str, key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _BOOL_WORDS:
        return _BOOL_WORDS[value.strip().lower()]
    raise ValueError(
        f"option {key!r} of policy {policy!r} must be true or false (or 1/0), got {value!r}"
    )


def merge_policy_options(
    policy_options: Mapping[str, Any] | None,
    legacy: Mapping[str, Any] | None,
    caller: str,
    *,
    stacklevel: int = 3,
) -> dict[str, Any]:
    """The policy options of one call of the entry point ``caller``: ``policy_options=``
    (a dict), plus the options given the deprecated way (``legacy``: keyword arguments mixed
    with the entry point's own), with a ``DeprecationWarning`` naming the new spelling. The
    options are checked later, once, by :func:`get_policy`. ``stacklevel``: the warning's,
    counted from this function (3: the caller of the function that calls this one).

    Raises:
        TypeError: ``policy_options`` is not a dict.
        ValueError: an option given both ways.
    """
    if policy_options is not None and not isinstance(policy_options, Mapping):
        raise TypeError(
            f"policy_options must be a dict of option names to values, got {type(policy_options).__name__}"
        )
    merged = dict(policy_options or {})
    if legacy:
        warnings.warn(
            f"{caller}: policy options as keyword arguments ({', '.join(sorted(legacy))}) are "
            f"deprecated; pass them as {caller}(..., policy_options={dict(legacy)!r})",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
        both = sorted(set(merged) & set(legacy))
        if both:
            raise ValueError(f"option {both[0]!r} given twice: in policy_options and as a keyword")
        merged.update(legacy)
    return merged
