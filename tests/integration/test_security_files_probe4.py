"""Issue 54 (fourth hostile probe), with the real models and the ``tokrag`` command:
``--max-file-mb`` past a float's range, the embedding cache under MiniLM (damaged entries,
a folder open to others), hostile model folders (a cut-short ``.gguf``, a tensor claiming
4 TiB, a chat template that loops 10**10 times, a context window of 10**12).

The cases without a model are in ``tests/unit/test_security_files_probe4.py``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")
#: Generous: loading the packaged model and one short answer take about 10 s here.
_CHILD_SECONDS = 240


def _run(argv: list[str], code: str | None = None, timeout: float = _CHILD_SECONDS, **env: str):
    """The ``tokrag`` command (``argv``) or Python ``code`` in a fresh process, killed after
    ``timeout`` seconds (a hang fails the test instead of stopping the run)."""
    command = [sys.executable, "-c", textwrap.dedent(code)] if code else [
        sys.executable, "-m", "tokrag_integrations.cli", *argv]  # fmt: skip
    full_env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", **env}
    try:
        return subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=full_env, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(argv) or 'the child'} did not finish in {timeout} s (killed)")


# ============================================================================ numbers
def test_max_file_mb_past_a_floats_range_on_the_command_line(tmp_path):
    """Low, numbers: ``tokrag ask --docs d --max-file-mb 1e308`` ended in an
    ``OverflowError`` traceback. It answers (no cap); ``1e400``, infinity once parsed, is
    one ``tokrag: error:`` line naming the option, exit 2."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.md").write_text("# A\n\nThe Dunmore bridge opened in 1911.\n")
    ask = ["ask", "When did the Dunmore bridge open?", "--docs", str(d), "--retriever", "bm25",
           "--max-new-tokens", "4"]  # fmt: skip
    proc = _run([*ask, "--max-file-mb", "1e308"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stdout.strip()
    proc = _run([*ask, "--max-file-mb", "1e400"], timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--max-file-mb: must be a finite number of MB above 0, got '1e400'" in proc.stderr


# ============================================================================ embedding cache
def _docs(tmp_path: Path) -> Path:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("Quillfeather Aerospace was founded by Ottoline Varga in 2009.")
    (docs / "b.md").write_text("The canteen serves porridge every Tuesday morning.")
    (docs / "c.md").write_text("The Dunmore bridge opened in 1911 after six years of work.")
    return docs


def test_damaged_cache_entries_are_embedded_again(tmp_path, monkeypatch):
    """Low, caches: an entry of the wrong dimension crashed the build (``np.stack``). Each
    damaged entry (another dimension, a pickled array, a vector of NaNs) is a miss: the chunk
    is embedded again with one warning, the entry is rewritten, and retrieval is the same as
    without a cache."""
    from tokrag_integrations.retrieval import build_retriever
    from tokrag_integrations.retrieval.index import EMBEDDER_ID, EmbeddingCache, index_text

    (tmp_path / "cache").mkdir(mode=0o700)
    monkeypatch.setenv("TOKRAG_CACHE_DIR", str(tmp_path / "cache"))
    docs = _docs(tmp_path)
    first = build_retriever(docs, cache=True)
    assert first.n_embedded == 3
    cache = EmbeddingCache(EMBEDDER_ID, 384)
    entries = []
    for chunk in first.chunks:
        key = cache._key(index_text(chunk.metadata.get("title", ""), chunk.text))
        entries.append(cache.folder / key[:2] / f"{key}.npy")
    np.save(entries[0], np.ones(383, dtype=np.float32))
    np.save(entries[1], np.array([None] * 384, dtype=object), allow_pickle=True)
    np.save(entries[2], np.full(384, np.nan, dtype=np.float32))
    with pytest.warns(UserWarning, match=r"3 entries of the embedding cache .* could not be used .*; embedded again"):
        again = build_retriever(docs, cache=True)
    assert again.n_embedded == 3
    q = "Who founded Quillfeather?"
    assert [(h.text, round(h.score, 5)) for h in again.retrieve(q, 3)] == [
        (h.text, round(h.score, 5)) for h in first.retrieve(q, 3)
    ]
    assert build_retriever(docs, cache=True).n_embedded == 0  # rewritten whole


def test_cache_folder_open_to_others_is_not_used(tmp_path, monkeypatch):
    """Low, caches: with the cache folder at mode 0777 one planted vector changed what a
    question retrieves. The probe's attack, replayed: the vector of the canteen chunk is
    replaced by the question's own embedding. In a private folder that is the user's own
    doing (and is read); open to others, the cache is refused with a warning and the ranking
    is the true one."""
    from tokrag_integrations.retrieval import build_retriever
    from tokrag_integrations.retrieval.embedder import load_embedder
    from tokrag_integrations.retrieval.index import EMBEDDER_ID, EmbeddingCache, index_text

    (tmp_path / "cache").mkdir(mode=0o700)
    monkeypatch.setenv("TOKRAG_CACHE_DIR", str(tmp_path / "cache"))
    docs = _docs(tmp_path)
    q = "Who founded Quillfeather?"
    honest = build_retriever(docs, cache=True)
    assert honest.retrieve(q, 1)[0].text.startswith("Quillfeather")
    cache = EmbeddingCache(EMBEDDER_ID, 384)
    canteen = next(c for c in honest.chunks if "canteen" in c.text)
    key = cache._key(index_text(canteen.metadata.get("title", ""), canteen.text))
    np.save(cache.folder / key[:2] / f"{key}.npy", load_embedder().encode([q])[0])
    assert build_retriever(docs, cache=True).retrieve(q, 1)[0].text.startswith("The canteen")
    os.chmod(cache.folder, 0o777)
    with pytest.warns(UserWarning, match=r"Not using the embedding cache: .*embeddings is writable by other users"):
        guarded = build_retriever(docs, cache=True)
    assert guarded.n_embedded == 3
    assert guarded.retrieve(q, 1)[0].text.startswith("Quillfeather")


# ============================================================================ model files

def _packaged_gguf() -> Path:
    from tokrag_integrations.models.files import _SMOLLM2_GGUF, _smollm2_folder

    return _smollm2_folder() / _SMOLLM2_GGUF


def _huge_tensor_gguf(target: Path) -> Path:
    """A copy of the packaged GGUF whose first tensor claims 2**38 x 576 values (about
    4 TiB at Q4_1's 0.625 bytes per value) in a 94 MB file."""
    from gguf import GGUFReader

    source = _packaged_gguf()
    reader = GGUFReader(source)
    dims = reader.tensors[0].field.parts[3]  # name length, name, n_dims, dims, type, offset
    offset = dims.ctypes.data - reader.data.ctypes.data
    del reader, dims
    shutil.copy(source, target)
    with open(target, "r+b") as f:
        f.seek(offset + 8)
        f.write(np.uint64(2**38).tobytes())
    return target


def test_damaged_gguf_files_are_one_sentence_naming_the_file(tmp_path):
    """Low, model files: a cut-short ``.gguf`` and a tensor claiming 4 TiB gave raw
    ``struct.error`` / numpy errors naming no file. Each is one ``DamagedModelError``
    sentence naming the file (memory stays bounded: the reader maps the file); the command
    line prints it as ``tokrag: error:``, exit 2."""
    from tokrag_integrations import load_model
    from tokrag_integrations.cli import main
    from tokrag_integrations.models import DamagedModelError

    source = _packaged_gguf()
    cases = {"header.gguf": 1000, "half.gguf": 5_000_000}
    for name, size in cases.items():
        with open(source, "rb") as src, open(tmp_path / name, "wb") as dst:
            dst.write(src.read(size))
    _huge_tensor_gguf(tmp_path / "huge.gguf")
    for name in (*cases, "huge.gguf"):
        with pytest.raises(DamagedModelError) as info:
            load_model(str(tmp_path / name), device="cpu")
        message = str(info.value)
        assert message.startswith(f"The model file {tmp_path / name} is damaged or not a GGUF file (")
        assert message.endswith("replace it with a complete copy.") and "\n" not in message
    assert "274877906944" in message  # the claimed shape is named
    argv = ["ask", "Who?", "--passage", "A passage.", "--model", str(tmp_path / "half.gguf")]
    assert main(argv) == 2


def _model_copy(tmp_path: Path, **config: object) -> Path:
    """The packaged model's converted folder, linked file by file, with ``config`` merged
    into its config.json."""
    from tokrag_integrations.models import default_model_path

    source = default_model_path()
    folder = tmp_path / "model"
    folder.mkdir()
    for f in source.iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f)
    data = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**data, **config}))
    return folder


def test_chat_template_that_loops_for_ever_is_stopped(tmp_path):
    """Low, model files: a chat template with nested loops of 100,000 hung ``generate``.
    Rendering stops past :data:`~tokrag_integrations.prompts.TEMPLATE_STEPS` with one
    sentence naming the model; the packaged template still renders the same prompt. (A
    child killed after 240 s: without the limit it runs for hours.)"""
    folder = _model_copy(tmp_path)
    (folder / "chat_template.jinja").unlink()
    hostile = (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    (folder / "chat_template.jinja").write_text(hostile)
    code = f"""
    from tokrag_integrations import generate, load_model
    from tokrag_integrations.prompts import ChatTemplateError
    lm = load_model({str(folder)!r}, device="cpu")
    try:
        generate(lm, "Who?", ["A passage."], policy="rag", max_new_tokens=2)
    except ChatTemplateError as e:
        print("STOPPED", e, flush=True)
    """
    proc = _run([], code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"STOPPED The chat template of {folder} ran past 1,000,000 steps" in proc.stdout


def test_packaged_chat_template_renders_as_transformers_does(lm):
    """The step limit changes nothing for a real template, and puts back a tracer already
    set (a debugger's or coverage's)."""
    from tokrag_integrations.prompts import render_chat_template

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who?"}]
    expected = lm.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    outer = sys.gettrace()

    def tracer(frame, event, arg):
        return None

    sys.settrace(tracer)
    try:
        got = render_chat_template(lm.tokenizer, msgs, tokenize=False, add_generation_prompt=True)
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(outer)
    assert got == expected


def test_context_window_of_a_trillion_is_cut_with_a_warning(tmp_path):
    """Low, model files: ``max_position_embeddings`` of 10**12 was taken on trust, so a
    prompt of any length went to the model. It is cut to 2**24 tokens with a warning naming
    the model and the value."""
    from tokrag_integrations import load_model
    from tokrag_integrations.models import MAX_CONTEXT_WINDOW

    folder = _model_copy(tmp_path, max_position_embeddings=10**12)
    with pytest.warns(UserWarning, match=r"states a context window of 1,000,000,000,000 tokens \(max_position_embeddings in its config.json\), more than any released model; using 16,777,216"):
        lm = load_model(str(folder), device="cpu")
    assert lm.context_window == MAX_CONTEXT_WINDOW == 2**24
