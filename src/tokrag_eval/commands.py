"""``tokrag eval`` and ``tokrag bench``: the evaluation harness on the command line.

    tokrag eval noise --data shared/data/squad_dev.jsonl --limit 40 --policies rag,tokrag,cad
    tokrag eval misleading --data shared/data/rgb_en_fact_dev.jsonl
    tokrag eval noise --data shared/data/squad_dev.jsonl --policies "rag,tokrag,tokrag[min_fusion_layer=0]"
    tokrag eval token --data shared/data/squad_dev.jsonl --limit 50
    tokrag eval token --data shared/data/popqa_dev.jsonl --limit 40 --scorers "tokrag,tokrag[lens_norm=false]"
    tokrag eval token-pool --records runs/token_rgb_en_fact_dev.jsonl runs/token_popqa_dev.jsonl
    tokrag eval cost --data shared/data/squad_dev.jsonl --limit 3
    tokrag bench --data shared/data/squad_dev.jsonl --questions 20 --throughput 1,4,16

Policies (and token scorers) are specs: a name or name[key=value,...]; the list is split on
the commas outside brackets. Values are read as int, float, true/false, none or text. The
normalised spec (keys sorted) labels the policy in records and tables.

Summaries (JSON, Markdown, PNG; accuracy and AUC with 95 % bootstrap intervals over items) go
to ``--out`` (default ``results/``); per-item records with traces go to ``--records`` (default
``runs/``) as ``<name>.jsonl``. Re-running the same command resumes: items already in the
records file are skipped. ``token-pool`` reads several token records files (``--records
A.jsonl B.jsonl ...``) into one table, per source and pooled.

Token level on PopQA (no passages in the data): the most popular items (``--min-pop-bin``,
default the top quintile) get synthetic supporting / counterfactual passages
(``tokrag_eval.data.synthesize_popqa``); ``--limit`` applies after that selection.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import warnings
from pathlib import Path
from typing import Any

from tokrag_integrations.cli.console import positive_int

# ``tokrag`` finds add_eval_parser and add_bench_parser through the ``tokrag.commands``
# entry points in pyproject.toml (tokrag_integrations.cli.plugin_commands).

TASKS = ("noise", "misleading", "token", "token-pool", "cost")


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from e


def _specs(text: str) -> list[str]:
    """``--policies`` / ``--scorers``: normalised spec strings (``tokrag[lens_norm=False]``)."""
    from .specs import parse_specs

    try:
        return [str(s) for s in parse_specs(text)]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def add_eval_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``eval`` sub-command to an ``argparse`` sub-parser set."""
    from .data import DEFAULT_RATIOS, DEFAULT_SEED
    from .harness import DEFAULT_CF_RATIOS, DEFAULT_POLICIES

    p = subparsers.add_parser(
        "eval",
        help="evaluate decoding policies on a JSONL set (noise sweep, misleading passages, token level, cost)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("task", nargs="?", default="noise", choices=TASKS, help="what to measure (default: noise)")
    p.add_argument("--data", default=None, help="JSONL evaluation set (format: shared/data/README.md); all tasks but token-pool")
    p.add_argument("--limit", type=positive_int, default=None, help="use the first N items")
    p.add_argument("--policies", type=_specs, default=list(DEFAULT_POLICIES),
                   help="comma-separated policy specs: name or name[key=value,...], e.g. 'rag,tokrag[min_fusion_layer=0]'")
    p.add_argument("--scorers", type=_specs, default=None,
                   help="token level: Tok-RAG scorer specs, e.g. 'tokrag,tokrag[lens_norm=false]' "
                        "(default: the built-in option sets); logprob and entropy are always added")
    p.add_argument("--model", default="default", help="'default', a model folder or a .gguf file")
    p.add_argument("--device", default=None, help="torch device (default: the loader's choice)")
    p.add_argument("--out", default="results", help="folder for JSON / Markdown / PNG summaries")
    p.add_argument("--records", nargs="+", default=["runs"],
                   help="folder for per-item JSONL records (resume state); token-pool: the records files to pool")
    p.add_argument("--name", default=None, help="output name (default: <task>_<data file stem>)")
    p.add_argument("--ratios", type=_floats, default=list(DEFAULT_RATIOS), help="noise ratios (noise, token)")
    p.add_argument("--cf-ratios", type=_floats, default=list(DEFAULT_CF_RATIOS), help="counterfactual ratios (misleading)")
    p.add_argument("--k", type=int, default=None, help="passages per question (default 5; misleading 2)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--stop", action="append", default=None, help="stop string (default: newline)")
    p.add_argument("--batch-size", type=positive_int, default=1, help="questions decoded together per policy")
    p.add_argument("--alpha", type=float, default=None, help="CAD's alpha (default 0.5)")
    p.add_argument("--target", choices=("auto", "evidence", "answer"), default="auto",
                   help="token level: gold continuation = answer-bearing evidence sentence, bare answer, or auto "
                        "(bare answer for yes/no and PopQA items, else the evidence sentence)")
    p.add_argument("--min-pop-bin", type=int, default=4,
                   help="token level on PopQA: keep items of popularity quintile >= this (0-4), most popular first")
    p.add_argument("--no-traces", action="store_true", help="do not keep traces in the records")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_eval)
    return p


def _config(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("task", "model", "ratios", "cf_ratios", "k", "seed", "max_new_tokens", "stop", "alpha")
    cfg = {k: getattr(args, k) for k in keys} | {"data": str(Path(args.data).resolve())}
    if args.task == "token":
        cfg["target"] = args.target
        if args.scorers is not None:
            cfg["scorers"] = args.scorers
        if args.popqa:
            cfg["min_pop_bin"] = args.min_pop_bin
    return cfg


def _check_resume(records: Path, config: dict[str, Any]) -> None:
    side = records.with_suffix(".config.json")
    if side.exists():
        old = json.loads(side.read_text())
        if old != config:
            diff = sorted(k for k in set(old) | set(config) if old.get(k) != config.get(k))
            raise ValueError(
                f"{records} was written with other settings ({', '.join(diff)} differ). "
                "Pass another --name, or delete the records file to start over."
            )
    else:
        side.parent.mkdir(parents=True, exist_ok=True)
        side.write_text(json.dumps(config, indent=2) + "\n")


def _command(args: argparse.Namespace) -> str:
    return "tokrag " + " ".join(shlex.quote(a) for a in getattr(args, "argv", sys.argv[1:]))


def _validate(args: argparse.Namespace) -> None:
    """Every argument checked before any model is loaded (ValueError with one sentence, which
    ``tokrag`` prints as ``tokrag: error: ...`` with exit status 2)."""
    from tokrag_integrations.policies import available_policies, get_policy

    from .specs import parse_specs, validate_specs
    from .token_level import scorer_configs

    if args.task != "token-pool" and not args.data:
        raise ValueError(f"tokrag eval {args.task} needs --data (a JSONL evaluation set).")
    if args.task != "token-pool" and len(args.records) != 1:
        raise ValueError(f"--records takes one folder for {args.task}, got {len(args.records)} paths.")
    if args.task in ("noise", "misleading", "cost"):
        validate_specs(parse_specs(args.policies), available_policies(), get_policy)
    if args.task == "token" and args.scorers is not None:
        scorer_configs(args.scorers)


def _token_items(args: argparse.Namespace) -> list[Any]:
    """The token-level items; PopQA (no passages): the popular ones with synthetic passages."""
    from .data import is_popqa, load_items, select_popular, synthesize_popqa

    args.popqa = is_popqa(load_items(args.data, limit=1))
    if not args.popqa:
        return load_items(args.data, limit=args.limit)
    every = load_items(args.data)
    chosen = select_popular(synthesize_popqa(every, pool=every, seed=args.seed), args.min_pop_bin)
    return chosen[: args.limit] if args.limit else chosen


def _run_pool(args: argparse.Namespace, out: Path, command: str) -> int:
    from . import report
    from .token_level import pool_token_records, summarize_token_level

    records = pool_token_records(args.records)
    name = args.name or "token_pool"
    summary = summarize_token_level(records)
    summary.update(runs=[str(p) for p in args.records])
    runs = " + ".join(Path(p).stem for p in args.records)
    files = report.write_token_report(summary, out, name, f"Token level pooled: {runs}", command)
    print(report.token_table(summary))
    print(report.token_sources_table(summary))
    print("wrote " + ", ".join(str(f) for f in files))
    return 0


def run_eval(args: argparse.Namespace) -> int:
    """Run one evaluation task; prints the Markdown table and the files written."""
    from . import report
    from .data import load_items
    from .harness import run_misleading, run_noise_sweep
    from .token_level import run_token_level, scorer_configs

    _validate(args)
    out = Path(args.out)
    command = _command(args)
    if args.task == "token-pool":
        return _run_pool(args, out, command)
    args.popqa = False
    items = _token_items(args) if args.task == "token" else load_items(args.data, limit=args.limit)
    stem = Path(args.data).stem
    name = args.name or f"{args.task}_{stem}"
    stop = args.stop if args.stop is not None else ["\n"]
    progress = not args.no_progress

    if args.task == "cost":
        from .cost import run_bench
        from .data import mix_passages

        # The Table 6 protocol: 40 % noise among k passages, answers up to the first newline.
        mixed = [(it.question, mix_passages(it, 0.4, k=args.k or 5, seed=args.seed).passages) for it in items]
        res = run_bench(
            model=args.model, items=mixed[: args.limit or 3], passages=args.k or 5, max_new_tokens=args.max_new_tokens,
            policies=tuple(args.policies), device=args.device, memory_questions=args.limit or 3, progress=progress,
            stop=stop,
        )
        report.write_json(out / f"{name}.json", {**res, "command": command})
        table = report.bench_table(res)
        (out / f"{name}.md").write_text(f"## Cost ({stem})\n\n```\n{command}\n```\n\n{table}\n", encoding="utf-8")
        print(table)
        print(f"wrote {out / (name + '.json')}, {out / (name + '.md')}")
        return 0

    from tokrag_integrations.models import load_model

    records = Path(args.records[0]) / f"{name}.jsonl"
    _check_resume(records, _config(args))
    warnings.simplefilter("ignore", UserWarning)
    lm = load_model(args.model, device=args.device) if args.device else load_model(args.model)
    opts = {"cad": {"alpha": args.alpha}} if args.alpha is not None else {}
    common = dict(
        records_path=records, policies=args.policies, seed=args.seed, max_new_tokens=args.max_new_tokens,
        stop=stop, batch_size=args.batch_size, policy_options=opts, keep_traces=not args.no_traces,
        progress=progress,
    )
    if args.task == "noise":
        summary = run_noise_sweep(lm, items, ratios=args.ratios, k=args.k or 5, **common)
        summary.update(model=lm.name, data=stem, max_new_tokens=args.max_new_tokens, k=args.k or 5)
        files = report.write_accuracy_report(summary, out, name, f"Noise sweep: {stem}, {lm.name}", command)
        print(report.accuracy_table(summary))
    elif args.task == "misleading":
        summary = run_misleading(lm, items, cf_ratios=args.cf_ratios, k=args.k or 2, **common)
        summary.update(model=lm.name, data=stem, max_new_tokens=args.max_new_tokens, k=args.k or 2)
        files = report.write_accuracy_report(summary, out, name, f"Misleading passages: {stem}, {lm.name}", command)
        print(report.accuracy_table(summary))
        print(report.accuracy_table(summary, "cf_repeat"))
        if summary.get("verdict_rate"):
            print(report.accuracy_table(summary, "verdict_rate", label="policy (verdict stated, %)"))
            print(report.accuracy_table(summary, "verdict_accuracy", label="policy (accuracy among verdicts)"))
    else:
        summary = run_token_level(
            lm, items, records_path=records, ratios=args.ratios, cf_ratios=args.cf_ratios,
            k=args.k or 5, seed=args.seed, target=args.target, progress=progress,
            tokrag_configs=scorer_configs(args.scorers),
        )
        summary.update(model=lm.name, data=stem)
        files = report.write_token_report(summary, out, name, f"Token level: {stem}, {lm.name}", command)
        print(report.token_table(summary))
    if args.task != "token" and summary.get("paired"):
        print(report.paired_table(summary))
    print("wrote " + ", ".join(str(f) for f in files) + f"; records in {records}")
    return 0


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``tokrag bench`` (:mod:`.cost`) to an ``argparse`` sub-parser set."""
    from . import cost

    p = subparsers.add_parser(
        "bench",
        help="time rag vs the two-context floor vs tokrag vs Hugging Face generate (paper Table 6)",
        description=cost.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="default")
    p.add_argument("--data", default=None,
                   help=f"SQuAD-format JSONL (default: $TOKRAG_DATA_DIR/{cost.DATA_FILE}; in a checkout "
                        f"../shared/data/{cost.DATA_FILE})")
    p.add_argument("--questions", type=int, default=20)
    p.add_argument("--passages", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--policies", default=",".join(cost.DEFAULT_POLICIES),
                   help="comma list of arms: rag, floor, tokrag-step, tokrag, rag-kernels-off, hf-generate, "
                        "hf-generate-static, or any policy spec; ARM@PRESET for a speed preset (tokrag@cuda)")
    p.add_argument("--device", default=None)
    p.add_argument("--no-memory", action="store_true", help="skip the per-policy memory subprocesses")
    p.add_argument("--memory-questions", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.add_argument("--throughput", type=_sizes, default=(),
                   help="comma list of batch sizes for tokens/s and questions/s, e.g. 1,4,16")
    p.add_argument("--throughput-only", action="store_true",
                   help="only the --throughput measurement (no per-question timing, no memory)")
    p.add_argument("--rounds", type=positive_int, default=3, help="rounds of the interleaved --throughput measurement")
    p.set_defaults(func=run_bench_command)
    return p


def _sizes(text: str) -> tuple[int, ...]:
    """``--throughput``'s batch sizes: a comma list of positive ints."""
    try:
        sizes = tuple(int(n) for n in text.split(",") if n.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--throughput must be a comma list of batch sizes, e.g. 1,4,16; got {text!r}"
        ) from None
    if any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"--throughput batch sizes must be >= 1, got {text!r}")
    return sizes


def run_bench_command(args: argparse.Namespace) -> int:
    """``tokrag bench``: run the benchmark, print its report, write ``--json``."""
    from .cost import run_bench
    from .report import bench_table
    from .specs import split_specs

    if args.throughput_only and not args.throughput:
        raise ValueError("--throughput-only needs --throughput SIZES, e.g. --throughput 1,4,16")
    res = run_bench(
        model=args.model, data=args.data, questions=args.questions, passages=args.passages,
        max_new_tokens=args.max_new_tokens, policies=tuple(split_specs(args.policies)), device=args.device,
        memory=not (args.no_memory or args.throughput_only), latency=not args.throughput_only,
        memory_questions=args.memory_questions, throughput=args.throughput, rounds=args.rounds,
    )
    print(bench_table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2), encoding="utf-8")
    return 0

