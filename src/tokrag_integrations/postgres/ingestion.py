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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import require_bool
from ..retrieval import (
    Document,
    chunk_text,
    unreadable_reason,
)
from ..retrieval.opener import given_roots, max_file_bytes
from .embeddings import Embedder, load_embedder
from .ingest_files import (  # noqa: F401 - re-exported: this was their module
    INGEST_SUFFIXES,
    ParseError,
    _is_gone,
    _name_is_utf8,
    discover_files,
    parse_file,
)
from .ingest_tables import (  # noqa: F401 - re-exported: this was their module
    _create_langchain_table,
    _create_table,
    _stored_models,
    _vector_dim,
    ensure_table,
)
from .layout import TableLayout, Target, check_layout, table_columns  # noqa: F401 - re-exported
from .pool import pooled
from .reports import FileReport, IngestSummary, _display
from .server import (
    DEFAULT_TABLE,
    PostgresConnectionError,
    ResolvedDatabase,
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

# Namespace for deterministic chunk ids: the same file, text and chunk number give the same id.
_ID_NAMESPACE = uuid.UUID("6f1d8a52-6c49-4d1b-9d0e-2f6c1b7a9e34")





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


# ============================================================================ ingest
def _rejected_by_postgres(exc: BaseException) -> bool:
    """A write failed because of this file's content (not the connection or a bug)."""
    import psycopg

    return isinstance(exc, (psycopg.DataError, psycopg.errors.ProgramLimitExceeded))


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


def _ingest_file(
    conn: Any,
    path: Path,
    db: ResolvedDatabase,
    layout: TableLayout,
    embedder: Embedder,
    summary: IngestSummary,
    chunking: tuple[int, int],
    batch_size: int,
    read_options: dict[str, Any],
) -> FileReport:
    """Read, chunk, embed and write one file (one transaction); its report. The embedding
    and writing times are added to ``summary``.

    Raises:
        PostgresConnectionError: The connection was lost (files written before are kept).
    """
    shown = _display(path)
    if not _name_is_utf8(path):
        return FileReport(
            shown,
            "failed",
            reason="the file name is not valid UTF-8 (Postgres stores paths as "
            "UTF-8 text); rename the file",
        )
    try:
        doc, notes = parse_file(path, **read_options)
    except (ParseError, OSError, UnicodeError) as exc:
        return FileReport(str(path), "failed", reason=str(exc))
    prep = _prepare(doc, chunking[0], chunking[1], embedder.name)
    if not prep.chunks:
        return FileReport(str(path), "failed", reason="no text after chunking")
    if _is_unchanged(_stored_state(conn, layout, prep.source), prep, embedder.name):
        return FileReport(str(path), "unchanged", chunks=len(prep.chunks))
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
        return FileReport(
            str(path),
            "failed",
            reason=f"Postgres rejected its content ({first}); its stored chunks, "
            "if any, are unchanged",
        )
    finally:
        summary.embed_seconds += t1 - t0
        summary.write_seconds += time.perf_counter() - t1
    return FileReport(
        str(path),
        status,  # type: ignore[arg-type]
        chunks=len(prep.chunks),
        removed=removed,
        reason="; ".join(notes),
    )


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
        on_start: Called with each file's path before it is read (``tokrag ingest`` says
            there when a big file will take a while).
        prune: Delete the chunks of stored files under the given *folders* that are no
            longer there: deleted, or now a symbolic link leaving the folders (unless
            ``follow_links``). Without it they are kept (and still retrieved) and counted as
            stale in the summary. Files under a sub-folder that cannot be read are kept.
        follow_links: Also ingest files reached through symbolic links that leave the given
            folders (a warning names each one; they are stored under the link's path). By
            default such links are reported as failed and not read. A file named directly
            counts its own folder as its root (``docs/pw.md -> /etc/shadow`` is refused).
        max_file_mb: The largest file read, in MB; a bigger one is reported as failed with
            the reason. ``None``: 100 MB.
        text_search_config: Text search configuration of the full-text column of a new
            table (``english`` by default; any of the server's ``pg_ts_config``).
        upgrade: Add the full-text column to an existing table that has none (otherwise
            the summary says it is missing).
        pool_size / pool_timeout: The process's psycopg pool for this database (see
            :mod:`.pool`), shared with :class:`~.store.PostgresKnowledgeBase`.

    Returns:
        The :class:`IngestSummary`. A file that cannot be used (unreadable, binary, NUL
        bytes, not UTF-8, a file name that is not UTF-8, content Postgres rejects, not a
        regular file when it is opened, over ``max_file_mb``), an
        unreadable sub-folder and a symbolic link not followed are reported there as failed
        and skipped, one by one; the other files are still ingested.

    Raises:
        FileNotFoundError: A path does not exist.
        TypeError: ``progress`` or ``prune`` is not ``True`` or ``False``.
        ValueError: Bad table name, target, chunking, ``max_file_mb``, or an embedding
            model that does not fit the table.
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
    max_file_bytes(max_file_mb)  # a bad cap fails before anything is opened
    files, rejected = discover_files(path_list, follow_links=follow_links)
    read_options = {"roots": given_roots(path_list), "follow_links": follow_links, "max_file_mb": max_file_mb}
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
            bar.set_postfix_str(shown[-30:])  # drawn now: a big file takes a while
            if on_start is not None:
                on_start(path)
            report(
                _ingest_file(
                    conn, path, db, layout, embedder, summary, (max_chars, overlap),
                    batch_size, read_options,
                )
            )
        bar.close()
        summary.gone = _gone_files(conn, layout, roots, prune, follow_links)
    summary.seconds = time.perf_counter() - start
    return summary
