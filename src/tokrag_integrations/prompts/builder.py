"""One prompt builder for the pure and the RAG context (docs/algorithm.md, "Two contexts").

Both contexts come from the same template and end in the same assistant prefix; the RAG
context inserts ``[Retrieved Passage]``-delimited passages before the question. Input ids are
built segment by segment so the exact token positions of every passage are known (those are
the "retrieved tokens" rt_1..rt_m of Eq. 15–16; delimiters and template tokens are not). User
text is encoded as text (:mod:`.chat_template`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from ..trace import PassageRecord
from .chat_template import (
    _adds_bos,
    _encode_marked,
    _mark_user_text,
    check_messages,
    clean_text,
    encode_user_text,
    render_chat_template,
)
from .prompt_types import Passage, PromptPlan, RenderedPrompt, as_passages

DELIMITER = "[Retrieved Passage]"
DEFAULT_SYSTEM_PROMPT = "Answer the question with a short, factual answer."
#: A passage cut to fit the window keeps at least this many tokens, otherwise it is dropped.
MIN_CUT_TOKENS = 16


#: Stands in for the last user turn while the chat frame is rendered, then split on.
_SENTINEL = "\u241eTOKRAG_USER_CONTENT\u241e"


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
