"""A conversation and a caller's formatted context as the core's arguments: the one rule the
LlamaIndex and LangChain adapters and the server all follow.

* :func:`split_turns` — chat turns -> the question, the earlier turns, the system prompt.
  System (and developer) messages, joined by blank lines, are the system prompt; the user
  messages after the last assistant turn, joined by blank lines, are the question; the turns
  before them are the history. The conversation must end with a user message.
* :func:`adapter_passages` — an adapter's ``passages=`` (its framework's documents, strings,
  :class:`~tokrag_integrations.prompts.Passage` objects, (text, score) pairs) as a list.
* :func:`split_context` — a context the caller's template formatted from passages -> one
  passage per piece, so that citations name the documents. A passage found in the context
  runs from where its text starts to where the next found text starts (whitespace between
  them included); text that is not whitespace and lies outside every passage's text is a
  passage of its own (metadata ``{"source": "template context"}``), never folded into a
  document it is not part of. Joined, the pieces give the context: nothing is lost; a warning
  names the passages not found and says when some text is no passage's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..prompts import Passage, as_passages

#: The metadata of a piece of a formatted context that is no passage's text.
TEMPLATE_CONTEXT = {"source": "template context"}


@dataclass
class ChatTurns:
    """A conversation split the way the core API takes it."""

    query: str
    """The user messages after the last assistant turn, joined by blank lines."""
    history: list[dict[str, str]]
    """The earlier user and assistant turns (``messages=`` of the core)."""
    system_prompt: str | None
    """The system and developer messages joined, or None for the core's default."""


def split_turns(
    turns: Sequence[dict[str, Any]], who: str = "the server", fix: str = "end with a user message"
) -> ChatTurns:
    """Split role/content dicts (roles ``system``, ``developer``, ``user``, ``assistant``; the
    caller maps its framework's roles first) by the module's rule.

    Raises:
        ValueError: no turns, or the last one is not a user message (one sentence naming
            ``who`` answers and the caller's ``fix``).
    """
    if not turns:
        raise ValueError(f"{who} got no messages: pass at least one user message.")
    system = [t["content"] for t in turns if t["role"] in ("system", "developer")]
    talk = [t for t in turns if t["role"] not in ("system", "developer")]
    if not talk or talk[-1]["role"] != "user":
        last = talk[-1]["role"] if talk else "system"
        raise ValueError(
            f"The last chat message must be a user message, not {last!r}: {who} "
            f"answers it, so {fix}."
        )
    first = len(talk)
    while first and talk[first - 1]["role"] == "user":
        first -= 1
    return ChatTurns(
        query="\n\n".join(t["content"] for t in talk[first:] if t["content"].strip()),
        history=[{"role": t["role"], "content": t["content"]} for t in talk[:first]],
        system_prompt="\n\n".join(s for s in system if s.strip()) or None,
    )


def adapter_passages(items: Any, convert: Callable[[Any], Any], kinds: str) -> list[Any] | None:
    """``items`` with each framework document through ``convert`` (its own type -> a
    :class:`Passage`; anything else is left as is, for the core to take or refuse); None stays
    None.

    Raises:
        TypeError: ``items`` is a single string or document (``kinds``: what the list may
            hold, named in the message), not a list.
    """
    if items is None:
        return None
    if isinstance(items, (str, bytes)) or convert(items) is not items:
        raise TypeError(
            f"passages must be a list (of {kinds}, strings or Passage objects), not a single "
            f"{type(items).__name__}"
        )
    return [convert(i) for i in items]


def split_context(
    context: str,
    passages: Sequence[Any],
    texts: Sequence[Iterable[str]] | None = None,
    *,
    stacklevel: int = 3,
) -> list[Passage] | None:
    """``context`` cut by the module's rule into passages that keep the score and metadata of
    the passage each piece holds. A passage is looked for by its text (outer whitespace aside),
    or by the longest of ``texts[i]`` found when given (the same document under several
    formats), where no passage found before it lies. ``passages``: what
    :func:`~tokrag_integrations.prompts.as_passages` takes. None when no passage is found."""
    passages = as_passages(passages)
    found: list[tuple[int, int, int]] = []  # (start, end, index of the passage)
    for i, p in enumerate(passages):
        candidates = {t.strip() for t in (texts[i] if texts is not None else [p.text])} - {""}
        for t in sorted(candidates, key=len, reverse=True):
            at = context.find(t)
            while at >= 0 and any(a < at + len(t) and at < b for a, b, _ in found):
                at = context.find(t, at + 1)
            if at >= 0:
                found.append((at, at + len(t), i))
                break
    starts: list[tuple[int, int | None]] = []  # (start of the piece, index or None)
    pos = 0
    for at, end, i in sorted(found):
        if context[pos:at].strip():
            starts.append((pos, None))
        starts.append((at if starts else 0, i))
        pos = end
    if context[pos:].strip():
        starts.append((pos, None))
    held = {i for _, _, i in found}
    missing = [i for i in range(len(passages)) if i not in held]
    stray = any(i is None for _, i in starts) or (context.strip() and not found)
    said = []
    if missing:
        meta = {i: passages[i].metadata for i in missing}
        names = ", ".join(str(m.get("node_id", m.get("id", i))) for i, m in meta.items())
        said.append(
            f"passage(s) {missing} are not in the context (not found: {names}): no citation "
            "names them"
        )
    if stray:
        said.append("part of the context is no passage's text: citations to it name no document")
    if said:
        warnings.warn("; ".join(said), UserWarning, stacklevel=stacklevel)
    if not found:
        return None
    ends = [s for s, _ in starts[1:]] + [len(context)]
    return [
        Passage(context[a:e], metadata=dict(TEMPLATE_CONTEXT)) if i is None
        else Passage(context[a:e], passages[i].score, dict(passages[i].metadata))
        for (a, i), e in zip(starts, ends, strict=True)
    ]
