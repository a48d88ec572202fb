"""What ``tokrag ingest`` reports: one :class:`FileReport` per file and the :class:`IngestSummary`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..retrieval import printable

__all__ = ["FileReport", "IngestSummary"]


@dataclass
class FileReport:
    """What happened to one file."""

    path: str
    """The file's absolute path (undecodable bytes of a file name shown as ``\\xNN``)."""
    status: Literal["added", "replaced", "unchanged", "failed", "pruned", "stale"]
    chunks: int = 0
    """Chunks written (added/replaced), already stored (unchanged), or stored for a file
    that no longer exists (stale, pruned)."""
    removed: int = 0
    """Old chunks deleted (replaced, pruned)."""
    reason: str = ""
    """Why the file failed, or warnings raised while reading it."""


@dataclass
class IngestSummary:
    """Totals of one :func:`ingest` run."""

    table: str
    target: str
    database: str
    """Masked connection string."""
    files: list[FileReport] = field(default_factory=list)
    gone: list[FileReport] = field(default_factory=list)
    """Stored files under an ingested folder that no longer exist there: ``"pruned"`` (their
    chunks deleted, ``prune=True``) or ``"stale"`` (still stored and retrieved)."""
    notes: list[str] = field(default_factory=list)
    """Notes about the table (a missing full-text column, an upgrade done)."""
    seconds: float = 0.0
    embed_seconds: float = 0.0
    write_seconds: float = 0.0

    def _count(self, status: str) -> int:
        return sum(1 for f in self.files if f.status == status)

    @property
    def added(self) -> int:
        return self._count("added")

    @property
    def replaced(self) -> int:
        return self._count("replaced")

    @property
    def unchanged(self) -> int:
        return self._count("unchanged")

    @property
    def failed(self) -> list[FileReport]:
        return [f for f in self.files if f.status == "failed"]

    @property
    def chunks_written(self) -> int:
        return sum(f.chunks for f in self.files if f.status in ("added", "replaced"))

    @property
    def pruned(self) -> int:
        """Files whose chunks were deleted because the file no longer exists."""
        return sum(1 for f in self.gone if f.status == "pruned")

    @property
    def stale(self) -> int:
        """Files no longer present whose chunks are still stored (not pruned)."""
        return sum(1 for f in self.gone if f.status == "stale")

    @property
    def skipped(self) -> int:
        """Files not written: unchanged plus failed."""
        return self.unchanged + len(self.failed)

    def to_text(self) -> str:
        """A human summary (several lines when files failed)."""
        lines = [
            f"{len(self.files)} files into {self.table} ({self.target} layout) at {self.database}: "
            f"{self.added} added, {self.replaced} replaced, {self.unchanged} unchanged, "
            f"{len(self.failed)} failed, {self._gone_text()}; {self.chunks_written} chunks written in "
            f"{self.seconds:.1f} s (embedding {self.embed_seconds:.1f} s, writing "
            f"{self.write_seconds:.1f} s)."
        ]
        lines += [f"  note: {n}" for n in self.notes]
        for f in self.failed:
            lines.append(f"  skipped {_display(f.path)}: {printable(f.reason)}")
        for f in self.files:
            if f.status != "failed" and f.reason:
                lines.append(f"  note {_display(f.path)}: {printable(f.reason)}")
        for f in self.gone:
            verb = "pruned" if f.status == "pruned" else "stale (no longer present)"
            lines.append(f"  {verb} {_display(f.path)}: {f.chunks} chunks")
        if self.stale:
            lines.append(
                "  Stale files are still retrieved; re-run with --prune to delete their chunks."
            )
        return "\n".join(lines)

    def _gone_text(self) -> str:
        return f"{self.pruned} pruned" if self.pruned else f"{self.stale} stale"


def _display(path: str | Path) -> str:
    """``path`` as printable text on one line: bytes of a non-UTF-8 file name shown as
    ``\\xNN``, control characters (a newline, ESC) as escapes."""
    return printable(path)
