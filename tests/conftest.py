"""Shared fixtures: one real default model per test session (loaded once, ~2 s from cache).

The tests live in two folders: ``tests/unit`` (no real model, no database, no server; a guard
in its conftest fails a test that tries) and ``tests/integration`` (the rest). Each test is
marked ``unit`` or ``integration`` after its folder, so ``-m unit`` selects the same tests as
the folder does."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

# Before torch is imported (its OpenMP runtime reads it once): torch's threads wait for one
# another spinning for a long time by default; with other jobs on the cores (a busy machine,
# issue 58) the spinning thread holds a core the thread it waits for needs. Figures in
# docs/results.md, "Test suite duration".
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
from _cli_fakes import fake_engine  # noqa: E402, F401 - the CLI tests' fake engine, a fixture

_HERE = Path(__file__).parent


def pytest_report_header(config):
    """The machine in the run's header (CPU model, usable CPUs, load, torch threads), so that a
    red run on a slow or busy machine can be read (``pytest -q`` hides the header; ``.ci/run``
    prints the same lines before the tests)."""
    from _helpers import machine_summary

    return machine_summary()


def pytest_collection_modifyitems(config, items):
    """Mark every test ``unit`` or ``integration`` after the folder it is in."""
    for item in items:
        folder = Path(str(item.path)).relative_to(_HERE).parts[0]
        if folder in ("unit", "integration"):
            item.add_marker(folder)


#: Set by ``.ci/run``: there the evaluation sets must be found, and a test that needs them fails
#: when they are missing instead of skipping.
REQUIRE_EVAL_DATA = "TOKRAG_REQUIRE_EVAL_DATA"


def eval_data_dir() -> Path:
    """Where the evaluation sets are: ``$TOKRAG_EVAL_DATA``, else ``shared/data`` beside the
    checkout (``../shared/data`` from its root, as CI lays it out)."""
    env = os.environ.get("TOKRAG_EVAL_DATA")
    return Path(env) if env else _HERE.parent.parent / "shared" / "data"


@pytest.fixture(scope="session")
def eval_data():
    """``eval_data(name)``: the path of the evaluation set ``name`` (e.g.
    ``"rgb_en_fact_dev.jsonl"``). A missing set skips the test, or fails it under
    ``$TOKRAG_REQUIRE_EVAL_DATA=1`` (CI), naming the folder that was searched."""

    def find(name: str) -> Path:
        path = eval_data_dir() / name
        if path.is_file():
            return path
        message = (f"evaluation set {name} not found in {path.parent} (set $TOKRAG_EVAL_DATA "
                   "to the folder that holds it)")
        if os.environ.get(REQUIRE_EVAL_DATA) == "1":
            pytest.fail(f"{message}; ${REQUIRE_EVAL_DATA}=1 requires it", pytrace=False)
        pytest.skip(message)

    return find


@pytest.fixture(scope="session")
def lm():
    """The packaged default model (SmolLM2-135M-Instruct), shared by every test, with the
    speed paths a default decode installs before its first step (``engine.seam.prepare``)."""
    from tokrag_integrations import load_model
    from tokrag_integrations.engine.seam import prepare
    from tokrag_integrations.speed import Speed

    model = load_model("default", device="cpu")
    prepare(model, Speed())
    return model


@pytest.fixture(scope="module")
def tiny(lm):
    """A tiny random 30-layer model shaped like SmolLM2 (``_helpers.tiny_smollm2``), one per
    test module (its pooled buffers and recorded steps stay in the module)."""
    from _helpers import tiny_smollm2

    return tiny_smollm2(lm.tokenizer)


@pytest.fixture(scope="module")
def shallow(lm):
    """The same with four layers: enough for the compiler's checks, cheap to trace."""
    from _helpers import tiny_smollm2

    return tiny_smollm2(lm.tokenizer, layers=4)


@pytest.fixture
def cli_shares_model(lm):
    """In-process CLI runs of this test use the session's model instead of loading the
    packaged model again (see :func:`_helpers.sharing_model`)."""
    from _helpers import sharing_model

    with sharing_model(lm):
        yield lm


@pytest.fixture(scope="session")
def embedded_pg():
    """One embedded PostgreSQL + pgvector for the whole run, started on first use, in a
    folder outside pytest's (a concurrent pytest run resets those to 0700, locking out the
    server's user when the tests run as root). Modules reach it through
    :func:`module_pg_dsn`; tests that stop, restart or break a server start their own."""
    from _helpers import require

    require("pgserver")
    from tokrag_integrations.postgres.embedded import start_embedded

    folder = Path(tempfile.mkdtemp(prefix="tokrag-pg-tests-"))
    dsn, server = start_embedded(folder / "pg")
    yield dsn
    server.cleanup()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def module_pg_dsn(embedded_pg, request):
    """A database of the requesting module's own on the shared server (made empty), so the
    modules stay independent: their tables, extensions and data never meet."""
    from psycopg import sql
    from psycopg.conninfo import make_conninfo

    from tokrag_integrations.postgres.connection import connect
    from tokrag_integrations.postgres.dsn import dsn_params

    name = "t_" + re.sub(r"\W", "_", request.module.__name__.rsplit(".", 1)[-1]).lower()[:50]
    with connect(embedded_pg, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return make_conninfo(**{**dsn_params(embedded_pg), "dbname": name})


def write_pdf(path, pages: list[str]) -> None:
    """Write a minimal valid PDF with one line of Helvetica text per page (for loader tests)."""
    objects = ["<< /Type /Catalog /Pages 2 0 R >>", ""]
    kids = []
    for text in pages:
        safe = text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
        stream = f"BT /F1 11 Tf 40 750 Td ({safe}) Tj ET"
        objects.append(f"<< /Length {len(stream)} >>\nstream\n{stream}\nendstream")
        content = len(objects)
        objects.append(
            "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            f"/Resources << /Font << /F1 {{font}} 0 R >> >> /Contents {content} 0 R >>"
        )
        kids.append(len(objects))
    objects.append("<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    font = len(objects)
    objects = [o.replace("{font}", str(font)) for o in objects]
    objects[1] = f"<< /Type /Pages /Kids [{' '.join(f'{k} 0 R' for k in kids)}] /Count {len(kids)} >>"
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n{body}\nendobj\n".encode("latin-1")
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += "".join(f"{o:010d} 00000 n \n" for o in offsets).encode()
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    path.write_bytes(bytes(out))


@pytest.fixture
def make_pdf():
    """``make_pdf(path, pages)``: write a small text PDF (see :func:`write_pdf`)."""
    return write_pdf
