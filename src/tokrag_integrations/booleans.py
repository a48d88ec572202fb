"""Boolean options are read strictly: a real ``True`` or ``False``, never a value's truthiness.

``bool("False")`` is ``True`` in Python, so an option written as the string ``"False"`` (from a
config file, a form, an environment variable passed through) would silently mean *yes*: with
``trust_remote_code="False"`` a model folder's own Python code ran (issue 29). Every public
entry point therefore checks its boolean options with :func:`require_bool`, which accepts
``True`` and ``False`` only and refuses anything else with a ``TypeError`` naming the option.

Text is read as a boolean only where it comes from a command line (``argparse`` flags are
real booleans already; ``--option fuse=false`` is read by :func:`~.policies.get_policy`
from its documented words ``true``/``false``/``1``/``0``) or an environment variable
(:func:`env_flag`, which is :func:`.config.env_switch`: ``1``/``true``/``yes``/``on`` or
``0``/``false``/``no``/``off``, any case; another word is an error, not *on*).

A leaf module (standard library and :mod:`.config` only), importable from anywhere in the
package.
"""

from __future__ import annotations

from typing import Any

from .config import env_switch

__all__ = ["env_flag", "require_bool"]


def require_bool(value: Any, name: str) -> bool:
    """``value`` when it is ``True`` or ``False``; otherwise a ``TypeError`` naming ``name``.

    >>> require_bool(False, "prune")
    False
    >>> require_bool("False", "prune")
    Traceback (most recent call last):
    ...
    TypeError: prune must be True or False, got 'False' (str); strings are not read as booleans.
    """
    if isinstance(value, bool):
        return value
    raise TypeError(
        f"{name} must be True or False, got {value!r} ({type(value).__name__}); strings are not "
        "read as booleans."
    )


def env_flag(name: str, default: bool) -> bool:
    """The environment variable ``name`` read as a switch; ``default`` when unset or empty
    (:func:`.config.env_switch`; the variables themselves have accessors in :mod:`.config`).

    Raises:
        ValueError: The value is not one of the words in the module docstring.
    """
    return env_switch(name, default)
