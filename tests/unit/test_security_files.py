"""Issue 29, files: symbolic links leaving the folder (3), unreadable sub-folders (6), file
names and documents holding newlines and escape sequences (10). Issue 43, files: a named link
to ``/dev/zero`` (1), a named FIFO (2), a named link leaving its folder (3), a file swapped for
a FIFO (4) or a link (5) after the listing, a file over the size cap (20).

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_security_files.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

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


# ============================================================================ 3: links, no database
def test_links_leaving_the_folder_are_not_followed_by_ask_docs(tree):
    """Issue 29.3: ``ask --docs``'s loader skips links leaving the folder, one warning each."""
    from tokrag_integrations.retrieval import load_documents

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        docs = load_documents(tree)
    assert [Path(d.source).name for d in docs] == ["a.md", "same.md"]  # a link inside is kept
    messages = [str(w.message) for w in caught]
    for name in ("leak.md", "leakdir"):
        assert any(m.startswith(f"{tree / name}: a symbolic link to ") and "not followed" in m for m in messages)
    assert any("broken.md: a broken symbolic link" in m for m in messages)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        docs = load_documents(tree, follow_links=True)
    assert sorted(Path(d.source).name for d in docs) == ["a.md", "leak.md", "more.md", "same.md"]
    assert sum("following a symbolic link" in str(w.message) for w in caught) == 2


# ============================================================================ issue 43: named files
#: A child process may use at most this much address space, so a regression that reads
#: /dev/zero fails the test with a MemoryError instead of eating the machine's memory.
_CHILD_MEMORY = 2 << 30

_CHILD_PRELUDE = f"""
import resource, sys, warnings
resource.setrlimit(resource.RLIMIT_AS, ({_CHILD_MEMORY}, {_CHILD_MEMORY}))
warnings.simplefilter("always")
from pathlib import Path
"""


def _child(code: str, *args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """``code`` run in a fresh Python with a memory limit and a time limit (a FIFO that
    blocks, or /dev/zero read to the end, fails the test instead of hanging it)."""
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run(
        [sys.executable, "-c", _CHILD_PRELUDE + textwrap.dedent(code), *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env=env, check=False,
    )


@pytest.fixture
def named(tmp_path):
    """d/ with a.md and the outside/ secret; the tests add the hostile entries."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.md").write_text(f"# Secret\n\n{SECRET}\n")
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.md").write_text("# A\n\nThe Dunmore bridge opened in 1911.\n")
    return d


_LOAD_NAMED = """
from tokrag_integrations.retrieval import load_documents
paths = sys.argv[2:]
for follow in (False, True):
    docs = load_documents(paths, follow_links=follow)
    print("LOADED", follow, sorted(Path(d.source).name for d in docs), flush=True)
"""


def test_named_link_to_dev_zero_is_refused(named):
    """Issue 43.1 (high): ``ask --docs d/z.txt`` where ``z.txt -> /dev/zero`` read without end.
    The opener refuses the link (it leaves d/), and with ``follow_links`` the character
    device it leads to; a child with 2 GB of address space finishes with a warning."""
    (named / "z.txt").symlink_to("/dev/zero")
    proc = _child(_LOAD_NAMED, "", named / "z.txt", named / "a.md")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "LOADED False ['a.md']" in proc.stdout and "LOADED True ['a.md']" in proc.stdout
    assert f"{named / 'z.txt'}: a symbolic link to /dev/zero, outside {named.resolve()}; not followed" in proc.stderr
    assert f"{named / 'z.txt'}: not a regular file but a character device; skipped." in proc.stderr


def test_named_fifo_is_not_opened(named):
    """Issue 43.2: ``ask --docs d/f.txt`` on a FIFO blocked forever; it is skipped with a
    warning (the child would time out if the open blocked)."""
    os.mkfifo(named / "f.txt")
    proc = _child(_LOAD_NAMED, "", named / "f.txt", named / "a.md", timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "LOADED False ['a.md']" in proc.stdout and "LOADED True ['a.md']" in proc.stdout
    assert f"{named / 'f.txt'}: not a regular file but a FIFO (named pipe); skipped." in proc.stderr


def test_named_link_leaving_its_folder_is_not_followed(named):
    """Issue 43.3: ``ask --docs d/*`` read ``d/pw.md -> ../outside/secret.md`` silently. A
    file named directly counts its own folder as its root: the link is skipped with a
    warning, read with ``follow_links`` (warned), and read when its target lies in another
    folder given; a link inside the folder is read."""
    from tokrag_integrations.retrieval import load_documents

    secret = named.parent / "outside" / "secret.md"
    (named / "pw.md").symlink_to(secret)
    (named / "same.md").symlink_to(named / "a.md")
    globbed = sorted(named.iterdir())  # what the shell's d/* passes
    with pytest.warns(UserWarning) as record:
        docs = load_documents(globbed)
    assert sorted(Path(d.source).name for d in docs) == ["a.md", "same.md"]
    assert SECRET not in "".join(d.text for d in docs)
    assert [str(w.message) for w in record] == [
        f"{named / 'pw.md'}: a symbolic link to {secret.resolve()}, outside {named.resolve()}; "
        "not followed (--follow-links / follow_links=True reads it); skipped."
    ]
    with pytest.warns(UserWarning, match="following a symbolic link") as record:
        docs = load_documents(globbed, follow_links=True)
    assert sorted(Path(d.source).name for d in docs) == ["a.md", "pw.md", "same.md"]
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        docs = load_documents([named / "pw.md", secret.parent])  # its target's folder is given
    assert SECRET in docs[0].text


_SWAP_FOR_FIFO = """
import os
import tokrag_integrations.retrieval as retrieval
from tokrag_integrations.retrieval import documents

folder = Path(sys.argv[1])
listed = documents.list_folder


def list_then_swap(root, **options):
    found = listed(root, **options)
    (folder / "b.md").unlink()
    os.mkfifo(folder / "b.md")  # after the listing, before the open
    return found


documents.list_folder = list_then_swap
print("LISTING", sorted(Path(d.source).name for d in retrieval.load_documents(folder)), flush=True)
documents.list_folder = listed

(folder / "b.md").unlink()
(folder / "b.md").write_text("# B\\n\\nThe Velloy tunnel closed in 1987.\\n")
seen, swapped = os.lstat, []


def lstat_then_swap(path, *args, **kwargs):
    found = seen(path, *args, **kwargs)
    if str(path).endswith("b.md") and not swapped:
        swapped.append(path)
        os.unlink(path)
        os.mkfifo(path)  # after the opener's lstat, before its open
    return found


os.lstat = lstat_then_swap
print("OPEN", sorted(Path(d.source).name for d in retrieval.load_documents(folder)), flush=True)
"""


def test_file_swapped_for_a_fifo_after_the_listing_is_not_opened(named):
    """Issue 43.4: a regular file replaced by a FIFO after the folder listing blocked the
    reader. Swapped after the listing, the opener's ``lstat`` refuses it; swapped after
    that ``lstat``, the ``O_NONBLOCK`` open returns and ``fstat`` refuses it."""
    (named / "b.md").write_text("# B\n\nThe Velloy tunnel closed in 1987.\n")
    proc = _child(_SWAP_FOR_FIFO, named, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "LISTING ['a.md']" in proc.stdout and "OPEN ['a.md']" in proc.stdout
    assert f"{named / 'b.md'}: not a regular file but a FIFO (named pipe); skipped." in proc.stderr
    assert (
        f"{named / 'b.md'}: not a regular file but a FIFO (named pipe), swapped in while it "
        "was being opened; skipped."
    ) in proc.stderr


def test_file_swapped_for_a_link_after_the_listing_is_not_followed(named, monkeypatch):
    """Issue 43.5: a regular file replaced by a link to a secret outside the folder after the
    listing was read. Swapped after the listing, the opener's ``lstat`` sees the link and
    refuses it; swapped after that ``lstat``, the ``O_NOFOLLOW`` open refuses it."""
    import tokrag_integrations.retrieval as retrieval
    from tokrag_integrations.retrieval import documents, opener

    secret = named.parent / "outside" / "secret.md"
    (named / "b.md").write_text("# B\n\nThe Velloy tunnel closed in 1987.\n")
    listed = documents.list_folder

    def list_then_swap(root, **options):
        found = listed(root, **options)
        (named / "b.md").unlink()
        (named / "b.md").symlink_to(secret)
        return found

    monkeypatch.setattr(documents, "list_folder", list_then_swap)
    with pytest.warns(UserWarning, match="not followed") as record:
        docs = retrieval.load_documents(named)
    assert [Path(d.source).name for d in docs] == ["a.md"]
    assert [str(w.message) for w in record] == [
        f"{named / 'b.md'}: a symbolic link to {secret.resolve()}, outside {named.resolve()}; "
        "not followed (--follow-links / follow_links=True reads it); skipped."
    ]

    monkeypatch.setattr(documents, "list_folder", listed)
    (named / "b.md").unlink()
    (named / "b.md").write_text("# B\n\nThe Velloy tunnel closed in 1987.\n")
    seen, swapped = os.lstat, []

    def lstat_then_swap(path, *args, **kwargs):
        found = seen(path, *args, **kwargs)
        if str(path).endswith("b.md") and not swapped:
            swapped.append(path)
            os.unlink(path)
            os.symlink(secret, path)  # after the opener's lstat, before its open
        return found

    monkeypatch.setattr(opener.os, "lstat", lstat_then_swap)
    with pytest.warns(UserWarning, match="became a symbolic link while it was being opened"):
        docs = retrieval.load_documents(named)
    assert [Path(d.source).name for d in docs] == ["a.md"]


def test_file_over_the_size_cap_is_skipped_naming_the_option(named):
    """Issue 43.20: a 200 MB text file was read whole, silently, into 1.5 GB of memory. Files
    over ``max_file_mb`` (default 100 MB) are skipped with a
    warning that names the option; the size is taken from ``fstat``, nothing is read."""
    from tokrag_integrations.retrieval import load_documents
    from tokrag_integrations.retrieval.opener import max_file_bytes

    with open(named / "huge.txt", "wb") as file:  # sparse: 101 MB on paper, no disk used
        file.truncate(101 * 2**20)
    with pytest.warns(UserWarning) as record:
        docs = load_documents(named)
    assert [Path(d.source).name for d in docs] == ["a.md"]
    assert [str(w.message) for w in record] == [
        f"{named / 'huge.txt'}: is 101.0 MB, over the limit of 100.0 MB per file (raise it with "
        "--max-file-mb or max_file_mb=); skipped."
    ]
    (named / "huge.txt").unlink()
    (named / "big.md").write_text("# Big\n\n" + "The Velloy tunnel closed in 1987. " * 40_000)
    with pytest.warns(UserWarning, match=r"big.md: is 1.3 MB, over the limit of 1.0 MB per file"):
        assert len(load_documents(named, max_file_mb=1)) == 1
    assert len(load_documents(named, max_file_mb=2)) == 2
    assert max_file_bytes() == 100 * 2**20 and max_file_bytes(0.5) == 2**19
    for bad in (0, -1, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ValueError, match="max_file_mb must be a number of MB above 0"):
            load_documents(named, max_file_mb=bad)


@pytest.mark.parametrize("command", [["ask", "Q", "--docs", "d"], ["ingest", "d"]])
def test_max_file_mb_option_is_checked(command, capsys):
    """Issue 43.20: ``--max-file-mb`` on ``ask`` and ``ingest`` takes a number of MB above 0."""
    from tokrag_integrations.cli import build_parser

    assert build_parser().parse_args([*command, "--max-file-mb", "2.5"]).max_file_mb == 2.5
    assert build_parser().parse_args(command).max_file_mb is None
    for bad in ("0", "-1", "nan", "inf", "lots"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, "--max-file-mb", bad])
        assert "--max-file-mb" in capsys.readouterr().err
