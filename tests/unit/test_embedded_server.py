"""The embedded Postgres as an operator meets it: who can reach it, and how it fails (issue 29).

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_embedded_server.py``."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from _helpers import require

pytestmark = pytest.mark.postgres


def _start(folder: Path) -> tuple[str, object]:
    require("pgserver")
    from tokrag_integrations.postgres.embedded import start_embedded

    return start_embedded(folder)


def _socket_folder(dsn: str) -> Path:
    from tokrag_integrations.postgres.dsn import dsn_params

    return Path(dsn_params(dsn)["host"])


def test_socket_folder_prepared_by_another_user_is_refused(tmp_path, monkeypatch):
    """The fallback socket folder lives in the shared temporary folder: one that another user
    made first (or that is open to others) is never used."""
    import tempfile

    from tokrag_integrations.postgres import embedded as pg

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    uid, gid = os.geteuid(), os.getegid()
    planted = tmp_path / f"tokrag-pg-{uid}"
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)
    long_data = Path("/" + "x" * 120) / "pg"
    with pytest.raises(pg.PostgresSetupError, match="not a private folder") as info:
        pg._socket_folder(long_data, uid, gid)
    assert str(planted) in str(info.value) and "\n" not in str(info.value)
    planted.chmod(0o700)  # private again: used, with a private folder for this data folder
    folder = pg._socket_folder(long_data, uid, gid)
    assert folder.parent == planted and stat.S_IMODE(folder.stat().st_mode) == 0o700


@pytest.mark.parametrize("name", ['a"b', "a$HOME", "a`id`", "a\\b", "a\nb"])
def test_data_folder_pg_ctl_cannot_quote_is_one_sentence(tmp_path, name):
    from tokrag_integrations.postgres.dsn import PostgresSetupError

    with pytest.raises(PostgresSetupError, match="pg_ctl passes it through a shell") as info:
        _start(tmp_path / name / "pg")
    assert "TOKRAG_DATA_DIR" in str(info.value)
    assert not (tmp_path / name).exists()  # refused before anything was created


def test_unreachable_socket_hint_does_not_send_to_the_embedded_server(tmp_path):
    from tokrag_integrations.postgres.connection import check_connection
    from tokrag_integrations.postgres.dsn import PostgresConnectionError

    with pytest.raises(PostgresConnectionError) as info:
        check_connection(f"postgresql://postgres:@/postgres?host={tmp_path}")
    message = str(info.value)
    assert "Nothing listens on the socket in" in message and "starts it again" in message
    assert "to use the embedded server" not in message and "\n" not in message


@pytest.mark.parametrize(
    ("args", "folder"),
    [
        (["-D", "/srv/pg", "-m", "fast", "stop"], "/srv/pg"),
        (["-D/srv/pg", "stop"], "/srv/pg"),
        (["--pgdata=/srv/pg", "-w", "restart"], "/srv/pg"),
        (["--pgdata", "rel/pg", "stop"], "rel/pg"),
        (["-m", "fast", "stop"], None),  # acts on $PGDATA
    ],
)
def test_pg_ctl_command_line_names_its_data_folder(args, folder):
    from tokrag_integrations.postgres.embedded import _pg_ctl_folder

    assert _pg_ctl_folder(args) == folder
