"""Where tokrag keeps files between processes: converted models and measured kernel plans.

A leaf module (standard library and :mod:`.config` only), so that both :mod:`.models` and the speed paths of
:mod:`.cpu_kernels` can read it without importing each other.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import config

#: Environment variable that moves tokrag's cache folder.
CACHE_DIR_ENV = config.CACHE_DIR


class CacheDirError(OSError):
    """tokrag's cache folder cannot be created or written (the message names the folder and
    :data:`CACHE_DIR_ENV`)."""


def cache_dir() -> Path:
    """Folder where converted models are cached (``$TOKRAG_CACHE_DIR`` or ``~/.cache/tokrag``)."""
    root = config.cache_dir()
    if root is not None:
        return root
    return (config.xdg_cache_home() or Path(os.path.expanduser("~/.cache"))) / "tokrag"


def cache_write_error(error: OSError, what: str, folder: Path) -> OSError:
    """The error to raise when writing ``what`` into ``folder`` failed with ``error``: a
    :class:`CacheDirError` naming the cache folder and :data:`CACHE_DIR_ENV` when ``folder``
    is inside it, else an ``OSError`` naming ``folder``."""
    reason = f"{error.strerror or error}: {error.filename or folder}"
    root = cache_dir()
    if Path(os.path.abspath(folder)).is_relative_to(os.path.abspath(root)):
        return CacheDirError(
            f"Cannot write {what} into tokrag's cache folder {root} ({reason}); set "
            f"${CACHE_DIR_ENV} to a writable folder."
        )
    return OSError(f"Cannot write {what} into {folder} ({reason}).")
