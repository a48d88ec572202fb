"""Whole-model verification of the few-row linear plans (:func:`verify_install`).

The plans of :mod:`.cpu_kernels` are timed per weight shape; here they are timed on the whole
model, per bucket of row counts, against the stock path, and a bucket that does not win goes
back to ``F.linear``. The timer and the per-bucket measurement are read from
:mod:`.cpu_kernels` at call time (a test may swap them there).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import cpu_kernels as K

#: Interleaved rounds of :func:`verify_install`, and the share of the stock model's time a
#: bucket's plans must take there to be kept (a tie goes to the stock path).
VERIFY_ROUNDS = 5
VERIFY_GAIN = 0.98


def _verify_file() -> Path | None:
    path = K._plan_file()
    return None if path is None else path.with_name(path.stem + ".verify.json")


def _routed(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if getattr(m, K._ATTR, False)]


def _verify_key(mods: list[torch.nn.Module]) -> str:
    """What a verdict depends on: every routed module's shape and plan, and the threads."""
    plans = sorted(
        f"{m.weight.shape[0]}x{m.weight.shape[1]}:{str(m.weight.dtype).removeprefix('torch.')}:"
        + ",".join(getattr(m, K._PLAN_NAMES, ()))
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
        setattr(model, K._VERDICT, {})
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
    for i, (m, hi) in enumerate(K.BUCKETS):
        label = f"rows {lo}-{hi}" if hi > lo else f"rows {lo}"
        rows = range(lo, hi + 1)
        lo = hi + 1
        if all(getattr(mod, K._PLAN_NAMES)[i] == "linear" for mod in mods):
            continue
        ratio = known.get(label) if known is not None else None
        if not isinstance(ratio, int | float):
            ratio = K._verify_bucket(model, mods, m, rounds)
            timed = True
        kept = ratio < VERIFY_GAIN
        verdict[label] = {"ratio": float(ratio), "kept": kept}
        if not kept:
            for mod in mods:
                table = getattr(mod, K._PLAN)
                for r in rows:
                    table[r] = K._k_linear
                names = list(getattr(mod, K._PLAN_NAMES))
                names[i] = "linear"
                setattr(mod, K._PLAN_NAMES, tuple(names))
    for mod in mods:
        if all(p == "linear" for p in getattr(mod, K._PLAN_NAMES)):
            del mod.forward
            setattr(mod, K._ATTR, False)
    if timed and path is not None:
        K._write_json(path, {**stored, key: {k: v["ratio"] for k, v in verdict.items()}})
    setattr(model, K._VERDICT, verdict)
    return verdict


def _verify_bucket(model: torch.nn.Module, mods: list[torch.nn.Module], rows: int, rounds: int) -> float:
    """Median over ``rounds`` of (model pass with the plans) / (the same with the stock
    ``nn.Linear`` forward), ``rows`` positions, the two timed side by side."""
    step = _model_step(model, rows)

    def plans_on(on: bool) -> None:
        for mod in mods:
            if on:
                mod.forward = types.MethodType(K._forward, mod)
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
                    t[on] = K._time(step, 1, warm=False)
                ratios.append(t[True] / t[False])
    finally:
        plans_on(True)
    return statistics.median(ratios)
