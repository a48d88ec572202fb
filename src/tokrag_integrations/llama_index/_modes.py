"""The package's own compact / refine / tree_summarize loops behind :class:`TokRAGSynthesizer`.

LlamaIndex has loops of these names, but they format a refine prompt that puts the answer so
far into every call's only context and give back text alone; Tok-RAG needs the question to
stay the pure context of every call and a per-token trace of each call, so the calls are
planned here (token budgets from the model's tokenizer) and decoded by the core.
:class:`_Session` is one synthesis: the calls it makes, in order, and the metadata they give.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

from llama_index.core.schema import MetadataMode, NodeWithScore

from ..models import LoadedModel
from ..prompts import MIN_CUT_TOKENS, Passage, PromptBuilder, PromptPlan
from ..results import GenerationResult
from ._convert import call_summary, node_to_passage, order_nodes, response_metadata

_GATE_SKIP = "the gate decided not to use retrieval"
#: A refine step gives the answer so far as the *first* passage, with this prefix, and the
#: next node(s) after it. Why a passage and not a refine prompt: the question stays the same
#: in every call, so the pure context Tok-RAG compares the RAG context with is the same
#: question-only prompt as in one pass (a refine prompt would put the earlier answer, i.e.
#: retrieved text, into the "pure" side). Why first: measured on the packaged SmolLM2-135M
#: (3 fictional facts x 2 cases, 14 new tokens): with the answer so far first, a right
#: answer survived an unrelated new passage 3/3 times (rag and tokrag) and a wrong one was
#: replaced by the fact in the new passage 2/3 (rag) and 1/3, a 2nd cut short (tokrag); with
#: the answer placed last, after the new passage, the right one survived 2/3 and the wrong
#: one was replaced 0/3 (the model copied it). Wordings such as "Draft answer, check it
#: against the passages below:" did no better. The order is also that of LlamaIndex's
#: refine prompt (existing answer, then the new context).
EXISTING_ANSWER_PREFIX = "Existing answer: "


@dataclass(frozen=True)
class _Setup:
    """What a session needs from its synthesizer."""

    lm: LoadedModel
    gen_kwargs: dict[str, Any]
    mode: str
    metadata_mode: MetadataMode
    policy: str
    roles: tuple[str, ...]


@dataclass
class _Piece:
    """A passage waiting to be given to the core, and where it came from: ``{"node_id",
    "rank", "part"}`` for (a part of) a node, ``{"answer_of": call index}`` for an answer."""

    passage: Passage
    source: dict[str, Any]


@dataclass
class _Call:
    kind: str  # "answer", "refine", "summarize" or "combine"
    pieces: list[_Piece]
    final: bool
    level: int | None = None

    @property
    def passages(self) -> list[Passage] | None:
        return [p.passage for p in self.pieces] or None


class _Packer:
    """The token budget of one synthesis, with the prompt builder the core uses: how many
    passage tokens fit next to the question (window, or ``max_context_tokens``, minus
    ``max_new_tokens`` minus the question and template), and what one passage costs
    (delimiter + text + separator, encoded as the builder encodes them)."""

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

    def take(self, pieces: deque[_Piece], room: int, *, one: bool = False) -> list[_Piece]:
        """Pop the next pieces that fit ``room`` (only one with ``one``); a piece too long
        for an empty chunk is split, its rest staying first in the queue."""
        chunk: list[_Piece] = []
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
            chunk.append(_Piece(_with_text(p.passage, head, part), {**p.source, "part": part}))
            if rest.strip():
                pieces[0] = _Piece(
                    _with_text(p.passage, rest, part + 1), {**p.source, "part": part + 1}
                )
            else:
                pieces.popleft()
            break
        return chunk

    def pack(self, pieces: Sequence[_Piece], *, at_least: int = 1) -> list[list[_Piece]]:
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


class _Session:
    """One synthesis: the nodes, the calls made so far, and the metadata they give."""

    def __init__(
        self,
        setup: _Setup,
        query: str,
        nodes: Sequence[NodeWithScore],
        decision: Any,
        gate: dict[str, Any] | None,
    ) -> None:
        self.setup = setup
        self.query = query
        self.mode = setup.mode
        self.gate = gate
        self.packer = _Packer(setup.lm, query, setup.gen_kwargs)
        self.reason: str | None = None
        if decision is not None and not decision.retrieve:
            self.ordered: list[NodeWithScore] = []
            self.reason = _GATE_SKIP
        elif not nodes:
            self.ordered = []
            self.reason = "no nodes were retrieved"
        else:
            self.ordered = order_nodes(nodes)
        self.passages = [node_to_passage(n, setup.metadata_mode) for n in self.ordered]
        self.notes: list[str] = []
        self.calls: list[tuple[_Call, GenerationResult]] = []

    @property
    def single(self) -> bool:
        """One call whose metadata is the one-pass kind."""
        return self.mode == "one_pass" or self.reason is not None

    def _node_pieces(self) -> list[_Piece]:
        out = []
        for rank, (n, p) in enumerate(zip(self.ordered, self.passages, strict=True)):
            src = {"node_id": n.node.node_id, "rank": rank}
            if self.mode != "one_pass" and not p.text.strip():
                note = f"node {n.node.node_id!r} (rank {rank}) is empty and was skipped"
                self.notes.append(note)
                warnings.warn(note, stacklevel=6)
                continue
            out.append(_Piece(p, src))
        return out

    def program(self) -> Generator[_Call, GenerationResult, None]:
        """The calls of this synthesis, in order; each gets the previous call's result."""
        if self.reason is not None:
            yield _Call("answer", [], final=True)
            return
        pieces = self._node_pieces()
        if self.mode == "one_pass":
            yield _Call("answer", pieces, final=True)
        elif not pieces:
            yield _Call("answer", [], final=True)
        elif self.mode == "tree_summarize":
            yield from self._tree(pieces)
        else:
            yield from self._refine(deque(pieces), one=self.mode == "refine")

    def _refine(
        self, queue: deque[_Piece], *, one: bool
    ) -> Generator[_Call, GenerationResult, None]:
        answer: _Piece | None = None
        while queue:
            first = [answer] if answer is not None else []
            room = self.packer.room - sum(self.packer.cost(p.passage.text) for p in first)
            chunk = self.packer.take(queue, room, one=one)
            result = yield _Call("refine" if first else "answer", first + chunk, final=not queue)
            text = result.text.strip()
            if text:  # an empty answer leaves the previous one standing
                index = len(self.calls) - 1
                answer = _Piece(
                    Passage(EXISTING_ANSWER_PREFIX + text, metadata={"answer_of": index}),
                    {"answer_of": index},
                )

    def _tree(self, pieces: list[_Piece]) -> Generator[_Call, GenerationResult, None]:
        level = 0
        while True:
            kind = "summarize" if level == 0 else "combine"
            chunks = self.packer.pack(pieces, at_least=1 if level == 0 else 2)
            if len(chunks) == 1:
                yield _Call(kind, chunks[0], final=True, level=level)
                return
            answers = []
            for chunk in chunks:
                result = yield _Call(kind, chunk, final=False, level=level)
                if result.text.strip():
                    index = len(self.calls) - 1
                    answers.append(
                        _Piece(
                            Passage(result.text.strip(), metadata={"answer_of": index}),
                            {"answer_of": index},
                        )
                    )
            if not answers:
                self.notes.append("every partial answer was empty: the last call has no passages")
                yield _Call("combine", [], final=True, level=level + 1)
                return
            pieces, level = answers, level + 1

    # -------------------------------------------------------------- per call
    def prompt_text(self, call: _Call) -> str:
        """The prompt of this call as text (the RAG prompt when the policy reads it)."""
        plan = self.packer.plan(call.passages)
        roles = set(self.setup.roles)
        rag = plan.has_passages and ("rag" in roles or not roles & {"pure", "rag"})
        return self.packer.decode(plan.rag_ids if rag else plan.pure_ids)

    def record(self, call: _Call, result: GenerationResult) -> None:
        self.calls.append((call, result))

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
        if self.single:
            call, result = self.calls[-1]
            md = response_metadata(
                result,
                self.ordered,
                policy=self.setup.policy,
                gate=self.gate,
                pure_reason=self.reason,
            )
            calls = self._summaries()
            calls[-1]["trace"] = md["trace"]  # the same dict, not a second copy
            md.update(response_mode=self.mode, calls=calls, usage=dict(calls[-1]["usage"]))
            return md
        return self._multi_metadata()

    def _multi_metadata(self) -> dict[str, Any]:
        calls = self._summaries()
        final = self.calls[-1][1]
        policy = self.setup.policy
        nodes: list[dict[str, Any]] = []
        for rank, (n, p) in enumerate(zip(self.ordered, self.passages, strict=True)):
            nodes.append(
                {
                    "node_id": n.node.node_id,
                    "rank": rank,
                    "score": None if n.score is None else float(n.score),
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
        used = [n["node_id"] for n in nodes if n["kept"]]
        cut = [n["node_id"] for n in nodes if n["cut"]]
        empty = [n["node_id"] for n in nodes if n["empty"]]
        dropped = [n["node_id"] for n in nodes if not n["kept"] and not n["empty"]]
        reason = None
        if not used:
            reason = "no node had usable text"
        elif policy == "llm":
            reason = "policy 'llm' ignores retrieval"
        counts, notes, total = _totals(calls, self.notes)
        return {
            "response_mode": self.mode,
            "policy": policy,
            "policy_used": "llm" if reason else policy,
            "answered_from": "pure_context" if reason else "retrieval",
            "pure_context_reason": reason,
            "counts": final.counts,
            "counts_all_calls": counts,
            "model": final.trace.model,
            "stop_reason": final.trace.stop_reason,
            "gate": self.gate,
            "passages": nodes,
            "nodes_used": used,
            "nodes_cut": cut,
            "nodes_dropped": dropped,
            "n_nodes_dropped": len(dropped),
            "nodes_skipped_empty": empty,
            "warnings": notes,
            "trace": calls[-1]["trace"],
            "calls": calls,
            "usage": total,
        }


def _totals(
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

