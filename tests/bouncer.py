"""PgBouncer for the tests: a real ``pgbouncer`` process in transaction mode in front of the test's
PostgreSQL server, and the two ways (:class:`Route`) a test's service instances reach the
database: ``direct`` (``AQ_DATABASE_URL`` is the server) or ``pgbouncer`` (``AQ_DATABASE_URL`` is
the PgBouncer, ``AQ_DIRECT_DATABASE_URL`` the server, ``AQ_DATABASE_POOLER=transaction``).

A test asks for the route with ``@pytest.mark.parametrize("db_route", ROUTES, indirect=True)``
(the ``db_route`` fixture, tests/conftest.py); without it the route is direct. Each PgBouncer is
started for one test, from an ini file and a userlist generated in the test's temporary
directory, on a free port, and stopped at the test's end by the PID it was started with. It
listens on 127.0.0.1 only, trusts its clients (the test server has trust authentication) and
hands each database few server connections, fewer than the instances' pools hold, so the
clients really share them. It refuses every startup parameter but the ones it tracks
(``ignore_startup_parameters`` is empty): a service that sent ``lock_timeout`` would not start.
Its admin console (``SHOW SERVERS``, ``SHOW CLIENTS``) speaks only the simple query protocol,
which asyncpg does not expose, so the tests ask it through ``psql``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from analysis_queue.config import env_name
from support import database_name, fetch, free_port

DIRECT = "direct"
PGBOUNCER = "pgbouncer"
ROUTES = [DIRECT, PGBOUNCER]

POOL_SIZE = 4  # server connections per database: two instances' pools (2..10 each) share them
START_TIMEOUT_S = 10.0
# Runs as root would be refused ("PgBouncer should not run as root"); it reads its files first.
# In front of a server reached by its socket, it runs as the socket directory's owner instead.
UNPRIVILEGED_USER = "nobody"


def _binary(name: str) -> str | None:
    found = shutil.which(name)
    if found is None and os.access(f"/usr/sbin/{name}", os.X_OK):
        found = f"/usr/sbin/{name}"
    return found


def missing() -> str | None:
    """Why the PgBouncer tests cannot run here, or None."""
    if _binary("pgbouncer") is None:
        return (
            "pgbouncer is not installed (Debian: apt-get install pgbouncer; .ci/run installs it): "
            "the tests through PgBouncer in transaction mode skip"
        )
    if _binary("psql") is None:
        return "psql is not installed (postgresql-client): PgBouncer's admin console needs it"
    return None


class Server:
    """Where a DSN's PostgreSQL listens, as PgBouncer's ``[databases]`` entry spells it."""

    def __init__(self, dsn: str) -> None:
        parts = urlsplit(dsn)
        socket_dir = parse_qs(parts.query).get("host", [None])[0]
        self.host = parts.hostname or socket_dir or "127.0.0.1"
        self.port = parts.port or 5432
        self.user = parts.username or "postgres"

    @property
    def socket_owner(self) -> str | None:
        """The OS user owning the server's socket directory (the embedded server's data
        directory, mode 0700), when it is reached by a socket: the one user that can reach it."""
        if not self.host.startswith("/"):
            return None
        try:
            return pwd.getpwuid(os.stat(self.host).st_uid).pw_name
        except (OSError, KeyError):
            return None

    @property
    def key(self) -> tuple[str, int, str]:
        return self.host, self.port, self.user


class PgBouncer:
    """One pgbouncer process in transaction mode for one PostgreSQL server."""

    def __init__(self, root: Path, server: Server, os_user: str | None = None) -> None:
        self.root = root
        self.server = server
        self.port = free_port()
        owner = server.socket_owner
        self.os_user = os_user or (owner if owner not in (None, "root") else UNPRIVILEGED_USER)
        self.ini = root / "pgbouncer.ini"
        self.log = root / "pgbouncer.log"
        self._popen: subprocess.Popen[bytes] | None = None

    def _write_config(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        userlist = self.root / "userlist.txt"
        userlist.write_text(f'"{self.server.user}" ""\n')
        self.ini.write_text(
            "\n".join(
                [
                    "[databases]",
                    f"* = host={self.server.host} port={self.server.port}",
                    "[pgbouncer]",
                    "listen_addr = 127.0.0.1",
                    f"listen_port = {self.port}",
                    "unix_socket_dir =",
                    "auth_type = trust",
                    f"auth_file = {userlist}",
                    f"admin_users = {self.server.user}",
                    "pool_mode = transaction",
                    f"default_pool_size = {POOL_SIZE}",
                    "max_client_conn = 500",
                    # A restarted server is tried again within a second, not fifteen.
                    "server_login_retry = 1",
                    "server_connect_timeout = 5",
                    # A client waiting for a server connection gets an error, not a hang.
                    "query_wait_timeout = 10",
                    "idle_transaction_timeout = 60",
                    "ignore_startup_parameters =",
                    "",
                ]
            )
        )

    def start(self) -> None:
        self._write_config()
        args = [_binary("pgbouncer") or "pgbouncer"]
        if os.geteuid() == 0:
            args += ["-u", self.os_user]
        with self.log.open("ab") as log:
            self._popen = subprocess.Popen(
                [*args, str(self.ini)], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self._popen.poll() is not None:
                raise RuntimeError(f"pgbouncer exited {self._popen.returncode}:\n{self.tail()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pgbouncer not listening in {START_TIMEOUT_S}s:\n{self.tail()}")
            time.sleep(0.02)

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    def stop(self) -> None:
        """Stop the process this object started (by its PID), whatever state it is in."""
        if self._popen is None or self._popen.poll() is not None:
            return
        self._popen.terminate()
        try:
            self._popen.wait(5)
        except subprocess.TimeoutExpired:
            self._popen.kill()
            self._popen.wait(5)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no pgbouncer log: {exc})"

    def url(self, dsn: str) -> str:
        """``dsn``'s database, through this PgBouncer."""
        dbname = database_name(dsn) or self.server.user
        return f"postgresql://{self.server.user}@127.0.0.1:{self.port}/{dbname}"

    async def show(self, what: str) -> list[dict[str, str]]:
        """``SHOW <what>`` on the admin console, as rows of column -> text."""
        psql = _binary("psql") or "psql"
        admin = f"postgresql://{self.server.user}@127.0.0.1:{self.port}/pgbouncer"
        proc = await asyncio.create_subprocess_exec(
            *(psql, admin, "-X", "-A", "-F", "\t", "-P", "footer=off", "-c", f"SHOW {what}"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 10)
        assert proc.returncode == 0, f"psql SHOW {what}: {err.decode()}"
        header, *lines = out.decode().splitlines()
        names = header.split("\t")
        return [dict(zip(names, line.split("\t"), strict=True)) for line in lines]


class Route:
    """How a test's service instances reach PostgreSQL (see the module docstring)."""

    def __init__(self, kind: str, root: Path) -> None:
        assert kind in ROUTES, kind
        self.kind = kind
        self.root = root
        self._bouncers: dict[tuple[str, int, str], PgBouncer] = {}

    @property
    def pooled(self) -> bool:
        return self.kind == PGBOUNCER

    def bouncer(self, dsn: str, os_user: str | None = None) -> PgBouncer:
        """The PgBouncer in front of ``dsn``'s server, started on first use. ``os_user``: the
        user it runs as when the tests run as root (by default the owner of the server's socket
        directory when it is reached by one, else an unprivileged user)."""
        server = Server(dsn)
        if server.key not in self._bouncers:
            bouncer = PgBouncer(self.root / f"pgbouncer-{len(self._bouncers)}", server, os_user)
            bouncer.start()
            self._bouncers[server.key] = bouncer
        return self._bouncers[server.key]

    def settings(self, dsn: str, os_user: str | None = None) -> dict[str, str]:
        """The service's database settings (field names) for a database at ``dsn``."""
        if not self.pooled:
            return {"database_url": dsn}
        return {
            "database_url": self.bouncer(dsn, os_user).url(dsn),
            "direct_database_url": dsn,
            "database_pooler": "transaction",
        }

    def env(self, dsn: str, os_user: str | None = None) -> dict[str, str]:
        """The same as environment variables."""
        return {env_name(k): v for k, v in self.settings(dsn, os_user).items()}

    async def assert_routed(self, dsn: str, *, listeners: int) -> dict[str, Any]:
        """The instances' LISTEN connections reach PostgreSQL directly, and (through PgBouncer)
        every other connection of theirs is one of PgBouncer's server connections, shared by
        their pools. Returns what it saw."""
        rows = await fetch(
            dsn,
            """SELECT pid, application_name FROM pg_stat_activity
                WHERE datname = current_database() AND application_name LIKE 'analysis-queue %'""",
        )
        listen = {r["pid"] for r in rows if r["application_name"].endswith("-listen")}
        others = {r["pid"] for r in rows} - listen
        assert len(listen) == listeners, f"listen backends: {rows}"
        assert others, f"no pool backend: {rows}"
        seen: dict[str, Any] = {"listen_backends": sorted(listen), "pool_backends": sorted(others)}
        if not self.pooled:
            return seen
        bouncer = self.bouncer(dsn)
        dbname = database_name(dsn)
        servers = {int(s["remote_pid"]) for s in await bouncer.show("SERVERS")}
        clients = [c for c in await bouncer.show("CLIENTS") if c["database"] == dbname]
        assert listen.isdisjoint(servers), f"a listener goes through PgBouncer: {listen & servers}"
        assert others <= servers, f"backends not PgBouncer's: {others - servers} ({rows})"
        names = [c["application_name"] for c in clients]
        assert not [n for n in names if n.endswith("-listen")], names
        seen.update(pgbouncer_servers=len(servers), pgbouncer_clients=len(clients))
        return seen

    def close(self) -> None:
        for bouncer in self._bouncers.values():
            bouncer.stop()
        self._bouncers.clear()
