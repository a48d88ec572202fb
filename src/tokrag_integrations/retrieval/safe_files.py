"""Files and folders another local user may have planted or swapped: the one set of checks
behind the document opener (:mod:`.retrieval.opener`), the embedded Postgres folders
(:mod:`.postgres.embedded`) and tokrag's caches (chunk embeddings, kernel plans).

The rules (docs/security.md, "Documents and caches"):

* a folder that holds what tokrag trusts is a real folder (not a symbolic link), owned by
  the user running tokrag, and not writable by group or others (``private``: not open to
  them at all), else it is refused with the reason (:func:`folder_refusal`);
* a file is judged before it is read: ``lstat`` first (only regular files), opened with
  ``O_NOFOLLOW | O_NONBLOCK`` (a link swapped in is not followed, a FIFO does not block),
  ``fstat`` of the descriptor (the same regular file, under the size cap), and at most the
  cap plus one byte read, in blocks (:func:`read_regular`);
* a file is written through a temporary file created in the checked folder and renamed into
  place (:func:`write_atomic`): a reader never sees half a file, and a link planted at the
  final name is replaced, not written through.

This module imports only the standard library, so anything in the package may import it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a folder"),
)


class FileRefused(ValueError):  # noqa: N818 - a refusal, not an internal error
    """A path that is not opened; the message says why, without the path."""


class FileTooBig(FileRefused):
    """A regular file over the size cap: ``size`` and ``cap`` in bytes."""

    def __init__(self, size: int, cap: int) -> None:
        super().__init__(f"is {size} bytes, over the limit of {cap} bytes")
        self.size, self.cap = size, cap


def kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words (``"a FIFO (named pipe)"``)."""
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def folder_refusal(
    folder: str | Path,
    *,
    uid: int | None = None,
    private: bool = False,
    follow: bool = False,
) -> str | None:
    """Why ``folder`` cannot be trusted with files tokrag reads back, or ``None``.

    It must be a folder (with ``follow``, a link to one; else not a link), owned by ``uid``
    (default: the effective user), and not writable by group or others (``private``: no
    group or other permission at all). The reason is a phrase without the path.

    Raises:
        OSError: ``folder`` cannot be examined (missing, a parent not searchable).
    """
    st = os.stat(folder) if follow else os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        return f"not a folder but {kind(st.st_mode)}"
    if uid is None:
        uid = os.geteuid()
    if st.st_uid != uid:
        return f"owned by user id {st.st_uid}, not by the user running tokrag ({uid})"
    if st.st_mode & (0o077 if private else 0o022):
        who = "open to" if private else "writable by"
        return f"{who} other users (mode {stat.filemode(st.st_mode)})"
    return None


def checked_folder(root: str | Path, *parts: str, create: bool = False) -> Path:
    """``root / parts[0] / parts[1] ...`` once every level has passed :func:`folder_refusal`:
    ``root`` as configured (a link to a folder is allowed there: the user chose the path),
    each part below it not a link. With ``create``, missing levels are made, mode 0700.

    Raises:
        FileRefused: A level is refused; the message names it and the reason.
        OSError: A level is missing (without ``create``) or cannot be made.
    """
    folder = Path(root)
    levels = [(folder, True)]
    for part in parts:
        folder = folder / part
        levels.append((folder, False))
    for level, follow in levels:
        if create:
            with contextlib.suppress(FileExistsError):
                level.mkdir(mode=0o700, parents=follow)
        reason = folder_refusal(level, follow=follow)
        if reason is not None:
            raise FileRefused(f"{level} is {reason}")
    return folder


def read_regular(
    path: str | Path, max_bytes: int, *, expect: os.stat_result | None = None
) -> bytes:
    """The bytes of regular file ``path``, at most ``max_bytes`` of them.

    ``path`` itself is not followed when it is a link. ``expect``: the ``stat`` of the file
    as the caller found it (a link's target, say); the file opened must be that file.

    Raises:
        FileRefused: Not a regular file (a link, a FIFO, a device, a folder), swapped while
            it was being opened, or over ``max_bytes`` (:class:`FileTooBig`).
        OSError: The file cannot be opened or read (permissions, gone).
    """
    if expect is None:
        expect = os.lstat(path)
        if not stat.S_ISREG(expect.st_mode):
            raise FileRefused(f"not a regular file but {kind(expect.st_mode)}")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW met a link (EMLINK: BSD)
            raise FileRefused(
                "became a symbolic link while it was being opened; not followed"
            ) from None
        raise
    with os.fdopen(fd, "rb") as file:
        opened = os.fstat(file.fileno())
        if not stat.S_ISREG(opened.st_mode):
            raise FileRefused(
                f"not a regular file but {kind(opened.st_mode)}, swapped in while it was "
                "being opened"
            )
        if (opened.st_dev, opened.st_ino) != (expect.st_dev, expect.st_ino):
            raise FileRefused("replaced by another file while it was being opened")
        if opened.st_size > max_bytes:
            raise FileTooBig(opened.st_size, max_bytes)
        data = _read_at_most(file, max_bytes + 1)
    if len(data) > max_bytes:
        raise FileTooBig(len(data), max_bytes)
    return data


#: Bytes asked of a file per read: ``read(n)`` allocates ``n`` bytes, and a cap may be as
#: large as a file can be.
_READ_BLOCK = 1 << 24


def _read_at_most(file: Any, limit: int) -> bytes:
    """At most ``limit`` bytes of ``file``, read in blocks of :data:`_READ_BLOCK`."""
    blocks: list[bytes] = []
    size = 0
    while size < limit:
        block = file.read(min(_READ_BLOCK, limit - size))
        if not block:
            break
        blocks.append(block)
        size += len(block)
    return b"".join(blocks)


def write_atomic(folder: Path, name: str, data: bytes) -> Path:
    """Write ``data`` to ``folder / name`` through a temporary file made in ``folder``
    (``O_EXCL``, mode 0600) and renamed over ``name``. ``folder`` is the caller's checked
    folder (:func:`checked_folder`); ``name`` is one path component.

    Raises:
        OSError: The file cannot be written (read-only or full disk, ``name`` a folder).
    """
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"not one file name: {name!r}")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(tmp, folder / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return folder / name
