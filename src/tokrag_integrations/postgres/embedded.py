"""The embedded PostgreSQL 16 + pgvector from ``pgserver``, for when no connection string
is given; listening only on a Unix socket in a folder private to the server's OS user (see
docs/postgres.md: data folder, root, who can reach it, restarts)."""

from __future__ import annotations

import hashlib
import os
import shlex
import stat
import subprocess
import sys
import tempfile
import threading
import warnings
from functools import cache
from pathlib import Path
from typing import Any

from .. import config
from ..retrieval.safe_files import folder_refusal
from .dsn import PostgresConnectionError, PostgresSetupError, dsn_params

#: Environment variable holding a production connection string.
DSN_ENV = config.PG_DSN
DATA_DIR_ENV = config.DATA_DIR


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def default_data_dir() -> Path:
    """``$TOKRAG_DATA_DIR/pg``, else ``$XDG_DATA_HOME/tokrag/pg``; as root ``/var/lib/tokrag/pg``
    (pgserver opens every parent folder to other users, which must not include a home)."""
    env = config.data_dir()
    if env is not None:
        return env / "pg"
    if _is_root():
        return Path("/var/lib/tokrag/pg")
    base = config.xdg_data_home() or Path(os.path.expanduser("~")) / ".local" / "share"
    return base / "tokrag" / "pg"


def _check_root_safe(data_dir: Path) -> None:
    """Refuse, as root, a data folder whose parents pgserver would open up inside a home."""
    if not _is_root():
        return
    resolved = data_dir.expanduser().resolve()
    homes = {Path("/root").resolve()}
    try:
        homes.add(Path.home().resolve())
    except RuntimeError:  # pragma: no cover - no home at all
        pass
    for home in homes:
        if resolved == home or home in resolved.parents:
            raise PostgresSetupError(
                f"Refusing to start the embedded Postgres in {resolved}: as root, pgserver makes "
                f"every parent folder world-readable, which would expose {home}. Set "
                f"{DATA_DIR_ENV} to a folder outside it (e.g. /var/lib/tokrag or a project "
                "folder), or pass --dsn / set TOKRAG_PG_DSN to use an existing server."
            )


_SERVERS: dict[Path, Any] = {}
_SERVERS_LOCK = threading.Lock()
#: pgserver's one file lock per process is not safe between threads; every use goes through this.
_PGSERVER_LOCK = threading.RLock()
#: pgserver's list of the processes using a server, in the data folder.
HANDLE_FILE = ".handle_pids.json"


#: Longest wait for an outside ``pg_ctl stop`` / ``restart`` before a restart (pg_ctl waits 60 s).
OUTSIDE_PG_CTL_WAIT = 90.0


def _pg_ctl_folder(args: list[str]) -> str | None:
    """The folder of ``-D F``, ``-DF``, ``--pgdata=F`` or ``--pgdata F`` (None: ``$PGDATA``)."""
    for i, arg in enumerate(args):
        if arg in ("-D", "--pgdata") and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--pgdata="):
            return arg.split("=", 1)[1]
        if arg.startswith("-D") and len(arg) > 2:
            return arg[2:]
    return None


def _outside_pg_ctl(pgdata: Path) -> list[Any]:
    """The ``pg_ctl stop`` / ``restart`` processes acting on ``pgdata``: a restart waits for
    them, or ``pg_ctl stop -w`` would wait its 60 s on the new server and report a failure."""
    import psutil

    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            args = proc.info["cmdline"] or []
            if proc.info["name"] != "pg_ctl" or not {"stop", "restart"} & set(args):
                continue
            folder = _pg_ctl_folder(args[1:])
            if folder is None:
                folder = proc.environ().get("PGDATA")
            if folder is None:
                continue
            path = Path(folder) if os.path.isabs(folder) else Path(proc.cwd(), folder)
            if path.resolve() == pgdata.resolve():
                found.append(proc)
        except (psutil.Error, OSError):  # ended meanwhile, or another user's we cannot read
            continue
    return found


def _process_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:  # NoSuchProcess, AccessDenied on a reused pid we cannot see
        return psutil.pid_exists(pid)


def _prune_stale_handles(pgdata: Path) -> None:
    """Drop dead processes from pgserver's handle list: a SIGKILLed one never leaves it, and
    pgserver stops the server only when the last listed process exits."""
    import json

    handle_file = pgdata / HANDLE_FILE
    if not handle_file.exists():
        return
    with _import_pgserver().postgres_server.PostgresServer._lock:
        try:
            pids = json.loads(handle_file.read_text())
        except (OSError, ValueError):
            return
        if isinstance(pids, list):
            alive = [p for p in pids if isinstance(p, int) and _process_alive(p)]
            if alive != pids:
                handle_file.write_text(json.dumps(alive))


def _import_pgserver() -> Any:
    """``pgserver``, without platformdirs' "XDG_RUNTIME_DIR is not set" warning (its
    fallback serves pgserver's lock file as well)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR", category=UserWarning)
        import pgserver
        import pgserver.postgres_server  # noqa: F401 - computes the runtime folder on import
    return pgserver


#: Longest Unix socket path (``sun_path`` holds 108 bytes on Linux, 104 on macOS, with the NUL).
_SOCKET_PATH_MAX = 103 if sys.platform == "darwin" else 107
#: The socket file Postgres creates in its socket folder (the port is always the default).
_SOCKET_NAME = ".s.PGSQL.5432"
#: Characters pg_ctl's shell command (``-D "<data folder>"``) cannot carry.
_UNQUOTABLE = '"$`\\\n'


def _check_quotable(folder: Path) -> None:
    bad = sorted({c for c in str(folder.absolute()) if c in _UNQUOTABLE})
    if bad:
        shown = " ".join(repr(c) for c in bad)
        raise PostgresSetupError(
            f"The embedded Postgres cannot use the data folder {str(folder)!r}: pg_ctl passes "
            f"it through a shell, which cannot carry {shown} in it; set {DATA_DIR_ENV} to a "
            "path without them."
        )


def _server_user_ids(system_user: str | None) -> tuple[int, int]:
    if system_user is None:
        return os.geteuid(), os.getegid()
    import pwd

    entry = pwd.getpwnam(system_user)
    return entry.pw_uid, entry.pw_gid


def _socket_fits(folder: Path) -> bool:
    return len(os.fsencode(str(folder / _SOCKET_NAME))) <= _SOCKET_PATH_MAX


def _is_private(folder: Path, uid: int) -> bool:
    try:
        return folder_refusal(folder, uid=uid, private=True) is None
    except OSError:
        return False


def _private_folder(folder: Path, uid: int, gid: int) -> Path:
    """``folder``, created 0700 for ``uid``, or refused when it exists as anything else."""
    try:
        folder.mkdir(mode=0o700)
        if os.geteuid() != uid:  # root making the folder for pgserver's system user
            os.chown(folder, uid, gid)
    except FileExistsError:
        pass
    if not _is_private(folder, uid):
        st = folder.lstat()
        raise PostgresSetupError(
            f"Refusing to put the embedded Postgres socket in {folder}: it is not a private "
            f"folder of user id {uid} (owner {st.st_uid}, mode {stat.filemode(st.st_mode)}), so "
            "another local user could reach or replace the server. Remove it (or set "
            f"{DATA_DIR_ENV} to a shorter path) and re-run."
        )
    return folder


def _socket_folder(pgdata: Path, uid: int, gid: int) -> Path:
    """The data folder, or when too long for a socket ``$TMPDIR/tokrag-pg-<uid>/<hash>``
    (then ``/tmp``), both levels private to the server's user."""
    if _socket_fits(pgdata):
        return pgdata
    digest = hashlib.sha256(os.fsencode(str(pgdata))).hexdigest()[:12]
    for base in dict.fromkeys([Path(tempfile.gettempdir()), Path("/tmp")]):
        folder = base / f"tokrag-pg-{uid}" / digest
        if _socket_fits(folder):
            _private_folder(folder.parent, uid, gid)
            return _private_folder(folder, uid, gid)
    raise PostgresSetupError(
        f"The embedded Postgres in {pgdata} needs a Unix socket path under "
        f"{_SOCKET_PATH_MAX} bytes and neither the data folder nor $TMPDIR gives one; set "
        f"{DATA_DIR_ENV} (or TMPDIR) to a shorter path."
    )


def _log_reason(log: Path) -> str:
    """The last FATAL/ERROR/PANIC line of the server log."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    for line in reversed(lines):
        if "FATAL:" in line or "ERROR:" in line or "PANIC:" in line:
            return line.split(":  ", 1)[-1].strip()
    return "pg_ctl could not start it"


@cache
def _server_class() -> Any:
    """pgserver's ``PostgresServer`` with its own start: pgserver's may put the socket in a
    world-writable folder and passes the data folder unquoted."""
    from pgserver._commands import POSTGRES_BIN_PATH
    from pgserver.postgres_server import PostgresServer
    from pgserver.utils import PostmasterInfo

    class PrivateSocketServer(PostgresServer):
        """A ``PostgresServer`` whose Unix socket only its own OS user (and root) can reach."""

        def _cleanup(self) -> None:
            with _PGSERVER_LOCK:
                self._cleaned_up = True  # stopped on purpose: not to be started again
                super()._cleanup()

        def ensure_postgres_running(self) -> None:  # called under pgserver's lock
            uid, gid = _server_user_ids(self.system_user)
            info = PostmasterInfo.read_from_pgdata(self.pgdata)
            if info is None or not info.is_running():
                self._start(uid, gid)
                info = PostmasterInfo.read_from_pgdata(self.pgdata)
            if info is None or not info.is_running() or info.status != "ready":
                raise PostgresSetupError(
                    f"The embedded Postgres in {self.pgdata} did not become ready: "
                    f"{_log_reason(self.log)}. See {self.log}."
                )
            if info.socket_dir is None or not _is_private(info.socket_dir, uid):
                raise PostgresSetupError(
                    f"The embedded Postgres in {self.pgdata} is already running with its socket "
                    f"in {info.socket_dir}, which other local users can reach (started by an "
                    f"older version?). Stop it with `pg_ctl -D '{self.pgdata}' stop` (as "
                    f"{self.system_user or 'this user'}) and re-run: it restarts with a "
                    "private socket."
                )
            self._postmaster_info = info

        def get_uri(self, database: str | None = None) -> str:
            """The connection URL, with the socket folder percent-encoded (it may hold spaces)."""
            from urllib.parse import quote

            folder = quote(str(self.get_postmaster_info().socket_dir), safe="/")
            return f"postgresql://postgres:@/{quote(database or 'postgres', safe='')}?host={folder}"

        def _start(self, uid: int, gid: int) -> None:
            socket_folder = _socket_folder(self.pgdata, uid, gid)
            # pg_ctl runs the server through /bin/sh: -o is shell text, so the folder is quoted.
            options = f"-h '' -k {shlex.quote(str(socket_folder))} -c unix_socket_permissions=0700"
            command = [str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(self.pgdata), "-w",
                       "-t", "60", "-o", options, "-l", str(self.log), "start"]  # fmt: skip
            as_user: dict[str, Any] = {}
            if self.system_user is not None:  # root: the server's own user and group only
                as_user = {"user": uid, "group": gid, "extra_groups": []}
            done = subprocess.run(
                command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, timeout=90, check=False, **as_user,
            )  # fmt: skip
            if done.returncode != 0:
                raise PostgresSetupError(
                    f"Could not start the embedded Postgres in {self.pgdata}: "
                    f"{_log_reason(self.log)}. See {self.log} for the server log, or pass "
                    f"--dsn / set {DSN_ENV}."
                )

    return PrivateSocketServer


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def stop_on_sigterm() -> None:
    """Make SIGTERM end the process as Ctrl-C does, so ``atexit`` stops the embedded server
    (only from the main thread, and only while SIGTERM has its default action)."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


def start_embedded(data_dir: str | Path | None = None) -> tuple[str, Any]:
    """Start (or attach to) the embedded server, once per data folder and process; returns
    ``(dsn, server_handle)``.

    Raises:
        PostgresSetupError: ``pgserver`` is missing, the folder is unsafe (root), or the
            server fails to start (the message names the server log).
    """
    folder = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    _check_root_safe(folder)
    _check_quotable(folder)
    try:
        _import_pgserver()
    except ImportError:
        raise PostgresSetupError(
            "No connection string was given and the embedded server needs the 'pgserver' "
            "package: pip install 'tokrag-integrations[postgres]' (or pass --dsn / set "
            f"{DSN_ENV})."
        ) from None
    with _SERVERS_LOCK:
        key = folder.resolve() if folder.exists() else folder.absolute()
        server = _SERVERS.get(key)
        if server is None:
            try:
                folder.parent.mkdir(parents=True, exist_ok=True)
                pgdata = folder.resolve()
                pgdata.mkdir(mode=0o700, exist_ok=True)
                _prune_stale_handles(pgdata)
                server_class = _server_class()
                server = server_class._instances.get(pgdata)
                if server is None:
                    try:
                        with _PGSERVER_LOCK:
                            server = server_class(pgdata, cleanup_mode="stop")
                    finally:  # pgserver registers the instance before starting it
                        if server is None:
                            server_class._instances.pop(pgdata, None)
            except PostgresSetupError:
                raise
            except Exception as exc:  # noqa: BLE001 - re-raised with the fix in the message
                raise PostgresSetupError(
                    f"Could not start the embedded Postgres in {folder}: {exc}. See "
                    f"{folder / 'log'} for the server log, or pass --dsn / set {DSN_ENV}."
                ) from exc
            _SERVERS[key] = server
    _start_again_if_stopped(server)
    stop_on_sigterm()
    return server.get_uri(), server


def _start_again_if_stopped(server: Any) -> bool:
    """Start ``server`` again (same folder and socket, with a warning) when it was stopped
    from outside this process; returns whether it was."""
    import psutil
    from pgserver.utils import PostmasterInfo

    with _PGSERVER_LOCK, server._lock:
        if getattr(server, "_cleaned_up", False):
            return False
        info = PostmasterInfo.read_from_pgdata(server.pgdata)
        if info is not None and info.is_running():
            return False
        psutil.wait_procs(_outside_pg_ctl(Path(server.pgdata)), timeout=OUTSIDE_PG_CTL_WAIT)
        info = PostmasterInfo.read_from_pgdata(server.pgdata)
        restarted_outside = info is not None and info.is_running()  # ``pg_ctl restart``
        server.ensure_postgres_running()  # starts it, or records where it now listens
        if restarted_outside:
            return True
        # Warned under the lock: another pool worker hands out a connection only after it.
        warnings.warn(
            f"The embedded Postgres in {server.pgdata} had been stopped from outside this "
            "process; tokrag started it again.",
            RuntimeWarning,
            stacklevel=3,
        )
    return True


def start_again_if_stopped(dsn: str) -> bool:
    """Whether ``dsn`` is this process's embedded server, stopped from outside and now
    started again; ``False`` for any other database."""
    try:
        host = dsn_params(dsn).get("host")
    except PostgresConnectionError:
        return False
    with _SERVERS_LOCK:
        servers = list(_SERVERS.values())
    for server in servers:
        info = server._postmaster_info
        if host and info is not None and str(info.socket_dir) == host:
            return _start_again_if_stopped(server)
    return False
