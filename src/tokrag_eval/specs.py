"""Policy / scorer specs: ``name`` or ``name[key=value,...]`` (e.g. ``tokrag[min_fusion_layer=0]``).

A spec list is split on the commas outside brackets::

    >>> parse_specs("no_rag,tokrag[lens_norm=false,min_fusion_layer=0],adacad")
    [PolicySpec(name='no_rag', options={}), PolicySpec(name='tokrag', options={'lens_norm': False, 'min_fusion_layer': 0}), PolicySpec(name='adacad', options={})]
    >>> str(parse_spec("tokrag[min_fusion_layer=0, lens_norm=false]"))
    'tokrag[lens_norm=False,min_fusion_layer=0]'

Values are read as int, float, bool (``true`` / ``false``, any case), ``None`` (``none``, any
case) or else a string (quotes around it are dropped). The normalised spec string (keys
sorted, values as Python writes them) is the label of a policy in records and tables.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PolicySpec:
    """A policy (or token scorer) name with its options."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        if not self.options:
            return self.name
        return (
            self.name
            + "["
            + ",".join(f"{k}={_show(self.options[k])}" for k in sorted(self.options))
            + "]"
        )


def _show(value: Any) -> str:
    """A value as it reads back: strings that would parse as something else get quotes."""
    if isinstance(value, str) and (parse_value(value) != value or any(c in value for c in ",[]=")):
        return repr(value)
    return str(value)


def parse_value(text: str) -> Any:
    """``"0"`` -> 0, ``"0.5"`` -> 0.5, ``"false"`` -> False, ``"none"`` -> None, else the string."""
    t = text.strip()
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        return t[1:-1]
    low = t.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for cast in (int, float):
        try:
            return cast(t)
        except ValueError:
            pass
    return t


def split_specs(text: str) -> list[str]:
    """Split on the commas outside ``[...]`` (empty parts dropped)."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"unclosed '[' in {text!r}")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def parse_spec(text: str) -> PolicySpec:
    """``name`` or ``name[key=value,...]`` -> :class:`PolicySpec`."""
    t = text.strip()
    if "[" not in t:
        if not t or "]" in t or "=" in t:
            raise ValueError(f"bad spec {text!r}: expected name or name[key=value,...]")
        return PolicySpec(t, {})
    name, _, rest = t.partition("[")
    if not rest.endswith("]") or not name.strip():
        raise ValueError(f"bad spec {text!r}: expected name[key=value,...]")
    options: dict[str, Any] = {}
    for part in split_specs(rest[:-1]):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"bad option {part!r} in {text!r}: expected key=value")
        if key.strip() in options:
            raise ValueError(f"option {key.strip()!r} given twice in {text!r}")
        options[key.strip()] = parse_value(value)
    return PolicySpec(name.strip(), options)


def parse_specs(text: str | Iterable[str]) -> list[PolicySpec]:
    """A comma-separated spec list (or a list of spec strings) -> specs, duplicates dropped."""
    parts = (
        split_specs(text) if isinstance(text, str) else [p for t in text for p in split_specs(t)]
    )
    out: list[PolicySpec] = []
    for p in parts:
        s = parse_spec(p)
        if str(s) not in {str(o) for o in out}:
            out.append(s)
    return out


def validate_specs(
    specs: Iterable[PolicySpec], known: Iterable[str], build: Callable[..., Any]
) -> None:
    """Raise ValueError (one sentence) for an unknown name or options that ``build(name,
    **options)`` rejects; nothing is loaded."""
    known = sorted(known)
    for s in specs:
        if s.name not in known:
            raise ValueError(
                f"Unknown policy {s.name!r} in {str(s)!r}; available: {', '.join(known)}."
            )
        try:
            build(s.name, **s.options)
        except (TypeError, ValueError) as e:
            raise ValueError(f"Bad options in {str(s)!r}: {str(e).rstrip('.')}.") from e
