"""Encoding user text so that it never becomes a control token.

Passages, the question and every chat turn's
content (system prompt included) are encoded by :func:`encode_user_text` (a whole
conversation: :func:`encode_chat`): a ``<|im_start|>``
written inside them is encoded as the plain characters ``<``, ``|``, ``im``..., so a document
cannot forge a chat turn or end the prompt. Only the chat template's own markers are control
tokens. Text without control-token strings encodes exactly as ``tokenizer(text)`` does.
"""

from __future__ import annotations

import re
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

__all__ = ["CHAT_ROLES", "check_messages", "clean_text", "encode_chat", "encode_user_text"]

_SENTINEL = "\u241eTOKRAG_USER_CONTENT\u241e"
#: Chat roles a prompt may hold (the ones every chat template knows).
CHAT_ROLES = ("system", "user", "assistant")
# Unicode noncharacters (reserved for internal use) that wrap a control-token string found in
# user text while the chat frame is rendered, so that the encoder can tell it apart from the
# template's own markers. They are removed from user text first, so they cannot be forged.
_MARK_START, _MARK_END = "\ufdd0", "\ufdd1"
_CONTROL_CACHE: weakref.WeakKeyDictionary[Any, tuple[Any, re.Pattern[str]]] = (
    weakref.WeakKeyDictionary()
)


def _control_pattern(tokenizer: Any) -> re.Pattern[str]:
    """A regex matching the tokenizer's control-token strings, longest first: its special
    added tokens, plus added tokens its chat template writes (``<|im_start|>`` is not flagged
    special in every tokenizer). Whitespace tokens are ordinary text."""
    template = getattr(tokenizer, "chat_template", None)
    key = (template, len(tokenizer))  # cheap: the added-token table is read only on a change
    try:
        cached = _CONTROL_CACHE.get(tokenizer)
    except TypeError:  # pragma: no cover - a tokenizer that cannot be weakly referenced
        cached = None
    if cached is not None and cached[0] == key:
        return cached[1]
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    tokens = {str(t) for t in getattr(tokenizer, "all_special_tokens", []) or []}
    for token in added.values():
        content = getattr(token, "content", str(token))
        if getattr(token, "special", False) or (isinstance(template, str) and content in template):
            tokens.add(content)
    tokens = {t for t in tokens if t and not t.isspace()}
    pattern = re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True))) or "(?!)")
    try:
        _CONTROL_CACHE[tokenizer] = (key, pattern)
    except TypeError:  # pragma: no cover
        pass
    return pattern


def _mark_user_text(tokenizer: Any, text: str) -> str:
    """``text`` with each control-token string wrapped in private markers (see module doc)."""
    text = text.replace(_MARK_START, "").replace(_MARK_END, "")
    return _control_pattern(tokenizer).sub(lambda m: _MARK_START + m.group(0) + _MARK_END, text)


def _encode_plain(tokenizer: Any, text: str) -> list[int]:
    """``text`` encoded with no added token matched, as a piece in the middle of a prompt.

    Uses the backend's normalizer, pre-tokenizer and model directly (the ``tokenizers``
    library's public pipeline), which holds no state: ``split_special_tokens=True`` instead
    flips a flag on the shared tokenizer, which a concurrent call on another thread can undo.
    The text is encoded after a newline that is then removed, so a SentencePiece tokenizer does
    not add the word-start space it adds at the start of a string.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)

    def encode(piece: str) -> list[int]:
        if backend is None:  # a Python tokenizer: split_special_tokens is a per-call option there
            return list(
                tokenizer(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            )
        if backend.normalizer is not None:
            piece = backend.normalizer.normalize_str(piece)
        splits = [piece]
        if backend.pre_tokenizer is not None:
            splits = [split for split, _ in backend.pre_tokenizer.pre_tokenize_str(piece)]
        return [token.id for split in splits for token in backend.model.tokenize(split)]

    newline = encode("\n")
    ids = encode("\n" + text)
    return ids[len(newline) :] if ids[: len(newline)] == newline else encode(text)


def _encode_marked(tokenizer: Any, text: str) -> list[int]:
    """Ids of ``text`` (template text holding user text marked by :func:`_mark_user_text`): the
    template's control tokens as control tokens, the marked ones as plain text."""
    if _MARK_START not in text:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
    pieces = re.split(f"{_MARK_START}(.*?){_MARK_END}", text, flags=re.DOTALL)
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if not piece:
            continue
        if i % 2:  # a control-token string from user text
            plain = _encode_plain(tokenizer, piece)
            if tokenizer.convert_tokens_to_ids(piece) in plain:
                raise ValueError(f"cannot encode {piece!r} as plain text with this tokenizer")
            ids += plain
        else:
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
    return ids


def encode_user_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of text that comes from a user or a document (a passage, a question, a chat
    turn's content), with any control-token string in it (``<|im_start|>``, ``<|endoftext|>``,
    ``<s>``...) encoded as plain text, never as the control token.

    Text without such strings gives exactly ``tokenizer(text, add_special_tokens=False)``.
    Thread-safe (see :func:`_encode_plain`). Any tokenizer, any model.
    """
    return _encode_marked(tokenizer, _mark_user_text(tokenizer, text)) if text else []


def encode_chat(
    tokenizer: Any, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template, with every turn's
    content encoded as user text (see :func:`encode_user_text`): only the template's own
    markers are control tokens. For messages without control-token strings this equals
    ``tokenizer.apply_chat_template(messages, tokenize=True)``.

    Raises:
        TypeError / ValueError: bad messages (see :func:`check_messages`), or a tokenizer
            without a chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template; encode the text with encode_user_text")
    marked = [
        {"role": m["role"], "content": _mark_user_text(tokenizer, m["content"])}
        for m in check_messages(messages)
    ]
    rendered = tokenizer.apply_chat_template(
        marked, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return _encode_marked(tokenizer, rendered)


def check_messages(messages: Any) -> list[dict[str, str]]:
    """Earlier chat turns as role/content dicts, checked: a list of dicts whose ``role`` is
    one of :data:`CHAT_ROLES` and whose ``content`` is a string.

    Raises:
        TypeError / ValueError: one sentence naming the bad turn and what is expected.
    """
    if messages is None:
        return []
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence):
        raise TypeError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}"
        )
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise ValueError(
                f"messages[{i}] has role {role!r}; use one of {', '.join(map(repr, CHAT_ROLES))}"
            )
        if not isinstance(content, str):
            raise ValueError(
                f"messages[{i}] ({role}) needs a 'content' string, got {type(content).__name__}"
            )
        out.append({"role": role, "content": clean_text(content, f"messages[{i}]", stacklevel=5)})
    return out


def _adds_bos(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` starts an encoded text with its BOS token (the prompt is encoded
    segment by segment without special tokens, so a plain prompt adds it itself). Read off
    an encoding: fast tokenizers (Gemma's among them) may add it by their post-processor
    while their ``add_bos_token`` attribute says False."""
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos_id is None:
        return False
    if getattr(tokenizer, "add_bos_token", False):
        return True
    try:
        ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    except Exception:  # pragma: no cover - exotic tokenizers
        return False
    return bool(ids) and int(ids[0]) == int(bos_id)


def clean_text(text: str, what: str, stacklevel: int = 3) -> str:
    """``text`` with lone surrogates (text that is not valid Unicode, e.g. from
    ``surrogateescape``-decoded bytes) replaced by U+FFFD, with a warning naming ``what``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        n = sum(1 for c in text if "\ud800" <= c <= "\udfff")
        warnings.warn(
            f"{what} contains {n} lone surrogate character(s) (not valid Unicode); "
            "they were replaced with U+FFFD",
            stacklevel=stacklevel,
        )
        return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)
    return text
