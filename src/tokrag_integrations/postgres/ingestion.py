"""``tokrag ingest``: files into pgvector, idempotently, one transaction per file.

For each file: parse (text, Markdown, reStructuredText, HTML, PDF: the loader
:func:`tokrag_integrations.retrieval.read_document` that ``tokrag ask --docs`` uses too),
cut into chunks with :func:`tokrag_integrations.retrieval.chunk_text`, embed
with the packaged MiniLM (or ``embed_model``), and write the chunks with their metadata:

``source`` (absolute path), ``file_name``, ``chunk`` (number within the file, from 0),
``content_hash`` (SHA-256 of the file's extracted text), ``chunk_hash``, ``chunker``
(``"<max_chars>/<overlap>"``), ``embed_model``, ``format`` and ``title`` when found.

**Idempotent.** A file whose stored chunks all carry the same ``content_hash``, ``chunker``
and ``embed_model`` as now, and are as many as it has chunks now, is skipped before it is
embedded. Otherwise its old chunks are deleted and the new ones inserted.

**One transaction per file.** LlamaIndex's ``PGVectorStore`` runs ``delete(ref_doc_id)``
and ``add(nodes)`` in two separate sessions and transactions, and offers no way to join
them; a crash between the two would leave the file's chunks gone. So the table is *created*
by ``PGVectorStore`` itself (its own schema: ``data_<table>`` with ``id``, ``text``,
``metadata_`` JSONB, ``node_id``, ``embedding vector(dim)``, the ``ref_doc_id`` index and an
HNSW index with ``vector_cosine_ops``) and each file's delete + insert is done here with
psycopg in a single ``BEGIN ... COMMIT``, writing rows exactly as ``PGVectorStore.add`` does
(``metadata_`` from LlamaIndex's own ``node_to_metadata_dict``, ``ref_doc_id`` = the source
path). A transaction-scoped advisory lock on (table, source) keeps two concurrent ingests of
the same file from interleaving. Readers never see a half-written file (MVCC), and a killed
process leaves the previous version of the file in place.

**Full-text column.** New tables are created by ``PGVectorStore(hybrid_search=True)``, so
they also hold its generated ``text_search_tsv`` column (``to_tsvector(text_search_config,
text)``, ``english`` by default) with a GIN index, for ``search="text"`` and ``"hybrid"``
(:mod:`.search`); the LangChain layout gets the same column. A table made before has none:
``upgrade=True`` (``tokrag ingest --upgrade``) adds it, otherwise the summary says so.

**LangChain layout** (``target="langchain"``). The LlamaIndex table is readable by
``langchain-postgres`` as is (see :mod:`.store`); ``target="langchain"`` instead writes the
native ``langchain-postgres`` v2 layout (table ``<table>`` created by
``PGEngine.init_vectorstore_table``: ``langchain_id`` UUID, ``content``, ``embedding``,
``langchain_metadata`` JSON) for applications that already expect LangChain's default
columns. The same idempotence and transaction rules apply.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..booleans import require_bool
from ..retrieval import (
    SUPPORTED_SUFFIXES,
    Document,
    DocumentError,
    chunk_text,
    list_folder,
    printable,
    read_document,
    supported_types,
    unreadable_reason,
)
from .embeddings import Embedder, load_embedder
from .layout import TableLayout, Target, check_layout, table_columns  # noqa: F401 - re-exported
from .pool import pooled
from .server import (
    DEFAULT_TABLE,
    PostgresConnectionError,
    ResolvedDatabase,
    connect,
    database_errors,
    resolve_dsn,
)

__all__ = [
    "INGEST_SUFFIXES",
    "FileReport",
    "IngestSummary",
    "ParseError",
    "TableLayout",
    "discover_files",
    "ingest",
    "parse_file",
]

#: Suffixes ``tokrag ingest`` reads: the same as ``tokrag ask --docs``.
INGEST_SUFFIXES: frozenset[str] = SUPPORTED_SUFFIXES

# Namespace for deterministic chunk ids: the same file, text and chunk number give the same id.
_ID_NAMESPACE = uuid.UUID("6f1d8a52-6c49-4d1b-9d0e-2f6c1b7a9e34")


class ParseError(DocumentError):
    """A file could not be turned into text (reported and skipped by :func:`ingest`)."""


# ============================================================================ reports
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


# ============================================================================ files
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

    A file's path is its resolved path, except for a link followed outside its folder: that
    file keeps the link's path, so that it is stored under the folder and pruned with it.

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
                warnings.warn(
                    f"{printable(link.absolute())}: following a symbolic link to "
                    f"{printable(target)}, outside {printable(path)} (follow_links is on)",
                    stacklevel=2,
                )
        elif path.suffix.lower() in INGEST_SUFFIXES:
            candidates = [(path, path.resolve())]
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


def parse_file(path: str | Path) -> tuple[Document, list[str]]:
    """One file as a :class:`~tokrag_integrations.retrieval.Document`, plus notes.

    The file is read by :func:`tokrag_integrations.retrieval.read_document`, the loader
    ``tokrag ask --docs`` uses, so the text, ``title`` and ``format`` match; the notes are its
    warnings (e.g. a file that is not valid UTF-8), without the path.

    Raises:
        ParseError: The file is binary (a NUL byte anywhere, or mostly invalid UTF-8; see
            :func:`~tokrag_integrations.retrieval.binary_reason`), an unreadable PDF, empty,
            or cannot be read.
    """
    path = Path(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            doc = read_document(path)
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


def _index_text(title: str, text: str) -> str:
    """What a chunk is embedded as: its document's title, then the chunk (as ``retrieval`` does)."""
    return f"{title}\n\n{text}" if title and title not in text else text


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
        index_texts=[_index_text(title, c) for c in chunks],
    )


def _stored_state(
    conn: Any, layout: TableLayout, source: str
) -> tuple[int, set[tuple[str, str, str]]]:
    """How many chunks are stored for ``source`` and their distinct (hash, chunker, model)."""
    m = layout.metadata_column
    rows = conn.execute(
        f"SELECT count(*), {m}->>'content_hash', {m}->>'chunker', {m}->>'embed_model' "
        f"FROM {layout.table} WHERE {layout.source_expr} = %s GROUP BY 2, 3, 4",
        (source,),
    ).fetchall()
    return sum(r[0] for r in rows), {(r[1], r[2], r[3]) for r in rows}


def _is_unchanged(
    state: tuple[int, set[tuple[str, str, str]]], prep: _PreparedFile, model: str
) -> bool:
    count, keys = state
    return count == len(prep.chunks) and keys == {(prep.content_hash, prep.chunker, model)}


def _rows(layout: TableLayout, prep: _PreparedFile, embeddings: Any) -> list[tuple[Any, ...]]:
    """Rows for ``layout``: LlamaIndex rows are built exactly as ``PGVectorStore.add`` builds them."""
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
        node_id = str(
            uuid.uuid5(
                _ID_NAMESPACE, f"{prep.source}\x1f{prep.content_hash}\x1f{prep.chunker}\x1f{i}"
            )
        )
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


def _write_file(
    conn: Any, layout: TableLayout, prep: _PreparedFile, model: str, embeddings: Any
) -> tuple[str, int]:
    """Replace ``prep.source``'s chunks in one transaction; returns ``(status, removed)``.

    The transaction takes an advisory lock on (table, source), re-checks the stored state
    (another process may have written the file meanwhile), deletes the old chunks and
    inserts the new ones. Any exception (or a killed process) rolls all of it back.
    """
    cols = f"{layout.id_column}, {layout.text_column}, {layout.metadata_column}, {layout.embedding_column}"
    cast = "::uuid" if layout.target == "langchain" else ""
    with conn.transaction():
        conn.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
            (f"{layout.table}\x1f{prep.source}",),
        )
        state = _stored_state(conn, layout, prep.source)
        if _is_unchanged(state, prep, model):
            return "unchanged", 0
        removed = conn.execute(
            f"DELETE FROM {layout.table} WHERE {layout.source_expr} = %s", (prep.source,)
        ).rowcount
        rows = _rows(layout, prep, embeddings)
        with conn.cursor() as cur:
            cur.executemany(
                f"INSERT INTO {layout.table} ({cols}) VALUES (%s{cast}, %s, %s, %s)", rows
            )
    return ("replaced" if state[0] else "added"), removed


# ============================================================================ table setup
def _vector_dim(conn: Any, layout: TableLayout) -> int | None:
    row = conn.execute(
        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
        "WHERE attrelid = to_regclass(%s) AND attname = %s AND NOT attisdropped",
        (layout.table, layout.embedding_column),
    ).fetchone()
    if not row:
        return None
    digits = "".join(ch for ch in str(row[0]) if ch.isdigit())
    return int(digits) if digits else None


def _stored_models(conn: Any, layout: TableLayout) -> set[str]:
    rows = conn.execute(
        f"SELECT DISTINCT {layout.metadata_column}->>'embed_model' FROM {layout.table}"
    ).fetchall()
    return {r[0] for r in rows if r[0] is not None}


def ensure_table(
    db: ResolvedDatabase,
    layout: TableLayout,
    embedder: Embedder,
    *,
    text_search_config: str = "english",
    upgrade: bool = False,
) -> str:
    """Create the table (its HNSW index, its full-text column and GIN index) if missing;
    check an existing one fits. Returns a note for the summary (``""`` when none).

    A table without the full-text column (ingested before tokrag made one) gets it when
    ``upgrade`` (:func:`~.layout.add_text_search`); otherwise the note says how.

    Creation runs under a session-level advisory lock on the table name, so concurrent
    first ingests into a new table create it once (without the lock, ``CREATE TABLE IF NOT
    EXISTS`` races on ``pg_class_relname_nsp_index``); the others wait, then find it.

    Raises:
        ValueError: The table exists with another embedding size or holds chunks embedded by
            a different model (mixing models would make every similarity meaningless).
        PostgresQueryError: A table of that name exists but is not a tokrag table, or the
            database user may not create or read it.
    """
    from .layout import add_text_search, text_search_column
    from .search import ts_config_exists

    note = ""
    with database_errors(db.dsn, f"prepare table {layout.table}"):
        with pooled(db.dsn) as conn:
            ts_config_exists(conn, text_search_config)
            conn.execute(
                "SELECT pg_advisory_lock(hashtextextended(%s, 0))", (f"tokrag:create:{layout.table}",)
            )
            try:
                if not check_layout(conn, layout, db.masked):
                    _create_table(db, layout, embedder.dim, text_search_config)
                dim = _vector_dim(conn, layout)
            finally:
                conn.execute(
                    "SELECT pg_advisory_unlock(hashtextextended(%s, 0))",
                    (f"tokrag:create:{layout.table}",),
                )
            if dim != embedder.dim:
                raise ValueError(
                    f"Table {layout.table} stores {dim}-dimensional embeddings but "
                    f"{embedder.name} makes {embedder.dim}-dimensional ones. Use the model the "
                    "table was built with (--embed-model), or another --table."
                )
            others = _stored_models(conn, layout) - {embedder.name}
            if not others and dim == embedder.dim and text_search_column(conn, layout)[0] is None:
                if upgrade:
                    add_text_search(conn, layout, text_search_config)
                    note = (
                        f"added the full-text column ({text_search_config}) and its GIN index "
                        f"to {layout.table}: text and hybrid search work now"
                    )
                else:
                    note = (
                        f"table {layout.table} has no full-text column (it was made before "
                        "tokrag added one), so search='text' and 'hybrid' cannot use it; re-run "
                        "with --upgrade (upgrade=True) to add it (rewrites the table once)"
                    )
    if others:
        raise ValueError(
            f"Table {layout.table} holds chunks embedded with {sorted(others)}, not "
            f"{embedder.name}; pass the same --embed-model, or use another --table."
        )
    return note


def _create_table(
    db: ResolvedDatabase, layout: TableLayout, dim: int, ts_config: str = "english"
) -> None:
    if layout.target == "llamaindex":
        from .store import close_llamaindex_store, make_llamaindex_store

        # hybrid_search=True: LlamaIndex's own generated text_search_tsv column and GIN index
        store = make_llamaindex_store(
            db, layout, dim, setup=True, hybrid_search=True, text_search_config=ts_config
        )
        try:
            store.add([])  # the public way to run PGVectorStore's table/index setup
        finally:
            close_llamaindex_store(store)
    else:
        _create_langchain_table(db, layout, dim, ts_config)


def _create_langchain_table(
    db: ResolvedDatabase, layout: TableLayout, dim: int, ts_config: str = "english"
) -> None:
    from langchain_postgres import PGEngine
    from psycopg import sql

    from .server import connect_timeout, sqlalchemy_url

    engine = PGEngine.from_connection_string(
        sqlalchemy_url(db.dsn), connect_args={"connect_timeout": connect_timeout()}
    )
    try:
        engine.init_vectorstore_table(layout.table, dim)
    finally:
        engine._run_as_sync(engine._pool.dispose())
    # The table was just created (under ensure_table's lock): without its indexes it is
    # dropped again, so a failure leaves nothing half-made behind.
    with connect(db.dsn, autocommit=True) as conn:
        try:
            with conn.transaction():
                conn.execute(
                    f"CREATE INDEX IF NOT EXISTS {layout.table}_hnsw_idx ON {layout.table} USING "
                    f"hnsw ({layout.embedding_column} vector_cosine_ops) WITH (m = 16, ef_construction = 64)"
                )
                conn.execute(
                    f"CREATE INDEX IF NOT EXISTS {layout.table}_source_idx ON {layout.table} "
                    f"({layout.source_expr})"
                )
            from .layout import add_text_search

            add_text_search(conn, layout, ts_config, lock=False)  # ensure_table holds it
        except Exception:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(layout.table)))
            raise


# ============================================================================ ingest
def _display(path: str | Path) -> str:
    """``path`` as printable text on one line: bytes of a non-UTF-8 file name shown as
    ``\\xNN``, control characters (a newline, ESC) as escapes."""
    return printable(path)


def _name_is_utf8(path: str | Path) -> bool:
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:  # os.fsdecode turned undecodable bytes into lone surrogates
        return False
    return True


def _rejected_by_postgres(exc: BaseException) -> bool:
    """A write failed because of this file's content (not the connection or a bug)."""
    import psycopg

    return isinstance(exc, (psycopg.DataError, psycopg.errors.ProgramLimitExceeded))


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


def _gone_files(
    conn: Any, layout: TableLayout, roots: Sequence[Path], prune: bool, follow_links: bool = False
) -> list[FileReport]:
    """Stored files under ``roots`` that are no longer there (see :func:`_is_gone`); deleted
    when ``prune``.

    Each deletion is its own transaction under the same (table, source) advisory lock as a
    write, and re-checks that the file is still gone, so a concurrent ingest that puts it
    back is never undone.
    """
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
                conn.execute(
                    "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
                    (f"{layout.table}\x1f{source}",),
                )
                if not _is_gone(source, roots, follow_links):
                    continue
                removed = conn.execute(
                    f"DELETE FROM {layout.table} WHERE {layout.source_expr} = %s", (source,)
                ).rowcount
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
    prune: bool = False,
    follow_links: bool = False,
    text_search_config: str = "english",
    upgrade: bool = False,
    pool_size: int | None = None,
    pool_timeout: float | None = None,
) -> IngestSummary:
    """Ingest files and folders into pgvector; see the module docstring for the guarantees.

    Args:
        paths: Files and/or folders.
        dsn: Connection URL; ``None`` uses ``$TOKRAG_PG_DSN`` or the embedded server.
        table: Logical table name (LlamaIndex stores it as ``data_<table>``).
        embed_model: Folder of a local sentence-transformers model; default packaged MiniLM.
        target: ``"llamaindex"`` (default; also readable from LangChain) or ``"langchain"``
            (native ``langchain-postgres`` layout).
        max_chars / overlap: Chunking, see :func:`tokrag_integrations.retrieval.chunk_text`.
        batch_size: Embedding batch size.
        progress: Show a progress bar (``tqdm``, on stderr).
        data_dir: Data folder of the embedded server.
        on_file: Called with each file's :class:`FileReport` as soon as it is done.
        prune: Delete the chunks of stored files under the given *folders* that are no
            longer there: deleted, or now a symbolic link leaving the folders (unless
            ``follow_links``). Without it they are kept (and still retrieved) and counted as
            stale in the summary. Files under a sub-folder that cannot be read are kept.
        follow_links: Also ingest files reached through symbolic links that leave the given
            folders (a warning names each one; they are stored under the link's path). By
            default such links are reported as failed and not read.
        text_search_config: Text search configuration of the full-text column of a new
            table (``english`` by default; any of the server's ``pg_ts_config``).
        upgrade: Add the full-text column to an existing table that has none (otherwise
            the summary says it is missing).
        pool_size / pool_timeout: The process's psycopg pool for this database (see
            :mod:`.pool`), shared with :class:`~.store.PostgresKnowledgeBase`.

    Returns:
        The :class:`IngestSummary`. A file that cannot be used (unreadable, binary, NUL
        bytes, not UTF-8, a file name that is not UTF-8, content Postgres rejects), an
        unreadable sub-folder and a symbolic link not followed are reported there as failed
        and skipped, one by one; the other files are still ingested.

    Raises:
        FileNotFoundError: A path does not exist.
        TypeError: ``progress`` or ``prune`` is not ``True`` or ``False``.
        ValueError: Bad table name, target, chunking, or an embedding model that does not
            fit the table.
        PostgresConnectionError: The database is unreachable (fails fast, password masked),
            or refused an operation (:class:`PostgresQueryError`: privileges, a table of that
            name that is not tokrag's).
    """
    start = time.perf_counter()
    require_bool(progress, "progress")
    require_bool(prune, "prune")
    require_bool(upgrade, "upgrade")
    from .pool import shared_pool
    from .search import validate_ts_config

    validate_ts_config(text_search_config)
    layout = TableLayout.for_target(table, target)
    chunk_text("check", max_chars=max_chars, overlap=overlap)  # bad chunking fails here, once
    path_list = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    files, rejected = discover_files(path_list, follow_links=follow_links)
    roots = [p.resolve() for p in path_list if unreadable_reason(p) is None and p.is_dir()]
    db = resolve_dsn(dsn, data_dir=data_dir)
    with database_errors(db.dsn, "open a connection pool"):
        shared_pool(db.dsn, pool_size, pool_timeout)
    embedder = load_embedder(embed_model)
    note = ensure_table(
        db, layout, embedder, text_search_config=text_search_config, upgrade=upgrade
    )
    summary = IngestSummary(table=layout.table, target=layout.target, database=db.masked)
    if note:
        summary.notes.append(note)

    def report(item: FileReport) -> None:
        summary.files.append(item)
        if on_file is not None:
            on_file(item)

    for item in rejected:
        report(item)

    from tqdm.auto import tqdm

    bar = tqdm(files, unit="file", desc="ingest", disable=not progress, leave=False)
    with (
        database_errors(db.dsn, f"ingest into {layout.table}"),
        pooled(db.dsn) as conn,
    ):
        for path in bar:
            shown = _display(path)
            bar.set_postfix_str(shown[-30:], refresh=False)
            if not _name_is_utf8(path):
                report(
                    FileReport(
                        shown,
                        "failed",
                        reason="the file name is not valid UTF-8 (Postgres stores paths as "
                        "UTF-8 text); rename the file",
                    )
                )
                continue
            try:
                doc, notes = parse_file(path)
            except (ParseError, OSError, UnicodeError) as exc:
                report(FileReport(str(path), "failed", reason=str(exc)))
                continue
            prep = _prepare(doc, max_chars, overlap, embedder.name)
            if not prep.chunks:
                report(FileReport(str(path), "failed", reason="no text after chunking"))
                continue
            if _is_unchanged(_stored_state(conn, layout, prep.source), prep, embedder.name):
                report(FileReport(str(path), "unchanged", chunks=len(prep.chunks)))
                continue
            t0 = time.perf_counter()
            embeddings = embedder.encode(prep.index_texts, batch_size=batch_size)
            t1 = time.perf_counter()
            try:
                status, removed = _write_file(conn, layout, prep, embedder.name, embeddings)
            except PostgresConnectionError:
                raise
            except Exception as exc:
                import psycopg

                if isinstance(exc, psycopg.OperationalError) and conn.closed:
                    raise PostgresConnectionError(
                        f"Lost the connection to {db.masked} while writing {shown}; files "
                        "written before it are committed, this one is unchanged. Re-run to "
                        "continue."
                    ) from None
                if not _rejected_by_postgres(exc):
                    raise
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                report(
                    FileReport(
                        str(path),
                        "failed",
                        reason=f"Postgres rejected its content ({first}); its stored chunks, "
                        "if any, are unchanged",
                    )
                )
                continue
            finally:
                summary.embed_seconds += t1 - t0
                summary.write_seconds += time.perf_counter() - t1
            report(
                FileReport(
                    str(path),
                    status,  # type: ignore[arg-type]
                    chunks=len(prep.chunks),
                    removed=removed,
                    reason="; ".join(notes),
                )
            )
        bar.close()
        summary.gone = _gone_files(conn, layout, roots, prune, follow_links)
    summary.seconds = time.perf_counter() - start
    return summary
