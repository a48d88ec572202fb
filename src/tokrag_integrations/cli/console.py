"""What the ``tokrag`` subcommands share: option parsing, the two consoles (with control
characters made visible), output-path checks, stop strings and the status line."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..defaults import ANSWER_STOP

if TYPE_CHECKING:  # pragma: no cover - typing only
    from rich.console import Console

#: Exit status for user errors (bad arguments, missing files), as argparse uses.
EXIT_USAGE = 2

#: Value of ``--docs`` that means the packaged sample documents.
SAMPLE_DOCS = "sample"

#: Styles for streamed tokens by source (unknown labels: amber), matching :mod:`.render`.
_STREAM_STYLES = {"agree": "", "rag": "green", "pure": "blue"}

AddParser = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


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


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """``--model``, ``--device`` and ``--dtype`` (``ask`` and ``serve``)."""
    p.add_argument(
        "--model",
        default="default",
        help="'default' (packaged SmolLM2-135M-Instruct), 'gemma3-270m' (the gemma extra), "
        "a Hugging Face hub id in the local cache (e.g. Qwen/Qwen2.5-7B-Instruct), "
        "a model folder or a .gguf file",
    )
    p.add_argument(
        "--device", default=None, help="torch device, e.g. cpu or cuda (default: CUDA if available)"
    )
    p.add_argument("--dtype", default=None, help="e.g. float32 or bfloat16 (default: by device)")


def check_policy(name: str, options: dict[str, Any]) -> Any:
    """The policy ``name`` built with ``options``, so that a bad name or option fails
    before anything loads."""
    from ..policies import available_policies, get_policy, unknown_policy

    if name not in available_policies():  # before get_policy, which imports torch
        raise ValueError(unknown_policy(name))
    return get_policy(name, **options)


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


#: C0 controls (but newline and tab) and DEL as their Unicode "control pictures"
#: (``\x1b`` -> ``␛``), C1 controls as U+FFFD.
_CONTROL_PICTURES = {c: 0x2400 + c for c in range(0x20) if chr(c) not in "\n\t"}
_CONTROL_PICTURES[0x7F] = 0x2421
_CONTROL_PICTURES.update({c: 0xFFFD for c in range(0x80, 0xA0)})


class _VisibleControls:
    """A rich render hook: every text segment printed through the console goes through
    :data:`_CONTROL_PICTURES`; rich's own control segments (cursor moves of a status line)
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
                yield Segment(segment.text.translate(_CONTROL_PICTURES), segment.style)


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


def stop_strings(args: argparse.Namespace) -> list[str]:
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


@contextmanager
def _status(err: Console, message: str) -> Iterator[None]:
    """``with _status(err, "Loading model…"):`` a spinner on a terminal; on a file or a pipe
    (``2> log``, CI), where rich shows no spinner, the message as a plain line and, at the
    end, how long it took, so a redirected wait is never silent."""
    if err.is_terminal:
        with err.status(message):
            yield
        return
    err.print(message, style="dim", soft_wrap=True, highlight=False)
    start = time.perf_counter()
    yield
    err.print(f"  done in {time.perf_counter() - start:.1f} s", style="dim", highlight=False)


def _print_warning(err: Console, message: str) -> None:
    from rich.text import Text

    err.print(Text.assemble(("warning: ", "bold yellow"), message), soft_wrap=True)
