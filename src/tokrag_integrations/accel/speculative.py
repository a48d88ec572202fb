"""Blockwise verification of a two-context rule (issue 8; ``speed={"speculative": True}``).

On the CPUs measured here the fused step-by-step loop (:func:`.packed.fuse_batches`),
the default, is faster; this loop is kept for machines where a multi-token verifier pass
costs about one step and the second context is expensive (docs/results.md).

The step-by-step loop (:func:`..engine.loop.decode_loop`) runs both contexts one token at a
time. Most steps are agreements, where Tok-RAG takes the shared token without a signal, so
the second context only has to *confirm* tokens. This loop lets one context (the drafter)
decode a block of ``k`` tokens greedily, one forward pass per token as usual, and runs the
other context (the verifier) over the whole block in one forward pass. Then it walks the
block position by position and asks the policy, with exactly the views the step-by-step
loop would have built (logits, per-layer states, attention rows over the cache up to that
position), which token to take:

* the chosen token equals the draft: keep walking (an agreement, or a disagreement the
  drafter's context won, where the signals are computed as usual);
* it differs (the verifier's context won a disagreement): every later draft position is
  stale. Both caches forget them (cropped where all rows share them, masked out where a
  batch row has fewer) and the chosen token is fed to both contexts at the start of the
  next block.

So the tokens, sources and signals are those of the step-by-step loop; the only
difference is that the verifier computes a block's positions in one matrix product, which
can change logits in the last bits (as in any speculative decoding). Per-layer states are
kept as references to tensors the forward pass made anyway (hooks store, never copy); a
:class:`..attention.ProbeRecord` is assembled only at positions whose rule reads it.

The drafter is, by default, the context that has won more disagreements so far (``"auto"``:
RAG at first, as in the issue's description). The block length (2 to 16) minimises the
expected cost per token (:func:`best_block`) given the observed rate of verifier wins and the
measured cost of a verifier pass, so long agreeing stretches get long blocks and a machine
where a block pass is nearly free (a GPU) gets longer ones than a CPU.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..attention import ModelParts, ProbeRecord, model_parts
from ..engine.loop import StepEvent, role_setup, step_event, views_for
from ..engine.prefill import prefill_roles, row_map
from ..engine.speed import Speed
from ..engine.view import ContextView
from ..models import LoadedModel
from ..policies.base import Policy
from ..prompts import PromptPlan

ROLES = ("pure", "rag")
MIN_BLOCK, MAX_BLOCK = 2, 16
#: Prior for the cost of one more position in a verifier pass, in drafter steps.
BETA_PRIOR = 0.1


@dataclass
class _Capture:
    """References to one forward pass's per-layer tensors ([B, T, ...] each)."""

    resid: list[torch.Tensor]  # L+1: the input of every layer, then the final norm's input
    attn_in: list[torch.Tensor]  # L: the input of every attention module
    cos: list[torch.Tensor]
    sin: list[torch.Tensor]

    def record(self, row: int, t: int) -> ProbeRecord:
        """The :class:`ProbeRecord` of position ``t`` of batch row ``row`` (batch size 1)."""

        def at(x: torch.Tensor) -> torch.Tensor:
            return x[min(row, x.shape[0] - 1), t][None]

        return ProbeRecord(
            resid=torch.stack([at(x) for x in self.resid]),
            attn_in=torch.stack([at(x) for x in self.attn_in]),
            cos=[at(c) for c in self.cos],
            sin=[at(s) for s in self.sin],
        )


class _Recorder:
    """Hooks kept installed for a whole decode; each stores references, never copies.

    The same tensors :class:`..attention.Probe` reads: the input of every decoder layer (the
    embeddings for layer 0; layer ``l``'s input is layer ``l-1``'s output), the input of the
    final norm (the last layer's output), and every attention module's input and rotary
    embedding, for all positions of the pass.
    """

    def __init__(self, parts: ModelParts):
        self.parts = parts
        n = parts.num_layers
        self._resid: list[Any] = [None] * (n + 1)
        self._attn_in: list[Any] = [None] * n
        self._cos: list[Any] = [None] * n
        self._sin: list[Any] = [None] * n
        self._handles: list[Any] = []

    def __enter__(self) -> _Recorder:
        n = self.parts.num_layers
        for i, (layer, attn) in enumerate(zip(self.parts.layers, self.parts.attn, strict=True)):

            def layer_pre(_m: Any, args: Any, kwargs: Any, i: int = i) -> None:
                self._resid[i] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

            def attn_pre(_m: Any, args: Any, kwargs: Any, i: int = i) -> None:
                self._attn_in[i] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                pe = kwargs.get("position_embeddings")
                if pe is None and len(args) > 1:
                    pe = args[1]
                self._cos[i], self._sin[i] = pe

            self._handles.append(layer.register_forward_pre_hook(layer_pre, with_kwargs=True))
            self._handles.append(attn.register_forward_pre_hook(attn_pre, with_kwargs=True))

        def norm_pre(_m: Any, args: Any) -> None:
            self._resid[n] = args[0]

        self._handles.append(self.parts.final_norm.register_forward_pre_hook(norm_pre))
        return self

    def take(self) -> _Capture:
        cap = _Capture(list(self._resid), list(self._attn_in), list(self._cos), list(self._sin))
        if any(x is None for x in cap.resid) or any(x is None for x in cap.attn_in):
            raise RuntimeError("the recorder saw no complete forward pass")
        return cap

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def blockwise_supported(lm: LoadedModel, policy: Policy) -> bool:
    """Whether :func:`blockwise_loop` can run ``policy`` on ``lm``: a rule over exactly the
    pure and RAG contexts, and a model whose KV cache keeps every position (rolling back a
    sliding-window cache is not possible)."""
    from .kv_cache import is_full_layer, new_cache

    if tuple(sorted(policy.roles)) != ROLES or policy.decode is not None:
        return False
    if policy.probe_roles:
        try:
            model_parts(lm.model)
        except ValueError:
            return False
    return all(is_full_layer(layer) for layer in new_cache(lm.model).layers)


def blockwise_loop(
    lm: LoadedModel,
    plans: Sequence[PromptPlan],
    policy: Policy,
    *,
    max_new_tokens: int = 64,
    stop: Sequence[str] = (),
    timings: dict[str, float] | None = None,
    speed: Speed | None = None,
) -> Iterator[StepEvent]:
    """:func:`..engine.loop.decode_loop` for a pure/RAG rule, by blockwise verification.

    Yields the same events (each token as soon as its block is verified). Options are read
    from ``speed`` (:class:`..engine.speed.Speed`): ``block`` (fixed block length; None =
    adaptive) and ``drafter`` (``"auto"``, ``"rag"`` or ``"pure"``). ``timings`` also receives the counts
    ``blocks``, ``drafted``, ``accepted`` (drafted tokens kept), ``disagreements``,
    ``verifier_wins`` and ``stale`` (positions rolled back).
    """
    per_query, _ = role_setup(lm, plans, policy)
    if any(set(c) != set(ROLES) for c in per_query):
        raise ValueError("blockwise verification needs a pure and a RAG context for every query")
    timings = timings if timings is not None else {}
    for key in ("blocks", "drafted", "accepted", "disagreements", "verifier_wins", "stale"):
        timings.setdefault(key, 0.0)
    speed = speed if speed is not None else Speed(speculative=True)
    fixed_block = speed.block
    drafter = speed.drafter
    auto = drafter == "auto"
    if auto:
        drafter = "rag"
    if drafter not in ROLES:
        raise ValueError(f"drafter must be 'auto', 'pure' or 'rag', got {drafter!r}")
    probe = policy.probe_roles
    n_q = len(plans)
    pad = lm.pad_token_id

    t0 = time.perf_counter()
    with torch.inference_mode():
        batches = prefill_roles(ROLES, per_query, lm, probe)
        timings["prefill_s"] = timings.get("prefill_s", 0.0) + time.perf_counter() - t0
        t1 = time.perf_counter()
        generated: list[list[int]] = [[] for _ in plans]
        done = [False] * n_q
        n_chosen = [0] * n_q
        pending = [pad] * n_q
        wins = {role: 0 for role in ROLES}

        # Step 0 reads the prefill's logits and probe records, as the step-by-step loop does.
        rows = row_map(batches)
        rows = {role: rows[role] for role in policy.roles}
        for q in range(n_q):
            views = views_for(rows, q)
            choice = policy.choose(views, lm)
            ev = step_event(lm, q, 0, choice, views, generated[q], stop, max_new_tokens)
            n_chosen[q] = 1
            pending[q] = int(choice.token_id)
            done[q] = ev.finished
            _count_disagreement(views, choice, wins, timings)
            yield ev
        for b in batches.values():
            b.records = None

        parts = model_parts(lm.model)
        walked, beta = 0, BETA_PRIOR
        eos = torch.tensor(sorted(lm.eos_token_ids), dtype=torch.long)
        with _Recorder(parts) as rec:
            while not all(done):
                active = [q for q in range(n_q) if not done[q]]
                left = max(max_new_tokens - n_chosen[q] for q in active)
                if fixed_block is not None:
                    k = fixed_block
                else:
                    # Prior: one verifier win in 8 walked positions.
                    rate = (timings["verifier_wins"] + 0.5) / (walked + 4.0)
                    k = best_block(rate, beta)
                k = max(1, min(k, left))
                verifier = "pure" if drafter == "rag" else "rag"
                dr, ve = batches[drafter], batches[verifier]
                d0, v0 = dr.mask.shape[1], ve.mask.shape[1]

                # The drafter: k ordinary one-token steps (the last draft is not fed yet).
                feed = torch.tensor(pending, dtype=torch.long)[:, None]
                d_logits, d_caps, drafts = [], [], []
                ended = torch.tensor(done)
                t_d = time.perf_counter()
                for _ in range(k):
                    lg = dr.extend(feed)[:, -1]
                    d_caps.append(rec.take())
                    d_logits.append(lg)
                    nxt = torch.argmax(lg, dim=-1).cpu()
                    drafts.append(nxt)
                    feed = nxt[:, None]
                    # A drafted EOS is either taken (the query ends) or overruled (the drafts
                    # after it are stale): nothing drafted after it is ever used.
                    ended |= torch.isin(nxt, eos)
                    if bool(ended.all()):
                        break
                k = len(drafts)
                t_v = time.perf_counter()
                # The verifier: the same k inputs in one forward pass.
                block = torch.stack([torch.tensor(pending, dtype=torch.long), *drafts[:-1]], dim=1)
                v_logits = ve.extend(block)
                v_cap = rec.take()
                if k >= 4:  # cost of each block position, in drafter steps (EMA; short
                    # passes take another kernel path and would mislead the linear model)
                    step_s = (t_v - t_d) / k
                    obs = ((time.perf_counter() - t_v) / step_s - 1.0) / k
                    beta = 0.7 * beta + 0.3 * min(max(obs, 0.0), 1.0)
                timings["blocks"] += 1
                timings["drafted"] += k * len(active)

                stale = [0] * n_q
                for q in active:
                    for j in range(k):
                        views = {
                            drafter: ContextView(
                                dr,
                                q,
                                _lazy(d_caps[j], q, 0) if drafter in probe else None,
                                logits=d_logits[j][q],
                                seen_len=d0 + j + 1,
                            ),
                            verifier: ContextView(
                                ve,
                                q,
                                _lazy(v_cap, q, j) if verifier in probe else None,
                                logits=v_logits[q, j],
                                seen_len=v0 + j + 1,
                            ),
                        }
                        views = {role: views[role] for role in policy.roles}
                        choice = policy.choose(views, lm)
                        ev = step_event(
                            lm, q, n_chosen[q], choice, views, generated[q], stop, max_new_tokens
                        )
                        n_chosen[q] += 1
                        _count_disagreement(views, choice, wins, timings)
                        walked += 1
                        yield ev
                        if ev.finished:
                            done[q] = True
                            break
                        tid = int(choice.token_id)
                        if tid != int(drafts[j][q]):
                            pending[q] = tid
                            stale[q] = k - 1 - j
                            timings["verifier_wins"] += 1
                            break
                        timings["accepted"] += 1
                    else:
                        pending[q] = int(drafts[-1][q])
                if any(stale):
                    dr.rollback(stale)
                    ve.rollback(stale)
                    timings["stale"] += sum(stale)
                if auto and wins[verifier] > wins[drafter]:
                    drafter = verifier
        timings["decode_s"] = timings.get("decode_s", 0.0) + time.perf_counter() - t1


def best_block(rate: float, beta: float, max_block: int = MAX_BLOCK) -> int:
    """The block length with the least expected cost per chosen token.

    A block of ``k`` costs ``k`` drafter steps plus a verifier pass worth ``1 + beta·k``
    steps (one read of the weights, then ``beta`` per position; ``beta`` is measured while
    decoding on passes of 4+ positions: about 0.1 on this 2-core CPU, near 0 on a GPU). It yields ``(1 - (1-r)^k) / r`` tokens when
    the verifier wins a position with probability ``r`` (the block ends at its first win).
    """
    r = min(max(rate, 1e-6), 1.0)
    best, best_cost = 1, math.inf
    for k in range(1, max_block + 1):
        tokens = (1.0 - (1.0 - r) ** k) / r
        cost = (k + 1.0 + beta * k) / tokens
        if cost < best_cost - 1e-12:
            best, best_cost = k, cost
    return max(min(best, max_block), min(MIN_BLOCK, max_block))


def _lazy(cap: _Capture, row: int, t: int) -> Any:
    return lambda: cap.record(row, t)


def _count_disagreement(
    views: dict[str, ContextView], choice: Any, wins: dict[str, int], timings: dict[str, float]
) -> None:
    a = int(torch.argmax(views["pure"].logits).item())
    b = int(torch.argmax(views["rag"].logits).item())
    if a != b:
        timings["disagreements"] += 1
        tid = int(choice.token_id)
        if tid == a:
            wins["pure"] += 1
        elif tid == b:
            wins["rag"] += 1
