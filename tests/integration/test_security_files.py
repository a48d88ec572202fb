"""Issue 29, files: symbolic links leaving the folder (3), unreadable sub-folders (6), file
names and documents holding newlines and escape sequences (10). Issue 43, files named on the
command line and swapped after the listing: a link to ``/dev/zero`` (1), a FIFO (2), a link
leaving its folder (3), a file swapped for a FIFO (4) or a link (5), a file over the size cap
(20).

The ingestion cases run against a real PostgreSQL 16 + pgvector (``pgserver``). Root reads
a ``chmod 000`` folder, so the unreadable-folder case runs in a fresh process that is not
root: under root, in a user namespace (``unshare --user``) mapped to another uid, with its
own embedded server.

Cases that need no model, database or server are in ``tests/unit/test_security_files.py``."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _helpers import require

SRC = str(Path(__file__).resolve().parents[2] / "src")
SECRET = "The vault code is 4417-Quasar."


@pytest.fixture
def tree(tmp_path):
    """docs/ with a file, a link to a file outside, a link to a folder outside, a link inside
    and a broken link; outside/ with the secret."""
    outside = tmp_path / "outside"
    (outside / "folder").mkdir(parents=True)
    (outside / "secret.md").write_text(f"# Secret\n\n{SECRET}\n")
    (outside / "folder" / "more.md").write_text(f"# More\n\n{SECRET}\n")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# A\n\nThe Dunmore bridge opened in 1911.\n")
    (docs / "leak.md").symlink_to(outside / "secret.md")
    (docs / "leakdir").symlink_to(outside / "folder", target_is_directory=True)
    (docs / "same.md").symlink_to(docs / "a.md")
    (docs / "broken.md").symlink_to(tmp_path / "nowhere.md")
    return docs


# ============================================================================ database
@pytest.fixture(scope="module")
def pg_dsn(module_pg_dsn):
    """This module's own database on the run's embedded PostgreSQL + pgvector."""
    return module_pg_dsn


def _ingest_cli(*argv: str) -> int:
    from tokrag_integrations.cli.pg import add_ingest_parser

    parser = argparse.ArgumentParser()
    add_ingest_parser(parser.add_subparsers())
    args = parser.parse_args(["ingest", *argv, "--no-progress"])
    return args.func(args)


def _sources(dsn: str, table: str) -> set[str]:
    from tokrag_integrations.postgres.connection import connect

    with connect(dsn, autocommit=True) as conn:
        rows = conn.execute(f"SELECT DISTINCT metadata_->>'source' FROM data_{table}").fetchall()
    return {r[0] for r in rows}


@pytest.mark.postgres
def test_ingest_links_leaving_the_folder_and_prune(pg_dsn, tree):
    """Issue 29.3: links leaving the folder are reported, not stored; ``follow_links`` stores
    them under the link's path (with a warning), and prune removes every chunk whose source
    is no longer under the folder (link removed, or a file replaced by a link outside)."""
    from tokrag_integrations.postgres import ingest

    summary = ingest([tree], dsn=pg_dsn, table="links", progress=False)
    failed = {Path(f.path).name: f.reason for f in summary.failed}
    assert set(failed) == {"leak.md", "leakdir", "broken.md"} and "not followed" in failed["leak.md"]
    assert _sources(pg_dsn, "links") == {str(tree.resolve() / "a.md")}

    with pytest.warns(UserWarning, match="following a symbolic link") as record:
        summary = ingest([tree], dsn=pg_dsn, table="links", progress=False, follow_links=True)
    followed = sorted(str(w.message).split(": following")[0] for w in record)
    assert followed == [str(tree.absolute() / "leak.md"), str(tree.absolute() / "leakdir")]
    root = tree.resolve()
    assert _sources(pg_dsn, "links") == {str(root / n) for n in ("a.md", "leak.md", "leakdir/more.md")}

    (tree / "leak.md").unlink()
    (tree / "a.md").rename(tree.parent / "outside" / "a.md")  # a.md becomes a link outside
    (tree / "a.md").symlink_to(tree.parent / "outside" / "a.md")
    summary = ingest([tree], dsn=pg_dsn, table="links", progress=False, prune=True)
    assert {Path(f.path).name for f in summary.gone if f.status == "pruned"} == {"a.md", "leak.md", "more.md"}
    assert not _sources(pg_dsn, "links")
    assert SECRET not in summary.to_text()


# ============================================================================ 10: names and text
@pytest.mark.postgres
def test_file_names_with_newlines_and_escapes_print_on_one_line(pg_dsn, tmp_path, capsys):
    """Issue 29.10: a file name holding a newline or ESC cannot forge a summary line or
    reach the terminal."""
    docs = tmp_path / "docs"
    docs.mkdir()
    forged = "x.md\n  skipped passwd: forged"
    (docs / f"{forged}.bin.md").write_bytes(b"\x00binary")  # fails, so it is listed
    (docs / "esc\x1b[2J\x1b[31mred.md").write_bytes(b"\x00binary")
    (docs / "ok.md").write_text("# Ok\n\nThe Marwick pump moves 40 litres a minute.\n")
    assert _ingest_cli(str(docs), "--dsn", pg_dsn, "--table", "names") == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out
    lines = out.splitlines()
    assert sum(line.startswith("  skipped ") for line in lines) == 2
    assert any(line.startswith("  skipped ") and "x.md\\n  skipped passwd: forged" in line for line in lines)
    assert any("esc\\x1b[2J\\x1b[31mred.md" in line for line in lines)


def test_escape_sequences_in_documents_do_not_reach_the_terminal(lm, tmp_path, capsys, monkeypatch):
    """Issue 29.10: ``ask --docs`` over a document (and a file name) full of escape
    sequences prints them as visible symbols; nothing else of the text is lost."""
    from tokrag_integrations.cli import main

    monkeypatch.setenv("COLUMNS", "400")  # the chunk lines are cut at the console's width
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "title\x1b]0;pwned\x07\n  1.0000  forged.md").write_text(
        "# Kestrel\n\nThe Kestrel-7 code name is \x1b[2J\x1b[31mBramblewick\x1b[0m\x9b31m.\n"
    )
    status = main(["ask", "What is the Kestrel-7 code name?", "--docs", str(docs),
                   "--retriever", "bm25", "--max-new-tokens", "4", "--explain"])
    assert status == 0
    out = capsys.readouterr()
    for stream in (out.out, out.err):
        assert not any(c in stream for c in "\x1b\x07\x9b")
    assert "title\\x1b]0;pwned\\x07\\n  1.0000  forged.md #0" in out.err  # one line
    assert "code name is ␛[2J␛" in out.err  # shown, not run


# ============================================================================ 6: unreadable folder
_UNREADABLE = """
import os, sys, warnings
from pathlib import Path
from tokrag_integrations.cli import main
from tokrag_integrations.postgres.embedded import start_embedded
from tokrag_integrations.retrieval import load_documents

work = Path(sys.argv[1])
dsn, server = start_embedded(work / "pg")
docs = work / "docs"
(docs / "sub").mkdir(parents=True)
(docs / "a.md").write_text("# A\\n\\nThe Dunmore bridge opened in 1911.\\n")
(docs / "sub" / "b.md").write_text("# B\\n\\nThe Velloy tunnel closed in 1987.\\n")
(docs / "locked.md").write_text("# L\\n\\nLocked.\\n")
args = ["ingest", str(docs), "--dsn", dsn, "--table", "perm", "--no-progress"]
assert main(args) == 0
os.chmod(docs / "sub", 0)
os.chmod(docs / "locked.md", 0)
try:
    print("STATUS", main([*args, "--prune"]), flush=True)
    inside = str(docs / "sub" / "b.md")  # named explicitly, under the unreadable folder
    print("NAMED", main(["ingest", inside, *args[2:]]), flush=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_documents(docs)
    for w in caught:
        print("WARNING", w.message, flush=True)
finally:
    os.chmod(docs / "sub", 0o755)
    os.chmod(docs / "locked.md", 0o644)
    server.cleanup()
"""


def _unprivileged() -> list[str]:
    """A command prefix that runs a process without root's access to every file."""
    if os.geteuid() != 0:
        return []
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("running as root without unshare: a chmod 000 folder stays readable")
    probe = subprocess.run([unshare, "--user", "--map-user=1000", "--map-group=1000", "true"], check=False)
    if probe.returncode != 0:
        pytest.skip("running as root and user namespaces are not available")
    return [unshare, "--user", "--map-user=1000", "--map-group=1000"]


@pytest.mark.postgres
def test_unreadable_sub_folder_is_reported_not_a_traceback(tmp_path):
    """Issue 29.6: a sub-folder (and a file) ingested earlier, then made unreadable: no
    PermissionError from the prune check, each reported in the summary, its chunks kept; the
    loader of ``ask --docs`` warns about each too."""
    require("pgserver")
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [*_unprivileged(), sys.executable, "-c", textwrap.dedent(_UNREADABLE), str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    docs = tmp_path / "docs"
    assert "STATUS 1" in out  # some paths skipped
    assert f"  skipped {docs / 'sub'}: folder cannot be read (Permission denied)" in out
    assert f"  skipped {docs / 'locked.md'}: could not be read (Permission denied)" in out
    assert "pruned " not in out and "stale (no longer present)" not in out  # its chunks are kept
    assert "NAMED 1" in out and f"  skipped {docs / 'sub' / 'b.md'}: cannot be read (Permission denied)" in out
    assert f"WARNING {docs / 'sub'}: folder cannot be read (Permission denied); skipped." in out
    assert f"WARNING {docs / 'locked.md'}: could not be read (Permission denied); skipped." in out


# ============================================================================ issue 43: named files
#: A child process may use at most this much address space (the embedder included), so a
#: regression that reads /dev/zero fails with a MemoryError instead of eating the machine.
_CHILD_MEMORY = 8 << 30

_CHILD_INGEST = f"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({_CHILD_MEMORY}, {_CHILD_MEMORY}))
from tokrag_integrations.cli import main
print("STATUS", main(["ingest", *sys.argv[1:], "--no-progress"]), flush=True)
"""


def _ingest_child(*argv: str | Path, code: str = _CHILD_INGEST, timeout: float = 240):
    """``tokrag ingest ARGV`` in a fresh process with a memory and a time limit."""
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, argv)],
        capture_output=True, text=True, timeout=timeout, env=env, check=False,
    )


@pytest.fixture
def named(tmp_path):
    """d/ with a.md and b.md, and the outside/ secret; the tests add the hostile entries."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.md").write_text(f"# Secret\n\n{SECRET}\n")
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.md").write_text("# A\n\nThe Dunmore bridge opened in 1911.\n")
    (d / "b.md").write_text("# B\n\nThe Velloy tunnel closed in 1987.\n")
    return d


@pytest.mark.postgres
def test_ingest_named_link_to_dev_zero_is_refused(pg_dsn, named):
    """Issue 43.1 (high): ``tokrag ingest d/z.txt`` where ``z.txt -> /dev/zero`` read until
    the process was killed. It is reported as skipped (a link leaving d/; with
    ``--follow-links``, a character device), in a child with a memory limit."""
    (named / "z.txt").symlink_to("/dev/zero")
    common = ["--dsn", pg_dsn, "--table", "zero"]
    proc = _ingest_child(named / "z.txt", named / "a.md", *common)
    assert "STATUS 1" in proc.stdout, proc.stderr[-3000:]
    assert f"  skipped {named.resolve() / 'z.txt'}: a symbolic link to /dev/zero, outside {named.resolve()}; not followed" in proc.stdout
    proc = _ingest_child(named / "z.txt", *common, "--follow-links")
    assert "STATUS 1" in proc.stdout, proc.stderr[-3000:]
    assert f"  skipped {named.resolve() / 'z.txt'}: not a regular file but a character device" in proc.stdout
    assert "following a symbolic link to /dev/zero" in proc.stderr
    assert _sources(pg_dsn, "zero") == {str(named.resolve() / "a.md")}


@pytest.mark.postgres
def test_ingest_named_fifo_is_not_opened(pg_dsn, named):
    """Issue 43.2: ``tokrag ingest d/f.txt`` on a FIFO hung forever; it is reported as
    skipped and the other file is stored."""
    os.mkfifo(named / "f.txt")
    proc = _ingest_child(named / "f.txt", named / "a.md", "--dsn", pg_dsn, "--table", "fifo", timeout=120)
    assert "STATUS 1" in proc.stdout, proc.stderr[-3000:]
    assert f"  skipped {named.resolve() / 'f.txt'}: not a regular file but a FIFO (named pipe)" in proc.stdout
    assert _sources(pg_dsn, "fifo") == {str(named.resolve() / "a.md")}


@pytest.mark.postgres
def test_ingest_named_link_leaving_its_folder(pg_dsn, named, capsys):
    """Issue 43.3: ``tokrag ingest d/*`` stored ``d/pw.md -> ../outside/secret.md`` with no
    warning. The link is judged against its own folder: skipped with the reason, nothing
    stored for it; ``--follow-links`` stores it under the link's path, with a warning."""
    secret = named.parent / "outside" / "secret.md"
    (named / "pw.md").symlink_to(secret)
    globbed = [str(p) for p in sorted(named.iterdir())]  # what the shell's d/* passes
    common = ["--dsn", pg_dsn, "--table", "named"]
    assert _ingest_cli(*globbed, *common) == 1
    root = named.resolve()
    out = capsys.readouterr().out
    assert f"  skipped {root / 'pw.md'}: a symbolic link to {secret.resolve()}, outside {root}; not followed" in out
    assert SECRET not in out
    assert _sources(pg_dsn, "named") == {str(root / "a.md"), str(root / "b.md")}
    with pytest.warns(UserWarning, match="following a symbolic link to") as record:
        assert _ingest_cli(*globbed, *common, "--follow-links") == 0
    assert len(record) == 1
    assert _sources(pg_dsn, "named") == {str(root / n) for n in ("a.md", "b.md", "pw.md")}



_INGEST_SWAPPED = f"""
import os, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({_CHILD_MEMORY}, {_CHILD_MEMORY}))
from pathlib import Path
import tokrag_integrations.retrieval.documents as documents
from tokrag_integrations.cli import main

folder, swap = Path(sys.argv[1]), sys.argv[2]
listed = documents.list_folder


def list_then_swap(root, **options):
    found = listed(root, **options)
    (folder / "b.md").unlink()
    if swap == "fifo":
        os.mkfifo(folder / "b.md")
    else:
        (folder / "b.md").symlink_to(swap)
    return found


documents.list_folder = list_then_swap
print("STATUS", main(["ingest", str(folder), *sys.argv[3:], "--no-progress"]), flush=True)
"""


@pytest.mark.postgres
def test_ingest_file_swapped_for_a_fifo_after_the_listing(pg_dsn, named):
    """Issue 43.4: b.md replaced by a FIFO between the folder listing and its open blocked
    ``tokrag ingest`` for minutes; it is reported as skipped and the ingest ends."""
    common = ["--dsn", pg_dsn, "--table", "swap_fifo"]
    proc = _ingest_child(named, "fifo", *common, code=_INGEST_SWAPPED, timeout=120)
    assert "STATUS 1" in proc.stdout, proc.stderr[-3000:]
    assert f"  skipped {named.resolve() / 'b.md'}: not a regular file but a FIFO (named pipe)" in proc.stdout
    assert _sources(pg_dsn, "swap_fifo") == {str(named.resolve() / "a.md")}


def _texts(dsn: str, table: str) -> str:
    from tokrag_integrations.postgres.connection import connect

    with connect(dsn, autocommit=True) as conn:
        return "\n".join(r[0] for r in conn.execute(f"SELECT text FROM data_{table}").fetchall())


@pytest.mark.postgres
def test_ingest_file_swapped_for_a_link_after_the_listing(pg_dsn, named, monkeypatch):
    """Issue 43.5: b.md replaced by a link to a secret outside the folder after the listing:
    the secret was stored and b.md listed as both added and stale. Now b.md is failed with
    the reason, nothing of the secret is stored, and chunks stored for b.md before are kept
    (stale: the link leaves the folder)."""
    import tokrag_integrations.retrieval.documents as documents
    from tokrag_integrations.postgres import ingest

    secret = named.parent / "outside" / "secret.md"
    listed = documents.list_folder

    def list_then_swap(root, **options):
        found = listed(root, **options)
        (named / "b.md").unlink()
        (named / "b.md").symlink_to(secret)
        return found

    def statuses(summary):
        return sorted((Path(f.path).name, f.status) for f in [*summary.files, *summary.gone])

    monkeypatch.setattr(documents, "list_folder", list_then_swap)
    summary = ingest([named], dsn=pg_dsn, table="swap_link", progress=False)
    assert statuses(summary) == [("a.md", "added"), ("b.md", "failed")]
    assert "a symbolic link to" in summary.failed[0].reason and "not followed" in summary.failed[0].reason
    assert SECRET not in _texts(pg_dsn, "swap_link")

    monkeypatch.setattr(documents, "list_folder", listed)
    (named / "b.md").unlink()
    (named / "b.md").write_text("# B\n\nThe Velloy tunnel closed in 1987.\n")
    assert statuses(ingest([named], dsn=pg_dsn, table="swap_link", progress=False)) == [
        ("a.md", "unchanged"), ("b.md", "added")
    ]
    monkeypatch.setattr(documents, "list_folder", list_then_swap)
    summary = ingest([named], dsn=pg_dsn, table="swap_link", progress=False)
    assert statuses(summary) == [("a.md", "unchanged"), ("b.md", "failed"), ("b.md", "stale")]
    texts = _texts(pg_dsn, "swap_link")
    assert SECRET not in texts and "Velloy tunnel" in texts


@pytest.mark.postgres
def test_ingest_file_over_the_size_cap_and_progress(pg_dsn, named, capsys, monkeypatch):
    """Issue 43.20: a 200 MB text file gave no output for minutes and took 1.5 GB. A file
    over the cap (default 100 MB, ``--max-file-mb``) is skipped with the option named; a big
    file under it (over ``LARGE_INPUT_BYTES``, 10 MB, lowered here to keep the test short)
    is announced on stderr before it is read."""
    import tokrag_integrations.retrieval as retrieval
    from tokrag_integrations.cli.pg import add_ingest_parser

    monkeypatch.setattr(retrieval, "LARGE_INPUT_BYTES", 4096)

    with open(named / "huge.txt", "wb") as file:  # sparse: 101 MB on paper, no disk used
        file.truncate(101 * 2**20)
    (named / "big.md").write_text("# Big\n\n" + "The Velloy tunnel closed in 1987. " * 200)
    parser = argparse.ArgumentParser()
    add_ingest_parser(parser.add_subparsers())
    args = parser.parse_args(["ingest", str(named), "--dsn", pg_dsn, "--table", "cap", "--max-file-mb", "12"])
    assert args.func(args) == 1
    out, err = capsys.readouterr()
    root = named.resolve()
    assert (
        f"  skipped {root / 'huge.txt'}: is 101.0 MB, over the limit of 12.0 MB per file "
        "(raise it with --max-file-mb or max_file_mb=)"
    ) in out
    assert f"ingest: reading {root / 'big.md'} (0.0 MB); a big file takes minutes" in err
    assert err.index("ingest: reading") < err.index(f"ingest: added {root / 'big.md'}")
    assert _sources(pg_dsn, "cap") == {str(root / n) for n in ("a.md", "b.md", "big.md")}
