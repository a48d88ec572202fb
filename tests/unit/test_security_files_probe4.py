"""Issue 54 (fourth hostile probe), documents, caches and numbers, without a model: a
Markdown heading that backtracked for an hour (medium 1), lines chunked in quadratic time,
HTML that the standard library's parser reads in quadratic time, the embedding and kernel-plan caches
trusting their folder (a damaged entry, a header claiming 40 GB, a FIFO, a folder of another
user or open to all, a sub-folder replaced by a link), ``max_file_mb`` past a float's range,
and GECE's ``torch.load``.

A case that hung or ate memory before its guard runs in a child process with a memory limit
and a generous time limit: the child is killed, never timed in this process. The cases with
a model or the ``tokrag`` command are in ``tests/integration/test_security_files_probe4.py``.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")
#: Address space of a child: a regression that allocates what a header claims fails there
#: with a MemoryError instead of taking the machine's memory.
_CHILD_MEMORY = 3 << 30
#: Far above what each child needs here (about a second to ten on a busy 2-core machine),
#: far below what the unguarded code took (minutes to hours, or for ever).
_CHILD_SECONDS = 90


def _child(code: str, *args: str | Path, timeout: float = _CHILD_SECONDS) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python with a memory limit; killed after ``timeout`` seconds."""
    prelude = (
        f"import resource, sys, warnings\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({_CHILD_MEMORY}, {_CHILD_MEMORY}))\n"
        "warnings.simplefilter('always')\n"
        "from pathlib import Path\n"
    )
    env = {**os.environ, "PYTHONPATH": SRC}
    try:
        return subprocess.run(
            [sys.executable, "-c", prelude + textwrap.dedent(code), *map(str, args)],
            capture_output=True, text=True, timeout=timeout, env=env, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child did not finish in {timeout} s (killed)")


# ============================================================================ documents
_LOAD_AND_INDEX = """
from tokrag_integrations.retrieval import build_retriever, load_documents
from tokrag_integrations.retrieval.chunking import chunk_documents
docs = load_documents(sys.argv[1])
chunks = chunk_documents(docs)
index = build_retriever(chunks, "bm25")
print("TITLES", sorted(d.metadata.get("title", "") for d in docs), flush=True)
print("CHUNKS", len(chunks), flush=True)
print("HIT", index.retrieve("quasar", 1)[0].source.rsplit("/", 1)[-1], flush=True)
"""


def test_hostile_markdown_headings_load_in_linear_time(tmp_path):
    """Medium 1: ``'# a' + ' ' * n + 'b'`` took 73 s at n = 3,000 (the heading pattern's
    adjacent optional runs of spaces backtrack cubically); a 1 MB file would take days. A
    megabyte of each hostile heading loads, chunks and indexes in a child killed after 90 s,
    and the titles read as CommonMark reads them, cut to 200 characters."""
    d = tmp_path / "d"
    d.mkdir()
    mb = 2**20
    (d / "spaces.md").write_text("# a" + " " * mb + "b\n\nThe quasar text.\n")
    (d / "lines.md").write_text(("# c" + " " * 1000 + "d\n") * (mb // 1004))
    (d / "closing.md").write_text("# " + "#" * mb + " e\n" + "word " * (mb // 5))
    (d / "tabs.md").write_text("#\t" + "\t " * (mb // 2) + "\n# Real title ##\n\nbody\n")
    (d / "long.md").write_text("# " + "word " * (mb // 5) + "\n\nbody\n")
    proc = _child(_LOAD_AND_INDEX, d)
    assert proc.returncode == 0, proc.stderr[-3000:]
    titles = json.loads(proc.stdout.split("TITLES ", 1)[1].split("\n", 1)[0].replace("'", '"'))
    assert titles == sorted(["a b", "c d", "#" * 200, "Real title", ("word " * 40).strip()])
    assert "HIT spaces.md" in proc.stdout


def test_hostile_html_loads_in_linear_time(tmp_path):
    """The standard library's HTML parser rescans the rest of the page for each ``<`` it
    cannot close: 96 KB of ``<x `` took 208 s on Python 3.11.7, and ``<!--``, ``</``, ``<?``
    and ``<a`` runs were quadratic too. A megabyte of each loads and indexes in a child killed
    after 90 s; the text around them reads as a browser shows it."""
    d = tmp_path / "d"
    d.mkdir()
    mb = 2**20
    pages = {
        "tags": "<x " * (mb // 3), "names": "<a" * (mb // 2), "comments": "<!--" * (mb // 4),
        "ends": "</" * (mb // 2), "pis": "<?" * (mb // 2), "attrs": "<a " + "b='c' " * (mb // 6),
        "script": "<script>" + "</scrip" * (mb // 7), "divs": "<div>" * (mb // 5),
    }  # fmt: skip
    for name, hostile in pages.items():
        (d / f"{name}.html").write_text(f"<title>{name}</title><p>The quasar {name}.</p>{hostile}")
    proc = _child(_LOAD_AND_INDEX, d)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"TITLES {sorted(pages)}" in proc.stdout


def test_html_text_is_what_a_browser_shows():
    """The one-pass HTML reader on the cases the standard parser also read: quoted ``>`` in
    attributes, scripts holding markup, comments holding tags, entities, stray ``<``; and,
    where they differ, as a browser: an unclosed comment or tag hides the rest of the page."""
    from tokrag_integrations.retrieval.documents import html_to_text

    page = (
        "<!DOCTYPE html><html><head><title>A &amp; B</title><script>if (a<b) x='</p>'"
        "</script><style>p>b{}</style></head><body><div title='x>y' data-q=\"'\">One</div>"
        "<!-- <p>hidden</p> --><p>a < b &lt;c&gt; <br/>d</p><?pi x?><![CDATA[ no ]]></body>"
    )
    assert html_to_text(page) == ("One\n\na < b <c>\nd", "A & B")
    assert html_to_text("<p>seen</p><!-- never closed <p>unseen</p>") == ("seen", "")
    assert html_to_text("<p>seen</p><b title='never closed>unseen") == ("seen", "")
    assert html_to_text("<SCRIPT>x</SCRIPT >vis<STYLE>y</style>ible") == ("visible", "")


def test_markdown_title_follows_commonmark_and_is_capped():
    """The line-by-line reading of a level-1 heading (no backtracking pattern)."""
    from tokrag_integrations.retrieval.documents import MAX_TITLE_CHARS, markdown_title, short_title

    assert markdown_title("intro\n# Title ##  \nbody") == "Title"
    assert markdown_title("# C#\n") == "C#"  # a closing run needs a space before it
    assert markdown_title("## Sub\n#no space\n#\t Tab title\t\n") == "Tab title"
    assert markdown_title("#   \n# ###\n# Second\n") == "Second"  # empty headings are passed over
    assert markdown_title("no heading at all") == ""
    assert short_title("a  \t b") == "a b"
    assert short_title("x" * 500) == "x" * MAX_TITLE_CHARS
    assert short_title("ab " * 100) == ("ab " * 67).strip()


def test_a_long_line_is_chunked_in_linear_time():
    """Low, long lines: each piece of a line re-sliced the rest of it (quadratic: 16 MB took
    23 s, and 64 MB about two minutes on this machine); chunk_text now walks the line once.
    64 MB of one line, and 8 MB of one-word sentences with 8,000-character chunks (each
    unit used to re-measure the whole chunk), are chunked in a child killed after 90 s."""
    code = """
    from tokrag_integrations.retrieval.chunking import chunk_text
    line = "lorem ipsum dolor " * (64 * 2**20 // 18)
    chunks = chunk_text(line)
    assert all(len(c) <= 800 for c in chunks) and chunks[0].startswith("lorem ipsum dolor")
    assert sum(len(c.split()) for c in chunks) >= len(line) // 6  # every word, some twice
    print("LINE", len(chunks), flush=True)
    del line, chunks
    chunks = chunk_text("a. " * (8 * 2**20 // 3), max_chars=8000, overlap=100)
    assert all(len(c) <= 8000 for c in chunks)
    print("SENTENCES", len(chunks), flush=True)
    """
    proc = _child(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LINE " in proc.stdout and "SENTENCES " in proc.stdout


def test_chunking_is_unchanged_by_the_linear_walk():
    """The same chunks as the re-slicing version on hand-checked cases: word cuts, a hard
    cut of one enormous word, whitespace runs between pieces, the overlap tail."""
    from tokrag_integrations.retrieval.chunking import _split_long, chunk_text

    assert _split_long("aaaa bbbb cccc", 9) == ["aaaa bbbb", "cccc"]
    assert _split_long("x" * 25, 10) == ["x" * 10, "x" * 10, "x" * 5]
    assert _split_long("aa" + " " * 30 + "bb", 10) == ["aa", "bb"]
    assert chunk_text("One two. Three four. Five six.", max_chars=20, overlap=10) == [
        "One two. Three four.",
        "four. Five six.",  # the last words of a sentence longer than the overlap
    ]
    assert chunk_text("a b c d e f g h", max_chars=5, overlap=2) == ["a b c", "d e f", "f g h"]


def test_one_line_file_of_16_mb_loads_and_indexes_in_seconds(tmp_path):
    """Acceptance: a 16 MB one-line file is read, chunked and BM25-indexed in a child killed
    after 90 s (about 3 s here)."""
    d = tmp_path / "d"
    d.mkdir()
    with open(d / "line.txt", "w") as f:
        f.write("lorem ipsum dolor " * (8 * 2**20 // 18) + "quasar " + "sit amet " * (8 * 2**20 // 9))
    proc = _child(_LOAD_AND_INDEX, d)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HIT line.txt" in proc.stdout
    assert int(proc.stdout.split("CHUNKS ")[1].split()[0]) > 16 * 2**20 // 800


# ============================================================================ numbers
def test_max_file_mb_past_a_floats_range_means_no_cap(tmp_path):
    """Low, numbers: ``max_file_mb=10**400`` and ``1e308`` ended in an ``OverflowError``
    traceback; a cap above the largest possible file is that size (no cap), and the file is
    read as usual; infinity and NaN stay refused with one sentence."""
    from tokrag_integrations.retrieval import load_documents
    from tokrag_integrations.retrieval.opener import max_file_bytes

    assert max_file_bytes(10**400) == sys.maxsize
    assert max_file_bytes(1e308) == sys.maxsize
    assert max_file_bytes(2**43) == sys.maxsize  # 2**63 bytes: one more than fits
    assert max_file_bytes(2**42) == 2**62
    assert max_file_bytes(1) == 2**20
    (tmp_path / "a.md").write_text("# A\n\nThe Dunmore bridge opened in 1911.\n")
    for cap in (10**400, 1e308):
        assert [d.metadata["title"] for d in load_documents(tmp_path, max_file_mb=cap)] == ["A"]
    for bad in (float("inf"), float("nan"), -(10**400)):
        with pytest.raises(ValueError, match="max_file_mb must be a number of MB above 0"):
            load_documents(tmp_path, max_file_mb=bad)


@pytest.mark.parametrize("command", [["ask", "Q", "--docs", "d"], ["ingest", "d"]])
def test_max_file_mb_option_past_a_floats_range(command, capsys):
    """``--max-file-mb 1e308`` parsed to an ``OverflowError`` traceback; it is taken (no
    cap), and ``1e400`` (infinity once parsed) is refused naming the option."""
    from tokrag_integrations.cli import build_parser

    assert build_parser().parse_args([*command, "--max-file-mb", "1e308"]).max_file_mb == 1e308
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--max-file-mb", "1e400"])
    err = capsys.readouterr().err
    assert "--max-file-mb" in err and "must be a finite number of MB above 0, got '1e400'" in err


# ============================================================================ embedding cache
def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=array.dtype == object)
    return buffer.getvalue()


def _entry(cache, text: str) -> Path:
    key = cache._key(text)
    return cache.folder / key[:2] / f"{key}.npy"


def _fresh_cache(root: Path, dim: int = 4):
    """An embedding cache in its default place, ``$TOKRAG_CACHE_DIR/embeddings``, with
    ``root`` as the cache folder (made private when new)."""
    from tokrag_integrations.retrieval.index import EmbeddingCache

    root.mkdir(mode=0o700, exist_ok=True)
    os.environ["TOKRAG_CACHE_DIR"] = str(root)
    return EmbeddingCache("test-embedder", dim)


@pytest.fixture(autouse=True)
def _cache_dir_restored(monkeypatch):
    """Whatever a test sets ``$TOKRAG_CACHE_DIR`` to is undone after it."""
    monkeypatch.setenv("TOKRAG_CACHE_DIR", os.environ.get("TOKRAG_CACHE_DIR", ""))


def test_embedding_cache_round_trip_and_damaged_entries_are_misses(tmp_path):
    """Low, caches: an entry of the wrong dimension crashed the build (``np.stack``); a
    pickled array, a truncated file, NaNs, a float64 vector, garbage and an entry that is a
    folder are all misses now, counted for one warning, and rewritten by the next store."""
    cache = _fresh_cache(tmp_path / "cache")
    texts = [f"text {i}" for i in range(8)]
    vectors = [np.full(4, i, dtype=np.float32) for i in range(8)]
    cache.store(texts, vectors)
    assert all(np.array_equal(a, b) for a, b in zip(cache.load(texts), vectors, strict=True))
    hostile = {
        0: _npy(np.zeros(3, dtype=np.float32)),  # wrong dimension
        1: _npy(np.zeros((2, 2), dtype=np.float32)),  # wrong shape
        2: _npy(np.zeros(4, dtype=np.float64)),  # wrong dtype
        3: _npy(np.array([{"a": 1}] * 4, dtype=object)),  # pickled
        4: _npy(np.zeros(4, dtype=np.float32))[:-3],  # cut short
        5: _npy(np.array([0, np.nan, 0, 0], dtype=np.float32)),  # not finite
        6: b"\x93NUMPY garbage",
    }
    for i, data in hostile.items():
        _entry(cache, texts[i]).write_bytes(data)
    _entry(cache, texts[7]).unlink()
    _entry(cache, texts[7]).mkdir()  # a folder where the entry belongs
    fresh = _fresh_cache(tmp_path / "cache")
    found = fresh.load(texts)
    assert found == [None] * 8
    assert len(fresh.damaged) == 8
    reasons = " | ".join(reason for _, reason in fresh.damaged)
    assert "float32 array of shape (3,)" in reasons and "not a float32 vector of 4" in reasons
    assert "not finite" in reasons and "not a regular file but a folder" in reasons
    with pytest.warns(UserWarning, match=r"8 entries of the embedding cache .* could not be used"):
        fresh.warn_damaged()
    _entry(cache, texts[7]).rmdir()
    fresh.store(texts, vectors)
    assert all(np.array_equal(a, b) for a, b in zip(fresh.load(texts), vectors, strict=True))


_HOSTILE_ENTRIES = """
import os, numpy as np
from tokrag_integrations.retrieval.index import EmbeddingCache
root = Path(sys.argv[1])
cache = EmbeddingCache("test-embedder", 384, folder=root)
texts = ["claims 40 GB", "a fifo", "claims 1536 bytes"]
def entry(text):
    key = cache._key(text)
    (root / key[:2]).mkdir(mode=0o700, exist_ok=True)
    return root / key[:2] / f"{key}.npy"
# A header claiming 10**10 float32 values (40 GB), followed by 16 bytes.
header = {"descr": "<f4", "fortran_order": False, "shape": (10**10,)}
from numpy.lib import format as npy
with open(entry(texts[0]), "wb") as f:
    npy.write_array_header_1_0(f, header)
    f.write(b"\\0" * 16)
os.mkfifo(entry(texts[1]))
with open(entry(texts[2]), "wb") as f:
    npy.write_array_header_1_0(f, {**header, "shape": (384,)})
    f.write(b"\\0" * 16)
found = cache.load(texts)
print("FOUND", [v is None for v in found], flush=True)
for path, reason in cache.damaged:
    print("DAMAGED", path.name, reason, flush=True)
cache.store(texts, [np.ones(384, dtype=np.float32)] * 3)
print("AGAIN", [None if v is None else float(v.sum()) for v in cache.load(texts)], flush=True)
"""


def test_embedding_cache_header_claiming_40_gb_and_a_fifo(tmp_path):
    """Low, caches: a ``.npy`` header claiming 40 GB took the build to a 37 GiB
    ``MemoryError``, and a FIFO planted as an entry blocked for ever. The header is checked
    against the file's size before anything is allocated, the FIFO is not opened for a
    blocking read, and a header's size is checked against the file's; all are misses and
    are replaced by the next store (a child with 3 GB of
    address space, killed after 90 s)."""
    root = tmp_path / "emb"
    root.mkdir(mode=0o700)
    proc = _child(_HOSTILE_ENTRIES, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FOUND [True, True, True]" in proc.stdout
    assert "holds a float32 array of shape (10000000000,), not a float32 vector of 384" in proc.stdout
    assert "not a regular file but a FIFO (named pipe)" in proc.stdout
    assert "holds 16 bytes of data; its header says 1536" in proc.stdout
    assert "AGAIN [384.0, 384.0, 384.0]" in proc.stdout


def test_embedding_cache_refuses_a_folder_open_to_others(tmp_path):
    """Low, caches: a cache folder with mode 0777 was used, so one planted vector changed
    what a question retrieved. A cache folder (or the cache root above it) writable by
    group or others is refused: nothing read, nothing written, one warning naming it."""
    cache = _fresh_cache(tmp_path / "cache")
    cache.store(["planted"], [np.ones(4, dtype=np.float32)])
    for folder, mode in ((cache.folder, 0o777), (cache.folder, 0o770), (tmp_path / "cache", 0o757)):
        os.chmod(folder, mode)
        victim = _fresh_cache(tmp_path / "cache")
        with pytest.warns(UserWarning, match=r"Not using the embedding cache: .* writable by other users"):
            assert victim.load(["planted"]) == [None]
        assert victim.refused is not None and str(folder) in victim.refused
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # refused once: no second warning
            victim.store(["new text"], [np.zeros(4, dtype=np.float32)])
        assert not _entry(victim, "new text").exists()
        os.chmod(folder, 0o700)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_embedding_cache_refuses_a_folder_of_another_user(tmp_path):
    """Low, caches: the probe's cache folder belonged to another user: refused, even with
    a private mode."""
    cache = _fresh_cache(tmp_path / "cache")
    cache.store(["planted"], [np.ones(4, dtype=np.float32)])
    os.chown(cache.folder, 12345, 12345)
    victim = _fresh_cache(tmp_path / "cache")
    with pytest.warns(UserWarning, match=r"owned by user id 12345, not by the user running tokrag"):
        assert victim.load(["planted"]) == [None]


def test_embedding_cache_sub_folder_replaced_by_a_link(tmp_path):
    """Low, caches: a cache sub-folder replaced by a symbolic link made writes land in the
    link's target. Neither a read nor a write goes through the link: the planted vector
    behind it is a miss, and the store warns instead of writing there."""
    cache = _fresh_cache(tmp_path / "cache")
    text = "the text"
    key = cache._key(text)
    outside = tmp_path / "outside"
    outside.mkdir()
    np.save(outside / f"{key}.npy", np.ones(4, dtype=np.float32))
    cache.folder.mkdir(mode=0o700)
    (cache.folder / key[:2]).symlink_to(outside, target_is_directory=True)
    assert cache.load([text]) == [None]
    assert cache.damaged and "a symbolic link" in cache.damaged[0][1]
    before = sorted(p.name for p in outside.iterdir())
    with pytest.warns(UserWarning, match=r"could not keep chunk embeddings .* a symbolic link"):
        cache.store([text], [np.zeros(4, dtype=np.float32)])
    assert sorted(p.name for p in outside.iterdir()) == before


def test_one_folder_check_for_the_opener_the_postgres_folder_and_the_caches(tmp_path):
    """The checks live in one place (:mod:`tokrag_integrations.retrieval.safe_files`), used by the
    document opener, the embedded Postgres socket folder and both caches."""
    from tokrag_integrations.accel import cpu_kernels
    from tokrag_integrations.postgres import embedded
    from tokrag_integrations.retrieval import index, opener, safe_files

    assert opener.read_regular is safe_files.read_regular
    assert embedded.folder_refusal is safe_files.folder_refusal
    assert cpu_kernels.checked_folder is safe_files.checked_folder
    assert "safe_files" in Path(index.__file__).read_text()
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    assert safe_files.folder_refusal(d) is None
    os.chmod(d, 0o750)
    assert safe_files.folder_refusal(d) is None
    assert "open to other users" in safe_files.folder_refusal(d, private=True)
    (tmp_path / "link").symlink_to(d)
    assert safe_files.folder_refusal(tmp_path / "link") == "not a folder but a symbolic link"
    assert safe_files.folder_refusal(tmp_path / "link", follow=True) is None


# ============================================================================ kernel-plan cache
_PLAN_CHILD = """
import os, torch, warnings
os.environ["TOKRAG_CACHE_DIR"] = sys.argv[1]
os.environ.pop("TOKRAG_KERNEL_PLAN_CACHE", None)
from tokrag_integrations.accel import cpu_kernels as K
path = K._plan_file()
path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
os.mkfifo(path)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    plan = K.plan_for(torch.randn(64, 32))
print("PLAN", len(plan) == len(K.BUCKETS), flush=True)
print("WARNED", [str(w.message) for w in seen], flush=True)
print("NOW", "regular" if path.is_file() and not path.is_fifo() else "fifo", flush=True)
"""


def test_kernel_plan_fifo_does_not_block(tmp_path):
    """Low, caches: a FIFO planted as the kernel-plan file blocked for ever. It is not
    opened for a blocking read: the plan is measured (with a warning) and written over the
    FIFO (a child killed after 90 s)."""
    (tmp_path / "cache").mkdir(mode=0o700)
    proc = _child(_PLAN_CHILD, tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PLAN True" in proc.stdout
    assert "not a kernel-plan file (not a regular file but a FIFO (named pipe)); measuring again." in proc.stdout
    assert "NOW regular" in proc.stdout


@pytest.fixture
def plan_cache(monkeypatch, tmp_path):
    """A private cache folder for the kernel plans, nothing measured in this process yet."""
    import torch

    from tokrag_integrations.accel import cpu_kernels as K

    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("TOKRAG_CACHE_DIR", str(root))
    monkeypatch.delenv("TOKRAG_KERNEL_PLAN_CACHE", raising=False)
    monkeypatch.setattr(K, "_PLANS", {})
    monkeypatch.setattr(K, "_WARNED", set())
    return K, root, torch.randn(64, 32)


def test_kernel_plan_cache_refuses_a_folder_open_to_others(plan_cache):
    """Low, caches: the plan folder with mode 0777 (or the cache root above it): its plans
    are not read (a planted plan is measured again) and nothing is written there."""
    K, root, w = plan_cache
    path = K._plan_file()
    path.parent.mkdir(mode=0o700)
    planted = {K._disk_key((64, 32, w.dtype, __import__("torch").get_num_threads())): ["dup"] * len(K.BUCKETS)}
    path.write_text(json.dumps(planted))
    for folder in (path.parent, root):
        os.chmod(folder, 0o777)
        K._PLANS.clear()
        K._WARNED.clear()
        with pytest.warns(UserWarning, match=r"Not using the kernel-plan cache: .* writable by other users"):
            plan = K.plan_for(w)
        assert len(plan) == len(K.BUCKETS)
        assert json.loads(path.read_text()) == planted  # neither read nor rewritten
        os.chmod(folder, 0o700)


def test_kernel_plan_folder_replaced_by_a_link(plan_cache, tmp_path):
    """Low, caches: ``kernel_plans`` replaced by a link: the plan is not written into its
    target; an oversized plan file is not read whole either."""
    K, root, w = plan_cache
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "kernel_plans").symlink_to(outside, target_is_directory=True)
    with pytest.warns(UserWarning, match=r"kernel_plans is not a folder but a symbolic link"):
        K.plan_for(w)
    assert list(outside.iterdir()) == []
    (root / "kernel_plans").unlink()
    K._PLANS.clear()
    path = K._plan_file()
    path.parent.mkdir(mode=0o700)
    path.write_text(" " * (K.MAX_PLAN_FILE_BYTES + 1))
    with pytest.warns(UserWarning, match=r"not a kernel-plan file \(is \d+ bytes, over the limit"):
        K.plan_for(w)
    assert len(json.loads(path.read_text())) == 1  # measured and written over it


# ============================================================================ GECE
def test_gece_gradient_file_is_loaded_with_weights_only(tmp_path, monkeypatch):
    """Low: ``torch.load`` in GECE unpickled by default on torch < 2.6 (which the project
    allows). It passes ``weights_only=True``: a tensor loads, a pickle that would run code
    is refused and runs nothing."""
    import torch

    from tokrag_integrations.gating import gece

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save(torch.ones(3), tmp_path / "good.grad.pt")
    torch.save(Payload(), tmp_path / "evil.grad.pt")
    calls = []
    real_load = torch.load
    monkeypatch.setattr(gece.torch, "load", lambda *a, **kw: calls.append(kw) or real_load(*a, **kw))
    gate = gece.GECEGate.__new__(gece.GECEGate)
    gate.set_state({"mean_grad_file": "good.grad.pt"}, tmp_path)
    assert torch.equal(gate.mean_grad, torch.ones(3))
    with pytest.raises(Exception, match="Weights only load failed"):
        gate.set_state({"mean_grad_file": "evil.grad.pt"}, tmp_path)
    assert not marker.exists()
    assert calls == [{"weights_only": True}, {"weights_only": True}]
