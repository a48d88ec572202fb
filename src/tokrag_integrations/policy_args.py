"""One spelling of policy options at every integration entry point.

Every entry point (``TokRAGLLM``, ``ChatTokRAG``, ``TokRAGSynthesizer``, the LangChain chain
factories, the gated routers, the CLI, the server) takes ``policy="tokrag"`` and
``policy_options={...}``, a dict kept apart from the loading options (``model``, ``device``,
``dtype`` ...). The older spelling, policy options as loose keyword arguments next to the
loading options, keeps working for one release with a :class:`DeprecationWarning` that names
the new one. Nothing is validated here: the options go on to
:func:`~tokrag_integrations.policies.get_policy`, which checks them once.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

__all__ = ["merge_policy_options"]


def merge_policy_options(
    where: str,
    policy_options: Mapping[str, Any] | None,
    loose: Mapping[str, Any],
    *,
    stacklevel: int = 3,
) -> dict[str, Any]:
    """``policy_options`` with the ``loose`` keyword arguments of the old spelling added.

    Args:
        where: the entry point, for the messages (``"TokRAGSynthesizer"``).
        policy_options: the dict of the new spelling, or None.
        loose: policy options given as keyword arguments (the loading options already taken
            out); when there are any, a DeprecationWarning names the new spelling.
        stacklevel: of the warning, so that it points at the caller of ``where``.

    Raises:
        TypeError: ``policy_options`` is not a mapping.
        ValueError: an option is given both ways.
    """
    if policy_options is not None and not isinstance(policy_options, Mapping):
        raise TypeError(
            f"{where}: policy_options must be a dict of the policy's options, "
            f"got {type(policy_options).__name__}"
        )
    out = dict(policy_options or {})
    if not loose:
        return out
    names = sorted(loose)
    shown = ", ".join(f"{k!r}: ..." for k in names)
    warnings.warn(
        f"{where}: policy options as keyword arguments ({', '.join(names)}) are deprecated; "
        f"pass them as policy_options={{{shown}}}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    both = sorted(set(out) & set(loose))
    if both:
        raise ValueError(
            f"{where}: {', '.join(both)} given both in policy_options and as keyword arguments"
        )
    out.update(loose)
    return out
