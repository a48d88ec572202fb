"""``tokrag ingest``: files into pgvector, idempotently (a file whose stored chunks carry the
same hashes, chunker and model is skipped before it is embedded), each file's delete + insert
in one transaction under an advisory lock on (table, source), rows written exactly as
``PGVectorStore.add`` writes them. See docs/postgres.md."""

from __future__ import annotations

import hashlib
import os
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..config import require_bool
from ..retrieval.chunking import chunk_text
from ..retrieval.documents import (
    Document,
    DocumentError,
    printable,
    read_document,
    supported_types,
    walk_paths,
)
from ..retrieval.embedder import load_embedder
from ..retrieval.index import index_text
from ..retrieval.opener import max_file_bytes
from .connection import pooled, resolve_dsn, shared_pool
from .dsn import PostgresConnectionError, database_errors, first_line
from .layout import DEFAULT_TABLE, TableLayout, Target, ensure_table
from .search import validate_ts_config

# Namespace for deterministic chunk ids: the same file, text and chunk number give the same id.
_ID_NAMESPACE = uuid.UUID("6f1d8a52-6c49-4d1b-9d0e-2f6c1b7a9e34")


class ParseError(DocumentError):
    """A file could not be turned into text (reported and skipped by :func:`ingest`)."""


@dataclass
class FileReport:
    """What happened to one file."""

    path: str
    """The file's absolute path (undecodable bytes of a file name shown as ``\\xNN``)."""
    status: Literal["added", "replaced", "unchanged", "failed", "pruned", "stale"]
    chunks: int = 0
    """Chunks written, already stored (unchanged), or stored for a file now gone."""
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

    def _count(self, status: str, reports: list[FileReport] | None = None) -> int:
        return sum(1 for f in (self.files if reports is None else reports) if f.status == status)

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
        return self._count("pruned", self.gone)

    @property
    def stale(self) -> int:
        """Files no longer present whose chunks are still stored (not pruned)."""
        return self._count("stale", self.gone)

    def to_text(self) -> str:
        """A human summary (several lines when files failed)."""
        lines = [
            f"{len(self.files)} files into {self.table} ({self.target} layout) at {self.database}: "
            f"{self.added} added, {self.replaced} replaced, {self.unchanged} unchanged, "
            f"{len(self.failed)} failed, {f'{self.pruned} pruned' if self.pruned else f'{self.stale} stale'}; "
            f"{self.chunks_written} chunks written in "
            f"{self.seconds:.1f} s (embedding {self.embed_seconds:.1f} s, writing "
            f"{self.write_seconds:.1f} s)."
        ]
        lines += [f"  note: {n}" for n in self.notes]
        for f in self.failed:
            lines.append(f"  skipped {printable(f.path)}: {printable(f.reason)}")
        for f in self.files:
            if f.status != "failed" and f.reason:
                lines.append(f"  note {printable(f.path)}: {printable(f.reason)}")
        for f in self.gone:
            verb = "pruned" if f.status == "pruned" else "stale (no longer present)"
            lines.append(f"  {verb} {printable(f.path)}: {f.chunks} chunks")
        if self.stale:
            lines.append(
                "  Stale files are still retrieved; re-run with --prune to delete their chunks."
            )
        return "\n".join(lines)


def parse_file(
    path: str | Path,
    *,
    roots: Sequence[Path] | None = None,
    follow_links: bool = False,
    max_file_mb: float | None = None,
) -> tuple[Document, list[str]]:
    """One file read by :func:`~tokrag_integrations.retrieval.documents.read_document` (as
    ``tokrag ask --docs`` reads it), NUL characters removed, plus its warnings as notes.

    Raises:
        ParseError: Whatever ``read_document`` refuses (binary, empty, a broken PDF, a link
            leaving ``roots``, a special file, over ``max_file_mb``).
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


# ============================================================================ writing
@dataclass
class _PreparedFile:
    source: str
    content_hash: str
    chunker: str
    chunks: list[str]
    metadata: dict[str, Any]
    index_texts: list[str]


def _prepare(doc: Document, max_chars: int, overlap: int, embed_model: str) -> _PreparedFile:
    chunks = chunk_text(doc.text, max_chars=max_chars, overlap=overlap)
    title = str(doc.metadata.get("title", "")).strip()
    return _PreparedFile(
        source=doc.source,
        content_hash=hashlib.sha256(doc.text.encode("utf-8")).hexdigest(),
        chunker=f"{max_chars}/{overlap}",
        chunks=chunks,
        metadata={**doc.metadata, "embed_model": embed_model},
        index_texts=[index_text(title, c) for c in chunks],
    )


def _stored_state(
    conn: Any, layout: TableLayout, prep: _PreparedFile, model: str
) -> tuple[int, bool]:
    """How many chunks are stored for ``prep.source``, and whether they are exactly the
    chunks ``prep`` would write (same count, hashes, chunker and model)."""
    m = layout.metadata_column
    rows = conn.execute(
        f"SELECT count(*), {m}->>'content_hash', {m}->>'chunker', {m}->>'embed_model' "
        f"FROM {layout.table} WHERE {layout.source_expr} = %s GROUP BY 2, 3, 4",
        (prep.source,),
    ).fetchall()
    count = sum(r[0] for r in rows)
    keys = {(r[1], r[2], r[3]) for r in rows}
    return count, count == len(prep.chunks) and keys == {(prep.content_hash, prep.chunker, model)}


def _rows(layout: TableLayout, prep: _PreparedFile, embeddings: Any) -> list[tuple[Any, ...]]:
    """Rows for ``layout`` (LlamaIndex's exactly as ``PGVectorStore.add`` builds them)."""
    import json

    rows: list[tuple[Any, ...]] = []
    for i, (text, vector) in enumerate(zip(prep.chunks, embeddings, strict=True)):
        meta = {
            **prep.metadata,
            "source": prep.source,
            "chunk": i,
            "content_hash": prep.content_hash,
            "chunk_hash": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "chunker": prep.chunker,
        }
        key = f"{prep.source}\x1f{prep.content_hash}\x1f{prep.chunker}\x1f{i}"
        node_id = str(uuid.uuid5(_ID_NAMESPACE, key))
        if layout.target == "llamaindex":
            from llama_index.core.schema import NodeRelationship, RelatedNodeInfo, TextNode
            from llama_index.core.vector_stores.utils import node_to_metadata_dict

            node = TextNode(
                id_=node_id,
                text=text,
                metadata=meta,
                # ref_doc_id = source path: PGVectorStore.delete(ref_doc_id=path) removes a file.
                relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id=prep.source)},
                excluded_llm_metadata_keys=list(meta),
                excluded_embed_metadata_keys=list(meta),
            )
            stored = node_to_metadata_dict(node, remove_text=True, flat_metadata=False)
            rows.append((node_id, text, json.dumps(stored), vector))
        else:
            rows.append((node_id, text, json.dumps(meta), vector))
    return rows


def _lock_source(conn: Any, layout: TableLayout, source: str) -> None:
    """The transaction's advisory lock on (table, source): concurrent writers of one file queue."""
    conn.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"{layout.table}\x1f{source}",)
    )


def _delete_source(conn: Any, layout: TableLayout, source: str) -> int:
    return conn.execute(
        f"DELETE FROM {layout.table} WHERE {layout.source_expr} = %s", (source,)
    ).rowcount


def _write_file(
    conn: Any, layout: TableLayout, prep: _PreparedFile, model: str, embeddings: Any
) -> tuple[str, int]:
    """Replace ``prep.source``'s chunks in one transaction under an advisory lock on (table,
    source), re-checking the stored state first; returns ``(status, removed)``."""
    cols = f"{layout.id_column}, {layout.text_column}, {layout.metadata_column}, {layout.embedding_column}"
    cast = "::uuid" if layout.target == "langchain" else ""
    with conn.transaction():
        _lock_source(conn, layout, prep.source)
        stored, unchanged = _stored_state(conn, layout, prep, model)
        if unchanged:
            return "unchanged", 0
        removed = _delete_source(conn, layout, prep.source)
        rows = _rows(layout, prep, embeddings)
        with conn.cursor() as cur:
            cur.executemany(
                f"INSERT INTO {layout.table} ({cols}) VALUES (%s{cast}, %s, %s, %s)", rows
            )
    return ("replaced" if stored else "added"), removed


# ============================================================================ ingest
def _gone_files(
    conn: Any, layout: TableLayout, roots: Sequence[Path], prune: bool, follow_links: bool = False
) -> list[FileReport]:
    """Stored files under ``roots`` that are no longer there (see :func:`_is_gone`); deleted
    when ``prune``, each in its own transaction under the file's advisory lock, re-checked
    there so a concurrent ingest that puts it back is never undone."""
    reports: list[FileReport] = []
    seen: set[str] = set()
    for root in roots:
        prefix = str(root).rstrip(os.sep) + os.sep
        rows = conn.execute(
            f"SELECT {layout.source_expr}, count(*) FROM {layout.table} "
            f"WHERE starts_with({layout.source_expr}, %s) GROUP BY 1 ORDER BY 1",
            (prefix,),
        ).fetchall()
        for source, count in rows:
            if source in seen or not _is_gone(source, roots, follow_links):
                continue
            seen.add(source)
            if not prune:
                reports.append(FileReport(source, "stale", chunks=int(count)))
                continue
            with conn.transaction():
                _lock_source(conn, layout, source)
                if not _is_gone(source, roots, follow_links):
                    continue
                removed = _delete_source(conn, layout, source)
            reports.append(FileReport(source, "pruned", chunks=removed, removed=removed))
    return reports


def ingest(
    paths: str | Path | Sequence[str | Path],
    *,
    dsn: str | None = None,
    table: str = DEFAULT_TABLE,
    embed_model: str | Path | None = None,
    target: Target = "llamaindex",
    max_chars: int = 800,
    overlap: int = 100,
    batch_size: int = 64,
    progress: bool = True,
    data_dir: str | Path | None = None,
    on_file: Callable[[FileReport], None] | None = None,
    on_start: Callable[[Path], None] | None = None,
    prune: bool = False,
    follow_links: bool = False,
    max_file_mb: float | None = None,
    text_search_config: str = "english",
    upgrade: bool = False,
    pool_size: int | None = None,
    pool_timeout: float | None = None,
) -> IngestSummary:
    """Ingest files and folders into pgvector (see the module docstring).

    Args:
        dsn / data_dir / pool_size / pool_timeout: As :class:`~.store.PostgresKnowledgeBase`.
        table: Logical table name (LlamaIndex stores it as ``data_<table>``).
        embed_model: Folder of a local sentence-transformers model; default packaged MiniLM.
        target: ``"llamaindex"`` (default; also readable from LangChain) or ``"langchain"``.
        max_chars / overlap: Chunking (:func:`~tokrag_integrations.retrieval.chunk_text`).
        progress: Show a ``tqdm`` bar on stderr.
        on_file: Called with each file's :class:`FileReport` as soon as it is done.
        on_start: Called with each file's path before it is read.
        prune: Delete the chunks of stored files under the given folders that are gone
            (deleted, or now a link leaving them); else they are kept and counted stale.
        follow_links: Also ingest files reached through links leaving the given folders
            (warned, stored under the link's path); else they are reported as failed.
        max_file_mb: The largest file read (default 100 MB); a bigger one fails.
        text_search_config: Configuration of a new table's full-text column.
        upgrade: Add the full-text column to an existing table that has none.

    Returns:
        The :class:`IngestSummary`: a file that cannot be used, an unreadable sub-folder and
        a link not followed are reported there as failed, one by one.

    Raises:
        FileNotFoundError: A path does not exist.
        ValueError: Bad table name, target, chunking, ``max_file_mb``, or an embedding
            model that does not fit the table.
        PostgresConnectionError: The database is unreachable or refused an operation
            (:class:`~.dsn.PostgresQueryError`).
    """
    start = time.perf_counter()
    require_bool(progress, "progress")
    require_bool(prune, "prune")
    require_bool(upgrade, "upgrade")
    validate_ts_config(text_search_config)
    layout = TableLayout.for_target(table, target)
    chunk_text("check", max_chars=max_chars, overlap=overlap)  # bad chunking fails here, once
    path_list = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    max_file_bytes(max_file_mb)  # a bad cap fails before anything is opened
    walk = walk_paths(path_list, follow_links=follow_links)
    rejected = [FileReport(str(p.absolute()), "failed", reason=r) for p, r in walk.skipped]
    rejected += [
        FileReport(
            str(p.resolve()), "failed", reason=f"unsupported type (supported: {supported_types()})"
        )
        for p in walk.unsupported
    ]
    # A file is stored under its resolved path, once, except a link leaving the given folders:
    # it keeps its path under its folder, so it is stored and pruned with the folder.
    files: dict[Path, Path] = {}
    for found, under_folder in walk.files:
        target = found.resolve()
        inside = any(target.is_relative_to(root) for root in walk.roots)
        files.setdefault(target, target if inside else under_folder)
    db = resolve_dsn(dsn, data_dir=data_dir)
    with database_errors(db.dsn, "open a connection pool"):
        shared_pool(db.dsn, pool_size, pool_timeout)
    embedder = load_embedder(embed_model)
    note = ensure_table(
        db, layout, embedder, text_search_config=text_search_config, upgrade=upgrade
    )
    summary = IngestSummary(layout.table, layout.target, db.masked, notes=[note] if note else [])
    read_options = {
        "roots": walk.roots,
        "follow_links": follow_links,
        "max_file_mb": max_file_mb,
    }

    def ingest_file(conn: Any, path: Path) -> FileReport:
        """Read, chunk, embed and write one file (one transaction)."""
        try:
            str(path).encode("utf-8")
        except UnicodeEncodeError:  # os.fsdecode turned undecodable bytes into lone surrogates
            return FileReport(
                printable(path),
                "failed",
                reason="the file name is not valid UTF-8 (Postgres stores paths as UTF-8 text); "
                "rename the file",
            )
        try:
            doc, notes = parse_file(path, **read_options)
        except (ParseError, OSError, UnicodeError) as exc:
            return FileReport(str(path), "failed", reason=str(exc))
        prep = _prepare(doc, max_chars, overlap, embedder.name)
        if not prep.chunks:
            return FileReport(str(path), "failed", reason="no text after chunking")
        if _stored_state(conn, layout, prep, embedder.name)[1]:
            return FileReport(str(path), "unchanged", chunks=len(prep.chunks))
        t0 = time.perf_counter()
        embeddings = embedder.encode(prep.index_texts, batch_size=batch_size)
        t1 = time.perf_counter()
        import psycopg

        try:
            status, removed = _write_file(conn, layout, prep, embedder.name, embeddings)
        except psycopg.Error as exc:
            if isinstance(exc, psycopg.OperationalError) and conn.closed:
                raise PostgresConnectionError(
                    f"Lost the connection to {db.masked} while writing {printable(path)}; files "
                    "written before it are committed, this one is unchanged. Re-run to continue."
                ) from None
            if not isinstance(exc, (psycopg.DataError, psycopg.errors.ProgramLimitExceeded)):
                raise
            return FileReport(  # this file's content, not the connection or a bug
                str(path),
                "failed",
                reason=f"Postgres rejected its content ({first_line(exc, db.dsn)}); its stored "
                "chunks, if any, are unchanged",
            )
        finally:
            summary.embed_seconds += t1 - t0
            summary.write_seconds += time.perf_counter() - t1
        return FileReport(
            str(path), status, chunks=len(prep.chunks), removed=removed, reason="; ".join(notes)
        )

    def report(item: FileReport) -> None:
        summary.files.append(item)
        if on_file is not None:
            on_file(item)

    for item in rejected:
        report(item)

    from tqdm.auto import tqdm

    bar = tqdm(files.values(), unit="file", desc="ingest", disable=not progress, leave=False)
    with database_errors(db.dsn, f"ingest into {layout.table}"), pooled(db.dsn) as conn:
        for path in bar:
            bar.set_postfix_str(printable(path)[-30:])  # drawn now: a big file takes a while
            if on_start is not None:
                on_start(path)
            report(ingest_file(conn, path))
        bar.close()
        summary.gone = _gone_files(conn, layout, walk.folders, prune, follow_links)
    summary.seconds = time.perf_counter() - start
    return summary
