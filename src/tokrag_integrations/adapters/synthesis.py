"""The multi-call synthesis behind the LlamaIndex synthesizer's compact / refine /
tree_summarize modes, framework-free: the token budget, the calls in order, and the metadata
they give. Unlike LlamaIndex's loops of these names, the question stays the pure context of
every call. Nodes come in as ``(node_id, score, passage)``, best first.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

from ..models import LoadedModel
from ..prompts import MIN_CUT_TOKENS, Passage, PromptBuilder, PromptPlan
from ..results import GenerationResult
from .translate import usage

_GATE_SKIP = "the gate decided not to use retrieval"
#: A refine step gives the answer so far as the first passage, with this prefix, then the
#: next node(s) (a passage, so the question alone stays the pure context).
EXISTING_ANSWER_PREFIX = "Existing answer: "


@dataclass(frozen=True)
class Setup:
    """What a session needs from its synthesizer."""

    lm: LoadedModel
    gen_kwargs: dict[str, Any]
    mode: str
    policy: str
    roles: tuple[str, ...]


@dataclass
class Piece:
    """A passage waiting to be given to the core, and where it came from: ``{"node_id",
    "rank", "part"}`` for (a part of) a node, ``{"answer_of": call index}`` for an answer."""

    passage: Passage
    source: dict[str, Any]


@dataclass
class Call:
    kind: str  # "answer", "refine", "summarize" or "combine"
    pieces: list[Piece]
    final: bool
    level: int | None = None

    @property
    def passages(self) -> list[Passage] | None:
        return [p.passage for p in self.pieces] or None


class Packer:
    """The token budget of one synthesis, counted with the core's prompt builder: ``room``
    for passages (window or ``max_context_tokens``, minus ``max_new_tokens``, minus the
    question and template) and the cost of one passage (delimiter + text + separator)."""

    def __init__(self, lm: LoadedModel, query: str, gen_kwargs: dict[str, Any]) -> None:
        kw: dict[str, Any] = {"context_window": lm.context_window}
        if "system_prompt" in gen_kwargs:
            kw["system_prompt"] = gen_kwargs["system_prompt"]
        self.tokenizer = lm.tokenizer
        self.builder = PromptBuilder(lm.tokenizer, **kw)
        self.query = query
        self.max_new_tokens = int(gen_kwargs["max_new_tokens"])
        self.max_context_tokens = gen_kwargs.get("max_context_tokens")
        window = lm.context_window
        if self.max_context_tokens is not None:
            window = min(window, int(self.max_context_tokens))
        pure = self.plan(None)  # raises when the question alone does not fit
        self.room = window - self.max_new_tokens - len(pure.pure_ids)
        b = self.builder
        self.overhead = len(b._encode(b.delimiter + "\n")) + len(b._encode("\n\n"))
        self._sizes: dict[str, int] = {}

    def plan(self, passages: Sequence[Passage] | None) -> PromptPlan:
        """The plan the core builds for these passages (its warnings come from the decode)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self.builder.build(
                self.query,
                passages,
                max_new_tokens=self.max_new_tokens,
                max_context_tokens=self.max_context_tokens,
            )

    def n_tokens(self, text: str) -> int:
        if text not in self._sizes:
            self._sizes[text] = len(self.builder._encode(text.strip()))
        return self._sizes[text]

    def cost(self, text: str) -> int:
        return self.overhead + self.n_tokens(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, clean_up_tokenization_spaces=False)

    def split(self, text: str, room: int) -> tuple[str, str]:
        """(the longest head of ``text`` whose passage fits ``room`` tokens, the rest)."""
        ids = self.builder._encode(text.strip())
        n = room - self.overhead
        while n >= MIN_CUT_TOKENS:
            head = self.decode(ids[:n])
            over = self.cost(head) - room
            if over <= 0:
                return head, self.decode(ids[n:])
            n -= over
        raise ValueError(
            f"Only {room} tokens are left for passages next to the question"
            + (" and the answer so far" if room < self.room else "")
            + f" (window {self.max_context_tokens or 'of the model'} minus max_new_tokens "
            f"{self.max_new_tokens}): raise max_context_tokens or lower max_new_tokens."
        )

    def take(self, pieces: deque[Piece], room: int, *, one: bool = False) -> list[Piece]:
        """Pop the next pieces that fit ``room`` (only one with ``one``); a piece too long
        for an empty chunk is split, its rest staying first in the queue."""
        chunk: list[Piece] = []
        left = room
        while pieces:
            cost = self.cost(pieces[0].passage.text)
            if cost <= left:
                chunk.append(pieces.popleft())
                left -= cost
                if one:
                    break
                continue
            if chunk:
                break
            p = pieces[0]
            head, rest = self.split(p.passage.text, left)
            part = p.source.get("part") or 0
            chunk.append(Piece(_with_text(p.passage, head, part), {**p.source, "part": part}))
            if rest.strip():
                pieces[0] = Piece(
                    _with_text(p.passage, rest, part + 1), {**p.source, "part": part + 1}
                )
            else:
                pieces.popleft()
            break
        return chunk

    def pack(self, pieces: Sequence[Piece], *, at_least: int = 1) -> list[list[Piece]]:
        """All ``pieces`` in order, in chunks that each fit the budget (``at_least`` pieces a
        chunk even when they do not fit, so a tree level always shrinks; the core then cuts)."""
        queue = deque(pieces)
        chunks = []
        while queue:
            chunk = self.take(queue, self.room)
            while len(chunk) < at_least and queue:
                chunk.append(queue.popleft())
            chunks.append(chunk)
        return chunks


def _with_text(p: Passage, text: str, part: int) -> Passage:
    return Passage(text=text, score=p.score, metadata={**p.metadata, "part": part})


class Session:
    """One synthesis: the nodes, the calls made so far, and the metadata they give."""

    def __init__(
        self,
        setup: Setup,
        query: str,
        nodes: Sequence[tuple[str, float | None, Passage]],
        decision: Any,
        gate: dict[str, Any] | None,
    ) -> None:
        self.setup = setup
        self.query = query
        self.mode = setup.mode
        self.gate = gate
        self.packer = Packer(setup.lm, query, setup.gen_kwargs)
        self.reason: str | None = None
        self.nodes = list(nodes)
        if decision is not None and not decision.retrieve:
            self.nodes, self.reason = [], _GATE_SKIP
        elif not nodes:
            self.reason = "no nodes were retrieved"
        self.notes: list[str] = []
        self.calls: list[tuple[Call, GenerationResult]] = []

    def _node_pieces(self) -> list[Piece]:
        out = []
        for rank, (node_id, _, p) in enumerate(self.nodes):
            src = {"node_id": node_id, "rank": rank}
            if self.mode != "one_pass" and not p.text.strip():
                note = f"node {node_id!r} (rank {rank}) is empty and was skipped"
                self.notes.append(note)
                warnings.warn(note, stacklevel=6)
                continue
            out.append(Piece(p, src))
        return out

    def program(self) -> Generator[Call, GenerationResult, None]:
        """The calls of this synthesis, in order; each gets the previous call's result."""
        if self.reason is not None:
            yield Call("answer", [], final=True)
            return
        pieces = self._node_pieces()
        if self.mode == "one_pass":
            yield Call("answer", pieces, final=True)
        elif not pieces:
            yield Call("answer", [], final=True)
        elif self.mode == "tree_summarize":
            yield from self._tree(pieces)
        else:
            yield from self._refine(deque(pieces), one=self.mode == "refine")

    def _refine(self, queue: deque[Piece], *, one: bool) -> Generator[Call, GenerationResult, None]:
        answer: Piece | None = None
        while queue:
            first = [answer] if answer is not None else []
            room = self.packer.room - sum(self.packer.cost(p.passage.text) for p in first)
            chunk = self.packer.take(queue, room, one=one)
            result = yield Call("refine" if first else "answer", first + chunk, final=not queue)
            if result.text.strip():  # an empty answer leaves the previous one standing
                answer = self._answer(EXISTING_ANSWER_PREFIX + result.text.strip())

    def _answer(self, text: str) -> Piece:
        """The last call's answer as a piece of the next call."""
        index = len(self.calls) - 1
        return Piece(Passage(text, metadata={"answer_of": index}), {"answer_of": index})

    def _tree(self, pieces: list[Piece]) -> Generator[Call, GenerationResult, None]:
        level = 0
        while True:
            kind = "summarize" if level == 0 else "combine"
            chunks = self.packer.pack(pieces, at_least=1 if level == 0 else 2)
            if len(chunks) == 1:
                yield Call(kind, chunks[0], final=True, level=level)
                return
            answers = []
            for chunk in chunks:
                result = yield Call(kind, chunk, final=False, level=level)
                if result.text.strip():
                    answers.append(self._answer(result.text.strip()))
            if not answers:
                self.notes.append("every partial answer was empty: the last call has no passages")
                yield Call("combine", [], final=True, level=level + 1)
                return
            pieces, level = answers, level + 1

    # -------------------------------------------------------------- per call
    def prompt_text(self, call: Call) -> str:
        """The prompt of this call as text (the RAG prompt when the policy reads it)."""
        plan = self.packer.plan(call.passages)
        roles = set(self.setup.roles)
        rag = plan.has_passages and ("rag" in roles or not roles & {"pure", "rag"})
        return self.packer.decode(plan.rag_ids if rag else plan.pure_ids)

    # -------------------------------------------------------------- metadata
    def partial_metadata(self) -> dict[str, Any]:
        """What a streaming response's metadata holds before the stream is read."""
        return {
            "policy": self.setup.policy,
            "gate": self.gate,
            "response_mode": self.mode,
        }

    def _summaries(self) -> list[dict[str, Any]]:
        return [
            call_summary(
                i,
                c.kind,
                r,
                [p.source for p in c.pieces],
                level=c.level,
                roles=self.setup.roles,
            )
            for i, (c, r) in enumerate(self.calls)
        ]

    def metadata(self) -> dict[str, Any]:
        calls = self._summaries()
        if self.mode != "one_pass" and self.reason is None:
            return self._multi_metadata(calls)
        result = self.calls[-1][1]
        tr = result.trace
        ids = [node_id for node_id, _, _ in self.nodes]
        records = [
            {
                "node_id": rec.metadata.get(
                    "node_id", ids[rec.rank] if rec.rank < len(ids) else None
                ),
                "rank": rec.rank,
                "score": rec.score,
                "kept": rec.kept,
                "cut": rec.cut,
                "empty": not rec.text.strip(),
                "n_tokens": rec.n_tokens,
            }
            for rec in tr.passages
        ]
        no_text = "no node had usable text" if ids else "no nodes were retrieved"
        calls[-1]["trace"] = tr.to_dict()
        return {
            "response_mode": self.mode,
            **_answer_fields(records, self.setup.policy, self.reason, no_text, result, self.gate),
            "warnings": list(tr.warnings),
            "trace": calls[-1]["trace"],
            "calls": calls,
            "usage": dict(calls[-1]["usage"]),
        }

    def _multi_metadata(self, calls: list[dict[str, Any]]) -> dict[str, Any]:
        final = self.calls[-1][1]
        policy = self.setup.policy
        nodes: list[dict[str, Any]] = []
        for rank, (node_id, score, p) in enumerate(self.nodes):
            nodes.append(
                {
                    "node_id": node_id,
                    "rank": rank,
                    "score": score,
                    "n_tokens": self.packer.n_tokens(p.text) if p.text.strip() else 0,
                    "parts": 0,
                    "calls": [],
                    "kept": False,
                    "cut": False,
                    "empty": not p.text.strip(),
                }
            )
        for i, (call, result) in enumerate(self.calls):
            for rec in result.trace.passages:
                src = call.pieces[rec.rank].source if rec.rank < len(call.pieces) else {}
                if "rank" not in src:
                    continue
                node = nodes[src["rank"]]
                if rec.kept:
                    node["kept"] = True
                    node["cut"] = node["cut"] or rec.cut
                    if i not in node["calls"]:
                        node["calls"].append(i)
                    node["parts"] += 1
        counts, notes, total = totals(calls, self.notes)
        return {
            "response_mode": self.mode,
            **_answer_fields(nodes, policy, None, "no node had usable text", final, self.gate),
            "counts_all_calls": counts,
            "warnings": notes,
            "trace": calls[-1]["trace"],
            "calls": calls,
            "usage": total,
        }


def _answer_fields(
    records: list[dict[str, Any]],
    policy: str,
    reason: str | None,
    no_text: str,
    result: GenerationResult,
    gate: dict[str, Any] | None,
) -> dict[str, Any]:
    """What the metadata says of the answer and the nodes (``records``: one per node, with
    ``node_id``, ``kept``, ``cut``, ``empty``); ``reason`` why no passage was given, else
    ``no_text`` when none was kept."""
    used = [r["node_id"] for r in records if r["kept"]]
    dropped = [r["node_id"] for r in records if not r["kept"] and not r["empty"]]
    if reason is None and not used:
        reason = no_text
    if reason is None and policy == "no_rag":
        reason = "policy 'no_rag' ignores retrieval"
    return {
        "policy": policy,
        "policy_used": "no_rag" if reason else policy,
        "answered_from": "pure_context" if reason else "retrieval",
        "pure_context_reason": reason,
        "counts": result.counts,
        "model": result.trace.model,
        "stop_reason": result.trace.stop_reason,
        "gate": gate,
        "passages": records,
        "nodes_used": used,
        "nodes_cut": [r["node_id"] for r in records if r["kept"] and r["cut"]],
        "nodes_dropped": dropped,
        "n_nodes_dropped": len(dropped),
        "nodes_skipped_empty": [r["node_id"] for r in records if not r["kept"] and r["empty"]],
    }


def totals(
    calls: Sequence[dict[str, Any]], notes: Sequence[str]
) -> tuple[dict[str, int], list[str], dict[str, int]]:
    """Over every call's summary: tokens per source, ``notes`` then each call's warnings
    (each once), and the token usage with the number of calls."""
    counts: dict[str, int] = {}
    for c in calls:
        for k, v in c["counts"].items():
            counts[k] = counts.get(k, 0) + v
    warned = list(notes)
    for c in calls:
        warned += [w for w in c["warnings"] if w not in warned]
    usage = {
        key: sum(c["usage"][key] for c in calls)
        for key in ("prompt_tokens", "completion_tokens", "total_tokens")
    }
    return counts, warned, {**usage, "calls": len(calls)}


def call_summary(
    index: int,
    kind: str,
    result: GenerationResult,
    sources: Sequence[dict[str, Any]],
    *,
    level: int | None = None,
    roles: Sequence[str] | None = None,
) -> dict[str, Any]:
    """One entry of ``Response.metadata["calls"]``: what one model call (``kind``: answer,
    refine, summarize, combine or template) was given (``sources``: per passage,
    ``{"node_id", "part"}`` or ``{"answer_of": call index}``) and did."""
    tr = result.trace
    used, cut, dropped = [], [], []
    for rec in tr.passages:
        src = sources[rec.rank] if rec.rank < len(sources) else {}
        nid = src.get("node_id")
        if nid is None or not rec.text.strip():
            continue
        if rec.kept:
            used.append(nid)
            if rec.cut:
                cut.append(nid)
        else:
            dropped.append(nid)
    entry: dict[str, Any] = {
        "index": index,
        "kind": kind,
        "node_ids": [s["node_id"] for s in sources if "node_id" in s],
        "answers_from": [s["answer_of"] for s in sources if "answer_of" in s],
        "text": result.text,
        "counts": result.counts,
        "stop_reason": tr.stop_reason,
        "usage": usage(result, roles),
        "nodes_used": used,
        "nodes_cut": cut,
        "nodes_dropped": dropped,
        "warnings": list(tr.warnings),
        "trace": tr.to_dict(),
    }
    if level is not None:
        entry["level"] = level
    return entry
