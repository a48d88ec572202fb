"""The ``tokrag`` command line (also ``python -m tokrag_integrations.cli``).

    tokrag ask "Who founded Quillfeather Aerospace?" --docs sample --explain --html trace.html

This module holds ``main``, the parser and ``tokrag ask``; the other subcommands live next to
it: :mod:`.eval` (``tokrag eval``), :mod:`.pg` (``tokrag ingest`` and the ``--store
postgres`` options of ``ask``), :mod:`.gate` (``ask --gate``), :mod:`.serve` (``tokrag
serve``); ``tokrag bench`` is :mod:`..bench`.

Each subcommand is one ``add_*_parser(subparsers)`` function that adds its parser and sets
``func`` (a ``(args) -> int`` handler) as a default; :data:`SUBCOMMANDS` lists them. A new
subcommand (``bench``, ``eval``, ``ingest``...) is a new pair of functions added to that list,
or registered from another module with :func:`register_subcommand`.

Importing this module is cheap: torch, transformers and the retrievers load only when a
command runs. User errors (``ValueError`` / ``FileNotFoundError`` from the library) end the
command with a one-line message and exit status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..defaults import ANSWER_STOP, MAX_NEW_TOKENS, TOP_K

if TYPE_CHECKING:  # pragma: no cover - typing only
    from rich.console import Console

__all__ = ["main", "build_parser", "register_subcommand", "SUBCOMMANDS", "parse_option"]

#: Exit status for user errors (bad arguments, missing files), as argparse uses.
EXIT_USAGE = 2

#: Value of ``--docs`` that means the packaged sample documents.
SAMPLE_DOCS = "sample"

#: Styles for streamed tokens by source (unknown labels: amber), matching :mod:`.render`.
_STREAM_STYLES = {"agree": "", "rag": "green", "llm": "blue"}

AddParser = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


# ============================================================================ helpers
def parse_option(text: str) -> tuple[str, Any]:
    """Parse one ``--option key=value``; the value is read as JSON when it parses
    (``3``, ``0.5``, ``true``, ``null``, ``[1, 2]``; Python's ``True``/``False``/``None`` too)
    and kept as a string otherwise."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    words = {"true": True, "false": False, "none": None, "null": None}
    try:
        value: Any = json.loads(raw)
    except json.JSONDecodeError:
        value = words.get(raw.strip().lower(), raw)
    return key.replace("-", "_"), value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _consoles() -> tuple[Console, Console]:
    """(stdout console for the answer and the trace, stderr console for everything else).

    Both show control characters of the text they print (ESC, BEL, backspace... from a
    document, a file name or the model's answer) as visible symbols (``␛``), so that no
    escape sequence from a document reaches the terminal; newlines and tabs are kept.
    """
    from rich.console import Console

    consoles = Console(), Console(stderr=True)
    for console in consoles:
        console.push_render_hook(_VisibleControls())
    return consoles


def _visible_controls(text: str) -> str:
    """``text`` with C0 controls (but newline and tab), DEL and C1 controls replaced by the
    Unicode "control pictures" (``\x1b`` -> ``␛``; C1 -> U+FFFD)."""
    return text.translate(_CONTROL_PICTURES)


_CONTROL_PICTURES = {c: 0x2400 + c for c in range(0x20) if chr(c) not in "\n\t"}
_CONTROL_PICTURES[0x7F] = 0x2421
_CONTROL_PICTURES.update({c: 0xFFFD for c in range(0x80, 0xA0)})


class _VisibleControls:
    """A rich render hook: every text segment printed through the console goes through
    :func:`_visible_controls`; rich's own control segments (cursor moves of a status line)
    and the styles it adds are untouched."""

    def process_renderables(self, renderables: list[Any]) -> list[Any]:
        return [_SanitizedRenderable(r) for r in renderables]


class _SanitizedRenderable:
    def __init__(self, renderable: Any):
        self.renderable = renderable

    def __rich_console__(self, console: Console, options: Any) -> Any:
        from rich.segment import Segment

        for segment in console.render(self.renderable, options):
            if segment.control:
                yield segment
            else:
                yield Segment(_visible_controls(segment.text), segment.style, segment.control)


def _check_output_path(path: str | None, flag: str) -> None:
    """Fail before the model loads when an output file could not be written."""
    if path is None:
        return
    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise FileNotFoundError(f"{flag} {path}: folder {parent} does not exist.")
    if Path(path).is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file name.")


def _resolve_docs(paths: Sequence[str]) -> list[Path]:
    from ..retrieval import get_sample_docs_path

    return [get_sample_docs_path() if p == SAMPLE_DOCS else Path(p).expanduser() for p in paths]


def _short_source(source: str, roots: Sequence[Path]) -> str:
    """``source`` relative to the parent of the ``--docs`` root it came from
    (``sample_docs/products.md``), for compact listings."""
    path = Path(source).resolve()
    for root in roots:
        root = root.resolve()
        base = root.parent
        if path == root or root in path.parents:
            return str(path.relative_to(base))
    return source


def _stop_strings(args: argparse.Namespace) -> list[str]:
    """The answer's stop strings: ``--stop`` texts (``\\n`` and ``\\t`` read as a newline
    and a tab), none with ``--no-stop``, else :data:`~tokrag_integrations.defaults.ANSWER_STOP`."""
    if getattr(args, "no_stop", False):
        return []
    given = getattr(args, "stop", None)
    if not given:
        return list(ANSWER_STOP)
    stops = [t.replace("\\n", "\n").replace("\\t", "\t") for t in given]
    if not all(stops):
        raise ValueError("--stop needs a non-empty text; use --no-stop to decode without stops.")
    return stops


class _Status:
    """``with _Status(err, "Loading model…"):`` a spinner on a terminal; on a file or a pipe
    (``2> log``, CI), where rich shows no spinner, the message as a plain line and, at the
    end, how long it took, so a redirected wait is never silent."""

    def __init__(self, err: Console, message: str):
        self.err = err
        self.message = message
        self._status: Any = None

    def __enter__(self) -> _Status:
        import time

        self._start = time.perf_counter()
        if self.err.is_terminal:
            self._status = self.err.status(self.message)
            self._status.__enter__()
        else:
            self.err.print(self.message, style="dim", soft_wrap=True, highlight=False)
        return self

    def __exit__(self, *exc: Any) -> None:
        import time

        if self._status is not None:
            self._status.__exit__(*exc)
        elif exc[0] is None:
            took = time.perf_counter() - self._start
            self.err.print(f"  done in {took:.1f} s", style="dim", highlight=False)


def _print_warning(err: Console, message: str) -> None:
    from rich.text import Text

    err.print(Text.assemble(("warning: ", "bold yellow"), message), soft_wrap=True)


# ============================================================================ ask
def add_ask_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    p.add_argument(
        "--retriever",
        choices=("dense", "bm25"),
        default="dense",
        help="dense (MiniLM cosine, default) or bm25 keyword retrieval",
    )
    p.add_argument(
        "--top-k",
        type=_positive_int,
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
    from ..policies import available_policies

    p.add_argument(
        "--policy",
        default="tokrag",
        help=f"decoding policy: one of {', '.join(available_policies())} (default tokrag)",
    )
    p.add_argument(
        "--model",
        default="default",
        help="'default' (packaged SmolLM2-135M-Instruct), 'gemma3-270m' (the gemma extra), "
        "a Hugging Face hub id in the local cache (e.g. Qwen/Qwen2.5-7B-Instruct), "
        "a model folder or a .gguf file",
    )
    p.add_argument(
        "--max-new-tokens",
        type=_positive_int,
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
        "--device", default=None, help="torch device, e.g. cpu or cuda (default: CUDA if available)"
    )
    p.add_argument("--dtype", default=None, help="e.g. float32 or bfloat16 (default: by device)")
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
    p.add_argument("--html", metavar="FILE", help="write the trace as a standalone HTML page")
    p.add_argument("--json", metavar="FILE", help="write the trace as JSON")
    p.set_defaults(func=cmd_ask)


def _retrieve(args: argparse.Namespace, err: Console) -> list[Any]:
    """Passages for ``args``: the ``--passage`` texts, then the chunks retrieved from
    ``--docs`` (printed, dim, to stderr)."""
    from rich.text import Text

    from .. import Passage
    from ..retrieval import printable

    passages: list[Any] = [
        Passage(text=t, metadata={"source": "--passage"}) for t in args.passage if t.strip()
    ]
    if args.store == "postgres":
        from .pg import retrieve_from_postgres

        chunks = retrieve_from_postgres(
            args.question,
            args.dsn,
            args.table,
            args.filter,
            args.top_k,
            embed_model=args.embed_model,
            data_dir=args.data_dir,
            search=args.search,
        )
        if not chunks:
            _print_warning(err, "the store returned no chunk for this question; answering without them.")
        for c in chunks:
            line = Text(f"  {c.score:7.4f}  {printable(c.source)} #{c.chunk}  ", style="dim")
            line.append(" ".join(c.text.split()), style="dim italic")
            err.print(line, no_wrap=True, overflow="ellipsis")
            passages.append(c.to_passage())
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
        cache=True,  # a folder asked about again embeds only the chunks that changed
    )
    hits = retriever.retrieve(args.question, top_k=args.top_k)
    if not hits:
        _print_warning(err, "no document chunk matched the question; answering without them.")
    for hit in hits:
        source = printable(_short_source(hit.source, roots))
        line = Text(f"  {hit.score:7.4f}  {source} #{hit.chunk.index}  ", style="dim")
        line.append(" ".join(hit.text.split()), style="dim italic")
        err.print(line, no_wrap=True, overflow="ellipsis")
        passages.append(
            Passage(
                text=hit.text,
                score=hit.score,
                metadata={"source": hit.source, "chunk": hit.chunk.index, **hit.chunk.metadata},
            )
        )
    return passages


def _print_sources(out: Console, trace: Any, roots: Sequence[Path]) -> None:
    """Each passage of ``trace`` in full: rank, source (relative to its ``--docs`` root),
    chunk, score, whether it was used, then its text wrapped to the console's width."""
    from rich.text import Text

    from ..retrieval import printable

    out.print(Text("Sources", style="bold"))
    if not trace.passages:
        out.print(Text("  (no passage was given to the model)", style="dim"))
    for rec in trace.passages:
        meta = rec.metadata
        source = str(meta.get("source", "?"))
        if roots and source != "--passage":
            source = _short_source(source, roots)
        head = f"[{rec.rank}] {printable(source)}"
        if "chunk" in meta:
            head += f" #{meta['chunk']}"
        if rec.score is not None:
            head += f"  score {rec.score:.4f}"
        if not rec.kept:
            head += "  (not used: it did not fit the window)"
        elif rec.cut:
            head += f"  (cut to {rec.n_tokens} tokens to fit)"
        out.print(Text(head, style="bold dim"))
        # Paragraphs re-flowed to the console's width (the source's own line breaks would
        # wrap a second time); nothing is cut.
        paragraphs = [" ".join(p.split()) for p in rec.text.strip().split("\n\n")]
        out.print(Text("\n\n".join(p for p in paragraphs if p)), soft_wrap=False)


def _placement(args: argparse.Namespace) -> dict[str, Any]:
    """``device_map=`` for load_model when ``--device-map`` was given."""
    device_map = getattr(args, "device_map", None)
    return {} if device_map is None else {"device_map": device_map}


def _check_before_loading(args: argparse.Namespace, options: dict[str, Any]) -> bool:
    """Fail on a bad policy, option, device or dtype before retrieval and the model load:
    the policy is built once here with the given options and thrown away. Returns whether
    the policy reads passages at all."""
    from ..models import check_device_and_dtype
    from ..policies import available_policies, get_policy

    if args.policy not in available_policies():  # before get_policy, which imports torch (~2 s)
        raise ValueError(
            f"Unknown policy {args.policy!r}. Available policies: {', '.join(available_policies())}."
        )
    uses_passages = bool(get_policy(args.policy, **options).uses_passages)
    check_device_and_dtype(args.device, args.dtype)
    if args.device is not None and getattr(args, "device_map", None) is not None:
        raise ValueError("pass --device or --device-map, not both")
    if getattr(args, "search", "vector") != "vector" and args.store != "postgres":
        raise ValueError(
            "--search applies to --store postgres; for --docs choose --retriever dense or bm25"
        )
    return uses_passages


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
    options = dict(args.option)
    stop = _stop_strings(args)
    uses_passages = _check_before_loading(args, options)

    from transformers.utils import logging as hf_logging

    from .. import load_model, stream

    if args.verbose:
        from ..models import show_loading_progress

        show_loading_progress()  # load_model shows its progress bars
    else:
        hf_logging.disable_progress_bar()  # the status line below says what is happening
    decision = None
    if not uses_passages and (args.docs or args.store or args.passage):
        # The pure model reads no passage: retrieving (and embedding a folder) would be wasted.
        err.print(Text(f"policy {args.policy} reads no passages: nothing is retrieved", style="dim"))
    if args.gate and uses_passages:
        with _Status(err, f"Loading model {args.model}…"):
            lm = load_model(args.model, device=args.device, dtype=args.dtype, **_placement(args))
        from .gate import build_gate

        with _Status(err, f"Gate {args.gate}: deciding whether to retrieve…"):
            gate = build_gate(lm, args.gate, calibration=args.gate_calibration)
            decision = gate.decide(question)
        err.print(
            Text(
                f"gate {args.gate}: {'retrieve' if decision.retrieve else 'answer directly'} "
                f"(score {decision.score:.4f}, threshold {decision.threshold})",
                style="bold",
            )
        )
    if uses_passages and (decision is None or decision.retrieve):
        passages = _retrieve(args, err)
    else:
        passages = []
    if not (args.gate and uses_passages):
        with _Status(err, f"Loading model {args.model}…"):
            lm = load_model(args.model, device=args.device, dtype=args.dtype, **_placement(args))

    tokens = stream(
        lm,
        question,
        passages,
        policy=args.policy,
        max_new_tokens=args.max_new_tokens,
        stop=stop,
        **options,
    )
    for event in tokens:
        style = _STREAM_STYLES.get(event.source, "dark_orange")
        out.print(Text(event.text, style=style or ""), end="", soft_wrap=True)
    out.print()
    result = tokens.result
    if result.trace.stop_reason == "length":
        err.print(
            Text(f"(answer cut at {args.max_new_tokens} tokens; raise --max-new-tokens)", style="dim")
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
    return 0


# ============================================================================ parser
#: The subcommands, each an ``add_*_parser(subparsers)`` function. Append to add one.
SUBCOMMANDS: list[AddParser] = [add_ask_parser]


def _lazy(module: str, func: str) -> AddParser:
    """A subcommand defined in another module of the package (``module`` relative to
    ``tokrag_integrations``), imported only when the parser is built."""

    def add(subparsers: Any) -> Any:
        import importlib

        package = __name__.rpartition(".")[0]
        return getattr(importlib.import_module(f"{package}.{module}"), func)(subparsers)

    add.__name__ = f"{module}.{func}"
    return add


SUBCOMMANDS += [
    _lazy("bench", "add_parser"),
    _lazy("cli.eval", "add_parser"),
    _lazy("cli.pg", "add_ingest_parser"),
    _lazy("cli.serve", "add_parser"),
]


def register_subcommand(add_parser: AddParser) -> AddParser:
    """Add a subcommand defined elsewhere; usable as a decorator.

    ``add_parser(subparsers)`` must add its parser and ``set_defaults(func=handler)``, where
    ``handler(args) -> int`` returns the exit status.
    """
    if add_parser not in SUBCOMMANDS:
        SUBCOMMANDS.append(add_parser)
    return add_parser


def build_parser() -> argparse.ArgumentParser:
    """The ``tokrag`` argument parser with every registered subcommand."""
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="tokrag",
        description="Token-level benefit/detriment harmonisation for RAG on local models.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for add_parser in SUBCOMMANDS:
        add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``tokrag`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    ``ValueError`` and ``FileNotFoundError`` raised while a command runs are user errors:
    they print ``tokrag: error: <message>`` to stderr and return 2. Python warnings raised
    meanwhile (e.g. a document that is not UTF-8) are printed as one-line warnings.
    """
    from ..paths import CacheDirError

    parser = build_parser()
    args = parser.parse_args(argv)
    _, err = _consoles()
    shown: set[str] = set()

    def show(message: Warning | str, *_: Any, **__: Any) -> None:
        text = str(message)
        if text not in shown:
            shown.add(text)
            _print_warning(err, text)

    previous = warnings.showwarning
    warnings.showwarning = show  # type: ignore[assignment]
    try:
        if getattr(args, "dsn", None):
            from .pg import warn_password_on_command_line

            warn_password_on_command_line(args.dsn)
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, CacheDirError) as exc:
        message = str(exc) or type(exc).__name__
        if isinstance(exc, FileNotFoundError) and exc.filename and str(exc.filename) not in message:
            message = f"{message}: {exc.filename}"
        print(f"tokrag: error: {' '.join(message.split())}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("tokrag: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        # Database problems (unreachable server, missing pgvector, unknown table) are the
        # user's to fix, not tracebacks; their messages never contain credentials.
        if not _is_database_error(exc):
            raise
        print(f"tokrag: database error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 3
    finally:
        warnings.showwarning = previous


def _is_database_error(exc: BaseException) -> bool:
    if "tokrag_integrations.postgres.server" not in sys.modules:
        return False
    from ..postgres.server import PostgresConnectionError, PostgresSetupError

    return isinstance(exc, (PostgresConnectionError, PostgresSetupError, LookupError))

