"""One prompt builder for the pure and the RAG context (docs/algorithm.md, "Two contexts").

Both contexts come from the same template and end in the same assistant prefix; the RAG
context inserts ``[Retrieved Passage]``-delimited passages before the question. Input ids are
built segment by segment so the exact token positions of every passage are known (those are
the "retrieved tokens" rt_1..rt_m of Eq. 15–16; delimiters and template tokens are not).

User text never becomes a control token. Passages, the question and every chat turn's content
(system prompt included) are encoded by :func:`encode_user_text` (a whole conversation:
:func:`encode_chat`): a ``<|im_start|>`` written inside them is encoded as the plain characters
``<``, ``|``, ``im``..., so a document cannot forge a chat turn or end the prompt. Only the chat
template's own markers are control tokens. Text without control-token strings encodes exactly
as ``tokenizer(text)`` does.
"""

from __future__ import annotations

import numbers
import re
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .trace import PassageRecord

DELIMITER = "[Retrieved Passage]"
DEFAULT_SYSTEM_PROMPT = "Answer the question with a short, factual answer."
#: A passage cut to fit the window keeps at least this many tokens, otherwise it is dropped.
MIN_CUT_TOKENS = 16


_SENTINEL = "\u241eTOKRAG_USER_CONTENT\u241e"
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


@dataclass
class Passage:
    """A retrieved passage: its text (lone surrogates replaced by U+FFFD, with a warning), the
    retriever's score (a number or None, higher = better) and metadata."""

    text: str
    score: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"Passage text must be a string, got {type(self.text).__name__}")
        self.text = clean_text(self.text, "a passage", stacklevel=5)
        if self.score is not None and (
            isinstance(self.score, bool) or not isinstance(self.score, numbers.Real)
        ):
            raise TypeError(f"Passage score must be a number or None, got {type(self.score).__name__}")
        if self.metadata is None:
            self.metadata = {}
        elif not isinstance(self.metadata, dict):
            raise TypeError(f"Passage metadata must be a dict, got {type(self.metadata).__name__}")


def as_passages(items: Sequence[Any] | None) -> list[Passage]:
    """Normalise strings / Passage objects / (text, score) pairs into Passage objects."""
    out: list[Passage] = []
    for i, it in enumerate(items or []):
        if isinstance(it, Passage):
            out.append(it)
        elif isinstance(it, str):
            out.append(Passage(it))
        elif isinstance(it, tuple) and len(it) == 2 and isinstance(it[0], str):
            out.append(Passage(it[0], None if it[1] is None else float(it[1])))
        else:
            raise TypeError(
                f"passage {i} is a {type(it).__name__}; pass str, Passage or (text, score) tuples"
            )
    return out


@dataclass
class PromptPlan:
    """Token ids of both contexts plus where every retrieved token sits.

    ``rag_ids`` = head + Σ(delimiter + passage + separator) + question/tail;
    ``passage_spans[j]`` = [start, end) of kept passage j inside ``rag_ids``.
    """

    query: str
    pure_ids: list[int]
    rag_ids: list[int]
    passage_spans: list[tuple[int, int]]
    passages: list[PassageRecord]
    warnings: list[str]
    head_ids: list[int] = field(default_factory=list, repr=False)
    tail_ids: list[int] = field(default_factory=list, repr=False)
    passage_segments: list[list[int]] = field(default_factory=list, repr=False)
    kept_passages: list[Passage] = field(default_factory=list, repr=False)

    @property
    def retrieved_positions(self) -> list[int]:
        return [p for s, e in self.passage_spans for p in range(s, e)]

    @property
    def has_passages(self) -> bool:
        return bool(self.passage_spans)

    def single_passage_context(self, j: int) -> tuple[list[int], list[int]]:
        """(ids, retrieved positions) of a context holding only kept passage ``j`` (RAG-Token)."""
        seg = self.passage_segments[j]
        ids = list(self.head_ids)
        start = len(ids) + self._delim_len
        ids += seg
        end = start + (self.passage_spans[j][1] - self.passage_spans[j][0])
        ids += self.tail_ids
        return ids, list(range(start, end))

    _delim_len: int = field(default=0, repr=False)


@dataclass
class RenderedPrompt:
    """A RAG prompt formatted by the caller's (a framework's) template: exactly one of
    ``messages`` (chat turns, rendered with the chat template) or ``text`` (a finished prompt,
    encoded as given). ``context`` is what the template's context variable received; its first
    occurrence is the retrieved span (rt_1..rt_m of Eq. 15-16), the rest is not retrieved.
    ``passages`` (optional): ``context`` cut into consecutive passages (their texts, in order,
    make up ``context``), each its own span of the retrieved tokens, so citations and the
    per-passage policies name them; the retrieved tokens are the same either way.
    """

    context: str
    messages: list[dict[str, str]] | None = None
    text: str | None = None
    passages: list[Passage] | None = None

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.text is None):
            raise ValueError("RenderedPrompt needs exactly one of messages= or text=")
        if not isinstance(self.context, str):
            raise TypeError(f"RenderedPrompt context must be a string, got {type(self.context).__name__}")
        if self.passages is not None and sum(len(p.text) for p in self.passages) != len(self.context):
            raise ValueError("RenderedPrompt passages must make up its context, in order")


class PromptBuilder:
    """Builds both contexts for a tokenizer (chat template when it has one, plain otherwise)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        context_window: int,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        delimiter: str = DELIMITER,
    ):
        self.tokenizer = tokenizer
        self.context_window = int(context_window)
        # Lone surrogates replaced with a warning, as in the query, messages and passages.
        self.system_prompt = (
            clean_text(system_prompt, "system_prompt", stacklevel=5)
            if isinstance(system_prompt, str) else system_prompt
        )
        self.delimiter = delimiter
        self.use_chat = bool(getattr(tokenizer, "chat_template", None))

    def _budget(self, max_context_tokens: int | None, max_new_tokens: int) -> tuple[int, int]:
        """The window and the tokens left in it for the prompt."""
        window = self.context_window if max_context_tokens is None else min(self.context_window, max_context_tokens)
        return window, window - int(max_new_tokens)

    def _encode(self, text: str) -> list[int]:
        """Ids of ``text`` as plain tokenizer text (the synthesizer sizes nodes with it)."""
        return _encode_marked(self.tokenizer, text)

    def _mark(self, text: str) -> str:
        return _mark_user_text(self.tokenizer, text)

    def _frame(self, messages: list[dict[str, str]] | None, query: str = "") -> tuple[str, str]:
        """Template text before and after the final user turn's content, every turn's content
        (and the system prompt) marked as user text. ``messages`` are the earlier turns; a last
        turn that is ``query`` itself is not repeated."""
        history = check_messages(messages)
        if history and history[-1]["role"] == "user" and history[-1]["content"].strip() == query.strip():
            history = history[:-1]
        history = [{"role": m["role"], "content": self._mark(m["content"])} for m in history]
        system = self._mark(self.system_prompt) if self.system_prompt else self.system_prompt
        if self.use_chat:
            msgs: list[dict[str, str]] = []
            if system and not any(m["role"] == "system" for m in history):
                msgs.append({"role": "system", "content": system})
            msgs += history + [{"role": "user", "content": _SENTINEL}]
            rendered = render_chat_template(self.tokenizer, msgs, tokenize=False, add_generation_prompt=True)
            head, _, tail = rendered.rpartition(_SENTINEL)  # the last turn: after it, only template text
        else:
            parts = [system] if system else []
            for m in history:
                parts.append(f"{m['role'].capitalize()}: {m['content']}")
            head = "\n\n".join(parts) + ("\n\n" if parts else "")
            tail = "\nAnswer:"
            bos = getattr(self.tokenizer, "bos_token", None)
            if bos and _adds_bos(self.tokenizer) and not head.startswith(bos):
                head = bos + head
        return head, tail

    def build(
        self,
        query: str,
        passages: Sequence[Any] | None = None,
        *,
        max_new_tokens: int = 64,
        messages: list[dict[str, str]] | None = None,
        max_context_tokens: int | None = None,
        prompt_format: str = "qa",
    ) -> PromptPlan:
        """Both contexts for ``query`` and ranked ``passages`` (best first).

        ``prompt_format`` applies only without passages: ``"qa"`` frames the query as
        ``Question: ...``; ``"chat"`` makes it the final user turn as is; ``"text"`` sends exactly
        ``tokenizer(query)`` (``formatted=True`` in the adapters).

        Passages that would push the prompt past ``min(context_window, max_context_tokens) -
        max_new_tokens`` are dropped lowest-ranked first; the last that partly fits is cut (at
        least ``MIN_CUT_TOKENS`` kept), with a warning also kept in the plan. ValueError: an
        empty query, or a question that alone does not fit.
        """
        if query is None or not str(query).strip():
            raise ValueError("The query is empty: pass a non-empty question.")
        plist = as_passages(passages)
        window, budget = self._budget(max_context_tokens, max_new_tokens)
        notes: list[str] = []

        if prompt_format not in ("qa", "chat", "text"):
            raise ValueError(f"prompt_format must be 'qa', 'chat' or 'text', got {prompt_format!r}")
        raw = prompt_format != "qa" and not plist
        head, tail = self._frame(messages, query)
        if raw and prompt_format == "text":
            head, tail = "", ""
            tail_ids = list(self.tokenizer(query)["input_ids"])
        else:
            question = self._mark(query if raw else f"Question: {query.strip()}")
            tail_ids = _encode_marked(self.tokenizer, question + tail)
        head_ids = _encode_marked(self.tokenizer, head)
        delim_ids = _encode_marked(self.tokenizer, self.delimiter + "\n")
        sep_ids = _encode_marked(self.tokenizer, "\n\n")
        pure_ids = head_ids + tail_ids
        if len(pure_ids) > budget and int(max_new_tokens) >= window:
            raise ValueError(
                f"max_new_tokens={max_new_tokens} does not fit the context window of {window} "
                f"tokens, which must also hold the {len(pure_ids)}-token prompt; use "
                f"max_new_tokens <= {window - len(pure_ids)}."
            )
        if len(pure_ids) > budget:
            raise ValueError(
                f"The question alone takes {len(pure_ids)} tokens, more than the {budget} available "
                f"(context window {window} minus max_new_tokens {max_new_tokens}). Shorten the "
                "question or lower max_new_tokens."
            )

        # The passages, best first, that fit the budget; the last that partly fits is cut.
        records: list[PassageRecord] = []
        rag_ids = list(head_ids)
        spans: list[tuple[int, int]] = []
        segments: list[list[int]] = []
        kept: list[Passage] = []
        used = len(pure_ids)
        frame = len(delim_ids) + len(sep_ids)
        full = False
        for rank, p in enumerate(plist):
            rec = PassageRecord(rank=rank, text=p.text, score=p.score, metadata=dict(p.metadata))
            records.append(rec)
            if not p.text or not p.text.strip():
                rec.kept = False
                notes.append(f"passage {rank} is empty and was skipped")
                continue
            body = encode_user_text(self.tokenizer, p.text.strip())
            rec.n_tokens = len(body)
            if not full and used + frame + len(body) > budget:
                full = True
                room = budget - used - frame
                if room >= MIN_CUT_TOKENS:
                    body = body[:room]
                    rec.cut = True
                    rec.n_tokens = len(body)
                else:
                    rec.kept = False
            elif full:
                rec.kept = False
            if not rec.kept:
                continue
            start = len(rag_ids) + len(delim_ids)
            rag_ids += delim_ids + body + sep_ids
            spans.append((start, start + len(body)))
            segments.append(delim_ids + body + sep_ids)
            kept.append(p)
            used += frame + len(body)
        dropped = [r.rank for r in records if not r.kept and r.text.strip()]
        cut = [r.rank for r in records if r.cut]
        if dropped or cut:
            msg = (
                f"Passages do not fit the context window ({window} tokens, {max_new_tokens} reserved "
                f"for the answer): "
                + (f"cut passage {cut[0]} to {records[cut[0]].n_tokens} tokens" if cut else "")
                + ("; " if cut and dropped else "")
                + (f"dropped lowest-ranked passage(s) {dropped}" if dropped else "")
                + "."
            )
            notes.append(msg)
        if plist and not spans:
            notes.append("No passage could be used: answering from the pure context.")
        elif not plist:
            notes.append("No passages given: answering from the pure context.")
        rag_ids += tail_ids
        for n in notes:
            if "No passages given" not in n:
                warnings.warn(n, stacklevel=3)
        plan = PromptPlan(
            query=query,
            pure_ids=pure_ids,
            rag_ids=rag_ids if spans else list(pure_ids),
            passage_spans=spans,
            passages=records,
            warnings=notes,
            head_ids=head_ids,
            tail_ids=tail_ids,
            passage_segments=segments,
            kept_passages=kept,
        )
        plan._delim_len = len(delim_ids)
        return plan

    def build_rendered(
        self,
        query: str,
        rendered: RenderedPrompt,
        *,
        max_new_tokens: int = 64,
        messages: list[dict[str, str]] | None = None,
        max_context_tokens: int | None = None,
    ) -> PromptPlan:
        """Both contexts when the RAG prompt comes from the caller's template.

        The RAG context is ``rendered`` as formatted, its retrieved positions where
        ``rendered.context`` lands; the pure context is :meth:`build`'s without passages, so a
        template changes the RAG side only. A context that does not fit is cut from its end (at
        least ``MIN_CUT_TOKENS`` kept, else left out) and one not found in the prompt leaves
        the pure context alone, each with a warning.
        """
        plan = self.build(
            query, None, max_new_tokens=max_new_tokens, messages=messages,
            max_context_tokens=max_context_tokens,
        )
        plan.warnings.clear()
        context = rendered.context
        parts = rendered.passages or [Passage(context, metadata={"source": "template context"})]
        plan.passages = [
            PassageRecord(rank=i, text=p.text, score=p.score, metadata=dict(p.metadata))
            for i, p in enumerate(parts)
        ]
        window, budget = self._budget(max_context_tokens, max_new_tokens)
        head, tail, found = self._split_rendered(rendered)
        if not context.strip() or not found:
            for r in plan.passages:
                r.kept = False
            why = "is empty" if not context.strip() else "was not found in the formatted prompt"
            return self._pure_only(plan, f"The template's context {why}: answering from the pure context.")
        # The context is user text (its control-token strings stay plain text); so is every
        # turn's content, marked in _split_rendered; a finished text prompt's own wording is
        # the caller's and is encoded as given.
        body = encode_user_text(self.tokenizer, context)
        head_ids, tail_ids = _encode_marked(self.tokenizer, head), _encode_marked(self.tokenizer, tail)
        if rendered.text is not None and _adds_bos(self.tokenizer):
            head_ids = [int(self.tokenizer.bos_token_id), *head_ids]
        # Each part's tokens: up to the tokens of the context up to its end (the last: all).
        ends, at = [], 0
        for p in parts[:-1]:
            at += len(p.text)
            ends.append(len(encode_user_text(self.tokenizer, context[:at])))
        cuts = [0]
        for e in [*ends, len(body)]:
            cuts.append(min(max(e, cuts[-1]), len(body)))
        for r, a0, b0 in zip(plan.passages, cuts[:-1], cuts[1:], strict=True):
            r.n_tokens = b0 - a0
        room = budget - len(head_ids) - len(tail_ids)
        if len(body) > room:
            if room < MIN_CUT_TOKENS:
                for r in plan.passages:
                    r.kept = False
                return self._pure_only(
                    plan,
                    f"The formatted prompt does not fit the context window ({window} tokens, "
                    f"{max_new_tokens} reserved for the answer) even with its context cut to "
                    f"{MIN_CUT_TOKENS} tokens: answering from the pure context.",
                )
            msg = (
                f"The formatted prompt does not fit the context window ({window} tokens, "
                f"{max_new_tokens} reserved for the answer): cut its context to {room} tokens."
            )
            plan.warnings.append(msg)
            warnings.warn(msg, stacklevel=3)
        body = body[:room]
        n, start = len(body), len(head_ids)
        plan.rag_ids = head_ids + body + tail_ids
        plan.passage_spans, plan.passage_segments, plan.kept_passages = [], [], []
        for p, r, a0, b0 in zip(parts, plan.passages, cuts[:-1], cuts[1:], strict=True):
            a, b = min(a0, n), min(b0, n)
            r.kept, r.cut = b > a, a < n < b0
            if r.kept:
                r.n_tokens = b - a
                plan.passage_spans.append((start + a, start + b))
                plan.passage_segments.append(body[a:b])
                plan.kept_passages.append(p)
        plan.head_ids, plan.tail_ids = head_ids, tail_ids
        plan._delim_len = 0
        return plan

    def _split_rendered(self, rendered: RenderedPrompt) -> tuple[str, str, bool]:
        """(text before the context, text after it, whether it was found) of the full prompt."""
        context = rendered.context
        if rendered.text is not None:
            head, sep, tail = rendered.text.partition(context) if context else ("", "", "")
            return head, tail, bool(sep)
        msgs = check_messages(rendered.messages)
        where = next((i for i, m in enumerate(msgs) if context and context in m["content"]), None)
        if where is None:
            return "", "", False
        for i, m in enumerate(msgs):
            before, sep, after = m["content"].partition(context) if i == where else (m["content"], "", "")
            marked = self._mark(before) + (_SENTINEL + self._mark(after) if sep else "")
            msgs[i] = {"role": m["role"], "content": marked}
        if self.use_chat:
            full = render_chat_template(self.tokenizer, msgs, tokenize=False, add_generation_prompt=True)
        else:
            full = "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in msgs) + "\nAssistant:"
        head, _, tail = full.partition(_SENTINEL)
        return head, tail, True

    @staticmethod
    def _pure_only(plan: PromptPlan, note: str) -> PromptPlan:
        plan.warnings.append(note)
        warnings.warn(note, stacklevel=4)
        plan.rag_ids, plan.passage_spans = list(plan.pure_ids), []
        return plan
