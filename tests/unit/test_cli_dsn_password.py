"""``--dsn`` with a password is readable by every local user through ``ps`` (issue 29, item 14)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "dsn",
    ["postgresql://alice:S3cr3t-pw@127.0.0.1:1/rag", "host=127.0.0.1 port=1 user=alice password=S3cr3t-pw"],
)
def test_password_in_dsn_argument_is_warned_about(tmp_path, capsys, dsn):
    from tokrag_integrations.cli import main

    (tmp_path / "a.md").write_text("# A\n\nText.\n")
    assert main(["ingest", str(tmp_path), "--dsn", dsn, "--no-progress"]) == 3  # unreachable
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if line.startswith("warning: --dsn holds a password")]
    assert len(warning) == 1 and "(ps)" in warning[0] and "TOKRAG_PG_DSN" in warning[0]
    assert "pgpass" in warning[0] and "service" in warning[0]
    assert "S3cr3t" not in err


@pytest.mark.parametrize("dsn", ["postgresql://alice@127.0.0.1:1/rag", "postgresql://alice:@127.0.0.1:1/rag"])
def test_dsn_argument_without_password_is_not_warned_about(tmp_path, capsys, dsn):
    from tokrag_integrations.cli import main

    (tmp_path / "a.md").write_text("# A\n\nText.\n")
    assert main(["ingest", str(tmp_path), "--dsn", dsn, "--no-progress"]) == 3
    assert "warning:" not in capsys.readouterr().err
