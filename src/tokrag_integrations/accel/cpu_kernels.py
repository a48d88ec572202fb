"""Faster CPU paths for the few-row work of decoding, chosen by measuring them.

A decode step multiplies a few rows (one token per step, two in a packed or fused step, a
dozen in a logit lens) by every weight matrix; BLAS picks its kernel by shape, often poorly
for such skinny products and differently from one CPU to the next (figures in
docs/results.md, "Speed paths kept"). So nothing is assumed:

* :func:`plan_for` times the :data:`STRATEGIES` per weight shape and bucket of row counts
  (:data:`BUCKETS`) and keeps the fastest; :func:`install` routes each ``nn.Linear`` call of
  at most :data:`MAX_ROWS` rows to its plan (``Speed.cpu_kernels``: ``auto`` measures, ``on``
  forces ``W @ x.T``, ``off`` keeps the stock paths);
* :func:`verify_install` checks the plans on the whole model, per bucket, and sends a
  bucket that does not win back to ``F.linear``;
* :func:`.packed_head.packed_head` gives the logit lens a oneDNN copy of the LM head where
  measured faster (``Speed.packed_head``; its own module, using the timing and the plan
  folder of this one);
* :func:`stock_kernels` runs the stock paths for one decode on a model that has plans
  (``Speed.cpu_kernels`` ``off`` on that decode's call).

Every choice comes in as an argument from the decode's :class:`..speed.Speed` (through the
engine's seam, ``engine/seam.py``): nothing here reads the environment.

Results are the same dot products summed in another order (last-bit differences, as
between any two BLAS kernels).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import statistics
import time
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..config import cache_dir
from ..retrieval.safe_files import FileRefused, checked_folder, read_regular, write_atomic

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
#: On a model: :func:`verify_install`'s verdict per bucket (read by ``install.speed_paths``).
_VERDICT = "_tokrag_verdict"
#: Marks the LM head of a model set up by :func:`install` (not the stock paths), and holds
#: its :func:`.packed_head.packed_head` product (False: measured slower).
_HEAD_OK = "_tokrag_head_ok"
_HEAD = "_tokrag_packed_head"

Kernel = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

#: True inside :func:`stock_kernels`: routed modules and the ``tokrag_sdpa`` attention take
#: the stock paths (a decode whose ``Speed.cpu_kernels`` is ``off``).
_STOCK: contextvars.ContextVar[bool] = contextvars.ContextVar("tokrag_stock_kernels", default=False)


@contextlib.contextmanager
def stock_kernels(on: bool = True) -> Iterator[None]:
    """Within this block (this thread or task), a model with plans installed runs the stock
    paths: ``F.linear`` in every routed module and transformers' SDPA attention (``on``
    False: the installed paths, as outside)."""
    token = _STOCK.set(bool(on))
    try:
        yield
    finally:
        _STOCK.reset(token)


def stock() -> bool:
    """Whether the stock paths are asked for here (:func:`stock_kernels`)."""
    return _STOCK.get()


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
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kernel: Callable[[int], Kernel],
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


def _alternating_ratio(timed: Callable[[bool], Callable[[], Any]], rounds: int) -> float:
    """Median over ``rounds`` of the time of ``timed(True)()`` over that of ``timed(False)()``,
    the two timed side by side in an order alternating from one round to the next."""
    ratios = []
    for r in range(rounds):
        t = {}
        for on in (True, False) if r % 2 == 0 else (False, True):
            t[on] = _time(timed(on), 1, warm=False)
        ratios.append(t[True] / t[False])
    return statistics.median(ratios)


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
                if line.split(":")[0].strip() in (
                    "model name",
                    "cache size",
                    "flags",
                    "cpu family",
                    "model",
                ):
                    cpu += line.strip() + "\n"
    except OSError:  # pragma: no cover - not Linux
        import platform

        cpu = platform.processor() + platform.machine()
    fmt = f"{torch.__version__}|{BUCKETS}|{STRATEGIES}|{MIN_GAIN}|{TILE}|{MAX_ROWS}|rounds{PLAN_ROUNDS}"
    return hashlib.sha1((cpu + fmt).encode()).hexdigest()[:16]


def _plan_file(cache: bool = True) -> Path | None:
    """Where measured plans persist between processes (``$TOKRAG_CACHE_DIR/kernel_plans``),
    or None when ``cache`` is off (``Speed.kernel_plan_cache``)."""
    if not cache:
        return None
    return cache_dir() / "kernel_plans" / f"{_machine_id()}.json"


def _disk_key(key: tuple[Any, ...]) -> str:
    n, k, dtype, threads = key
    return f"{n}x{k}:{str(dtype).removeprefix('torch.')}:{threads}"


#: Largest plan file read, in bytes (a machine's plans take a few KB).
MAX_PLAN_FILE_BYTES = 1 << 20
#: Cache warnings already given in this process (each is given once).
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, UserWarning, stacklevel=4)


def _plan_folder(path: Path, create: bool) -> Path | None:
    """``path``'s folder once it and the cache folder above it pass the cache checks of
    :func:`..retrieval.safe_files.checked_folder`; None when missing, not writable, or refused (with a
    warning: the plans are then measured and kept for this process only)."""
    try:
        return checked_folder(path.parent.parent, path.parent.name, create=create)
    except OSError:  # missing, or a read-only disk: the plans are measured again
        return None
    except FileRefused as exc:
        _warn_once(
            f"Not using the kernel-plan cache: {exc}, so a plan planted there could slow "
            "every decode; plans are measured for this process only. Make it your own folder "
            "(chmod go-w), or set $TOKRAG_CACHE_DIR to one."
        )
        return None


def _read_json(path: Path | None) -> dict[str, Any]:
    """The dict stored in ``path``; {} for no path, a missing file, a refused folder, or an
    entry that is not a regular JSON file of at most :data:`MAX_PLAN_FILE_BYTES` (which only
    costs a new measurement, with a warning)."""
    if path is None or _plan_folder(path, create=False) is None:
        return {}
    try:
        raw = json.loads(read_regular(path, MAX_PLAN_FILE_BYTES).decode("utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # FileRefused and JSON errors are ValueErrors
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        _warn_once(f"{path}: not a kernel-plan file ({reason}); measuring again.")
        return {}
    return raw if isinstance(raw, dict) else {}


def _load_plans(path: Path) -> dict[str, tuple[str, ...]]:
    """The valid plans in ``path``."""
    raw = _read_json(path)
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
    """Write ``data`` to a temporary file in the checked folder, then rename it into place;
    a read-only or full disk, or a refused folder, only means the next process measures
    again."""
    folder = _plan_folder(path, create=True)
    if folder is None:
        return
    try:
        write_atomic(folder, path.name, json.dumps(data, sort_keys=True).encode("utf-8"))
    except OSError:
        pass


def plan_for(
    weights: torch.Tensor | list[torch.Tensor], reps: int = 1, *, cache: bool = True
) -> tuple[str, ...]:
    """The fastest strategy for each of :data:`BUCKETS` on a weight shape, measured here.

    Each timing runs the product over every weight given (all the model's matrices of that
    shape: they stream from memory, as in a decode step). The strategies are timed in
    :data:`PLAN_ROUNDS` rounds in a rotated order, each against ``F.linear`` in the same
    round; one replaces it only if the median of its ratios is below :data:`MIN_GAIN`. Kept
    for the process and, per machine, in ``$TOKRAG_CACHE_DIR/kernel_plans`` (unless ``cache``,
    ``Speed.kernel_plan_cache``, is off)."""
    ws = [weights] if isinstance(weights, torch.Tensor) else list(weights)
    n, k = ws[0].shape
    key = (n, k, ws[0].dtype, torch.get_num_threads())
    if key in _PLANS:
        return _PLANS[key]
    path = _plan_file(cache)
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
    if _STOCK.get():
        return F.linear(x, self.weight, self.bias)
    return _few_rows(x, self.weight, self.bias, getattr(self, _PLAN).__getitem__)


def install(model: torch.nn.Module, mode: str = "on", *, cache: bool = True) -> int:
    """Route few-row calls of ``model``'s ``nn.Linear`` modules to faster kernels; returns how
    many modules were changed. ``mode="on"``: the transposed product for every few-row call;
    ``"auto"``: each weight shape's measured plan (:func:`plan_for`), and modules whose plan
    is ``F.linear`` throughout are left as they are (``cache``: :func:`plan_for`'s)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Linear):
        setattr(head, _HEAD_OK, True)  # the logit lens may use packed_head()
    mods = [
        m for m in model.modules() if type(m) is torch.nn.Linear and not getattr(m, _ATTR, False)
    ]
    groups: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    for mod in mods:
        groups.setdefault((*mod.weight.shape, mod.weight.dtype), []).append(mod.weight)
    n = 0
    for mod in mods:
        if mode == "auto":
            plan = plan_for(groups[(*mod.weight.shape, mod.weight.dtype)], cache=cache)
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


#: Interleaved rounds of :func:`verify_install`, and the share of the stock model's time a
#: bucket's plans must take there to be kept (a tie goes to the stock path).
VERIFY_ROUNDS = 5
VERIFY_GAIN = 0.98


def _side_file(kind: str, cache: bool = True) -> Path | None:
    """The file of :func:`verify_install`'s verdicts (``verify``) or :func:`.packed_head.packed_head`'s
    choices (``head``), next to the plans (None where ``cache`` is off)."""
    path = _plan_file(cache)
    return None if path is None else path.with_name(f"{path.stem}.{kind}.json")


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


def verify_install(
    model: torch.nn.Module, rounds: int = VERIFY_ROUNDS, *, cache: bool = True
) -> dict[str, dict[str, Any]]:
    """Check the installed plans on the whole model, per bucket of row counts: a forward
    pass with the plans against one with the stock ``nn.Linear`` paths, in
    :data:`VERIFY_ROUNDS` interleaved rounds; where the median ratio is not below
    :data:`VERIFY_GAIN` the bucket goes back to ``F.linear`` in every module. The verdicts
    are kept per machine next to the plans and on the model (``{"rows lo-hi": {"ratio",
    "kept"}}``, for ``install.speed_paths``)."""
    mods = _routed(model)
    if not mods:
        setattr(model, _VERDICT, {})
        return {}
    key = _verify_key(mods)
    path = _side_file("verify", cache)
    stored = _read_json(path)
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


def _verify_bucket(
    model: torch.nn.Module, mods: list[torch.nn.Module], rows: int, rounds: int
) -> float:
    """Median over ``rounds`` of (model pass with the plans) / (the same with the stock
    ``nn.Linear`` forward), ``rows`` positions, the two timed side by side."""
    step = _model_step(model, rows)

    def plans_on(on: bool) -> Callable[[], Any]:
        for mod in mods:
            if on:
                mod.forward = types.MethodType(_forward, mod)
            elif "forward" in mod.__dict__:
                del mod.forward
        return step

    try:
        with torch.inference_mode():
            for on in (True, False):  # warm-up
                plans_on(on)()
            return _alternating_ratio(plans_on, rounds)
    finally:
        plans_on(True)
