"""The files ``tokrag ingest`` reads: finding them under the given paths, reading each one,
and telling which stored files are gone."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..retrieval import (
    SUPPORTED_SUFFIXES,
    Document,
    DocumentError,
    list_folder,
    printable,
    read_document,
    supported_types,
    unreadable_reason,
    warn_followed_link,
)
from ..retrieval.opener import given_roots, link_leaving
from .reports import FileReport

__all__ = ["INGEST_SUFFIXES", "ParseError", "discover_files", "parse_file"]

#: Suffixes ``tokrag ingest`` reads: the same as ``tokrag ask --docs``.
INGEST_SUFFIXES: frozenset[str] = SUPPORTED_SUFFIXES


class ParseError(DocumentError):
    """A file could not be turned into text (reported and skipped by :func:`ingest`)."""


def discover_files(
    paths: str | Path | Iterable[str | Path], *, follow_links: bool = False
) -> tuple[list[Path], list[FileReport]]:
    """Files to ingest under ``paths`` and reports for what was not read.

    Folders are searched recursively in path order (see
    :func:`~tokrag_integrations.retrieval.list_folder`), hidden entries skipped; other
    suffixes inside folders are ignored silently, but a file named explicitly with an
    unsupported suffix, an unreadable sub-folder, a symbolic link leaving its folder (unless
    ``follow_links``, which warns for each one followed), a broken link or a special file is
    reported as failed.

    A file's path is its resolved path, except for a link leaving its folder (followed, or
    named directly): that file keeps the link's path, so that it is stored under the folder
    and pruned with it, and :func:`parse_file` judges the link when it opens it.

    Raises:
        FileNotFoundError: A path does not exist.
        ValueError: No path was given.
    """
    path_list = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    if not path_list:
        raise ValueError("No paths were given; pass at least one file or folder to ingest.")
    files: list[Path] = []
    rejected: list[FileReport] = []
    seen: set[Path] = set()
    roots = given_roots(path_list)
    for path in path_list:
        reason = unreadable_reason(path)
        if reason is not None:
            rejected.append(FileReport(str(path.absolute()), "failed", reason=reason))
            continue
        if not path.exists():
            raise FileNotFoundError(f"Path not found: {path}")
        if path.is_dir():
            listing = list_folder(path, follow_links=follow_links)
            real_root = path.resolve()
            # a file reached through a link leaving the folder is stored under the folder
            candidates = [
                (p, p.resolve() if p.resolve().is_relative_to(real_root) else real_root / p.relative_to(path))
                for p in listing.files
            ]
            rejected += [FileReport(str(p.absolute()), "failed", reason=r) for p, r in listing.skipped]
            for link, target in listing.followed_links:
                warn_followed_link(link.absolute(), target, path, stacklevel=2)
        elif path.suffix.lower() in INGEST_SUFFIXES:
            # A link named directly is judged when it is opened (parse_file), against the
            # folder it lies in and the given folders; one leaving them keeps the link's path.
            target = link_leaving(path, roots)
            if target is None:
                candidates = [(path, path.resolve())]
            else:
                candidates = [(path, path.absolute().parent.resolve() / path.name)]
                if follow_links:
                    warn_followed_link(path.absolute(), target, "the given folders", stacklevel=2)
        else:
            rejected.append(
                FileReport(
                    str(path.resolve()),
                    "failed",
                    reason=f"unsupported type (supported: {supported_types()})",
                )
            )
            continue
        for p, stored in candidates:
            resolved = p.resolve()
            if resolved not in seen:
                seen.add(resolved)
                files.append(stored)
    return files, rejected


def parse_file(
    path: str | Path,
    *,
    roots: Sequence[Path] | None = None,
    follow_links: bool = False,
    max_file_mb: float | None = None,
) -> tuple[Document, list[str]]:
    """One file as a :class:`~tokrag_integrations.retrieval.Document`, plus notes.

    The file is read by :func:`tokrag_integrations.retrieval.read_document`, the loader
    ``tokrag ask --docs`` uses, so the text, ``title`` and ``format`` match, and the same
    opener refuses what it refuses (``roots``, ``follow_links`` and ``max_file_mb`` are
    passed on); the notes are its warnings (e.g. a file that is not valid UTF-8), without
    the path.

    Raises:
        ParseError: The file is binary (a NUL byte anywhere, or mostly invalid UTF-8; see
            :func:`~tokrag_integrations.retrieval.binary_reason`), an unreadable PDF, empty,
            cannot be read, or is refused by the opener (a link leaving ``roots``, a FIFO or
            device, over ``max_file_mb``).
    """
    path = Path(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            doc = read_document(
                path, roots=roots, follow_links=follow_links, max_file_mb=max_file_mb
            )
        except DocumentError as exc:
            raise ParseError(str(exc)) from None
    notes = [str(w.message).replace(f"{printable(path)}: ", "") for w in caught]
    # Postgres text cannot hold NUL characters (a PDF's text layer or an HTML entity can
    # still produce one); strip them from the text and every metadata string.
    doc.text = doc.text.replace("\x00", "")
    doc.metadata = {
        k: v.replace("\x00", "") if isinstance(v, str) else v for k, v in doc.metadata.items()
    }
    return doc, notes


def _name_is_utf8(path: str | Path) -> bool:
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:  # os.fsdecode turned undecodable bytes into lone surrogates
        return False
    return True


def _is_gone(source: str, roots: Sequence[Path], follow_links: bool) -> bool | None:
    """Whether stored file ``source`` is no longer under ``roots``: it does not exist, or it
    is now a symbolic link leaving them (unless ``follow_links``). ``None`` when it cannot be
    told (a folder on its path cannot be read: reported by the walk, its chunks are kept)."""
    path = Path(source)
    try:
        path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return None
    return not follow_links and not any(path.resolve().is_relative_to(r) for r in roots)
