"""Faster CPU paths for the few-row work of decoding: linear layers and attention.

Linear layers
-------------

Decoding multiplies a few rows (one token per step, two in a fused pure+RAG step, ``k``
tokens in a blockwise verifier pass, a dozen rows in a logit lens) by every weight matrix of
the model. BLAS libraries pick their kernel by shape, and for such skinny products the pick
is often poor, in ways that differ from one CPU to the next and are not monotone in the
number of rows (the figures are in docs/results.md, "Speed-path measurements moved from
docstrings").

So nothing is assumed: :func:`plan_for` times, for each weight shape of the model and each
bucket of row counts (1, 2, 3-4, 5-8, 9-16, 17-32, 33-64, each timed at a count inside it),
the strategies of :data:`STRATEGIES` (``linear``: ``F.linear``; ``dup``: one row
duplicated, then ``F.linear``; ``wxt``: the transposed product ``W @ x.T``, one row
duplicated; ``tiled``: ``F.linear`` on slices of :data:`TILE` output features; ``pad``: zero
rows up to the bucket's top, then ``F.linear``) and keeps the fastest per bucket. :func:`install` routes each
``nn.Linear`` call with at most :data:`MAX_ROWS` rows to its plan; shapes where ``F.linear``
wins every bucket keep the stock ``forward``. It is applied by :func:`..models.load_model` to
float32 models on CPU (``TOKRAG_CPU_KERNELS=auto`` (default) measures, ``on`` forces the
transposed product, ``off`` keeps the stock paths). The numbers are those of the same dot
products summed in a different order (differences in the last bits, as between any two BLAS
kernels).

Attention
---------
With a KV cache and a mask (more than one new position, a left-padded batch, a cache with
rolled-back holes), transformers' SDPA path repeats the key/value heads for grouped-query
attention and torch falls back to its math kernel: a 2-token pass then costs about twice a
1-token step. :func:`few_query_attention` computes the same attention for up to
:data:`MAX_ROWS` query positions without repeating keys (one query per row: torch's flash
kernel with the mask and ``enable_gqa``, and in a left-padded batch each row over its own
keys only; several: the query heads grouped per key/value head) and delegates everything
else (prefill, no mask, CUDA, soft-capping, sinks) to transformers' SDPA function. It is
registered as the attention implementation ``"tokrag_sdpa"`` (SDPA's boolean masks) and set
by :func:`maybe_install` on float32 CPU models unless ``TOKRAG_CPU_KERNELS=off``.

A prefill that packs two contexts of one query into one sequence (the RAG prompt, then the
part of the pure prompt after the head both share: :data:`PACKED_PREFILL`) attends as two
causal products, one per context, instead of one product under a full mask.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import json
import os
import statistics
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .. import config
from ..attention import ACTIVE_TAP, attention_window, set_lens_head_product
from ..paths import cache_dir

#: Calls with more rows than this use ``F.linear`` (GEMM-shaped work, e.g. prefill).
MAX_ROWS = 64
#: Output features per slice of the ``tiled`` strategy.
TILE = 512
#: Only matrices with at least this many output features are tried ``tiled``.
MIN_TILED_FEATURES = 8 * TILE
#: Row-count buckets: (row count timed, largest row count of the bucket). The timed count is
#: inside the bucket, not at its top: BLAS kernels can be fast at 16 rows and twice as slow
#: at 12, which the ``pad`` strategy turns into the cost at 16.
BUCKETS = ((1, 1), (2, 2), (3, 4), (6, 8), (12, 16), (24, 32), (48, MAX_ROWS))
STRATEGIES = ("linear", "dup", "wxt", "tiled", "pad")
#: A strategy replaces ``F.linear`` in a bucket only below this share of its time.
MIN_GAIN = 0.9
#: Interleaved rounds of :func:`plan_for` (the median of the per-round ratios decides).
PLAN_ROUNDS = 3

_ATTR = "_tokrag_skinny"
_PLAN = "_tokrag_plan"
_PLAN_NAMES = "_tokrag_plan_names"
#: On a model: :func:`verify_install`'s verdict per bucket (read by :func:`speed_paths`).
_VERDICT = "_tokrag_verdict"
#: Marks the LM head of a model set up by :func:`install` (not the stock paths), and holds
#: its :func:`packed_head` product (False: measured slower).
_HEAD_OK = "_tokrag_head_ok"
_HEAD = "_tokrag_packed_head"

Kernel = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _k_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w, b)


def _k_dup(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    if x.shape[0] != 1:
        return F.linear(x, w, b)
    return F.linear(torch.cat([x, x]), w, b)[:1]


def _k_wxt(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    # Row-major rows in, row-major rows out: the weight is read row by row as stored.
    m = x.shape[0]
    x2 = torch.cat([x, x]) if m == 1 else x
    out = torch.mm(w, x2.t())[:, :m].t().contiguous()
    return out + b if b is not None else out


def _k_pad(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, rows: int) -> torch.Tensor:
    # Zero rows up to ``rows`` (the top of the bucket), then F.linear; the extra rows are
    # dropped. Each output row is the same dot products as without them.
    m = x.shape[0]
    if m >= rows:
        return F.linear(x, w, b)
    return F.linear(torch.cat([x, x.new_zeros(rows - m, x.shape[1])]), w, b)[:m]


def _k_tiled(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    if torch.is_grad_enabled() and (w.requires_grad or x.requires_grad):
        return F.linear(x, w, b)  # out= writes are not differentiable
    n = w.shape[0]
    x2 = torch.cat([x, x]) if x.shape[0] == 1 else x
    out = x.new_empty((x2.shape[0], n))
    for s in range(0, n, TILE):
        e = min(s + TILE, n)
        torch.mm(x2, w[s:e].t(), out=out[:, s:e])
    out = out[: x.shape[0]]
    return out + b if b is not None else out


KERNELS: dict[str, Kernel] = {"linear": _k_linear, "dup": _k_dup, "wxt": _k_wxt, "tiled": _k_tiled}


def kernel(name: str, hi: int = MAX_ROWS) -> Kernel:
    """The kernel of strategy ``name`` for a bucket whose largest row count is ``hi``."""
    if name == "pad":
        return functools.partial(_k_pad, rows=hi)
    return KERNELS[name]


def _few_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: Callable[[int], Kernel]
) -> torch.Tensor:
    """``F.linear`` for any leading shape, by ``kernel(rows)`` when there are few rows."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if m == 0 or m > MAX_ROWS:
        return F.linear(x, weight, bias)
    out = kernel(m)(x.reshape(m, k).contiguous(), weight, bias)
    return out.contiguous().view(*x.shape[:-1], weight.shape[0])


def few_row_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, strategy: str = "wxt"
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by one of :data:`STRATEGIES` (any leading shape)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    return _few_rows(x, weight, bias, lambda m: kernel(strategy, _bucket_top(m)))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as ``(weight @ x.T).T`` for few rows."""
    return few_row_linear(x, weight, bias, "wxt")


def _time(fn: Any, reps: int, warm: bool = True) -> float:
    """Best of ``reps`` timed runs of ``fn`` (after one untimed run unless ``warm=False``)."""
    if warm:
        fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


#: Measured plans per (out features, in features, dtype, threads): one per process.
_PLANS: dict[tuple[Any, ...], tuple[str, ...]] = {}


def _machine_id() -> str:
    """What the plans depend on besides the shape: the CPU (model, cache, instruction set),
    torch's version and the plan format. Hashed into the plan file's name."""
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if not line.strip():
                    break  # the first processor's block is enough
                if line.split(":")[0].strip() in ("model name", "cache size", "flags", "cpu family", "model"):
                    cpu += line.strip() + "\n"
    except OSError:  # pragma: no cover - not Linux
        import platform

        cpu = platform.processor() + platform.machine()
    fmt = f"{torch.__version__}|{BUCKETS}|{STRATEGIES}|{MIN_GAIN}|{TILE}|{MAX_ROWS}|rounds{PLAN_ROUNDS}"
    return hashlib.sha1((cpu + fmt).encode()).hexdigest()[:16]


def _plan_file() -> Path | None:
    """Where measured plans persist between processes (``$TOKRAG_CACHE_DIR/kernel_plans``),
    or None when ``TOKRAG_KERNEL_PLAN_CACHE=0``."""
    if not config.kernel_plan_cache():
        return None
    return cache_dir() / "kernel_plans" / f"{_machine_id()}.json"


def _disk_key(key: tuple[Any, ...]) -> str:
    n, k, dtype, threads = key
    return f"{n}x{k}:{str(dtype).removeprefix('torch.')}:{threads}"


def _load_plans(path: Path) -> dict[str, tuple[str, ...]]:
    """The plans in ``path``; entries that are not valid plans (or an unreadable file) are
    ignored, so a damaged file only costs a new measurement."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    return {
        k: tuple(v)
        for k, v in raw.items()
        if isinstance(v, list) and len(v) == len(BUCKETS) and all(x in STRATEGIES for x in v)
    }


def _save_plan(path: Path, key: str, plan: tuple[str, ...]) -> None:
    """Add one plan to ``path``."""
    plans = _load_plans(path)
    plans[key] = plan
    _write_json(path, {k: list(v) for k, v in sorted(plans.items())})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to a temporary file, then rename it into place; a read-only or full
    disk only means the next process measures again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


def plan_for(weights: torch.Tensor | list[torch.Tensor], reps: int = 1) -> tuple[str, ...]:
    """The fastest strategy for each of :data:`BUCKETS` on a weight shape, measured on this
    machine: each timing runs the product over every weight given (all the model's matrices
    of that shape), so that, as in a decode step, they stream from memory rather than sit in
    cache. After one warm-up run of each, the strategies are timed in :data:`PLAN_ROUNDS`
    rounds (``reps`` runs each, best kept), in an order rotated from round to round, and
    each is compared with ``F.linear`` timed in the same round: a strategy replaces it only
    if the median of its per-round ratios is below :data:`MIN_GAIN` (a burst of load from
    another process falls on one round, not on one strategy). A few seconds for
    SmolLM2-135M; kept per shape and thread count for the process and, per machine (CPU,
    torch version), in ``$TOKRAG_CACHE_DIR/kernel_plans`` for later processes
    (``TOKRAG_KERNEL_PLAN_CACHE=0``: measure in every process). :func:`verify_install`
    then checks the plans on the whole model."""
    ws = [weights] if isinstance(weights, torch.Tensor) else list(weights)
    n, k = ws[0].shape
    key = (n, k, ws[0].dtype, torch.get_num_threads())
    if key in _PLANS:
        return _PLANS[key]
    path = _plan_file()
    if path is not None:
        stored = _load_plans(path).get(_disk_key(key))
        if stored is not None:
            _PLANS[key] = stored
            return stored
    ws = [w.detach() for w in ws]
    names = [s for s in STRATEGIES if s != "tiled" or n >= MIN_TILED_FEATURES]
    plan = []
    with torch.inference_mode():
        for m, hi in BUCKETS:
            x = torch.randn(m, k, dtype=ws[0].dtype)

            def run(s: str, x: torch.Tensor = x, hi: int = hi) -> None:
                fn = kernel(s, hi)
                for w in ws:
                    fn(x, w, None)

            tried = [s for s in names if (s != "dup" or m == 1) and (s != "pad" or m < hi)]
            for s in tried:
                run(s)  # warm-up
            times: dict[str, list[float]] = {s: [] for s in tried}
            for r in range(PLAN_ROUNDS):
                for s in tried[r % len(tried) :] + tried[: r % len(tried)]:
                    times[s].append(_time(lambda s=s: run(s), reps, warm=False))
            ratio = {
                s: statistics.median(a / b for a, b in zip(times[s], times["linear"], strict=True))
                for s in tried
            }
            best = min(ratio, key=ratio.__getitem__)
            # Another strategy must be clearly faster than F.linear, not by timing noise.
            plan.append(best if ratio[best] < MIN_GAIN else "linear")
    _PLANS[key] = tuple(plan)
    if path is not None:
        _save_plan(path, _disk_key(key), _PLANS[key])
    return _PLANS[key]


def _route(plan: tuple[str, ...]) -> list[Kernel]:
    """Row count (0..MAX_ROWS) -> kernel."""
    table: list[Kernel] = [_k_linear]
    lo = 1
    for (_, hi), name in zip(BUCKETS, plan, strict=True):
        table += [kernel(name, hi)] * (hi - lo + 1)
        lo = hi + 1
    return table


def _bucket_top(m: int) -> int:
    """The largest row count of the bucket holding ``m`` rows."""
    for _, hi in BUCKETS:
        if m <= hi:
            return hi
    return m


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _few_rows(x, self.weight, self.bias, getattr(self, _PLAN).__getitem__)


def install(model: torch.nn.Module, mode: str = "on") -> int:
    """Route few-row calls of ``model``'s ``nn.Linear`` modules to faster kernels; returns how
    many modules were changed. ``mode="on"``: the transposed product for every few-row call;
    ``"auto"``: each weight shape's measured plan (:func:`plan_for`), and modules whose plan
    is ``F.linear`` throughout are left as they are."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Linear):
        setattr(head, _HEAD_OK, True)  # the logit lens may use packed_head()
    mods = [m for m in model.modules() if type(m) is torch.nn.Linear and not getattr(m, _ATTR, False)]
    groups: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    for mod in mods:
        groups.setdefault((*mod.weight.shape, mod.weight.dtype), []).append(mod.weight)
    n = 0
    for mod in mods:
        if mode == "auto":
            plan = plan_for(groups[(*mod.weight.shape, mod.weight.dtype)])
            if all(p == "linear" for p in plan):
                continue
        else:
            plan = ("wxt",) * len(BUCKETS)
        setattr(mod, _PLAN, _route(plan))
        setattr(mod, _PLAN_NAMES, tuple(plan))
        mod.forward = types.MethodType(_forward, mod)
        setattr(mod, _ATTR, True)
        n += 1
    return n


#: Interleaved rounds of :func:`verify_install`, and the share of the stock model's time a
#: bucket's plans must take there to be kept (a tie goes to the stock path).
VERIFY_ROUNDS = 5
VERIFY_GAIN = 0.98


def _verify_file() -> Path | None:
    path = _plan_file()
    return None if path is None else path.with_name(path.stem + ".verify.json")


def _routed(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if getattr(m, _ATTR, False)]


def _verify_key(mods: list[torch.nn.Module]) -> str:
    """What a verdict depends on: every routed module's shape and plan, and the threads."""
    plans = sorted(
        f"{m.weight.shape[0]}x{m.weight.shape[1]}:{str(m.weight.dtype).removeprefix('torch.')}:"
        + ",".join(getattr(m, _PLAN_NAMES, ()))
        for m in mods
    )
    return hashlib.sha1(f"{plans}|{torch.get_num_threads()}".encode()).hexdigest()[:16]


def _model_step(model: torch.nn.Module, rows: int) -> Callable[[], Any]:
    """One pass of ``rows`` token positions through ``model`` with the logits of every one:
    the linear layers and LM head see ``rows`` rows, as in a decode step of ``rows`` rows."""
    vocab = int(getattr(model.config, "vocab_size", 2) or 2)
    gen = torch.Generator().manual_seed(rows)
    ids = torch.randint(0, vocab, (1, rows), generator=gen)
    return lambda: model(input_ids=ids, use_cache=False)


def verify_install(model: torch.nn.Module, rounds: int = VERIFY_ROUNDS) -> dict[str, dict[str, Any]]:
    """Check the installed plans on the whole model, per bucket of row counts: a forward
    pass of the bucket's timed row count with the plans and with the stock ``nn.Linear``
    paths, in :data:`VERIFY_ROUNDS` interleaved rounds (the order alternating); where the
    median of the per-round ratios is not below :data:`VERIFY_GAIN`, the bucket goes back to
    ``F.linear`` in every module (and a module left with ``F.linear`` throughout gets its
    stock ``forward`` back). So a row count never runs a path measured slower than the plain
    one on this model, whatever the per-shape timings said. The verdicts are kept per
    machine next to the plans (a later process applies them untimed) and on the model
    (``{"rows lo-hi": {"ratio", "kept"}}``, for :func:`speed_paths`)."""
    mods = _routed(model)
    if not mods:
        setattr(model, _VERDICT, {})
        return {}
    key = _verify_key(mods)
    path = _verify_file()
    stored: dict[str, Any] = {}
    if path is not None:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            stored = raw if isinstance(raw, dict) else {}
        except (OSError, ValueError):
            stored = {}
    known = stored.get(key) if isinstance(stored.get(key), dict) else None
    verdict: dict[str, dict[str, Any]] = {}
    lo = 1
    timed = False
    for i, (m, hi) in enumerate(BUCKETS):
        label = f"rows {lo}-{hi}" if hi > lo else f"rows {lo}"
        rows = range(lo, hi + 1)
        lo = hi + 1
        if all(getattr(mod, _PLAN_NAMES)[i] == "linear" for mod in mods):
            continue
        ratio = known.get(label) if known is not None else None
        if not isinstance(ratio, int | float):
            ratio = _verify_bucket(model, mods, m, rounds)
            timed = True
        kept = ratio < VERIFY_GAIN
        verdict[label] = {"ratio": float(ratio), "kept": kept}
        if not kept:
            for mod in mods:
                table = getattr(mod, _PLAN)
                for r in rows:
                    table[r] = _k_linear
                names = list(getattr(mod, _PLAN_NAMES))
                names[i] = "linear"
                setattr(mod, _PLAN_NAMES, tuple(names))
    for mod in mods:
        if all(p == "linear" for p in getattr(mod, _PLAN_NAMES)):
            del mod.forward
            setattr(mod, _ATTR, False)
    if timed and path is not None:
        _write_json(path, {**stored, key: {k: v["ratio"] for k, v in verdict.items()}})
    setattr(model, _VERDICT, verdict)
    return verdict


def _verify_bucket(model: torch.nn.Module, mods: list[torch.nn.Module], rows: int, rounds: int) -> float:
    """Median over ``rounds`` of (model pass with the plans) / (the same with the stock
    ``nn.Linear`` forward), ``rows`` positions, the two timed side by side."""
    step = _model_step(model, rows)

    def plans_on(on: bool) -> None:
        for mod in mods:
            if on:
                mod.forward = types.MethodType(_forward, mod)
            elif "forward" in mod.__dict__:
                del mod.forward

    ratios = []
    try:
        with torch.inference_mode():
            for on in (True, False):  # warm-up
                plans_on(on)
                step()
            for r in range(rounds):
                t = {}
                for on in ((True, False) if r % 2 == 0 else (False, True)):
                    plans_on(on)
                    t[on] = _time(step, 1, warm=False)
                ratios.append(t[True] / t[False])
    finally:
        plans_on(True)
    return statistics.median(ratios)


def uninstall(model: torch.nn.Module) -> int:
    """Undo :func:`install` (and drop a packed LM head)."""
    n = 0
    if hasattr(model, _VERDICT):
        delattr(model, _VERDICT)
    for mod in model.modules():
        for attr in (_HEAD_OK, _HEAD):
            if hasattr(mod, attr):
                delattr(mod, attr)
        if getattr(mod, _ATTR, False):
            del mod.forward
            setattr(mod, _ATTR, False)
            n += 1
    return n


def installed(model: torch.nn.Module) -> bool:
    return any(getattr(m, _ATTR, False) for m in model.modules())


def model_plans(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """The measured plan of each weight shape of ``model`` ("out x in" -> per bucket)."""
    out: dict[str, tuple[str, ...]] = {}
    for mod in model.modules():
        if type(mod) is torch.nn.Linear:
            n, k = mod.weight.shape
            key = (n, k, mod.weight.dtype, torch.get_num_threads())
            if key in _PLANS:
                out[f"{n}x{k}"] = _PLANS[key]
    return out


ATTN_IMPLEMENTATION = "tokrag_sdpa"

#: Set around a packed prefill: ``(R, H)``, the sequence's first ``R`` positions are one
#: causal context and the rest a second one that also sees the first ``H`` positions (the
#: prompt head both share). The attention mask passed along says the same, so a path that
#: does not know this layout still computes it (slowly, as one masked product).
PACKED_PREFILL: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "tokrag_packed_prefill", default=None
)
#: One-query batches up to this many rows attend row by row when the mask is left padding.
MAX_SPLIT_ROWS = 4

# (mask, starts) of the last mask seen; replaced as one tuple so threads never mix two.
_pad_cache: tuple[torch.Tensor | None, list[int] | None] = (None, None)


def _left_pad_starts(mask: torch.Tensor) -> list[int] | None:
    """Per row, the first attended key of a [B, 1, 1, T] boolean mask that is left padding
    only (False..False True..True), else None. Computed once per forward pass: every layer
    gets the same mask tensor."""
    global _pad_cache
    if mask.dtype != torch.bool or mask.shape[1] != 1 or mask.shape[2] != 1:
        return None
    cached_mask, cached = _pad_cache
    if cached_mask is mask:
        return cached
    m = mask[:, 0, 0, :]
    starts_t = (~m).sum(-1)
    expected = torch.arange(m.shape[-1], device=m.device)[None, :] >= starts_t[:, None]
    ok = torch.equal(m, expected) and bool((starts_t < m.shape[-1]).all())
    starts = [int(x) for x in starts_t] if ok else None
    _pad_cache = (mask, starts)
    return starts


#: Rows of a left-padded batch whose first keys lie within this many keys of each other (or
#: a quarter of the keys, if more) attend in one call, from the earliest of their first keys.
SEGMENT_KEYS = 64


def _pad_segments(starts: list[int], n_keys: int) -> list[tuple[int, int, int]]:
    """Consecutive rows of a left-padded batch in runs whose first attended keys are close
    (:data:`SEGMENT_KEYS`): ``(first row, end row, first key of the run)`` per run."""
    gap = max(SEGMENT_KEYS, n_keys // 4)
    segs = []
    a, lo, hi = 0, starts[0], starts[0]
    for r in range(1, len(starts)):
        x = starts[r]
        if max(hi, x) - min(lo, x) > gap:
            segs.append((a, r, lo))
            a, lo, hi = r, x, x
        else:
            lo, hi = min(lo, x), max(hi, x)
    segs.append((a, len(starts), lo))
    return segs


def few_query_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention for a few query positions against a cache, with a mask, on CPU.

    ``query`` [B, H, q, hd], ``key``/``value`` [B, Hkv, T, hd], ``attention_mask`` SDPA's
    [B, 1, q, T] (bool, True = attend, or additive float). Returns ([B, q, H, hd], None),
    as transformers' attention functions do.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, q, hd = query.shape
    active = ACTIVE_TAP.get()
    if active:
        _keep_queries(module, query, key, dropout, scaling, kwargs, active)
    packed = PACKED_PREFILL.get()
    if packed is not None and b == 1 and q == key.shape[2] and q > packed[0]:
        got = _packed_attention(module, query, key, value, dropout, scaling, kwargs, *packed)
        if got is not None:
            return got, None
    if (
        attention_mask is None
        or q > MAX_ROWS
        or not _plain_attention(module, query, key, dropout, kwargs)
        or attention_mask.dim() != 4
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = scaling if scaling is not None else hd**-0.5
    if q == 1 and b <= MAX_SPLIT_ROWS:
        starts = _left_pad_starts(attention_mask)
        if starts is not None:
            # Left padding only (a fused pure+RAG batch): each row attends to its own keys,
            # so a short row does not pay for the padding up to the longest one.
            out = torch.cat(
                [
                    F.scaled_dot_product_attention(
                        query[r : r + 1],
                        key[r : r + 1, :, s_:],
                        value[r : r + 1, :, s_:],
                        scale=scale,
                        enable_gqa=True,
                    )
                    for r, s_ in enumerate(starts)
                ]
            )
            return out.transpose(1, 2).contiguous(), None
    if q == 1 and b > MAX_SPLIT_ROWS:
        starts = _left_pad_starts(attention_mask)
        segs = _pad_segments(starts, key.shape[2]) if starts is not None else None
        if segs is not None and (len(segs) > 1 or segs[0][2] > 0):
            # Left padding only, in runs of rows that start close together (a fused batch is
            # all pure rows, then all RAG rows): each run attends from its own first key, so
            # the short rows do not read the padding up to the longest one.
            outs = []
            for a, e, lo in segs:
                m = None if all(x == lo for x in starts[a:e]) else attention_mask[a:e, :, :, lo:]
                outs.append(
                    F.scaled_dot_product_attention(
                        query[a:e], key[a:e, :, lo:], value[a:e, :, lo:],
                        attn_mask=m, scale=scale, enable_gqa=True,
                    )
                )
            return torch.cat(outs).transpose(1, 2).contiguous(), None
    if q == 1 or (b == 1 and attention_mask.dtype != torch.bool):
        # One query per row (a decode step of a padded or fused batch), or several queries of
        # one sequence under an additive mask (a packed two-context step): torch's CPU flash
        # kernel takes the mask and the key/value heads as they are, and reads each key once.
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None
    return _grouped_attention(query, key, value, attention_mask, scale)[0], None


def _packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    scaling: float | None,
    kwargs: dict[str, Any],
    r: int,
    head: int,
) -> torch.Tensor | None:
    """Attention of a packed two-context prefill (see :data:`PACKED_PREFILL`): positions
    ``< r`` causally over themselves, the rest over the first ``head`` positions and
    causally over themselves. Returns [1, N, H, hd], or None where the module attends in a
    way this does not compute (the caller then applies the mask as it is)."""
    if not _plain_attention(module, query, key, dropout, kwargs) or attention_window(module):
        return None
    hd = query.shape[-1]
    scale = scaling if scaling is not None else hd**-0.5
    n = query.shape[2]
    first = F.scaled_dot_product_attention(
        query[:, :, :r], key[:, :, :r], value[:, :, :r], is_causal=True, scale=scale, enable_gqa=True
    )
    tail = n - r
    k2 = torch.cat([key[:, :, :head], key[:, :, r:]], dim=2)
    v2 = torch.cat([value[:, :, :head], value[:, :, r:]], dim=2)
    mask = torch.ones(tail, head + tail, dtype=torch.bool, device=query.device)
    mask[:, head:] = torch.ones(tail, tail, dtype=torch.bool, device=query.device).tril_()
    second = F.scaled_dot_product_attention(
        query[:, :, r:], k2, v2, attn_mask=mask, scale=scale, enable_gqa=True
    )
    # [1, N, H, hd] in one copy (the flash kernel's outputs are [1, q, H, hd] in memory).
    return torch.cat([first.transpose(1, 2), second.transpose(1, 2)], dim=1)


def _plain_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, dropout: float, kwargs: dict[str, Any]
) -> bool:
    """Whether this call is attention our CPU paths compute as written: on CPU, no dropout,
    whole query groups per key/value head, no soft-capping, position bias or sinks."""
    return not (
        query.device.type != "cpu"
        or dropout
        or query.shape[1] % key.shape[1]
        or kwargs.get("softcap") is not None
        or kwargs.get("position_bias") is not None
        or getattr(module, "sinks", None) is not None
    )


def _grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention with the query heads grouped per key/value head (no repeated keys).

    ``query`` [B, H, q, hd], ``key``/``value`` [B, Hkv, T, hd], ``attention_mask`` None or
    [B, 1, q, T] (bool or additive). Returns the output [B, q, H, hd] and the probabilities
    [B, Hkv, g, q, T] (query head i*g + j is ``[:, i, j]``; masked keys get 0)."""
    b, h, q, hd = query.shape
    hkv, t = key.shape[1], key.shape[2]
    g = h // hkv
    # Query head i*g + j reads key/value head i: group the g query heads of each key head.
    qg = query.reshape(b, hkv, g * q, hd)
    scores = torch.matmul(qg, key.transpose(-1, -2)).mul_(scale).view(b, hkv, g, q, t)
    if attention_mask is not None:
        mask = attention_mask[:, :, None]  # [B, 1, 1, q, T]
        if mask.dtype == torch.bool:
            # A row with no key at all (a padded query) gets finite scores, not NaN.
            scores = scores.masked_fill_(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores.add_(mask)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs.view(b, hkv, g * q, t), value)  # [B, Hkv, g*q, hd]
    return out.view(b, h, q, hd).transpose(1, 2).contiguous(), probs


def _keep_queries(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    dropout: float,
    scaling: float | None,
    kwargs: dict[str, Any],
    taps: tuple[Any, ...],
) -> None:
    """Leave each active probe's rows of this layer's rotated query (and its scaling) in its
    tap, so that an attention row read later is one ``q·K`` with the cached keys. Only for
    attention the recomputation reproduces (:func:`_plain_attention`, no sliding window)."""
    idx = getattr(module, "layer_idx", None)
    if idx is None or attention_window(module):
        return
    if not _plain_attention(module, query, key, dropout, kwargs):
        return
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    for tap in taps:
        if not 0 <= idx < len(tap.query):
            continue
        if tap.positions is not None:
            if query.shape[0] != 1:
                continue
            rows = query[0, :, tap.positions].transpose(0, 1)  # [rows, H, hd]
            if query.shape[2] > rows.shape[0] and isinstance(tap.positions, slice):
                rows = rows.clone()  # not a view keeping a whole prefill's queries alive
        else:
            rows = query[:, :, -1]
            if query.shape[2] > 1:
                rows = rows.clone()  # a prefill: keep the last position, not the whole pass
        tap.query[idx] = rows.detach()
        tap.scale[idx] = scale


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, few_query_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)


def install_attention(model: Any) -> bool:
    """Use :func:`few_query_attention` in ``model`` when it runs SDPA now; returns whether."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    _register_attention()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return True


#: ``config.model_type`` of the architectures the speed paths are measured correct on: the
#: matrix of ``tests/test_architectures.py`` (tiny random models, float32 and bfloat16) and
#: the packaged models (SmolLM2 is ``llama``, Gemma-3-270M ``gemma3_text``).
COVERED_ARCHITECTURES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text", "phi3", "olmo2", "granite"}
)
#: Why :func:`maybe_install` left the CPU paths off on a model (read by :func:`speed_paths`).
_SPEED_OFF = "_tokrag_speed_off"


def _first_parameter(model: Any) -> torch.Tensor | None:
    try:
        return next(model.parameters())
    except StopIteration:
        return None


def _architecture_reason(model: Any) -> str | None:
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in COVERED_ARCHITECTURES:
        return f"architecture {kind!r} is not in the tested matrix (tests/test_architectures.py)"
    return None


def speed_off_reason(model: Any) -> str | None:
    """Why the CPU speed paths (few-row kernels, few-query attention, packed prefill, packed
    LM head) do not apply to ``model``, in a few words, or None where they do: they are
    measured correct on CPU, in float32, for the architectures of the matrix only."""
    p = _first_parameter(model)
    if p is None:
        return "the model has no parameters"
    if p.device.type != "cpu":
        return f"device {p.device.type}: the CPU speed paths are measured on CPU only"
    if p.dtype != torch.float32:
        return f"dtype {str(p.dtype).removeprefix('torch.')}: the CPU speed paths are measured in float32 only"
    return _architecture_reason(model)


def fusion_off_reason(model: Any) -> str | None:
    """Why contexts are not fused into one batch on ``model`` (None where they are): fusing
    is measured to give the step-by-step tokens on CPU, in float32 and bfloat16, for the
    architectures of the matrix; a GPU kernel may round a padded batch differently."""
    p = _first_parameter(model)
    if p is not None and p.device.type != "cpu":
        return f"device {p.device.type}: fused contexts are measured on CPU only"
    return _architecture_reason(model)


def _kernel_detail(model: Any) -> str:
    """The whole-model verdicts of :func:`verify_install`, e.g. ``rows 1 0.91x kept; rows
    3-4 1.01x -> stock``."""
    verdict = getattr(model, _VERDICT, None)
    if not verdict:
        return ""
    parts = [
        f"{label} {v['ratio']:.2f}x {'kept' if v['kept'] else '-> stock'}" for label, v in verdict.items()
    ]
    return " (model pass with plans / stock: " + "; ".join(parts) + ")"


def _head_detail(model: Any) -> str:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    choice = getattr(head, _HEAD, None)
    if choice is None:
        return f" (measured at the first logit lens of >= {HEAD_MIN_ROWS} rows)"
    return " (measured faster)" if choice else ""


def speed_paths(model: Any) -> dict[str, str]:
    """Each speed path of ``model``: ``"on"`` or ``"off: <reason>"`` (``cpu_kernels``,
    ``packed_prefill``, ``packed_head``, ``fused_contexts``; environment switches are read
    per decode and not reflected here), with what was measured where a path was chosen by
    timing on this machine."""
    off = getattr(model, _SPEED_OFF, None)
    attention = getattr(model.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION
    kernels = installed(model)
    fusion = fusion_off_reason(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_ok = getattr(head, _HEAD_OK, False)
    if getattr(head, _HEAD, None) is False:
        head_state = "off: measured slower than the routed product on this machine"
    elif head_ok:
        head_state = "on" + _head_detail(model)
    else:
        head_state = f"off: {off or 'no few-row plan installed'}"
    detail = _kernel_detail(model)
    return {
        "cpu_kernels": ("on" + detail)
        if kernels
        else f"off: {off or 'no few-row plan installed' + detail}",
        "packed_prefill": "on" if attention else f"off: {off or 'attention is not ' + ATTN_IMPLEMENTATION}",
        "packed_head": head_state,
        "fused_contexts": "on" if fusion is None else f"off: {fusion}",
    }


def maybe_install(model: Any, mode: str | None = None) -> bool:
    """On a float32 CPU model: the few-query attention path and, per ``mode`` (default
    ``$TOKRAG_CPU_KERNELS``), the few-row linear plans. Returns whether any linear module was
    changed.

    ``mode``: ``auto`` (default: measured plans per weight shape), ``on`` (the transposed
    product for every few-row call) or ``off`` (stock paths throughout).
    """
    if mode is None:
        mode = config.cpu_kernels()
    mode = mode.strip().lower()
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"cpu_kernels (TOKRAG_CPU_KERNELS) must be 'auto', 'on' or 'off', got {mode!r}")
    if mode == "off":
        setattr(model, _SPEED_OFF, "cpu_kernels='off'")
        return False
    reason = speed_off_reason(model)
    setattr(model, _SPEED_OFF, reason)
    if reason is not None:
        return False
    install_attention(model)
    changed = install(model, mode) > 0
    if changed and mode == "auto":
        verify_install(model)
        changed = installed(model)
    return changed


# ----------------------------------------------------------------------- packed LM head
#: Rows at which :func:`packed_head` compares the two products (a logit lens of one
#: disagreement step reads ~10-16 rows), and below which the routed product is kept.
HEAD_ROWS = 14
HEAD_MIN_ROWS = 6
#: The packed product replaces the routed one only below this share of its time (it costs a
#: second copy of the weight, so a marginal gain is not worth it).
HEAD_GAIN = 0.75
#: Interleaved rounds of that comparison (the median of the per-round ratios decides).
HEAD_ROUNDS = 5
#: Measured choices per machine and weight shape, for the process.
_HEAD_CHOICE: dict[str, bool] = {}


def _head_file() -> Path | None:
    path = _plan_file()
    return None if path is None else path.with_name(path.stem + ".head.json")


def _stored_head_choices() -> dict[str, Any]:
    path = _head_file()
    if path is None:
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _known_head_choice(key: str) -> bool | None:
    """The choice measured for ``key`` in this process or kept on disk, or None."""
    if key not in _HEAD_CHOICE:
        stored = _stored_head_choices().get(key)
        if not isinstance(stored, bool):
            return None
        _HEAD_CHOICE[key] = stored
    return _HEAD_CHOICE[key]


def _remember_head_choice(key: str, choice: bool) -> None:
    _HEAD_CHOICE[key] = choice
    path = _head_file()
    if path is not None:
        _write_json(path, {**_stored_head_choices(), key: choice})


def packed_head(head: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A faster many-row product with a model's LM head, or None: the weight reordered once
    into oneDNN's blocked layout and multiplied by oneDNN's GEMM.

    The logit lens of a Tok-RAG disagreement step multiplies ~10-16 rows by the large head,
    a shape where oneDNN on a reordered weight can beat MKL by about 2x (figures in
    docs/results.md); at 1-2 rows the routed product stays faster. The copy costs the
    weight's size again, so it is made only where it is measured at :data:`HEAD_ROWS` rows to take less than :data:`HEAD_GAIN` of the
    routed product's time (kept per machine next to the kernel plans), and only for calls of
    at least :data:`HEAD_MIN_ROWS` rows. ``TOKRAG_PACKED_HEAD``: ``auto`` (default),
    ``on`` (always, where oneDNN is available), ``off``. The sums are the same dot products
    in another order (last-bit differences, as between any two BLAS kernels); the
    step-by-step and fast decoders share it, so their decisions stay identical.
    """
    cached = getattr(head, _HEAD, None)
    if cached is not None:
        return cached or None
    mode = config.packed_head()
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"TOKRAG_PACKED_HEAD must be 'auto', 'on' or 'off', got {mode!r}")
    w = head.weight
    usable = (
        mode != "off"
        and getattr(head, _HEAD_OK, False)
        and w.device.type == "cpu"
        and w.dtype == torch.float32
        and w.dim() == 2
        and torch.backends.mkldnn.is_available()
    )
    if not usable:
        return None  # not cached: the environment variable may change between calls
    key = f"{w.shape[0]}x{w.shape[1]}:{torch.get_num_threads()}"
    known = _known_head_choice(key) if mode == "auto" else True
    if known is False:  # measured slower on this machine: no copy at all
        setattr(head, _HEAD, False)
        return None
    with torch.inference_mode():
        packed = w.detach().to_mkldnn()
    bias = None if head.bias is None else head.bias.detach()

    def product(x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] < HEAD_MIN_ROWS or x.dtype != torch.float32 or x.requires_grad:
            return head(x)
        out = torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), packed, None).to_dense()
        return out + bias if bias is not None else out

    if known is None:  # auto, not measured yet on this machine
        x = torch.randn(HEAD_ROWS, w.shape[1])
        with torch.inference_mode():
            head(x), product(x)  # warm-up
            ratios = []
            for r in range(HEAD_ROUNDS):  # interleaved, the order alternating
                t = {}
                for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                    fn = product if which else head
                    t[which] = _time(lambda fn=fn: fn(x), 1, warm=False)
                ratios.append(t[1] / t[0])
        faster = statistics.median(ratios) < HEAD_GAIN
        _remember_head_choice(key, faster)
        if not faster:
            del packed
            setattr(head, _HEAD, False)
            return None
    setattr(head, _HEAD, product)
    return product


# The logit lens of :mod:`.attention` reads many rows through the packed head where it is
# measured faster (the lens module does not import this one; see ``set_lens_head_product``).
set_lens_head_product(packed_head)
