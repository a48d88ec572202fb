"""``tokrag ask``: retrieve, stream the answer with its provenance, explain and export."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..defaults import MAX_NEW_TOKENS, RETRIEVER, TOP_K
from .console import (
    _STREAM_STYLES,
    SAMPLE_DOCS,
    _check_output_path,
    _consoles,
    _print_warning,
    _resolve_docs,
    _short_source,
    _status,
    add_model_arguments,
    check_policy,
    parse_option,
    positive_int,
    stop_strings,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    from rich.console import Console


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``tokrag ask``."""
    p = subparsers.add_parser(
        "ask",
        help="answer a question with token-level provenance",
        description=(
            "Answer QUESTION with a local model, choosing each token from the retrieval-"
            "augmented or the model's own context (Tok-RAG). Passages come from --passage "
            "and/or from retrieval over --docs."
        ),
    )
    p.add_argument("question", help="the question to answer")
    p.add_argument(
        "--passage",
        action="append",
        default=[],
        metavar="TEXT",
        help="a passage to give the model (repeatable; placed before retrieved ones)",
    )
    _add_source_arguments(p)
    _add_decoding_arguments(p)
    _add_output_arguments(p)
    p.set_defaults(func=cmd_ask)


def _add_source_arguments(p: argparse.ArgumentParser) -> None:
    """Where passages come from: --docs, the retriever, the Postgres store, the gate."""
    from ..retrieval import supported_types

    p.add_argument(
        "--docs",
        action="append",
        default=[],
        metavar="PATH",
        help=(
            f"a file or folder of documents to retrieve from (repeatable): {supported_types()}; "
            f"other files are skipped with a warning; '{SAMPLE_DOCS}' means the packaged sample "
            "documents"
        ),
    )
    p.add_argument(
        "--follow-links",
        action="store_true",
        help="--docs: also read files through symbolic links that leave the given folders "
        "(a warning names each one; default: skip them with a warning)",
    )
    from .pg import add_max_file_argument

    add_max_file_argument(p, "--docs: ")
    p.add_argument(
        "--retriever",
        choices=("dense", "bm25", "hybrid"),
        default=RETRIEVER,
        help="--docs: dense (MiniLM cosine), bm25 (keywords) or hybrid (both, fused by "
        f"reciprocal rank fusion; finds exact identifiers) (default {RETRIEVER})",
    )
    p.add_argument(
        "--top-k",
        type=positive_int,
        default=TOP_K,
        help=f"chunks to retrieve (default {TOP_K})",
    )
    p.add_argument(
        "--store",
        choices=("postgres",),
        default=None,
        help="retrieve from a Postgres + pgvector table filled by `tokrag ingest`",
    )
    from .pg import add_filter_argument, add_store_arguments

    add_store_arguments(p)
    add_filter_argument(p)
    p.add_argument(
        "--gate",
        choices=("confidence", "gece", "ctrla"),
        default=None,
        help="decide per question whether to retrieve at all (retrieval gating)",
    )
    p.add_argument(
        "--gate-calibration",
        metavar="FILE",
        default=None,
        help="saved gate calibration (JSON); created from the sample questions if missing",
    )


def _add_decoding_arguments(p: argparse.ArgumentParser) -> None:
    """The policy and its options, the model, the answer's length and stops."""
    from ..policies import available_policies

    p.add_argument(
        "--policy",
        default="tokrag",
        help=f"decoding policy: one of {', '.join(available_policies())} (default tokrag)",
    )
    add_model_arguments(p)
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=MAX_NEW_TOKENS,
        help=f"answer length limit in tokens (default {MAX_NEW_TOKENS})",
    )
    stops = p.add_mutually_exclusive_group()
    stops.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help="end the answer where TEXT appears (repeatable; replaces the default stops: a "
        "blank line or a line starting with '#'; escapes such as \\n are read)",
    )
    stops.add_argument(
        "--no-stop",
        action="store_true",
        help="no stop strings: the answer ends at the model's end of turn or at --max-new-tokens",
    )
    p.add_argument(
        "--device-map",
        default=None,
        help="place the model with transformers' device_map, e.g. auto (a large model over "
        "the GPUs and the CPU; not with --device)",
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        type=parse_option,
        metavar="KEY=VALUE",
        help="a policy option, e.g. --option pr_norm=softmax (repeatable; values parsed as JSON)",
    )


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    """What is shown or written after the answer."""
    p.add_argument(
        "--explain", action="store_true", help="show the token-level trace after the answer"
    )
    p.add_argument(
        "--sources",
        action="store_true",
        help="after the answer, print every passage given to the model in full: its source, "
        "score and text (wrapped, not cut)",
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show the model's weight-loading progress bars (quiet by default)",
    )
    p.add_argument(
        "--citations",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="read which passage each token attended to, for --explain, --html and --sources "
        "(default: with the policies that read the attention anyway, tokrag and "
        "tokrag_authors; --citations for every policy, --no-citations for none)",
    )
    p.add_argument("--html", metavar="FILE", help="write the trace as a standalone HTML page")
    p.add_argument("--json", metavar="FILE", help="write the trace as JSON")


def _retrieve(args: argparse.Namespace, err: Console) -> list[Any]:
    """Passages for ``args``: the ``--passage`` texts, then the chunks retrieved from the
    store and from ``--docs`` (each listed, dim, on stderr)."""
    from rich.text import Text

    from .. import Passage
    from ..retrieval import printable

    passages = [
        Passage(text=t, metadata={"source": "--passage"}) for t in args.passage if t.strip()
    ]

    def add(score: float, source: str, chunk: int, text: str, metadata: dict[str, Any]) -> None:
        line = Text(f"  {score:7.4f}  {source} #{chunk}  ", style="dim")
        line.append(" ".join(text.split()), style="dim italic")
        err.print(line, no_wrap=True, overflow="ellipsis")
        passages.append(Passage(text=text, score=score, metadata=metadata))

    if args.store == "postgres":
        from ..postgres.layout import DEFAULT_TABLE
        from ..postgres.store import _knowledge_base

        kb = _knowledge_base(args.dsn, args.table or DEFAULT_TABLE, args.embed_model, args.data_dir)
        chunks = kb.retrieve(args.question, args.top_k, args.filter, search=args.search)
        if not chunks:
            _print_warning(
                err, "the store returned no chunk for this question; answering without them."
            )
        for c in chunks:
            add(c.score, printable(c.source), c.chunk, c.text, c.passage_metadata)
    if not args.docs:
        return passages
    from ..retrieval import build_retriever

    roots = _resolve_docs(args.docs)
    retriever = build_retriever(
        roots,
        kind=args.retriever,
        device="cpu",
        progress=True,
        follow_links=args.follow_links,
        max_file_mb=args.max_file_mb,
        cache=True,  # a folder asked about again embeds only the chunks that changed
    )
    hits = retriever.retrieve(args.question, top_k=args.top_k)
    if not hits:
        _print_warning(err, "no document chunk matched the question; answering without them.")
    for hit in hits:
        source = printable(_short_source(hit.source, roots))
        metadata = {"source": hit.source, "chunk": hit.chunk.index, **hit.chunk.metadata}
        add(hit.score, source, hit.chunk.index, hit.text, metadata)
    return passages


def _print_sources(out: Console, trace: Any, roots: Sequence[Path]) -> None:
    """Each passage of ``trace`` in full: rank, source (relative to its ``--docs`` root),
    chunk, row id (Postgres), score, whether it was used, its share of the answer's attention
    (with citations, the passages in that order), then its text wrapped to the console's
    width."""
    from rich.text import Text

    from ..retrieval import printable

    shares = dict(trace.contributions())
    title = "Sources, by their share of the answer's attention" if shares else "Sources"
    out.print(Text(title, style="bold"))
    if not trace.passages:
        out.print(Text("  (no passage was given to the model)", style="dim"))
    order = sorted(range(len(trace.passages)), key=lambda i: -shares.get(i, -1.0))
    for i in order:
        rec = trace.passages[i]
        meta = rec.metadata
        source = str(meta.get("source", "?"))
        if roots and source != "--passage":
            source = _short_source(source, roots)
        head = f"[{rec.rank}] {printable(source)}"
        if "chunk" in meta:
            head += f" #{meta['chunk']}"
        if meta.get("node_id"):  # a Postgres chunk's row id
            head += f"  id {printable(str(meta['node_id']))}"
        if rec.score is not None:
            head += f"  score {rec.score:.4f}"
        if i in shares:
            head += f"  cited {100 * shares[i]:.0f} %"
        if not rec.kept:
            head += "  (not used: it did not fit the window)"
        elif rec.cut:
            head += f"  (cut to {rec.n_tokens} tokens to fit)"
        out.print(Text(head, style="bold dim"))
        # Paragraphs re-flowed to the console's width (the source's own line breaks would
        # wrap a second time); nothing is cut.
        paragraphs = [" ".join(p.split()) for p in rec.text.strip().split("\n\n")]
        out.print(Text("\n\n".join(p for p in paragraphs if p)), soft_wrap=False)


def _check_before_loading(args: argparse.Namespace, options: dict[str, Any]) -> bool:
    """Fail on a bad policy, option, device or dtype before retrieval and the model load.
    Returns whether the policy reads passages at all."""
    from ..models import check_device_and_dtype
    from ..policies import uses_passages as policy_uses_passages

    uses_passages = policy_uses_passages(check_policy(args.policy, options))
    check_device_and_dtype(args.device, args.dtype)
    if args.device is not None and args.device_map is not None:
        raise ValueError("pass --device or --device-map, not both")
    if args.search != "vector" and args.store != "postgres":
        raise ValueError(
            "--search applies to --store postgres; for --docs choose --retriever dense, bm25 "
            "or hybrid"
        )
    return uses_passages


def _gate(lm: Any, name: str, calibration: str | None) -> Any:
    """The ``--gate`` gate: loaded from ``--gate-calibration``, else calibrated on the
    packaged sample questions (and saved there when given)."""
    from ..gating import GATES
    from ..retrieval import get_sample_questions

    if calibration is not None and Path(calibration).exists():
        return GATES[name].load(calibration, lm)
    gate = GATES[name](lm)
    questions = [q["question"] if isinstance(q, dict) else str(q) for q in get_sample_questions()]
    gate.calibrate(questions)
    if calibration is not None:
        gate.save(calibration)
    return gate


def _load(args: argparse.Namespace, err: Console) -> Any:
    from .. import load_model

    placement = {} if args.device_map is None else {"device_map": args.device_map}
    with _status(err, f"Loading model {args.model}…"):
        return load_model(args.model, device=args.device, dtype=args.dtype, **placement)


def _model_and_passages(
    args: argparse.Namespace, err: Console, uses_passages: bool
) -> tuple[Any, list[Any]]:
    """Load the model and retrieve, in the order the gate needs: with ``--gate`` the model
    loads first (the gate reads it) and retrieval runs only when the gate says so."""
    from rich.text import Text

    if not uses_passages and (args.docs or args.store or args.passage):
        err.print(
            Text(f"policy {args.policy} reads no passages: nothing is retrieved", style="dim")
        )
    if not (args.gate and uses_passages):
        passages = _retrieve(args, err) if uses_passages else []
        return _load(args, err), passages
    lm = _load(args, err)
    with _status(err, f"Gate {args.gate}: deciding whether to retrieve…"):
        decision = _gate(lm, args.gate, args.gate_calibration).decide(args.question)
    err.print(
        Text(
            f"gate {args.gate}: {'retrieve' if decision.retrieve else 'answer directly'} "
            f"(score {decision.score:.4f}, threshold {decision.threshold})",
            style="bold",
        )
    )
    return lm, _retrieve(args, err) if decision.retrieve else []


def _after_answer(args: argparse.Namespace, out: Console, err: Console, result: Any) -> None:
    """The notes, sources, trace and exports that follow the streamed answer."""
    from rich.text import Text

    if result.trace.stop_reason == "length":
        err.print(
            Text(
                f"(answer cut at {args.max_new_tokens} tokens; raise --max-new-tokens)", style="dim"
            )
        )
    for message in result.trace.warnings:
        _print_warning(err, message)
    if args.sources:
        _print_sources(out, result.trace, _resolve_docs(args.docs) if args.docs else [])
    if args.explain:
        result.trace.render(out)
    if args.html:
        result.trace.to_html(args.html)
        err.print(Text(f"HTML trace written to {args.html}", style="dim"))
    if args.json:
        result.trace.to_json(args.json)
        err.print(Text(f"JSON trace written to {args.json}", style="dim"))


def cmd_ask(args: argparse.Namespace) -> int:
    """Run ``tokrag ask``: retrieve, stream the answer, then explain and export on request."""
    from rich.text import Text

    out, err = _consoles()
    question = args.question.strip()
    if not question:
        raise ValueError("The question is empty; pass the question to answer as an argument.")
    args.question = question
    _check_output_path(args.html, "--html")
    _check_output_path(args.json, "--json")
    policy_options = dict(args.option)
    stop = stop_strings(args)
    uses_passages = _check_before_loading(args, policy_options)

    from transformers.utils import logging as hf_logging

    from .. import stream

    if args.verbose:
        from ..models import show_loading_progress

        show_loading_progress()  # load_model shows its progress bars
    else:
        hf_logging.disable_progress_bar()  # the status line below says what is happening
    lm, passages = _model_and_passages(args, err, uses_passages)
    tokens = stream(
        lm,
        question,
        passages,
        policy=args.policy,
        max_new_tokens=args.max_new_tokens,
        stop=stop,
        policy_options=policy_options,
        citations=args.citations,
    )
    for event in tokens:
        style = _STREAM_STYLES.get(event.source, "dark_orange")
        out.print(Text(event.text, style=style or ""), end="", soft_wrap=True)
    out.print()
    _after_answer(args, out, err, tokens.result)
    return 0
