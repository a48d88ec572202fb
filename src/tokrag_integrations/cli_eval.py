"""``tokrag eval``: the evaluation harness on the command line.

    tokrag eval noise --data shared/data/squad_dev.jsonl --limit 40 --policies rag,tokrag,cad
    tokrag eval misleading --data shared/data/rgb_en_fact_dev.jsonl
    tokrag eval token --data shared/data/squad_dev.jsonl --limit 50
    tokrag eval cost --data shared/data/squad_dev.jsonl --limit 3

Summaries (JSON, Markdown, PNG) go to ``--out`` (default ``results/``); per-item records with
traces go to ``--records`` (default ``runs/``) as ``<name>.jsonl``. Re-running the same
command resumes: items already in the records file are skipped.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import warnings
from pathlib import Path
from typing import Any

TASKS = ("noise", "misleading", "token", "cost")


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from e


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``eval`` sub-command to an ``argparse`` sub-parser set."""
    from .evaluation.data import DEFAULT_RATIOS, DEFAULT_SEED
    from .evaluation.runner import DEFAULT_CF_RATIOS, DEFAULT_POLICIES

    p = subparsers.add_parser(
        "eval",
        help="evaluate decoding policies on a JSONL set (noise sweep, misleading passages, token level, cost)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("task", nargs="?", default="noise", choices=TASKS, help="what to measure (default: noise)")
    p.add_argument("--data", required=True, help="JSONL evaluation set (format: shared/data/README.md)")
    p.add_argument("--limit", type=int, default=None, help="use the first N items")
    p.add_argument("--policies", type=_names, default=list(DEFAULT_POLICIES), help="comma-separated policy names")
    p.add_argument("--model", default="default", help="'default', a model folder or a .gguf file")
    p.add_argument("--device", default=None, help="torch device (default: the loader's choice)")
    p.add_argument("--out", default="results", help="folder for JSON / Markdown / PNG summaries")
    p.add_argument("--records", default="runs", help="folder for per-item JSONL records (resume state)")
    p.add_argument("--name", default=None, help="output name (default: <task>_<data file stem>)")
    p.add_argument("--ratios", type=_floats, default=list(DEFAULT_RATIOS), help="noise ratios (noise, token)")
    p.add_argument("--cf-ratios", type=_floats, default=list(DEFAULT_CF_RATIOS), help="counterfactual ratios (misleading)")
    p.add_argument("--k", type=int, default=None, help="passages per question (default 5; misleading 2)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--stop", action="append", default=None, help="stop string (default: newline)")
    p.add_argument("--batch-size", type=int, default=1, help="questions decoded together per policy")
    p.add_argument("--alpha", type=float, default=None, help="CAD's alpha (default 0.5)")
    p.add_argument("--target", choices=("evidence", "answer"), default="evidence",
                   help="token level: gold continuation = answer-bearing evidence sentence or bare answer")
    p.add_argument("--no-traces", action="store_true", help="do not keep traces in the records")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_eval)
    return p


def _config(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("task", "model", "ratios", "cf_ratios", "k", "seed", "max_new_tokens", "stop", "alpha")
    cfg = {k: getattr(args, k) for k in keys} | {"data": str(Path(args.data).resolve())}
    if args.task == "token":
        cfg["target"] = args.target
    return cfg


def _check_resume(records: Path, config: dict[str, Any]) -> None:
    side = records.with_suffix(".config.json")
    if side.exists():
        old = json.loads(side.read_text())
        if old != config:
            diff = sorted(k for k in set(old) | set(config) if old.get(k) != config.get(k))
            raise SystemExit(
                f"{records} was written with other settings ({', '.join(diff)} differ). "
                "Pass another --name, or delete the records file to start over."
            )
    else:
        side.parent.mkdir(parents=True, exist_ok=True)
        side.write_text(json.dumps(config, indent=2) + "\n")


def run_eval(args: argparse.Namespace) -> int:
    """Run one evaluation task; prints the Markdown table and the files written."""
    from .evaluation import report
    from .evaluation.data import load_items
    from .evaluation.runner import run_misleading, run_noise_sweep, run_token_level

    if args.limit is not None and args.limit < 1:
        raise SystemExit(f"--limit must be >= 1, got {args.limit}")
    if args.batch_size < 1:
        raise SystemExit(f"--batch-size must be >= 1, got {args.batch_size}")
    from .policies import available_policies

    unknown = [p for p in args.policies if p not in available_policies()]
    if unknown:
        raise SystemExit(f"Unknown policies {unknown}. Available: {', '.join(available_policies())}.")
    items = load_items(args.data, limit=args.limit)
    stem = Path(args.data).stem
    name = args.name or f"{args.task}_{stem}"
    out = Path(args.out)
    argv = getattr(args, "argv", None)
    if argv is not None:
        command = "tokrag eval " + " ".join(shlex.quote(a) for a in argv)
    else:  # wired into the main ``tokrag`` parser
        command = "tokrag " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    stop = args.stop if args.stop is not None else ["\n"]
    progress = not args.no_progress

    if args.task == "cost":
        from .evaluation.cost import cost_table, measure_costs

        res = measure_costs(
            args.policies, data=args.data, model=args.model, limit=args.limit or 3,
            k=args.k or 5, max_new_tokens=args.max_new_tokens, device=args.device,
        )
        report.write_json(out / f"{name}.json", {**res, "command": command})
        table = cost_table(res)
        (out / f"{name}.md").write_text(f"## Cost ({stem})\n\n```\n{command}\n```\n\n{table}\n", encoding="utf-8")
        print(table)
        print(f"wrote {out / (name + '.json')}, {out / (name + '.md')}")
        return 0

    from .models import load_model

    records = Path(args.records) / f"{name}.jsonl"
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
    else:
        summary = run_token_level(
            lm, items, records_path=records, ratios=args.ratios, cf_ratios=args.cf_ratios,
            k=args.k or 5, seed=args.seed, target=args.target, progress=progress,
        )
        summary.update(model=lm.name, data=stem)
        files = report.write_token_report(summary, out, name, f"Token level: {stem}, {lm.name}", command)
        print(report.token_table(summary))
    print("wrote " + ", ".join(str(f) for f in files) + f"; records in {records}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (``python -m tokrag_integrations.cli_eval noise --data ...``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="tokrag")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["eval", *argv])
    args.argv = argv
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
