"""Where tokrag keeps files between processes: converted models and measured kernel plans.

A leaf module (standard library only), so that both :mod:`.models` and the speed paths of
:mod:`.cpu_kernels` can read it without importing each other.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Folder where converted models are cached (``$TOKRAG_CACHE_DIR`` or ``~/.cache/tokrag``)."""
    root = os.environ.get("TOKRAG_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokrag"
    )
    return Path(root)
