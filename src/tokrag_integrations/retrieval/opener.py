"""The one way a document file is opened, for folder scans and files named directly alike.

A listed or named path may, by the time it is read, be a link to ``/dev/zero`` or a secret,
a FIFO, or a file of gigabytes, so :func:`read_file_bytes` decides at open time: ``lstat``
(a link is followed only into the given roots, or with ``follow_links``; only regular
files), then :func:`.safe_files.read_regular`: open with ``O_NOFOLLOW | O_NONBLOCK``,
``fstat`` the descriptor (the same regular file, under the cap), and read at most the cap
plus one byte.
"""

from __future__ import annotations

import math
import os
import stat
import sys
from collections.abc import Sequence
from pathlib import Path

from .safe_files import FileRefused, FileTooBig, kind, read_regular

#: Default cap on one document file, in MB (2**20 bytes): image-heavy PDFs reach tens of MB;
#: 100 MB of text (~50,000 pages) is almost surely a log, a dump or a mistake.
DEFAULT_MAX_FILE_MB = 100.0


def max_file_bytes(max_file_mb: float | None = None) -> int:
    """The size cap in bytes: ``max_file_mb``, else :data:`DEFAULT_MAX_FILE_MB`.

    A cap above the largest size a file can have (``sys.maxsize`` bytes, 8 EiB on 64-bit
    systems: ``1e308``, ``10**400``) is that size, which means no cap.

    Raises:
        ValueError: ``max_file_mb`` is not a finite number above 0 (the message names it).
    """
    if max_file_mb is None:
        max_file_mb = DEFAULT_MAX_FILE_MB
    elif (
        isinstance(max_file_mb, bool)
        or not isinstance(max_file_mb, (int, float))
        or (isinstance(max_file_mb, float) and not math.isfinite(max_file_mb))
        or max_file_mb <= 0
    ):
        raise ValueError(f"max_file_mb must be a number of MB above 0, got {max_file_mb!r}")
    # An int stays exact (10**400 MB would overflow a float); a float may reach inf here.
    return int(min(max_file_mb * 2**20, sys.maxsize))


def _mb(size: int) -> str:
    return f"{size / 2**20:.1f} MB"


def _inside(target: Path, roots: Sequence[Path]) -> bool:
    return any(target.is_relative_to(root) for root in roots)


def given_roots(paths: Sequence[Path]) -> list[Path]:
    """The folders a symbolic link may point into (resolved): every folder given, and the
    folder holding each file given, so a file named directly (``docs/*``) is judged by its
    own folder, as a folder scan judges its files."""
    roots: list[Path] = []
    for path in paths:
        try:
            root = path.resolve() if path.is_dir() else path.absolute().parent.resolve()
        except (OSError, RuntimeError):  # unreadable or a link loop: reported by the caller
            continue
        if root not in roots:
            roots.append(root)
    return roots


def read_file_bytes(
    path: str | Path,
    *,
    roots: Sequence[Path] | None = None,
    follow_links: bool = False,
    max_bytes: int | None = None,
) -> bytes:
    """The bytes of document file ``path``, opened safely (see the module docstring).
    ``roots``: resolved folders a link may point into (default: the file's own folder);
    ``max_bytes``: the cap (default :func:`max_file_bytes`).

    Raises:
        FileRefused: A link leaving ``roots``, a broken link, not a regular file, a file
            over the cap, or a file swapped while it was being opened.
        OSError: The file cannot be opened or read (permissions, gone).
    """
    path = Path(path)
    cap = max_file_bytes() if max_bytes is None else max_bytes
    if roots is None:
        roots = [path.absolute().parent.resolve()]
    seen = os.lstat(path)
    target = path
    if stat.S_ISLNK(seen.st_mode):
        try:
            target = path.resolve(strict=True)
        except FileNotFoundError:
            raise FileRefused(f"a broken symbolic link (to {path.resolve()})") from None
        except RuntimeError:
            raise FileRefused("a symbolic link loop") from None
        if not follow_links and not _inside(target, roots):
            where = roots[0] if len(roots) == 1 else "the given folders"
            raise FileRefused(
                f"a symbolic link to {target}, outside {where}; not followed "
                "(--follow-links / follow_links=True reads it)"
            )
        seen = os.stat(target)
    if not stat.S_ISREG(seen.st_mode):
        raise FileRefused(f"not a regular file but {kind(seen.st_mode)}")
    try:
        return read_regular(target, cap, expect=seen)
    except FileTooBig as exc:
        raise FileRefused(_over_cap(exc.size, cap)) from None


def _over_cap(size: int, cap: int) -> str:
    return (
        f"is {_mb(size)}, over the limit of {_mb(cap)} per file (raise it with "
        "--max-file-mb or max_file_mb=)"
    )
