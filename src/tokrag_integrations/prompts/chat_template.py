"""Chat-template rendering with a step limit, and user text that never becomes a control token.

Passages, the question and every chat turn's content (system prompt included) are encoded by
:func:`encode_user_text` (a whole conversation: :func:`encode_chat`): a ``<|im_start|>`` written
inside them is encoded as the plain characters ``<``, ``|``, ``im``..., so a document cannot
forge a chat turn or end the prompt. Only the chat template's own markers are control tokens.
Text without control-token strings encodes exactly as ``tokenizer(text)`` does.
"""

from __future__ import annotations

import re
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

#: Chat roles a prompt may hold (the ones every chat template knows).
CHAT_ROLES = ("system", "user", "assistant")
# Unicode noncharacters wrapping a control-token string of user text while the chat frame is
# rendered, so the encoder tells it from the template's markers (removed from user text first).
_MARK_START, _MARK_END = "\ufdd0", "\ufdd1"
_CONTROL_CACHE: weakref.WeakKeyDictionary[Any, tuple[Any, re.Pattern[str]]] = (
    weakref.WeakKeyDictionary()
)


#: Most lines of template code one rendering of a chat template may run. A real template
#: runs tens per message (a 100-turn conversation with tools: about 10,000); one that loops
#: for ever, or 100,000 x 100,000 times, is stopped here in well under a second.
TEMPLATE_STEPS = 1_000_000
#: The file name jinja2 gives a template compiled from a string (transformers' chat templates).
_TEMPLATE_FILE = "<template>"


class ChatTemplateError(ValueError):
    """A chat template that does not finish within :data:`TEMPLATE_STEPS` steps."""


class _OutOfSteps(Exception):  # noqa: N818 - raised into the template's frames to stop them
    pass


def render_chat_template(tokenizer: Any, messages: list[dict[str, str]], **options: Any) -> Any:
    """``tokenizer.apply_chat_template(messages, **options)`` with a step limit.

    transformers renders the template in jinja2's immutable sandbox (no file or attribute
    access), which bounds what it can reach but not how long it runs: nested loops of 100,000
    hang the caller. While it renders, a trace function of this thread counts the lines run
    in the template's own code (jinja2 compiles it to Python; other frames are not traced)
    and stops it past :data:`TEMPLATE_STEPS`. A tracer already set (a debugger, coverage) is
    put back afterwards.

    Raises:
        ChatTemplateError: The template ran past the limit (one sentence).
    """
    import sys

    steps = 0

    def count_lines(frame: Any, event: str, arg: Any) -> Any:
        nonlocal steps
        if event == "line":
            steps += 1
            if steps > TEMPLATE_STEPS:
                raise _OutOfSteps
        return count_lines

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        return count_lines if frame.f_code.co_filename == _TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        return tokenizer.apply_chat_template(messages, **options)
    except _OutOfSteps:
        pass
    finally:
        sys.settrace(previous)
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    raise ChatTemplateError(
        f"The chat template of {name} ran past {TEMPLATE_STEPS:,} steps rendering one prompt "
        "(a loop without end, or loops nested over a huge range), so it was stopped; fix or "
        "replace the template (tokenizer_config.json or chat_template.jinja)."
    )


def _control_pattern(tokenizer: Any) -> re.Pattern[str]:
    """A regex of the tokenizer's control-token strings, longest first: its special added
    tokens and the added tokens its chat template writes; whitespace tokens are ordinary text."""
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

    Runs the backend's normalizer, pre-tokenizer and model directly, which hold no state
    (``split_special_tokens=True`` flips a flag a concurrent thread can undo). Encoded after a
    newline that is then removed, so SentencePiece adds no word-start space.
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
    """Token ids of text from a user or a document, any control-token string in it
    (``<|im_start|>``, ``<s>``...) encoded as plain text; other text gives exactly
    ``tokenizer(text, add_special_tokens=False)``. Thread-safe."""
    return _encode_marked(tokenizer, _mark_user_text(tokenizer, text)) if text else []


def encode_chat(
    tokenizer: Any, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of ``messages`` rendered by the chat template, every turn's content encoded
    as user text (:func:`encode_user_text`); without control-token strings this equals
    ``tokenizer.apply_chat_template(messages, tokenize=True)``. TypeError / ValueError: bad
    messages (:func:`check_messages`) or a tokenizer without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template; encode the text with encode_user_text")
    marked = [
        {"role": m["role"], "content": _mark_user_text(tokenizer, m["content"])}
        for m in check_messages(messages)
    ]
    rendered = render_chat_template(
        tokenizer, marked, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return _encode_marked(tokenizer, rendered)


def check_messages(messages: Any) -> list[dict[str, str]]:
    """Chat turns checked: a list of dicts whose ``role`` is one of :data:`CHAT_ROLES` and whose
    ``content`` is a string; else TypeError / ValueError naming the bad turn."""
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
    """Whether ``tokenizer`` starts an encoded text with BOS (a plain prompt, encoded by segments,
    adds it itself). Read off an encoding: Gemma's post-processor adds it while
    ``add_bos_token`` says False."""
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
