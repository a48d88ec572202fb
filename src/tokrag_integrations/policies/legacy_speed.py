"""Deprecated: speed choices given to a policy (``TokRAG(speculative=True)``,
``policy.fuse = False``). They are the ``speed=`` of the runner and the API now
(:class:`..engine.speed.Speed`); given the old way they still apply, with a
``DeprecationWarning``, through :attr:`.base.Policy.legacy_speed` (read by
:func:`..runner.resolve_speed`).
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["SPEED_KEYS", "add_speed_properties", "legacy_speed_options"]


def _speed_property(key: str, default: Any) -> property:
    """A deprecated speed attribute of a policy: reads and writes :attr:`Policy.legacy_speed`."""

    def get(self: Any) -> Any:
        warnings.warn(
            f"policy.{key} is deprecated: speed choices are not policy attributes any more; "
            f"pass speed={{{key!r}: ...}} to generate() or the runner",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.legacy_speed.get(key, default)

    def set_(self: Any, value: Any) -> None:
        warnings.warn(
            f"setting policy.{key} is deprecated: pass speed={{{key!r}: {value!r}}} to "
            "generate() or the runner",
            DeprecationWarning,
            stacklevel=2,
        )
        self.legacy_speed = {**self.legacy_speed, key: value}

    return property(get, set_, doc=f"Deprecated: the ``{key}`` of ``speed=``.")


#: The speed choices that used to be policy options, with their old defaults.
SPEED_KEYS: dict[str, Any] = {"fuse": True}


def legacy_speed_options(policy: str, given: dict[str, Any]) -> dict[str, Any]:
    """Speed options given to a rule's constructor the old way, checked like ``speed=``
    (:class:`..engine.speed.Speed`), with a ``DeprecationWarning``; {} when none."""
    unknown = sorted(set(given) - set(SPEED_KEYS))
    if unknown:
        raise TypeError(f"{policy} got an unexpected keyword argument {unknown[0]!r}")
    if not given:
        return {}
    warnings.warn(
        f"{', '.join(sorted(given))} of policy {policy!r} are speed choices, not policy "
        f"options; pass speed={dict(given)!r} to generate() / the runner instead",
        DeprecationWarning,
        stacklevel=3,
    )
    from ..engine.speed import Speed  # imports nothing of the package

    Speed(**given)  # the same checks and messages as speed=
    return dict(given)


def add_speed_properties(cls: type) -> None:
    """Give the policy base class its deprecated speed attributes (:func:`_speed_property`)."""
    for key, default in SPEED_KEYS.items():
        setattr(cls, key, _speed_property(key, default))

