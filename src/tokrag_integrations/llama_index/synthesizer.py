"""TokRAGSynthesizer: a LlamaIndex response synthesizer that decodes with a Tok-RAG policy."""

from __future__ import annotations

import asyncio
import warnings
from collections import deque
from collections.abc import AsyncGenerator, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import llama_index.core.instrumentation as instrument
from llama_index.core.base.llms.types import CompletionResponse
from llama_index.core.base.response.schema import (
    RESPONSE_TYPE,
    AsyncStreamingResponse,
    Response,
    StreamingResponse,
)
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.instrumentation.events.llm import (
    LLMCompletionEndEvent,
    LLMCompletionStartEvent,
)
from llama_index.core.instrumentation.events.synthesis import (
    SynthesizeEndEvent,
    SynthesizeStartEvent,
)
from llama_index.core.prompts.base import BasePromptTemplate
from llama_index.core.prompts.default_prompt_selectors import (
    DEFAULT_REFINE_PROMPT_SEL,
    DEFAULT_TEXT_QA_PROMPT_SEL,
    DEFAULT_TREE_SUMMARIZE_PROMPT_SEL,
)
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.response_synthesizers.base import BaseSynthesizer, QueryTextType
from llama_index.core.response_synthesizers.factory import get_response_synthesizer
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode
from llama_index.core.types import RESPONSE_TEXT_TYPE

from .. import batching
from ..api import GenerationResult, astream_with_result, stream
from ..booleans import require_bool
from ..defaults import ANSWER_STOP, MAX_NEW_TOKENS
from ..models import LOAD_OPTIONS, LoadedModel, check_greedy
from ..policies import get_policy
from ..policies.base import Policy
from ..prompts import MIN_CUT_TOKENS, Passage, PromptBuilder, PromptPlan
from ._convert import (
    call_summary,
    jsonable,
    node_to_passage,
    order_nodes,
    response_metadata,
    result_kwargs,
    usage,
)
from .llm import TokRAGLLM

dispatcher = instrument.get_dispatcher(__name__)

_GATE_SKIP = "the gate decided not to use retrieval"
#: Constructor arguments of TokRAGSynthesizer other than the policy's options.
_OWN_ARGUMENTS = (
    "lm", "model", "temperature", "policy", "max_new_tokens", "stop", "max_context_tokens",
    "system_prompt", "gate", "streaming", "callback_manager", "response_mode", "metadata_mode",
    "batching", "text_qa_template", "refine_template", "summary_template",
)
#: ``response_mode`` values with the package's own prompt: one decode over every node that
#: fits (the default), or LlamaIndex's multi-call modes of the same names.
NATIVE_MODES = ("one_pass", "compact", "refine", "tree_summarize")
#: Every ``response_mode``: the native ones, and LlamaIndex's other built-in modes, which
#: run LlamaIndex's own synthesizer with its templates through :class:`TokRAGLLM`.
RESPONSE_MODES = (*NATIVE_MODES, "simple_summarize", "accumulate", "compact_accumulate", "no_text")
#: The prompt templates of LlamaIndex's synthesizers that this one takes.
TEMPLATE_KEYS = ("text_qa_template", "refine_template", "summary_template")
_DEFAULT_TEMPLATES = {
    "text_qa_template": DEFAULT_TEXT_QA_PROMPT_SEL,
    "refine_template": DEFAULT_REFINE_PROMPT_SEL,
    "summary_template": DEFAULT_TREE_SUMMARIZE_PROMPT_SEL,
}
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


def _mode_name(response_mode: Any) -> str:
    mode = getattr(response_mode, "value", response_mode)
    if mode not in RESPONSE_MODES:
        raise ValueError(
            f"Unknown response_mode {response_mode!r}; TokRAGSynthesizer accepts "
            + ", ".join(repr(m) for m in RESPONSE_MODES)
            + " ('one_pass' is the default)."
        )
    return str(mode)


async def _no_tokens() -> AsyncGenerator[str, None]:
    return
    yield  # an async generator that yields nothing


def _template(key: str, value: Any) -> BasePromptTemplate | None:
    if value is None or isinstance(value, BasePromptTemplate):
        return value
    raise TypeError(
        f"{key} must be a LlamaIndex prompt template (PromptTemplate, ChatPromptTemplate...), "
        f"got {type(value).__name__}"
    )


def _metadata_mode(metadata_mode: Any) -> MetadataMode:
    try:
        return MetadataMode(getattr(metadata_mode, "value", metadata_mode))
    except ValueError:
        raise ValueError(
            f"Unknown metadata_mode {metadata_mode!r}; use one of "
            + ", ".join(f"MetadataMode.{m.name}" for m in MetadataMode)
        ) from None


# ---------------------------------------------------------------------- planning the calls
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
        synth: TokRAGSynthesizer,
        query: str,
        nodes: Sequence[NodeWithScore],
        decision: Any,
        gate: dict[str, Any] | None,
    ) -> None:
        self.synth = synth
        self.query = query
        self.mode = synth._mode
        self.gate = gate
        self.packer = _Packer(synth._lm, query, synth._gen_kwargs)
        self.reason: str | None = None
        if decision is not None and not decision.retrieve:
            self.ordered: list[NodeWithScore] = []
            self.reason = _GATE_SKIP
        elif not nodes:
            self.ordered = []
            self.reason = "no nodes were retrieved"
        else:
            self.ordered = order_nodes(nodes)
        self.passages = [node_to_passage(n, synth._metadata_mode) for n in self.ordered]
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
        roles = set(self.synth._roles)
        rag = plan.has_passages and ("rag" in roles or not roles & {"pure", "rag"})
        return self.packer.decode(plan.rag_ids if rag else plan.pure_ids)

    def record(self, call: _Call, result: GenerationResult) -> None:
        self.calls.append((call, result))

    # -------------------------------------------------------------- metadata
    def partial_metadata(self) -> dict[str, Any]:
        """What a streaming response's metadata holds before the stream is read."""
        return {
            "policy": self.synth._policy_name,
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
                roles=self.synth._roles,
            )
            for i, (c, r) in enumerate(self.calls)
        ]

    def metadata(self) -> dict[str, Any]:
        if self.single:
            call, result = self.calls[-1]
            md = response_metadata(
                result,
                self.ordered,
                policy=self.synth._policy_name,
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
        policy = self.synth._policy_name
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


class TokRAGSynthesizer(BaseSynthesizer):
    """Answers from the retrieved nodes with a decoding policy (default ``tokrag``).

    The query and the node texts go to the core separately (no prompt template is
    formatted here): nodes become :class:`~tokrag_integrations.Passage` objects (text from
    ``node.get_content(metadata_mode=...)``), best score first, so when they do not fit the
    window the lowest-scored are dropped first.

    ``response_mode`` (a string or LlamaIndex's ``ResponseMode``):

    * ``"one_pass"`` (default): one decode over every node that fits the window; the rest
      are listed in ``nodes_dropped`` / ``n_nodes_dropped``.
    * ``"compact"``: nodes are packed, best first, into chunks that fill the window (token
      counts from the model's tokenizer, the same budget the one-pass prompt has; a node
      longer than a whole chunk is split); the first chunk is answered, and each next chunk
      refines that answer (the answer so far goes in as the first passage, "Existing
      answer: ...", see :data:`EXISTING_ANSWER_PREFIX`).
    * ``"refine"``: the same with one node (or one part of a long node) per call.
    * ``"tree_summarize"``: every packed chunk is answered, then the answers are packed and
      answered again, level by level, until one call remains.
    * ``"simple_summarize"``, ``"accumulate"``, ``"compact_accumulate"``, ``"no_text"``:
      LlamaIndex's own synthesizer of that name (``no_text`` makes no call).

    Prompt templates: the native modes above use the package's own prompt (passages each
    behind a ``[Retrieved Passage]`` line, then ``Question: ...``) while no template is set.
    Give ``text_qa_template``, ``refine_template`` or ``summary_template`` (or set them with
    ``update_prompts``) and every mode runs LlamaIndex's synthesizer of the same name
    (``one_pass`` as ``compact``) with your templates, LlamaIndex's defaults filling the
    others, through a :class:`TokRAGLLM` with this synthesizer's settings: the RAG context is
    your template as formatted and Tok-RAG compares it with the question alone. This is the
    path ``Settings.llm = TokRAGLLM(...)`` takes, token for token. ``get_prompts()`` returns
    the templates that path uses.

    Every call decodes under the synthesizer's policy with the same question. With
    ``streaming=True`` the earlier calls run when the response is made and the last call
    streams. Each call emits LlamaIndex's LLM callback event (``CBEventType.LLM`` with the
    prompt and a ``CompletionResponse`` whose ``raw["usage"]`` holds the exact token counts,
    so ``TokenCountingHandler`` counts them) and the ``LLMCompletionStart/EndEvent``
    instrumentation events.

    ``response.metadata`` holds ``response_mode``, ``policy``, ``policy_used`` (``"llm"``
    when answered from the pure context), ``answered_from`` (``"retrieval"`` or
    ``"pure_context"``) and ``pure_context_reason``, ``counts`` (generated tokens per source
    in the final answer: ``agree``/``rag``/``llm``), ``passages`` (per node: node id, rank,
    score, kept/cut/empty, tokens; in the multi-call modes also ``calls`` and ``parts``),
    ``nodes_used``, ``nodes_cut``, ``nodes_dropped``, ``n_nodes_dropped``,
    ``nodes_skipped_empty``, ``warnings``, ``gate`` (the gate's decision or None), ``model``,
    ``stop_reason``, ``trace`` (the final call's ``Trace.to_dict()``, JSON-safe), ``usage``
    (prompt/completion tokens over all calls) and ``calls`` (one entry per model call:
    ``index``, ``kind`` (answer/refine/summarize/combine), ``node_ids``, ``answers_from``,
    ``text``, ``counts``, ``usage``, ``nodes_used``/``cut``/``dropped``, ``warnings``,
    ``trace``; ``level`` in tree_summarize); the multi-call modes add ``counts_all_calls``.
    With ``streaming=True`` the metadata dict is filled in place once the token generator is
    exhausted (``policy``, ``gate`` and ``response_mode`` are there from the start).

    Args:
        lm: a LoadedModel, a :class:`TokRAGLLM` to share, or None to load ``model``.
        model: what :func:`~tokrag_integrations.load_model` takes (``"default"``, a hub id
            in the local cache, a folder, a ``.gguf`` path, a loaded ``PreTrainedModel``),
            with its keyword options (``tokenizer``, ``device``, ``device_map``, ``dtype``,
            ``model_kwargs``, ``tokenizer_kwargs``, ``trust_remote_code``, ``revision``...).
        temperature: only None or 0 (greedy decoding).
        policy: decoding policy name or instance (``"tokrag"``, ``"rag"``, ``"llm"``...).
        max_new_tokens: answer budget in tokens (per call; default
            :data:`~tokrag_integrations.defaults.MAX_NEW_TOKENS`, as ``tokrag ask``).
        stop: stop strings (EOS always stops); default
            :data:`~tokrag_integrations.defaults.ANSWER_STOP` (a blank line or a heading
            ends the answer, as ``tokrag ask``); None or ``[]``: none.
        max_context_tokens: a tighter context budget than the model's window.
        system_prompt: override the core's default system prompt (None = no system turn).
        gate: optional object with ``decide(query)`` returning a decision with ``.retrieve``
            (bool), ``.score`` (float) and ``.to_dict()``; when it says no, the answer comes
            from the pure context (one call in every mode) and the decision is in the metadata.
        streaming: return ``StreamingResponse`` / ``AsyncStreamingResponse``.
        callback_manager: LlamaIndex callback manager (default ``Settings.callback_manager``).
        response_mode: ``"one_pass"`` (default), ``"compact"``, ``"refine"`` or
            ``"tree_summarize"``.
        metadata_mode: which node metadata goes into the passage text (default
            ``MetadataMode.LLM``, as LlamaIndex's synthesizers; ``MetadataMode.NONE`` for
            the text alone).
        batching: decode concurrent non-streaming calls (``asyncio.gather`` over ``aquery``,
            threads) together as one batch (:mod:`tokrag_integrations.batching`); False
            decodes them one at a time.
        **policy_options: the policy's options (e.g. ``pr_norm="softmax"``).
    """

    def __init__(
        self,
        lm: LoadedModel | TokRAGLLM | None = None,
        *,
        model: Any = None,
        temperature: float | None = None,
        policy: str | Policy = "tokrag",
        max_new_tokens: int = MAX_NEW_TOKENS,
        stop: str | Sequence[str] | None = ANSWER_STOP,
        max_context_tokens: int | None = None,
        system_prompt: Any = ...,
        gate: Any = None,
        streaming: bool = False,
        callback_manager: CallbackManager | None = None,
        response_mode: Any = "one_pass",
        metadata_mode: Any = MetadataMode.LLM,
        batching: bool = True,
        text_qa_template: BasePromptTemplate | None = None,
        refine_template: BasePromptTemplate | None = None,
        summary_template: BasePromptTemplate | None = None,
        **policy_options: Any,
    ) -> None:
        self._templates: dict[str, BasePromptTemplate] = {
            k: t
            for k, v in (
                ("text_qa_template", text_qa_template),
                ("refine_template", refine_template),
                ("summary_template", summary_template),
            )
            if (t := _template(k, v)) is not None
        }
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if max_context_tokens is not None and (
            isinstance(max_context_tokens, bool)
            or not isinstance(max_context_tokens, int)
            or max_context_tokens < 1
        ):
            raise ValueError(
                f"max_context_tokens must be a whole number >= 1 or None, got {max_context_tokens!r}"
            )
        if gate is not None and not callable(getattr(gate, "decide", None)):
            raise TypeError(f"gate must have a decide(query) method, got {type(gate).__name__}")
        check_greedy(temperature, "TokRAGSynthesizer")
        require_bool(streaming, "streaming")
        require_bool(batching, "batching")
        mode = _mode_name(response_mode)
        meta_mode = _metadata_mode(metadata_mode)
        load_options = {k: policy_options.pop(k) for k in LOAD_OPTIONS if k in policy_options}
        # Unknown policies or options fail here, not at the first query.
        try:
            pol = get_policy(policy, **policy_options)
        except ValueError as e:
            if "unknown option" not in str(e):
                raise
            raise TypeError(
                f"TokRAGSynthesizer got an unknown keyword argument ({e}); besides the policy's "
                f"options it accepts: {', '.join(_OWN_ARGUMENTS + LOAD_OPTIONS)}"
            ) from e
        self._policy_name = pol.name
        self._roles: tuple[str, ...] = tuple(pol.roles)
        if (model is not None or load_options) and lm is not None:
            raise ValueError("pass lm, or model with its load options, not both")
        if isinstance(lm, TokRAGLLM):
            llm = lm
        elif model is not None or load_options:
            llm = TokRAGLLM(model=model or "default", max_new_tokens=max_new_tokens, **load_options)
        elif lm is None or isinstance(lm, LoadedModel):
            llm = TokRAGLLM(lm, max_new_tokens=max_new_tokens)
        else:
            raise TypeError(
                f"lm must be a LoadedModel, a TokRAGLLM or None, got {type(lm).__name__}"
            )
        super().__init__(llm=llm, callback_manager=callback_manager, streaming=streaming)
        self._lm: LoadedModel = llm.loaded_model
        self._gate = gate
        self._mode = mode
        self._metadata_mode = meta_mode
        self._batching = bool(batching)
        self._policy_options = dict(policy_options)
        self._gen_kwargs: dict[str, Any] = {
            "policy": policy,
            "max_new_tokens": max_new_tokens,
            "stop": stop,
            "max_context_tokens": max_context_tokens,
            **policy_options,
        }
        if system_prompt is not ...:
            self._gen_kwargs["system_prompt"] = system_prompt

    @property
    def llm(self) -> TokRAGLLM:
        """The :class:`TokRAGLLM` over the same model (e.g. for ``as_query_engine(llm=...)``)."""
        return self._llm  # type: ignore[return-value]

    @property
    def loaded_model(self) -> LoadedModel:
        return self._lm

    @property
    def policy(self) -> str:
        return self._policy_name

    @property
    def response_mode(self) -> str:
        return self._mode

    @property
    def metadata_mode(self) -> MetadataMode:
        return self._metadata_mode

    @property
    def uses_templates(self) -> bool:
        """Whether answers go through LlamaIndex's synthesizer with prompt templates (a
        template was set, or the mode is one of LlamaIndex's others)."""
        return bool(self._templates) or self._mode not in NATIVE_MODES

    def _get_prompts(self) -> PromptDictType:
        """The templates the template path formats (yours, else LlamaIndex's defaults)."""
        return {k: self._templates.get(k, _DEFAULT_TEMPLATES[k]) for k in TEMPLATE_KEYS}

    def _update_prompts(self, prompts: PromptDictType) -> None:
        """Set templates (``text_qa_template``, ``refine_template``, ``summary_template``);
        from then on every mode runs through them (see the class docstring)."""
        for key, value in prompts.items():
            if key not in TEMPLATE_KEYS:
                raise KeyError(f"unknown prompt {key!r}; TokRAGSynthesizer has {', '.join(TEMPLATE_KEYS)}")
            self._templates[key] = _template(key, value)

    # ------------------------------------------------------------------ template path
    def _template_llm(self) -> TokRAGLLM:
        """A TokRAGLLM with this synthesizer's settings that keeps its calls' results."""
        kw = self._gen_kwargs
        own: dict[str, Any] = {
            "policy": self._policy_name,
            "max_new_tokens": kw["max_new_tokens"],
            "stop": [kw["stop"]] if isinstance(kw["stop"], str) else kw["stop"],
            "max_context_tokens": kw["max_context_tokens"],
            "policy_options": self._policy_options,
            "batching": self._batching,
        }
        if "system_prompt" in kw:
            own["system_prompt"] = kw["system_prompt"]
        llm = TokRAGLLM(self._lm, callback_manager=self._callback_manager, **own)
        llm._results = []
        return llm

    def _template_synth(self, llm: TokRAGLLM) -> BaseSynthesizer | None:
        """LlamaIndex's synthesizer for the mode (None for ``no_text``: no call at all)."""
        if self._mode == "no_text":
            return None
        mode = "compact" if self._mode == "one_pass" else self._mode
        return get_response_synthesizer(
            llm=llm,
            response_mode=mode,
            streaming=self._streaming,
            callback_manager=self._callback_manager,
            **self._templates,
        )

    def _template_metadata(
        self, llm: TokRAGLLM, nodes: Sequence[NodeWithScore], gate: dict[str, Any] | None
    ) -> dict[str, Any]:
        results = list(llm._results or [])
        calls = [call_summary(i, "template", r, [{}], roles=self._roles) for i, r in enumerate(results)]
        final = results[-1] if results else None
        policy_used = final.trace.policy if final is not None else None
        counts, notes, total = _totals(calls, [])
        return {
            "response_mode": self._mode,
            "templates": sorted(self._templates),
            "policy": self._policy_name,
            "policy_used": policy_used,
            "answered_from": "retrieval" if policy_used not in (None, "llm") else "pure_context",
            "counts": final.counts if final is not None else {},
            "counts_all_calls": counts,
            "model": self._lm.name,
            "stop_reason": final.trace.stop_reason if final is not None else None,
            "gate": gate,
            "nodes_used": [n.node.node_id for n in nodes],
            "warnings": notes,
            "trace": calls[-1]["trace"] if calls else None,
            "calls": calls,
            "usage": total,
        }

    def _template_chunks(self, nodes: Sequence[NodeWithScore]) -> list[str]:
        return [n.node.get_content(metadata_mode=self._metadata_mode) for n in nodes]

    def _run_templates(
        self, query: str, nodes: Sequence[NodeWithScore], gate: dict[str, Any] | None
    ) -> tuple[Any, dict[str, Any]]:
        llm = self._template_llm()
        synth = self._template_synth(llm)
        if synth is None:
            return (iter(()) if self._streaming else ""), self._template_metadata(llm, nodes, gate)
        answer = synth.get_response(query, self._template_chunks(nodes))
        if not self._streaming or isinstance(answer, str):
            return answer, self._template_metadata(llm, nodes, gate)
        metadata = {"policy": self._policy_name, "gate": gate, "response_mode": self._mode}

        def gen() -> Generator[str, None, None]:
            yield from answer
            metadata.update(self._template_metadata(llm, nodes, gate))

        return gen(), metadata

    async def _arun_templates(
        self, query: str, nodes: Sequence[NodeWithScore], gate: dict[str, Any] | None
    ) -> tuple[Any, dict[str, Any]]:
        llm = self._template_llm()
        synth = self._template_synth(llm)
        if synth is None:
            return (_no_tokens() if self._streaming else ""), self._template_metadata(llm, nodes, gate)
        answer = await synth.aget_response(query, self._template_chunks(nodes))
        if not self._streaming or isinstance(answer, str):
            return answer, self._template_metadata(llm, nodes, gate)
        metadata = {"policy": self._policy_name, "gate": gate, "response_mode": self._mode}

        async def agen() -> AsyncGenerator[str, None]:
            async for token in answer:
                yield token
            metadata.update(self._template_metadata(llm, nodes, gate))

        return agen(), metadata

    # ------------------------------------------------------------------ translation
    def _gate_dict(self, decision: Any) -> dict[str, Any] | None:
        if decision is None:
            return None
        return jsonable(
            {
                **dict(decision.to_dict()),
                "retrieve": bool(decision.retrieve),
                "score": float(decision.score),
            }
        )

    def _session(
        self, query: str, nodes: Sequence[NodeWithScore], decision: Any = None
    ) -> _Session:
        return _Session(self, query, nodes, decision, self._gate_dict(decision))

    @staticmethod
    def _chunk_nodes(text_chunks: Sequence[str]) -> list[NodeWithScore]:
        return [
            NodeWithScore(node=TextNode(text=c, id_=f"chunk-{i}"))
            for i, c in enumerate(text_chunks)
        ]

    # ------------------------------------------------------------------ callbacks per call
    def _llm_start(self, sess: _Session, call: _Call) -> tuple[str, str]:
        """Emit the LLM start events of one call; (event id, prompt text)."""
        prompt = sess.prompt_text(call)
        llm = self._llm
        model_dict = llm.to_payload() if hasattr(llm, "to_payload") else llm.to_dict()
        extra = {
            "policy": self._policy_name,
            "response_mode": self._mode,
            "call": len(sess.calls),
            "kind": call.kind,
        }
        dispatcher.event(
            LLMCompletionStartEvent(prompt=prompt, additional_kwargs=extra, model_dict=model_dict)
        )
        event_id = self._callback_manager.on_event_start(
            CBEventType.LLM,
            payload={
                EventPayload.PROMPT: prompt,
                EventPayload.ADDITIONAL_KWARGS: extra,
                EventPayload.SERIALIZED: model_dict,
            },
        )
        return event_id, prompt

    def _llm_end(
        self, sess: _Session, call: _Call, event_id: str, prompt: str, result: GenerationResult
    ) -> None:
        sess.record(call, result)
        response = CompletionResponse(
            text=result.text,
            additional_kwargs=result_kwargs(result),
            raw={"usage": usage(result, self._roles)},
        )
        self._callback_manager.on_event_end(
            CBEventType.LLM,
            payload={EventPayload.PROMPT: prompt, EventPayload.COMPLETION: response},
            event_id=event_id,
        )
        dispatcher.event(LLMCompletionEndEvent(prompt=prompt, response=response))

    def _llm_error(self, event_id: str, error: BaseException) -> None:
        self._callback_manager.on_event_end(
            CBEventType.LLM, payload={EventPayload.EXCEPTION: error}, event_id=event_id
        )

    def _call(self, sess: _Session, call: _Call) -> GenerationResult:
        event_id, prompt = self._llm_start(sess, call)
        try:
            result = batching.generate(
                self._lm, sess.query, call.passages, batching=self._batching, **self._gen_kwargs
            )
        except BaseException as e:
            self._llm_error(event_id, e)
            raise
        self._llm_end(sess, call, event_id, prompt, result)
        return result

    async def _acall(self, sess: _Session, call: _Call) -> GenerationResult:
        event_id, prompt = self._llm_start(sess, call)
        try:
            result = await batching.agenerate(
                self._lm, sess.query, call.passages, batching=self._batching, **self._gen_kwargs
            )
        except BaseException as e:
            self._llm_error(event_id, e)
            raise
        self._llm_end(sess, call, event_id, prompt, result)
        return result

    # ------------------------------------------------------------------ running a session
    def _run(self, sess: _Session) -> tuple[Any, dict[str, Any]]:
        """(answer text, or a token generator when streaming; the metadata dict)."""
        program = sess.program()
        call = next(program)
        while not call.final:
            call = program.send(self._call(sess, call))
        program.close()
        if not self._streaming:
            return self._call(sess, call).text, sess.metadata()
        metadata = sess.partial_metadata()
        event_id, prompt = self._llm_start(sess, call)
        try:
            s = stream(self._lm, sess.query, call.passages, **self._gen_kwargs)
        except BaseException as e:
            self._llm_error(event_id, e)
            raise

        def gen() -> Generator[str, None, None]:
            try:
                for ev in s:
                    if ev.text:
                        yield ev.text
            except BaseException as e:
                self._llm_error(event_id, e)
                raise
            self._llm_end(sess, call, event_id, prompt, s.result)
            metadata.update(sess.metadata())

        return gen(), metadata

    async def _arun(self, sess: _Session) -> tuple[Any, dict[str, Any]]:
        """Async :meth:`_run`: every call runs in a worker thread."""
        program = sess.program()
        call = next(program)
        while not call.final:
            call = program.send(await self._acall(sess, call))
        program.close()
        if not self._streaming:
            return (await self._acall(sess, call)).text, sess.metadata()
        metadata = sess.partial_metadata()
        lm, kw, last = self._lm, self._gen_kwargs, call

        async def agen() -> AsyncGenerator[str, None]:
            event_id, prompt = self._llm_start(sess, last)
            try:
                async for item in astream_with_result(lm, sess.query, last.passages, **kw):
                    if isinstance(item, GenerationResult):
                        self._llm_end(sess, last, event_id, prompt, item)
                        metadata.update(sess.metadata())
                    elif item.text:
                        yield item.text
            except BaseException as e:
                if len(sess.calls) == 0 or sess.calls[-1][0] is not last:
                    self._llm_error(event_id, e)
                raise

        return agen(), metadata

    # ------------------------------------------------------------------ BaseSynthesizer API
    def get_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        """Answer from plain text chunks (ranked best first) in the synthesizer's
        ``response_mode``; a generator when streaming."""
        nodes = self._chunk_nodes(text_chunks)
        if self.uses_templates:
            return self._run_templates(query_str, nodes, None)[0]
        return self._run(self._session(query_str, nodes))[0]

    async def aget_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        """Async :meth:`get_response`; the model runs in a worker thread."""
        nodes = self._chunk_nodes(text_chunks)
        if self.uses_templates:
            return (await self._arun_templates(query_str, nodes, None))[0]
        return (await self._arun(self._session(query_str, nodes)))[0]

    def _response(
        self, answer: Any, metadata: dict[str, Any], source_nodes: list[NodeWithScore]
    ) -> RESPONSE_TYPE:
        if not self._streaming:
            return Response(answer, source_nodes=source_nodes, metadata=metadata)
        if isinstance(answer, AsyncGenerator):
            return AsyncStreamingResponse(answer, source_nodes=source_nodes, metadata=metadata)
        return StreamingResponse(answer, source_nodes=source_nodes, metadata=metadata)

    @dispatcher.span
    def synthesize(
        self,
        query: QueryTextType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        """Answer ``query`` from ``nodes``; with no nodes, from the pure context (said in metadata)."""
        dispatcher.event(SynthesizeStartEvent(query=query))
        qb = QueryBundle(query_str=query) if isinstance(query, str) else query
        source_nodes = list(nodes) + list(additional_source_nodes or [])
        with self._callback_manager.event(
            CBEventType.SYNTHESIZE, payload={EventPayload.QUERY_STR: qb.query_str}
        ) as event:
            decision = self._gate.decide(qb.query_str) if self._gate is not None else None
            if self.uses_templates and (decision is None or decision.retrieve):
                answer, metadata = self._run_templates(qb.query_str, nodes, self._gate_dict(decision))
            else:
                answer, metadata = self._run(self._session(qb.query_str, nodes, decision))
            response = self._response(answer, metadata, source_nodes)
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=qb, response=response))
        return response

    @dispatcher.span
    async def asynthesize(
        self,
        query: QueryTextType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        """Async :meth:`synthesize`: the gate and the model run in worker threads."""
        dispatcher.event(SynthesizeStartEvent(query=query))
        qb = QueryBundle(query_str=query) if isinstance(query, str) else query
        source_nodes = list(nodes) + list(additional_source_nodes or [])
        with self._callback_manager.event(
            CBEventType.SYNTHESIZE, payload={EventPayload.QUERY_STR: qb.query_str}
        ) as event:
            decision = (
                await asyncio.to_thread(self._gate.decide, qb.query_str)
                if self._gate is not None
                else None
            )
            if self.uses_templates and (decision is None or decision.retrieve):
                answer, metadata = await self._arun_templates(
                    qb.query_str, nodes, self._gate_dict(decision)
                )
            else:
                answer, metadata = await self._arun(self._session(qb.query_str, nodes, decision))
            response = self._response(answer, metadata, source_nodes)
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=qb, response=response))
        return response


__all__ = ["RESPONSE_MODES", "TokRAGSynthesizer"]
