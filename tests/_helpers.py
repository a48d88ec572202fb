"""Helpers shared by several test modules (imported as ``from _helpers import ...``; pytest
puts this folder on ``sys.path``)."""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest


def machine_summary() -> list[str]:
    """What a test run's speed and timing depend on, for its header (``tests/conftest.py``)
    and ``.ci/run``: the CPU model, the CPUs this process may use, the load average, and
    torch's version and thread counts."""
    import os
    import platform

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            model = next(
                (line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")),
                model,
            )
    except OSError:  # not Linux
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    lines = [f"cpu: {model}; {usable} of {os.cpu_count()} CPUs usable; load average {load}"]
    try:
        import torch
    except ImportError:  # the unit tests' guard names what is missing
        return [*lines, "torch: not installed"]
    return [
        *lines,
        f"torch {torch.__version__}: {torch.get_num_threads()} intra-op threads, "
        f"{torch.get_num_interop_threads()} inter-op threads, "
        f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', 'unset')}",
    ]


def require(module: str, package: str | None = None) -> ModuleType:
    """Import ``module``, which the ``dev`` extra installs (``package``: its PyPI name, if it
    differs). Missing, the test fails naming the package and the extra: a skip would hide a
    dependency dropped from the extra, and every test that needs it with it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(
            f"{module} cannot be imported ({exc}): the 'dev' extra installs it (PyPI "
            f"{package or module}); run `pip install -e '.[dev]'` or `make install`",
            pytrace=False,
        )


@contextlib.contextmanager
def sharing_model(lm: Any) -> Iterator[None]:
    """While open, in-process command-line runs get ``lm`` (the session's packaged model)
    where they would load the packaged model again: ``load_model("default")`` with no
    option other than ``device="cpu"`` returns it; any other load is a real one. The
    command's own messages around the load are unchanged."""
    import tokrag_integrations
    from tokrag_integrations import models

    real = models.load_model

    def load(model: Any = "default", **kwargs: Any) -> Any:
        options = {k: v for k, v in kwargs.items() if v is not None}
        if model == "default" and options.get("device", "cpu") == "cpu" and set(options) <= {"device"}:
            return lm
        return real(model, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(models, "load_model", load)
        mp.setattr(tokrag_integrations, "load_model", load)
        yield


def forward_inputs(lm: Any, call: Callable[[], Any]) -> list[list[list[int]]]:
    """The input ids of every forward pass of ``lm.model`` while ``call()`` runs: one list of
    rows per pass (the contexts of a decode are packed into one row or fused as rows)."""
    seen: list[list[list[int]]] = []

    def hook(module: Any, args: Any, kwargs: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            seen.append(ids.tolist())

    handle = lm.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        call()
    finally:
        handle.remove()
    return seen


def aggregate(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed chain output put back together (``answer`` and ``sources`` concatenated,
    the other keys as last seen)."""
    agg: dict[str, Any] = {}
    for c in chunks:
        for k, v in c.items():
            agg[k] = agg[k] + v if k in ("answer", "sources") and k in agg else v
    return agg


def sample_documents() -> list[Any]:
    """The packaged sample documents as LlamaIndex ``Document`` objects, with the reader's
    metadata except that ``file_path`` is relative to the documents folder: LlamaIndex puts
    the metadata into the prompt, so an absolute path would make the answers depend on where
    the checkout lives."""
    from pathlib import Path

    from llama_index.core import SimpleDirectoryReader

    from tokrag_integrations.retrieval import get_sample_docs_path

    root = get_sample_docs_path()

    def metadata(path: str) -> dict[str, str]:
        return {"file_path": str(Path(path).relative_to(root)), "file_name": Path(path).name}

    return SimpleDirectoryReader(str(root), file_metadata=metadata).load_data()


class CheckedThread(threading.Thread):
    """A thread whose failure reaches the test: :meth:`join` re-raises, in the joining
    thread, whatever its target raised, and fails naming the thread when it is still running
    after ``timeout``. (A plain ``threading.Thread`` only prints its exception, which pytest
    turns into a warning: the test then sees a missing result instead of its cause.) Every
    test that starts threads starts these and joins them (:func:`join_all`)."""

    error: BaseException | None = None

    def run(self) -> None:
        try:
            super().run()
        except BaseException as e:  # noqa: BLE001 - re-raised by join() in the test's thread
            self.error = e

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.is_alive():
            raise AssertionError(f"thread {self.name!r} is still running after {timeout} s")
        if self.error is not None:
            raise self.error


def join_all(threads: Any, timeout: float | None = None) -> None:
    """Join every thread of ``threads`` (:class:`CheckedThread`, each given ``timeout``
    seconds), then re-raise the first failure; the others are named in a note. None is left
    unjoined because an earlier one failed."""
    errors: list[tuple[str, BaseException]] = []
    for t in threads:
        try:
            t.join(timeout)
        except BaseException as e:  # noqa: BLE001 - re-raised below, once every thread is joined
            errors.append((t.name, e))
    if not errors:
        return
    name, first = errors[0]
    if hasattr(first, "add_note"):  # Python >= 3.11
        first.add_note(f"raised in thread {name!r}")
        for other, e in errors[1:]:
            first.add_note(f"thread {other!r} failed too: {type(e).__name__}: {e}")
    raise first


class LiveServer:
    """uvicorn running ``app`` in a daemon thread on a free localhost port."""

    def __init__(self, app):
        import socket

        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = CheckedThread(target=self.server.run, name="uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive():
                self.thread.join()  # its exception, if it raised one
                raise RuntimeError("the test server did not start")
            if time.monotonic() > deadline:
                raise RuntimeError("the test server did not start in 60 s")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = "unused", **kw):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0,
                             timeout=120, **kw)

    def health(self) -> dict:
        import httpx

        return httpx.get(f"{self.url}/health", timeout=30).json()

    def stop(self) -> None:
        """Stop the server (waiting up to 60 s, as before: uvicorn waits for open
        connections); its thread's exception, if it raised one, is raised here."""
        self.server.should_exit = True
        threading.Thread.join(self.thread, timeout=60)
        if self.thread.error is not None:
            raise self.thread.error


def wait_until_healthy(proc: Any, port: int, log: Any, timeout: float = 300) -> None:
    """Wait for a ``tokrag serve`` subprocess ``proc`` to answer ``/health`` with 200 on
    ``port``; fail with its log (the path ``log``) if it exits or is not healthy in time."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "tokrag serve did not become healthy"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def interrupt(proc: Any) -> None:
    """Stop a ``tokrag serve`` subprocess as Ctrl-C does; killed if it has not ended in 60 s."""
    import signal
    import subprocess

    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def assert_process_ended(pid: int) -> None:
    """The process ``pid`` (a stopped postmaster) has ended within 60 s, or is a zombie
    waiting for its parent to reap it."""
    import psutil

    try:
        psutil.Process(pid).wait(60)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def assert_sigterm_stops_postmaster(proc: Any, folder: Any, log_path: Any) -> None:
    """SIGTERM to ``proc`` (a process running the embedded server in ``folder``) ends it with
    128 + SIGTERM and stops its postmaster: the pid file is gone and the process has ended.
    ``proc`` is killed and the postmaster terminated if a check fails (never left behind)."""
    import signal

    import psutil

    postmaster = None
    try:
        postmaster = psutil.Process(int((folder / "postmaster.pid").read_text().split()[0]))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM, log_path.read_text()
        assert not (folder / "postmaster.pid").exists()
        assert_process_ended(postmaster.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
        if postmaster is not None and postmaster.is_running():
            postmaster.terminate()


def tiny_model(
    tokenizer: Any,
    *,
    config: str = "LlamaConfig",
    model: str = "LlamaForCausalLM",
    vocab_size: int | None = None,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 4096,
    **extra: Any,
) -> Any:
    """A random-weight transformers causal LM (not loaded: a ``PreTrainedModel`` in eval mode)
    of any architecture, built the same way everywhere: ``transformers.<model>(<config>(...))``
    with tied embeddings, the tokenizer's special ids, a feed-forward twice the hidden size,
    weights drawn with ``initializer_range=0.3`` (distinct logits) after ``torch.manual_seed(0)``.
    ``extra``: further config fields, overriding these."""
    import torch
    import transformers

    fields = dict(
        vocab_size=len(tokenizer) if vocab_size is None else vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    cfg = getattr(transformers, config)(**{**fields, **extra})
    torch.manual_seed(0)
    return getattr(transformers, model)(cfg).eval()


def greedy_generate(model: Any, ids: list[int], n: int, pad_token_id: int) -> list[int]:
    """``n`` new token ids of transformers' own greedy ``model.generate`` after the prompt
    ``ids`` (sampling options unset, so a model's generation config cannot turn sampling on):
    what the engine's greedy decode is compared with."""
    import torch

    x = torch.tensor([ids])
    out = model.generate(
        input_ids=x,
        attention_mask=torch.ones_like(x),
        do_sample=False,
        max_new_tokens=n,
        pad_token_id=pad_token_id,
        top_p=None,
        top_k=None,
        temperature=None,
    )
    return out[0, len(ids) :].tolist()


def tiny_smollm2(tokenizer: Any, *, layers: int = 30, hidden: int = 72, cpu_kernels: str = "off") -> Any:
    """A random-weight model with SmolLM2-135M's shape where it sets the launch count (30
    Llama layers, 9 query / 3 key-value heads, SmolLM2's tokenizer and vocabulary) and a small
    hidden size, so that arithmetic is negligible and a step costs what its operations and
    host reads cost (issue 56's "tiny random 30-layer model"): a LoadedModel."""
    from tokrag_integrations import load_model

    model = tiny_model(tokenizer, layers=layers, hidden=hidden, heads=9, kv_heads=3, max_positions=8192)
    return load_model(model, tokenizer=tokenizer, cpu_kernels=cpu_kernels)
