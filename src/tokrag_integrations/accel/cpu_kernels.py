"""Faster CPU paths for the few-row work of decoding: the linear layers.

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

The whole-model check of the plans (:func:`verify_install`) is in :mod:`.verify`, the
few-query attention (``tokrag_sdpa``) in :mod:`.sdpa`, the packed LM head of the logit lens
in :mod:`.lens_head`, and the choice of the speed paths per model (:func:`maybe_install`,
:func:`speed_paths`) in :mod:`.paths`; their names are importable from here too.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
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
from ..config import cache_dir

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
#: :func:`.lens_head.packed_head`'s measured choices per machine and weight shape, for the
#: process (kept here, with the kernel plans).
_HEAD_CHOICE: dict[str, bool] = {}

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


#: Names defined in the modules split off this one, importable from here as before (resolved
#: on first access: those modules import this one).
_MOVED = {
    "sdpa": (
        "ATTN_IMPLEMENTATION", "PACKED_PREFILL", "MAX_SPLIT_ROWS", "SEGMENT_KEYS",
        "few_query_attention", "install_attention", "_left_pad_starts", "_pad_segments",
        "_packed_attention", "_plain_attention", "_grouped_attention", "_keep_queries",
        "_register_attention",
    ),
    "paths": (
        "COVERED_ARCHITECTURES", "fusion_off_reason", "maybe_install", "speed_off_reason",
        "speed_paths", "_SPEED_OFF", "_architecture_reason", "_first_parameter",
        "_head_detail", "_kernel_detail",
    ),
    "verify": (
        "VERIFY_GAIN", "VERIFY_ROUNDS", "verify_install", "_model_step", "_routed",
        "_verify_bucket", "_verify_file", "_verify_key",
    ),
    "lens_head": (
        "HEAD_GAIN", "HEAD_MIN_ROWS", "HEAD_ROUNDS", "HEAD_ROWS", "packed_head", "_head_file",
        "_known_head_choice", "_remember_head_choice", "_stored_head_choices",
    ),
}
_WHERE = {name: module for module, names in _MOVED.items() for name in names}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The logit lens reads many rows through the packed head where it is measured faster: the
# head module registers its product with :mod:`..attention` when it is imported.
importlib.import_module(".lens_head", __package__)
