"""Documents: the file types read, the record types, the one loader of a file
(:func:`read_document`) and the one walk of the paths a user names (:func:`walk_paths`,
through :func:`list_folder` for each folder), both shared by ``tokrag ask --docs`` and
``tokrag ingest``; the frameworks' readers are optional extras."""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .opener import FileRefused, given_roots, max_file_bytes, read_file_bytes

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


@dataclass
class Document:
    """One loaded file: its ``text`` (visible text only, for HTML), the ``source`` path, and
    ``metadata``: ``file_name``, ``format``, ``title`` where found, ``decode_errors`` when the
    file was not valid UTF-8."""

    text: str
    source: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class Chunk:
    """A piece of a document small enough to be one passage of a prompt: its ``text``, the
    ``source`` document's path, its ``index`` within the document (from 0) and the
    document's ``metadata``."""

    text: str
    source: str
    index: int
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class ScoredChunk:
    """A chunk with its retrieval ``score`` (cosine similarity for dense, BM25 score for bm25;
    higher is better)."""

    chunk: Chunk
    score: float

    @property
    def text(self) -> str:
        return self.chunk.text

    @property
    def source(self) -> str:
        return self.chunk.source


#: An element name after ``<`` or ``</`` (as HTML's tokenizer reads it: up to whitespace,
#: ``/`` or ``>``); one character class, so matching it is linear.
_TAG_NAME = re.compile(r"[a-zA-Z][^\t\n\r\f />]*")
#: What ends a tag or opens a quoted attribute value inside one.
_IN_TAG = re.compile(r"""[>"']""")
#: Elements whose content is raw text, not markup (as the standard library's parser has it).
_RAW_TEXT = ("script", "style")
_RAW_END = {name: re.compile(rf"</{name}(?=[\t\n\r\f />])", re.IGNORECASE) for name in _RAW_TEXT}


def _tag_end(html: str, i: int) -> int:
    """The index of the ``>`` ending the tag whose attributes start at ``i`` (a ``>`` in a
    quoted attribute value does not end it), or -1 when the page ends first."""
    while True:
        m = _IN_TAG.search(html, i)
        if m is None:
            return -1
        j = m.start()
        if m.group() == ">":
            return j
        if html[i:j].rstrip(" \t\n\r\f").endswith("="):  # a quoted value: skip past it
            close = html.find(m.group(), j + 1)
            if close < 0:
                return -1
            i = close + 1
        else:  # a stray quote in a name or an unquoted value
            i = j + 1


def _html_events(html: str) -> Iterator[tuple[str, str]]:
    """``("start" | "end", tag)`` and ``("data", text)`` events of an HTML page, in one pass.

    The standard library's :class:`html.parser.HTMLParser` rescans the rest of the page
    for each ``<`` it cannot close, which is quadratic: 96 KB of ``<x `` took 208 s on
    Python 3.11.7, a megabyte would take hours (issue 54). This reads the page as a browser's
    tokenizer does, for what text extraction needs: each search starts where the last one
    ended, and a search that reaches the end of the page (an unclosed comment, tag or quoted
    value: browsers drop them too) ends the page. Comments, doctypes, processing
    instructions and CDATA sections give no text; entities are decoded in the text."""
    from html import unescape

    pos, n = 0, len(html)
    while pos < n:
        lt = html.find("<", pos)
        if lt < 0:
            yield "data", unescape(html[pos:])
            return
        if lt > pos:
            yield "data", unescape(html[pos:lt])
        pos = lt + 1
        if html.startswith(("!--", "![CDATA["), pos):
            closer = "-->" if html.startswith("!--", pos) else "]]>"
            end = html.find(closer, pos + 3)
            pos = n if end < 0 else end + 3
            continue
        closing = html.startswith("/", pos)
        name = _TAG_NAME.match(html, pos + closing)
        if html.startswith(("!", "?"), pos) or (closing and name is None):
            end = html.find(">", pos)  # a doctype, processing instruction or bogus comment
            pos = n if end < 0 else end + 1
        elif name is not None:
            end = _tag_end(html, name.end())
            if end < 0:
                return
            tag = name.group().lower()
            pos = end + 1
            if closing:
                yield "end", tag
                continue
            yield "start", tag
            if tag in _RAW_TEXT:  # skip to its end tag, markup inside is text of the script
                close = _RAW_END[tag].search(html, pos)
                if close is None:
                    return
                yield "data", html[pos : close.start()]
                pos = close.start()
        else:
            yield "data", "<"


class _HTMLTextExtractor:
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
        self._parts: list[str] = []
        self._skip_depth = 0
        self._in_title = False
        self.title = ""

    def feed(self, html: str) -> None:
        """Read the whole page (:func:`_html_events`)."""
        handlers = {"start": self.handle_starttag, "end": self.handle_endtag}
        for kind, value in _html_events(html):
            handlers.get(kind, self.handle_data)(value)

    def handle_starttag(self, tag: str) -> None:
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
    """Visible text and ``<title>`` of an HTML page (scripts and styles removed, entities
    decoded; standard library only), in time linear in the page (:func:`_html_events`)."""
    parser = _HTMLTextExtractor()
    parser.feed(html)
    return parser.text(), re.sub(r"\s+", " ", parser.title).strip()


#: The start of a level-1 ATX heading line: ``#`` then a space or tab. A fixed-length
#: pattern, so finding every candidate is one linear scan; the rest of the line is read with
#: string methods, never by a pattern with two adjacent runs of optional spaces (which
#: backtracks cubically on ``# a`` + thousands of spaces + ``b``: issue 54.1).
_HEADING_START = re.compile(r"^#[ \t]", re.MULTILINE)


def markdown_title(text: str) -> str:
    """The text of the first level-1 heading (``# Title``) of Markdown ``text``, or ``""``.

    As CommonMark reads an ATX heading: the closing run of ``#`` is dropped when a space or
    tab precedes it (``# Title ##`` is ``Title``, ``# C#`` is ``C#``), and surrounding
    whitespace is trimmed; a heading with no text is passed over. Linear in ``len(text)``.
    """
    for match in _HEADING_START.finditer(text):
        end = text.find("\n", match.end())
        line = text[match.end() : end if end >= 0 else len(text)].strip()
        closing = line.rstrip("#")
        if closing != line and (not closing or closing[-1] in " \t"):
            line = closing.rstrip()
        if line:
            return line
    return ""


#: Longest title kept (characters). A title is indexed with every chunk of its document
#: (:func:`.index.index_text`), so a heading of a megabyte would be indexed once per chunk:
#: quadratic in the file (issue 54).
MAX_TITLE_CHARS = 200


def short_title(title: str) -> str:
    """``title`` with its whitespace runs made single spaces, cut between words to at most
    :data:`MAX_TITLE_CHARS` characters (hard, for one enormous word)."""
    title = " ".join(title.split())
    if len(title) <= MAX_TITLE_CHARS:
        return title
    cut = title.rfind(" ", 0, MAX_TITLE_CHARS + 1)
    return title[: cut if cut > 0 else MAX_TITLE_CHARS].rstrip()


#: Share of undecodable bytes above which a file is taken for binary data, not text.
BINARY_UNDECODABLE_SHARE = 0.3


def binary_reason(data: bytes) -> str | None:
    """Why ``data`` is not a text file (a NUL byte anywhere: binary or UTF-16; mostly invalid
    UTF-8), or ``None``: a few bad bytes (a Latin-1 accent) are decoded with a warning."""
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


def _pdf_text(data: bytes) -> str:
    """The text layer of a PDF's bytes, page by page (blank pages dropped)."""
    try:
        import pypdf
    except ImportError:
        raise DocumentError("PDF support needs the 'pypdf' package: pip install pypdf") from None
    import io

    try:
        reader = pypdf.PdfReader(io.BytesIO(data))
        pages = [page.extract_text() or "" for page in reader.pages]
    except Exception as exc:  # noqa: BLE001 - any parser failure means "cannot read this PDF"
        raise DocumentError(f"not a readable PDF ({type(exc).__name__}: {exc})") from None
    return "\n\n".join(p.strip() for p in pages if p.strip())


def read_document(
    path: str | Path,
    *,
    roots: Sequence[Path] | None = None,
    follow_links: bool = False,
    max_file_mb: float | None = None,
) -> Document:
    """One file as a :class:`Document`: text and Markdown as they are, HTML reduced to its
    visible text, PDF through ``pypdf``. The bytes come from :func:`.opener.read_file_bytes`
    (``roots``, ``follow_links`` and ``max_file_mb`` are its rules).

    Raises:
        DocumentError: The file is refused by the opener, cannot be read, is binary (see
            :func:`binary_reason`), is a broken PDF, or holds no text.
        ValueError: ``max_file_mb`` is not a number above 0.

    Warns:
        UnicodeWarning: The file is not valid UTF-8 (decoded with replacement characters).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    metadata: dict[str, Any] = {"file_name": path.name, "format": suffix.lstrip(".")}
    cap = max_file_bytes(max_file_mb)
    try:
        data = read_file_bytes(path, roots=roots, follow_links=follow_links, max_bytes=cap)
    except FileRefused as exc:
        raise DocumentError(str(exc)) from None
    except OSError as exc:
        raise DocumentError(f"could not be read ({exc.strerror or exc})") from None
    if suffix in PDF_SUFFIXES:
        text = _pdf_text(data)
        if not text.strip():
            raise DocumentError("the PDF contains no extractable text (scanned images need OCR)")
        return Document(text=text, source=str(path), metadata=metadata)
    reason = binary_reason(data)
    if reason is not None:
        raise DocumentError(f"looks binary, not a {suffix or 'text'} text file: {reason}")
    text, had_errors = _decode(data, path)
    if suffix in HTML_SUFFIXES:
        text, title = html_to_text(text)
    else:
        title = markdown_title(text) if suffix in {".md", ".markdown"} else ""
    title = short_title(title)
    if title:
        metadata["title"] = title
    if had_errors:
        metadata["decode_errors"] = True
    if not text.strip():
        raise DocumentError("contains no text")
    return Document(text=text, source=str(path), metadata=metadata)


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


@dataclass
class FolderListing:
    """What :func:`list_folder` found under one folder."""

    #: Files of a supported type, in path order (as found under the folder, not resolved).
    files: list[Path] = field(default_factory=list)
    other_types: list[Path] = field(default_factory=list)
    #: Entries not read, with the reason.
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    #: Links leaving the folder followed with ``follow_links=True``, with their targets.
    followed_links: list[tuple[Path, Path]] = field(default_factory=list)


def list_folder(root: Path, *, follow_links: bool = False) -> FolderListing:
    """The files under folder ``root``, recursively, in path order; hidden entries skipped.

    A link leaving ``root`` is not followed unless ``follow_links``; a link inside ``root`` to
    a folder is not descended. Each unreadable folder, link not followed, broken link or
    special file is listed in ``skipped`` with the reason.
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
                listing.skipped.append(
                    (path, f"cannot be read ({getattr(exc, 'strerror', None) or exc})")
                )
                continue
            if link and not (is_dir or is_file):
                listing.skipped.append((path, f"a broken symbolic link (to {target})"))
                continue
            if link and not target.is_relative_to(real_root):
                if not follow_links:
                    listing.skipped.append(
                        (
                            path,
                            f"a symbolic link to {target}, outside {root}; not followed "
                            "(--follow-links / follow_links=True reads it)",
                        )
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


@dataclass
class PathWalk:
    """What :func:`walk_paths` found under the paths given."""

    #: Each document file as found (the folder given joined with its path inside it, or the
    #: file named) and the same path under the resolved folder, its final link not resolved.
    files: list[tuple[Path, Path]] = field(default_factory=list)
    #: Entries not read, with the reason: a path given or a folder entry that cannot be read,
    #: a link leaving its folder not followed, a broken link, a special file.
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    #: Files named directly whose type is not supported.
    unsupported: list[Path] = field(default_factory=list)
    #: The resolved folders a symbolic link may point into (:func:`.opener.given_roots`).
    roots: list[Path] = field(default_factory=list)
    #: The folders given that were walked, resolved.
    folders: list[Path] = field(default_factory=list)


def walk_paths(paths: Sequence[Path], *, follow_links: bool = False) -> PathWalk:
    """The document files under ``paths`` (files, and folders through :func:`list_folder`),
    in the order given. A file named directly is listed even when it is a link leaving its
    folder: :func:`read_document` judges it when it opens it.

    Raises:
        FileNotFoundError: A path does not exist.
        ValueError: No path was given.

    Warns:
        UserWarning: One per link leaving its folder followed (``follow_links``); one per
            folder for the files of other types in it.
    """
    if not paths:
        raise ValueError("No document paths were given; pass at least one file or folder.")
    walk = PathWalk(roots=given_roots(paths))
    followed: list[tuple[Path, Path, str | Path]] = []
    for path in paths:
        try:
            path.stat()
        except (FileNotFoundError, NotADirectoryError):
            raise FileNotFoundError(f"Document path not found: {path}") from None
        except OSError as exc:  # a folder on its way is not readable
            walk.skipped.append((path, f"cannot be read ({exc.strerror or exc})"))
            continue
        if path.is_dir():
            listing = list_folder(path, follow_links=follow_links)
            real_root = path.resolve()
            walk.folders.append(real_root)
            walk.files += [(file, real_root / file.relative_to(path)) for file in listing.files]
            walk.skipped += listing.skipped
            followed += [(link, target, path) for link, target in listing.followed_links]
            if listing.other_types:
                suffixes = sorted({p.suffix.lower() or "no suffix" for p in listing.other_types})
                warnings.warn(
                    f"{printable(path)}: {len(listing.other_types)} file(s) of other types "
                    f"skipped ({', '.join(suffixes)}); supported: {supported_types()}.",
                    stacklevel=3,
                )
        elif path.suffix.lower() not in SUPPORTED_SUFFIXES:
            walk.unsupported.append(path)
        else:
            walk.files.append((path, path.absolute().parent.resolve() / path.name))
            if follow_links and path.is_symlink():
                # A broken link or a loop is not warned about: the opener refuses it.
                with contextlib.suppress(OSError, RuntimeError):
                    target = path.resolve(strict=True)
                    if not any(target.is_relative_to(root) for root in walk.roots):
                        followed.append((path, target, "the given folders"))
    for link, target, outside in followed:
        warnings.warn(
            f"{printable(link)}: following a symbolic link to {printable(target)}, outside "
            f"{printable(outside)} (follow_links is on).",
            stacklevel=3,
        )
    return walk
