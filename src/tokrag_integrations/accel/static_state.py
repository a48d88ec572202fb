"""The static decode state of ``speed="cuda"`` (issue 56): one step function per token over
buffers of fixed shape, updated in place (capturable as CUDA graphs); one host read a step.

The state holds R rows (a bucket: 1, 2, 4, 8... rows; every context of every query is one
row) and C cache columns. Every row writes the same column ``col`` at a step (a 0-d device
tensor): a prompt is right-aligned to the column where its query joins (left padding, as
Hugging Face ``generate`` lays out a batch in a static cache), its key/value columns before
that masked. The buffers: token ids [R] (the token each row is fed next), positions [R],
the valid columns [R, C] (bool), each layer's keys and values [R, kv_heads, C, hd], the
column; and what the device rule reads of the queries (:class:`..accel.step_tensors.StepTensors`:
each role's row per query slot, the RAG row's retrieved-token columns and ids...).

:func:`.static_step.static_step` is the step: the model's forward on one token per row (the
key/value column written in place; the probes on the way: every layer's residual and, where
a rule or a citation reads them, every layer's attention probabilities over the C columns),
the device rule (:func:`..accel.step_tensors.device_rule_for`) on the slots that can hold a
query (taken lowest first: the first R // the fewest rows of a query), then the next-step
update (tokens into the token buffer, positions and column advanced). No host read and no
branch on a tensor's value: on CUDA it is recorded as CUDA graphs (a graph per bucket), either
as it runs (``Speed.graphs="capture"``, :mod:`.static_graphs`) or after ``torch.compile(mode=
"reduce-overhead")`` (``"on"``); ``torch.compile`` or eager elsewhere. It returns one
tensor [Q, 1 + K] (each slot's chosen id, then its record), read once a step
(:meth:`StaticDecode.step`); the trace is rebuilt from it (the rule's ``decode``).

:class:`StaticDecode` is the host side: admission between steps (the prefill paths run each
context's prompt but its last token, whose keys and values are copied into free rows; the
last token is the row's first fed token, so the step makes every choice), retirement, growth
(a bigger bucket or capacity is a new state, the live rows copied, and a new graph). A
decode's buffers go back to the model's pool when its last query leaves, and the next decode
of that shape takes them (the same addresses: a captured graph is replayed, not recorded).
:class:`..engine.decoder.Decoder` delegates to it where ``Speed.static`` is on
(:func:`static_decode_for`, through ``engine/seam.py``).

Covered: the Llama-family architectures of :data:`STATIC_ARCHITECTURES` with full attention,
and every policy with a device rule (:mod:`.rules`) whose contexts are ``pure`` / ``rag``
or RAG-Token's ``passage:j`` (at most ``MAX_PASSAGES`` a query); the others are decoded on
the view path, and the trace's ``speed_paths_off["static"]`` says why.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..models import LoadedModel
from ..policies.base import ContextSpec, Policy
from ..sampling import Sampling, TokenConstraint, bitmask_words
from ..speed import Speed
from .packed import _PackedBatch
from .static_buffers import POOL_SIZE, StaticBuffers, new_buffers, pool_of, reset_buffers
from .static_forward import ATTN_STATIC, direct_off_reason, register_attention, static_off_reason
from .static_graphs import CudaGraphs, StepGraphs, capture_off_reason, graphs_of
from .static_step import _compiled, static_step
from .step_tensors import MAX_PASSAGES, DecodedStep, device_rule_for

__all__ = ["ATTN_STATIC", "StaticDecode", "static_asked", "static_decode_for"]

#: The smallest capacity (columns) and retrieved-token slots of a state.
MIN_COLUMNS = 64
MIN_RT_SLOTS = 16


def _pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= max(n, least)."""
    n = max(int(n), int(least), 1)
    return 1 << (n - 1).bit_length()


# ---------------------------------------------------------------------- host side
@dataclass
class _Slot:
    """A query in the state: its rows by role, and its RAG row's retrieved tokens (prompt
    coordinates) with their passages."""

    query: int
    rows: dict[str, int]
    rt_positions: list[int] = field(default_factory=list)
    rt_ids: list[int] = field(default_factory=list)
    rt_passage: list[int] = field(default_factory=list)
    cite: int = 0
    weights: list[float] = field(default_factory=list)
    #: How its tokens are taken, its constraint, and its step index (host mirror).
    sampling: Sampling = field(default_factory=Sampling)
    constraint: TokenConstraint | None = None
    step: int = 0


class StaticDecode:
    """The host side of a static decode (see the module docstring): admission, one step per
    token, retirement, growth. ``rule`` is the policy's device rule."""

    def __init__(
        self,
        lm: LoadedModel,
        policy: Policy,
        rule: Any,
        speed: Speed,
        *,
        max_new_tokens: int,
    ) -> None:
        register_attention()
        self.lm, self.policy, self.rule, self.speed = lm, policy, rule, speed
        self.max_new_tokens = int(max_new_tokens)
        #: What the step records for the rule: the residuals, the attention rows. A rule may
        #: say what it reads (``reads``); else both where a context is probed (the policy
        #: reads its layers, or its RAG context is cited), which the first admission shows.
        self.reads: tuple[str, ...] | None = getattr(rule, "reads", None)
        self.resid = self.attn = False
        model = lm.model
        #: RAG-Token's contexts are one per passage (``passage:j``, up to MAX_PASSAGES).
        self.passages = not policy.roles
        self.roles = tuple(policy.roles) or tuple(f"passage:{j}" for j in range(MAX_PASSAGES))
        self.min_rows = 1 if self.passages else len(self.roles)  # the fewest rows of a query
        self.dev, self.dtype = model.device, model.dtype
        cfg = model.config
        self.n_layers = int(cfg.num_hidden_layers)
        attn0 = model.model.layers[0].self_attn
        self.head_dim = int(attn0.head_dim)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.vocab = int(model.get_output_embeddings().weight.shape[0])
        self.buf: StaticBuffers | None = None
        self.col = 0  # host mirror of buf.col
        self.row_owner: list[tuple[int, str] | None] = []
        self.row_start: list[int] = []  # column of each live row's first prompt token
        self.slots: list[_Slot | None] = []
        self.slot_of: dict[int, int] = {}
        on_cuda = self.dev.type == "cuda"
        # "auto" runs eagerly until a graph path is measured on a device (docs/results.md).
        self.compiled = speed.graphs == "on"
        #: The eager step recorded as CUDA graphs (``graphs="capture"`` on a CUDA device).
        self.graphs: StepGraphs | None = None
        self._fn: Any = static_step
        if self.compiled:
            self._fn = _compiled("reduce-overhead" if on_cuda else None)
        elif _records(lm, speed):
            self.graphs = self._fn = graphs_of(lm, lambda: StepGraphs(static_step, CudaGraphs(self.dev)))
        #: What the last admission cost.
        self.timings: dict[str, float] = {}
        #: Whether the step writes the layers out (:func:`.static_forward.direct_off_reason`,
        #: checked at each admission: a hook may have come since).
        self.direct = False

    # ------------------------------------------------------------------ bookkeeping
    def rows_in_use(self) -> int:
        return sum(o is not None for o in self.row_owner)

    def width(self) -> int:
        return self.col if self.rows_in_use() else 0

    def _key(self, R: int, C: int, P: int) -> tuple[Any, ...]:
        return (R, C, P, self.roles, self.n_layers, str(self.dtype), str(self.dev), self.compiled)

    def _alloc(self, R: int, C: int, P: int) -> StaticBuffers:
        """Buffers of R rows, C columns and P retrieved-token slots: a free set of the
        model's pool where there is one (the same addresses, so a captured graph is replayed,
        not recorded again, by the next decode), else new ones."""
        kept = pool_of(self.lm).pop(self._key(R, C, P), None)
        if kept is not None:
            reset_buffers(kept, self.lm.pad_token_id)
            return kept
        b = new_buffers(
            R, C, P,
            roles=self.roles, layers=self.n_layers, kv_shape=(self.n_kv, self.head_dim),
            vocab=self.vocab, pad_id=self.lm.pad_token_id, passages=self.passages,
            dtype=self.dtype, device=self.dev,
        )  # fmt: skip
        if self.dev.type == "cuda" and self.compiled:
            for t in b.all():  # fixed addresses: the captured graph reads and writes them
                torch._dynamo.mark_static_address(t)
        return b

    # ------------------------------------------------------------------ admission
    def admit(
        self,
        query_ids: Sequence[int],
        per_query: Sequence[dict[str, ContextSpec]],
        roles: Sequence[str],
        cite_lengths: Sequence[list[int] | None],
        prefill: Any,
        sampling: Sequence[tuple[Sampling, TokenConstraint | None]] | None = None,
    ) -> dict[str, float]:
        """Prefill the queries' contexts (each prompt but its last token, with ``prefill``:
        the speed paths' prefill, unprobed) and place their rows in the state; their first
        token is chosen at the next step. ``sampling``: per query, how its tokens are taken
        and its constraint (default: greedy, unconstrained)."""
        t0 = time.perf_counter()
        self.direct = direct_off_reason(self.lm.model) is None
        extra = sorted({r for c in per_query for r in c} - set(self.roles))
        if extra:
            raise ValueError(
                f"the static state has no row for the context {extra[0]!r} (at most "
                f"{MAX_PASSAGES} passages a query): decode this query with speed='auto'"
            )
        probed = any(s.probe for c in per_query for s in c.values())
        cited = any(c is not None for c in cite_lengths)
        if self.reads is not None:
            self.resid, self.attn = "resid" in self.reads, "attn" in self.reads or cited
        else:  # only ever turned on (a new graph where it changes)
            self.resid, self.attn = self.resid or probed, self.attn or probed
        # A one-token prompt has nothing to prefill: its row starts with no valid column.
        trimmed = [
            {r: ContextSpec(s.ids[:-1], s.rt_positions, s.weight) for r, s in c.items() if len(s.ids) > 1}
            for c in per_query
        ]
        run = [r for r in roles if any(r in c for c in trimmed)]
        rows_of: dict[str, dict[int, tuple[Any, int]]] = {}
        fused = packed = 0.0
        if run:
            with torch.inference_mode():
                ready = prefill(run, trimmed, self.lm, frozenset())
            rows_of, fused, packed = ready.rows, float(ready.fused), float(ready.packed)
        # (query, role, prefilled batch or None, its row) of every new context
        placed: list[tuple[int, str, Any, int]] = [
            (q, role, *rows_of.get(role, {}).get(q, (None, -1)))
            for role in roles
            for q, c in enumerate(per_query)
            if role in c
        ]
        batches = {id(b): b for _, _, b, _ in placed if b is not None}
        for key, b in list(batches.items()):
            if isinstance(b, _PackedBatch):  # one query's two contexts in one row: unpack
                batches[key] = b.unpacked()
        placed = [(q, role, batches.get(id(b)), r) for q, role, b, r in placed]
        self.min_rows = min([self.min_rows, *(len(c) for c in per_query)])
        width = max((int(b.mask.shape[1]) for b in batches.values()), default=0)
        self._make_room(len(placed), len(query_ids), width, per_query)
        buf = self.buf
        assert buf is not None
        col = self.col
        free_rows = [i for i, o in enumerate(self.row_owner) if o is None]
        free_slots = [i for i, s in enumerate(self.slots) if s is None]
        slot_rows: dict[int, dict[str, int]] = {}
        by_batch: dict[int, list[tuple[int, int]]] = {}
        last_ids: list[int] = []
        positions: list[int] = []
        rows_taken: list[int] = []
        for q, role, b, r in placed:
            row = free_rows.pop(0)
            rows_taken.append(row)
            spec = per_query[q][role]
            self.row_owner[row] = (query_ids[q], role)
            slot_rows.setdefault(q, {})[role] = row
            if b is not None:
                by_batch.setdefault(id(b), []).append((r, row))
            else:
                buf.valid[row] = False
            last_ids.append(spec.ids[-1])
            positions.append(len(spec.ids) - 1)
            while len(self.row_start) <= row:
                self.row_start.append(0)
            self.row_start[row] = col - (len(spec.ids) - 1)
        with torch.inference_mode():
            for key, pairs in by_batch.items():
                b = batches[key]
                w = int(b.mask.shape[1])
                src = torch.tensor([r for r, _ in pairs], dtype=torch.long)
                dst = torch.tensor([row for _, row in pairs], dtype=torch.long, device=self.dev)
                src_dev = src.to(self.dev)
                mask = b.mask.index_select(0, src_dev.to(b.mask.device)).bool().to(self.dev)
                full = torch.zeros((len(pairs), buf.valid.shape[1]), dtype=torch.bool, device=self.dev)
                full[:, col - w : col] = mask
                buf.valid.index_copy_(0, dst, full)
                for i in range(self.n_layers):
                    layer = b.cache.layers[i]
                    k = layer.keys.index_select(0, src_dev.to(layer.keys.device))[:, :, :w]
                    v = layer.values.index_select(0, src_dev.to(layer.values.device))[:, :, :w]
                    buf.keys[i][:, :, col - w : col].index_copy_(0, dst, k.to(buf.keys[i].dtype))
                    buf.values[i][:, :, col - w : col].index_copy_(0, dst, v.to(buf.values[i].dtype))
            rows_t = torch.tensor(rows_taken, dtype=torch.long, device=self.dev)
            buf.ids.index_copy_(0, rows_t, torch.tensor(last_ids, dtype=torch.long, device=self.dev))
            buf.pos.index_copy_(0, rows_t, torch.tensor(positions, dtype=torch.long, device=self.dev))
            for q, rows in slot_rows.items():
                s = free_slots.pop(0)
                assert s < max(1, buf.valid.shape[0] // self.min_rows), "a slot past R // min_rows"
                rag = per_query[q].get("rag")
                lengths = cite_lengths[q]
                slot = _Slot(query_ids[q], rows)
                if sampling is not None:
                    slot.sampling, slot.constraint = sampling[q]
                if rag is not None:
                    slot.rt_positions = list(rag.rt_positions)
                    slot.rt_ids = [rag.ids[p] for p in rag.rt_positions]
                    per = lengths if lengths else [len(slot.rt_positions)]
                    passage = [j for j, n in enumerate(per) for _ in range(n)]
                    if len(passage) != len(slot.rt_positions):
                        passage = [0] * len(slot.rt_positions)
                    slot.rt_passage = passage
                slot.cite = len(lengths) if lengths is not None else 0
                if self.passages:
                    slot.weights = [
                        float(per_query[q][r].weight or 0.0) if r in per_query[q] else 0.0
                        for r in self.roles
                    ]
                self.slots[s] = slot
                self.slot_of[query_ids[q]] = s
                for role, row in rows.items():
                    buf.row_q[row] = s
                    buf.rows[role][s] = row
                self._write_slot(s)
        self.timings = {"prefill_s": time.perf_counter() - t0, "fused": fused, "packed": packed}
        self.timings["static"] = 1.0
        if self.graphs is not None:
            self.timings["cuda_graphs"] = 1.0
        return self.timings

    def _write_slot(self, s: int) -> None:
        """The slot's retrieved-token tensors from its host record (cache columns of its RAG
        row as of now)."""
        buf = self.buf
        assert buf is not None
        slot = self.slots[s]
        P = buf.rt_pos.shape[1]
        pos = [0] * P
        ids = [0] * P
        passage = [0] * P
        ok = [False] * P
        cite = 0
        if slot is not None and "rag" in slot.rows:
            start = self.row_start[slot.rows["rag"]]
            n = len(slot.rt_positions)
            pos[:n] = [start + p for p in slot.rt_positions]
            ids[:n] = slot.rt_ids
            passage[:n] = slot.rt_passage
            ok[:n] = [True] * n
            cite = slot.cite
        dev = self.dev
        buf.rt_pos[s] = torch.tensor(pos, dtype=torch.long, device=dev)
        buf.rt_ids[s] = torch.tensor(ids, dtype=torch.long, device=dev)
        buf.rt_passage[s] = torch.tensor(passage, dtype=torch.long, device=dev)
        buf.rt_valid[s] = torch.tensor(ok, dtype=torch.bool, device=dev)
        buf.cite[s] = cite
        smp = slot.sampling if slot is not None else Sampling()
        buf.temperature[s] = smp.temperature
        buf.top_p[s] = smp.top_p
        buf.top_k[s] = smp.top_k
        buf.seed[s] = int(smp.seed or 0)
        buf.step[s] = slot.step if slot is not None else 0
        buf.constrained[s] = slot is not None and slot.constraint is not None
        if buf.weights is not None:
            w = slot.weights if slot is not None and slot.weights else [0.0] * len(self.roles)
            buf.weights[s] = torch.tensor(w, dtype=torch.float32, device=dev)

    def _make_room(
        self, n_rows: int, n_queries: int, width: int, per_query: Sequence[dict[str, ContextSpec]]
    ) -> None:
        """Make room for ``n_rows`` new rows of prompts ``width`` columns wide, right-aligned
        at the column: shift the live rows (right where a prompt is longer than the column,
        left to drop columns no live row uses where capacity runs short), or a new state
        (a bigger bucket, capacity or retrieved-token slots) with the live rows copied."""
        live = [i for i, o in enumerate(self.row_owner) if o is not None]
        rt_need = max(
            [len(c["rag"].rt_positions) for c in per_query if "rag" in c]
            + [len(s.rt_positions) for s in self.slots if s is not None]
            + [1]
        )
        room = self.max_new_tokens + 1
        if not live:
            delta, col = 0, width
        else:
            delta = max(0, width - self.col)
            col = self.col + delta
            if self.buf is not None and col + room > self.buf.valid.shape[1]:
                lo = min(self.row_start[i] for i in live)
                delta = -lo + max(0, width - (self.col - lo))
                col = self.col + delta
        R_need = len(live) + n_rows
        buf = self.buf
        fits = (
            buf is not None
            and R_need <= buf.valid.shape[0]
            and col + room <= buf.valid.shape[1]
            and rt_need <= buf.rt_pos.shape[1]
        )
        if fits:
            if delta:
                self._shift(delta, live)
            self.col = col
            buf.col.fill_(col)  # type: ignore[union-attr]
            return
        R = _pow2(R_need)
        C = _pow2(col + room, MIN_COLUMNS)
        P = _pow2(rt_need, MIN_RT_SLOTS)
        if buf is not None:  # keep what fits: shrink nothing a later step may need
            R, C, P = max(R, buf.shape[0]), max(C, buf.shape[1]), max(P, buf.shape[2])
        new = self._alloc(R, C, P)
        old_owner, old_start, old_slots = self.row_owner, self.row_start, self.slots
        self.row_owner = [None] * R
        self.row_start = [0] * R
        self.slots = [None] * R
        self.slot_of = {}
        if buf is not None and live:
            # The live rows, compacted to rows 0..n-1, their columns moved by ``delta``.
            src = torch.tensor(live, dtype=torch.long, device=self.dev)
            n, c0 = len(live), self.col
            lo = min(old_start[i] for i in live)
            a, e = lo, c0  # the columns live rows use
            with torch.inference_mode():
                new.valid[:n, a + delta : e + delta] = buf.valid.index_select(0, src)[:, a:e]
                for i in range(self.n_layers):
                    new.keys[i][:n, :, a + delta : e + delta] = buf.keys[i].index_select(0, src)[:, :, a:e]
                    new.values[i][:n, :, a + delta : e + delta] = buf.values[i].index_select(0, src)[:, :, a:e]
                new.ids[:n] = buf.ids.index_select(0, src)
                new.pos[:n] = buf.pos.index_select(0, src)
            row_map = {old: i for i, old in enumerate(live)}
            for old, i in row_map.items():
                self.row_owner[i] = old_owner[old]
                self.row_start[i] = old_start[old] + delta
            k = 0
            for s_old in old_slots:
                if s_old is None:
                    continue
                s_old.rows = {r: row_map[x] for r, x in s_old.rows.items()}
                self.slots[k] = s_old
                self.slot_of[s_old.query] = k
                k += 1
        if buf is not None:
            self._release(buf)
        self.buf = new
        self.col = col
        with torch.inference_mode():
            new.col.fill_(col)
            for s, slot in enumerate(self.slots):
                if slot is None:
                    continue
                for role, row in slot.rows.items():
                    new.row_q[row] = s
                    new.rows[role][s] = row
                self._write_slot(s)

    def _shift(self, delta: int, live: list[int]) -> None:
        """Move every row's columns by ``delta`` (in place; columns that come in are
        masked), and the live rows' retrieved-token columns with them."""
        buf = self.buf
        assert buf is not None
        C = buf.valid.shape[1]
        with torch.inference_mode():
            for t in [buf.valid, *buf.keys, *buf.values]:
                dim = 1 if t.dim() == 2 else 2
                moved = t.narrow(dim, max(0, -delta), C - abs(delta)).clone()
                t.narrow(dim, max(0, delta), C - abs(delta)).copy_(moved)
                gap = t.narrow(dim, 0 if delta > 0 else C + delta, abs(delta))
                gap.zero_()
        for i in live:
            self.row_start[i] += delta
        for s, slot in enumerate(self.slots):
            if slot is not None:
                self._write_slot(s)

    # ------------------------------------------------------------------ one step
    def step_args(self) -> tuple[Any, ...]:
        """The arguments of :func:`static_step` on this state (for a compiler's checks)."""
        buf = self.buf
        assert buf is not None
        live = [s for s in self.slots if s is not None]
        sample = any(not s.sampling.greedy for s in live)
        masked = any(s.constraint is not None for s in live)
        tops = any(s.sampling.top_logprobs for s in live)
        return (
            self.lm.model, self.rule, self.lm.pad_token_id, self.resid, self.attn, sample,
            masked, tops, self.direct, buf.ids, buf.pos, buf.valid, buf.col, buf.keys, buf.values, buf.row_q,
            buf.rows, buf.rt_pos, buf.rt_ids, buf.rt_valid, buf.rt_passage, buf.cite,
            buf.weights, buf.temperature, buf.top_p, buf.top_k, buf.seed, buf.step, buf.bits,
            buf.constrained, max(1, buf.valid.shape[0] // self.min_rows),
        )  # fmt: skip

    def _write_masks(self) -> None:
        """The constrained slots' allowed tokens into the device bitmask (written from the
        host before the step: no read)."""
        buf = self.buf
        assert buf is not None
        live = [(s, slot) for s, slot in enumerate(self.slots) if slot is not None and slot.constraint is not None]
        if not live:
            return
        host = torch.zeros((len(live), bitmask_words(self.vocab)), dtype=torch.int32)
        for j, (_, slot) in enumerate(live):
            slot.constraint.fill_bitmask(host, j)  # type: ignore[union-attr]
        at = torch.tensor([s for s, _ in live], dtype=torch.long, device=self.dev)
        with torch.inference_mode():
            buf.bits.index_copy_(0, at, host.to(self.dev))

    @contextlib.contextmanager
    def attention(self) -> Iterator[None]:
        """While open, the model's attention layers run :func:`static_attention` (the step's;
        the prefill keeps the model's own); written-out layers call it directly."""
        if self.direct:
            yield
            return
        cfg = self.lm.model.config
        before = cfg._attn_implementation
        cfg._attn_implementation = ATTN_STATIC
        try:
            yield
        finally:
            cfg._attn_implementation = before

    def step(self, queries: Sequence[int], tokenizer: Any) -> list[DecodedStep]:
        """Run the step on every row; the one host read; each query's decoded record (its
        ``top_logprobs`` cut to the query's count)."""
        self._write_masks()
        with self.attention(), torch.inference_mode():
            if self.compiled and self.dev.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()  # the last step's output is read
            out = self._fn(*self.step_args())
        self.col += 1
        for slot in self.slots:
            if slot is not None:
                slot.step += 1
        table = out.tolist()  # the one host read of the step
        decoded = []
        for q in queries:
            row = table[self.slot_of[q]]
            slot = self.slots[self.slot_of[q]]
            assert slot is not None
            d = self.rule.decode(row[1:], tokenizer, top_logprobs=slot.sampling.top_logprobs)
            d.token_id = int(row[0])
            decoded.append(d)
        return decoded

    def retire(self, done: Sequence[int]) -> None:
        """Free the rows and slots of the queries ``done``."""
        buf = self.buf
        if buf is None:
            return
        with torch.inference_mode():
            for q in done:
                s = self.slot_of.pop(q, None)
                if s is None:
                    continue
                slot = self.slots[s]
                self.slots[s] = None
                assert slot is not None
                for role, row in slot.rows.items():
                    self.row_owner[row] = None
                    buf.row_q[row] = -1
                    buf.rows[role][s] = -1
                buf.rt_valid[s] = False
                buf.cite[s] = 0
                buf.constrained[s] = False
                buf.temperature[s] = 0.0
        if not self.rows_in_use():  # nothing left: the buffers go back to the pool
            self._release(buf)
            self.buf, self.col = None, 0
            self.row_owner, self.row_start, self.slots, self.slot_of = [], [], [], {}

    def _release(self, buf: StaticBuffers) -> None:
        pool = pool_of(self.lm)
        pool[self._key(*buf.shape)] = buf
        while len(pool) > POOL_SIZE:
            pool.pop(next(iter(pool)))


def static_asked(lm: LoadedModel, speed: Speed) -> bool:
    """Whether ``speed`` asks for the static state on ``lm``: ``static="on"``, or ``"auto"``
    with the model on a CUDA device."""
    return speed.wants_static(lm.model.device.type)


def static_decode_for(
    lm: LoadedModel,
    policy: Policy,
    speed: Speed,
    *,
    max_new_tokens: int,
    citations: bool | None,
) -> tuple[StaticDecode | None, str | None]:
    """The static decode of ``policy`` on ``lm`` where ``speed.static`` asks for it (``"on"``;
    ``"auto"`` on a CUDA device) and it applies, else None; and why it does not apply where
    it was asked for (None where it was not)."""
    if not static_asked(lm, speed):
        return None, None
    why = static_off_reason(lm, policy)
    if why is not None:
        return None, why
    if _records(lm, speed):  # the same rule object, so a later decode replays the graphs
        rule = _cached_rule(lm, policy, citations)
    else:
        rule = device_rule_for(policy, lm, citations=citations, passages=MAX_PASSAGES)
    if rule is None:
        return None, f"policy {policy.name!r} has no device rule"
    return StaticDecode(lm, policy, rule, speed, max_new_tokens=max_new_tokens), None


def _cached_rule(lm: LoadedModel, policy: Policy, citations: bool | None) -> Any:
    """The device rule of ``policy`` on ``lm``, one per policy class, options and citations
    (a rule keeps no state between steps); this call's policy is prepared at admission."""
    cache: dict[tuple[Any, ...], Any] = lm.__dict__.setdefault("_tokrag_device_rules", {})
    key = (type(policy).__module__, type(policy).__qualname__, repr(policy.options()), citations)
    if key not in cache:
        cache[key] = device_rule_for(policy, lm, citations=citations, passages=MAX_PASSAGES)
    return cache[key]


def _records(lm: LoadedModel, speed: Speed) -> bool:
    """Whether the static step of ``lm`` under ``speed`` is recorded as CUDA graphs."""
    return speed.graphs == "capture" and capture_off_reason(lm.model.device) is None
