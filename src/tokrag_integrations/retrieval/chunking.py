"""Chunking: text cut at paragraph, then sentence (or line), then word boundaries (the
frameworks' splitters are optional extras; this gives the same chunks on every install)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from ..defaults import CHUNK_CHARS, CHUNK_OVERLAP
from .documents import Chunk, Document

# A sentence ends at . ! or ? followed by whitespace; lines inside a paragraph (lists, table
# rows) are also natural break points.
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+|\n")


def _split_units(text: str, max_chars: int) -> list[tuple[str, str]]:
    """Split ``text`` into ``(separator_before, piece)`` units of at most ``max_chars``.

    Paragraphs that fit are one unit; longer ones are split at sentence and line breaks,
    and sentences that still do not fit are split between words (or, for a single huge
    "word", hard at ``max_chars``).
    """
    units: list[tuple[str, str]] = []
    paragraphs = [p.strip() for p in re.split(r"\n[ \t]*\n", text) if p.strip()]
    for paragraph in paragraphs:
        if len(paragraph) <= max_chars:
            units.append(("\n\n", paragraph))
            continue
        sep, pos = "\n\n", 0
        for match in [*_SENTENCE_BREAK.finditer(paragraph), None]:
            end = match.start() if match else len(paragraph)
            sentence = paragraph[pos:end].strip()
            if sentence:
                for piece in _split_long(sentence, max_chars):
                    units.append((sep, piece))
                    sep = " "
                sep = "\n" if match and "\n" in match.group() else " "
            pos = match.end() if match else len(paragraph)
    return units


#: A run of whitespace (possibly empty), matched at a position: skipping it is one C scan.
_SPACES = re.compile(r"\s*")


def _split_long(sentence: str, max_chars: int) -> list[str]:
    """``sentence`` cut between words into pieces of at most ``max_chars``.

    Walks one position forward instead of re-slicing the rest of the sentence for each
    piece, so a one-line file of megabytes is cut in linear time (issue 54: re-slicing made
    a 16 MB line take 23 s, quadratic in its length).
    """
    pieces: list[str] = []
    pos, end = 0, len(sentence)
    while end - pos > max_chars:
        cut = sentence.rfind(" ", pos, pos + max_chars + 1)
        if cut <= pos:  # one enormous token: cut it hard
            cut = pos + max_chars
        pieces.append(sentence[pos:cut].rstrip())
        pos = _SPACES.match(sentence, cut).end()
    if pos < end:
        pieces.append(sentence[pos:])
    return pieces


def _joined_len(units: Sequence[tuple[str, str]]) -> int:
    return sum(len(text) for _, text in units) + sum(len(sep) for sep, _ in units[1:])


def _join(units: Sequence[tuple[str, str]]) -> str:
    return "".join(text if i == 0 else sep + text for i, (sep, text) in enumerate(units))


def _overlap_tail(units: Sequence[tuple[str, str]], overlap: int) -> list[tuple[str, str]]:
    """The trailing units of a finished chunk to repeat at the start of the next one.

    Whole sentences/paragraphs are preferred; if even the last one is longer than
    ``overlap``, its last words (at most ``overlap`` characters) are used.
    """
    if overlap <= 0 or not units:
        return []
    tail: list[tuple[str, str]] = []  # last unit first
    size = 0  # joined length of the tail
    for sep, text in reversed(units):
        # Put before the tail, this unit's text counts, and so does the separator of the
        # unit that was first until now.
        grown = size + len(text) + (len(tail[-1][0]) if tail else 0)
        if grown > overlap:
            break
        tail.append((sep, text))
        size = grown
    if tail:
        return tail[::-1]
    sep, last = units[-1]
    cut = last.find(" ", len(last) - overlap)
    words = last[cut + 1 :] if cut >= 0 else ""
    return [(sep, words)] if words else []


def chunk_text(
    text: str, max_chars: int = CHUNK_CHARS, overlap: int = CHUNK_OVERLAP
) -> list[str]:
    """Split ``text`` into chunks of at most ``max_chars`` characters (``[]`` for blank text).

    Chunks end at paragraph boundaries where possible, else at sentence (or line) ends,
    else between words. Consecutive chunks share up to ``overlap`` characters of trailing
    context (whole sentences where they fit), so a fact cut at a boundary is still found.

    Raises:
        ValueError: ``max_chars`` is not positive or ``overlap`` is not in
            ``[0, max_chars)``.
    """
    if max_chars <= 0:
        raise ValueError(f"max_chars must be positive, got {max_chars}.")
    if not 0 <= overlap < max_chars:
        raise ValueError(f"overlap must be >= 0 and smaller than max_chars, got {overlap}.")
    chunks: list[str] = []
    current: list[tuple[str, str]] = []
    size = 0  # _joined_len(current), kept as units come and go: linear in the text
    for sep, piece in _split_units(text, max_chars):
        if current and size + len(sep) + len(piece) > max_chars:
            chunks.append(_join(current))
            current = _overlap_tail(current, overlap)
            size = _joined_len(current)
            while current and size + len(sep) + len(piece) > max_chars:
                _, dropped = current.pop(0)
                size -= len(dropped) + (len(current[0][0]) if current else 0)
        size += len(piece) + (len(sep) if current else 0)
        current.append((sep, piece))
    if current:
        chunks.append(_join(current))
    return chunks


def chunk_documents(
    documents: Iterable[Document], max_chars: int = CHUNK_CHARS, overlap: int = CHUNK_OVERLAP
) -> list[Chunk]:
    """Every document cut with :func:`chunk_text`, as :class:`Chunk` objects."""
    return [
        Chunk(text=piece, source=doc.source, index=i, metadata=dict(doc.metadata))
        for doc in documents
        for i, piece in enumerate(chunk_text(doc.text, max_chars=max_chars, overlap=overlap))
    ]

