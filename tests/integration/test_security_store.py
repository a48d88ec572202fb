"""Issue 43, the store cases: what a client of the Postgres store (the Python API and
``tokrag serve --store postgres``) can do with bad search input, what it sees of the
server's paths, and how ``tokrag serve`` ends on SIGTERM. Every case runs against a real
embedded PostgreSQL + pgvector (pgserver); the signal case against a real process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("pgserver")

pytestmark = pytest.mark.postgres

DOCS = {
    "leave.md": "Full-time employees at Quillfeather get 27 days of annual leave.",
    "offices.md": "Quillfeather has offices in Lisbon and Tallinn.",
}


@pytest.fixture
def data_folder():
    """A data folder for an embedded server outside pytest's base folder: as root the server
    runs as pgserver's user, and every pytest session (another one, running beside this)
    makes ``/tmp/pytest-of-root`` private again, which would lock that user out of it."""
    import shutil
    import tempfile

    parent = Path(tempfile.mkdtemp(prefix="tokrag-store-"))
    parent.chmod(0o755)
    yield parent / "pg"
    shutil.rmtree(parent, ignore_errors=True)


def _write_docs(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name, text in DOCS.items():
        (folder / name).write_text(text + "\n")
    return folder


# ============================================================================ 6: SIGTERM under serve
@pytest.mark.slow
def test_sigterm_stops_tokrag_serve_and_its_embedded_server(tmp_path, data_folder):
    """uvicorn catches SIGTERM, shuts down, then raises it again under the handler it found:
    that must end the process through ``atexit``, as Ctrl-C does, so pgserver stops the
    server and removes this process from its handle file (slow: a second process loads the
    model)."""
    import httpx
    import psutil

    from tokrag_integrations.postgres import ingest
    from tokrag_integrations.postgres.embedded import HANDLE_FILE
    from tokrag_integrations.postgres.server import start_embedded

    folder = data_folder
    _, pg = start_embedded(folder)
    ingest([_write_docs(tmp_path / "docs")], data_dir=folder, table="probe", progress=False)
    pg.cleanup()  # this process no longer uses it: the server's only user is `tokrag serve`
    assert not (folder / "postmaster.pid").exists()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path / "serve.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tokrag_integrations.cli", "serve", "--port", str(port),
             "--store", "postgres", "--data-dir", str(folder), "--table", "probe"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    postmaster = None
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "tokrag serve did not become healthy"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert json.loads((folder / HANDLE_FILE).read_text()) == [proc.pid]
        postmaster = psutil.Process(int((folder / "postmaster.pid").read_text().split()[0]))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM, log_path.read_text()
        assert not (folder / "postmaster.pid").exists()
        assert json.loads((folder / HANDLE_FILE).read_text()) == []
        try:  # gone, or a zombie waiting for its parent to be reaped
            postmaster.wait(60)
        except psutil.TimeoutExpired:
            assert postmaster.status() == psutil.STATUS_ZOMBIE
    finally:
        if proc.poll() is None:
            proc.kill()
        if postmaster is not None and postmaster.is_running():
            postmaster.terminate()  # never leave a server behind
