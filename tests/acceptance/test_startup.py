"""How a ``serve`` process fails: at once, with a non-zero exit status, in a few lines that name
the setting or the host, never a traceback; so that a supervisor (``restart: on-failure``,
systemd's ``Restart=on-failure``) restarts it and an operator can read why."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
from analysis_queue.store.sqlfiles import migrations
from bouncer import PGBOUNCER, Route
from procs import SECRETS, Proc, base_env, cli
from support import fetch, free_port

pytestmark = pytest.mark.acceptance

EXIT_FAILED = 1
EXIT_CONFIG = 78


def _run(args: list[str], env: dict[str, str], timeout_s: float = 60) -> tuple[int, str, float]:
    started = time.monotonic()
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout_s)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def _complete(tmp: Path, **values: str) -> dict[str, str]:
    """Every setting serve needs, Core at a port nobody listens on (it is not called at start)."""
    return base_env(
        tmp,
        AQ_CORE_URL=f"http://127.0.0.1:{free_port()}",
        AQ_PORT=str(free_port()),
        **values,
    )


def test_serve_without_settings_names_each_missing_one(tmp_path: Path) -> None:
    env = {k: v for k, v in base_env(tmp_path).items() if k not in SECRETS}
    code, out, took = _run(cli("serve"), env)
    assert code == EXIT_CONFIG, out
    for name in ("AQ_DATABASE_URL", "AQ_CORE_URL", *SECRETS):
        assert f"{name}: not set" in out, out
    assert "Traceback" not in out and took < 20


def test_a_misspelled_setting_stops_the_start(tmp_path: Path, database_url: str) -> None:
    env = _complete(tmp_path, AQ_DATABASE_URL=database_url, AQ_CORE_URLL="http://core")
    code, out, _ = _run(cli("serve"), env)
    assert code == EXIT_CONFIG, out
    assert "AQ_CORE_URLL: unknown setting; did you mean AQ_CORE_URL?" in out, out
    assert "Traceback" not in out


def test_an_unreachable_database_ends_the_start_after_its_bound(tmp_path: Path) -> None:
    port = free_port()  # nobody listens there
    env = _complete(
        tmp_path,
        AQ_DATABASE_URL=f"postgresql://postgres:pw@127.0.0.1:{port}/aq",
        AQ_STARTUP_TIMEOUT_S="1.5",
    )
    code, out, took = _run(cli("serve"), env)
    assert code == EXIT_FAILED, out
    assert f"127.0.0.1:{port}" in out and "AQ_DATABASE_URL" in out, out
    assert "within 1.5 s" in out, out
    assert '"attempt":' in out, "each attempt is logged"
    assert "pw@" not in out, "the password stays out of the logs"
    assert "Traceback" not in out, out
    assert 1.5 <= took < 30, took


def test_a_transaction_pooler_without_a_direct_url_stops_the_start(
    tmp_path: Path, database_url: str
) -> None:
    env = _complete(tmp_path, AQ_DATABASE_URL=database_url, AQ_DATABASE_POOLER="transaction")
    code, out, _ = _run(cli("serve"), env)
    assert code == EXIT_CONFIG, out
    assert "AQ_DIRECT_DATABASE_URL: not set (AQ_DATABASE_POOLER=transaction: LISTEN" in out, out
    assert "Traceback" not in out


@pytest.mark.parametrize("db_route", [PGBOUNCER], indirect=True)
def test_pgbouncer_without_the_pooler_setting_stops_the_start_at_once(
    tmp_path: Path, database_url: str, db_route: Route
) -> None:
    """PgBouncer refuses the pool's startup parameters; no retry helps, so no 30 s of them."""
    url = db_route.bouncer(database_url).url(database_url)
    env = _complete(tmp_path, AQ_DATABASE_URL=url, AQ_DIRECT_DATABASE_URL=database_url)
    code, out, took = _run(cli("serve"), env)
    assert code == EXIT_FAILED, out
    assert f"127.0.0.1:{db_route.bouncer(database_url).port} (AQ_DATABASE_URL)" in out, out
    assert "refused a startup parameter" in out and "lock_timeout" in out, out
    assert "set AQ_DATABASE_POOLER=transaction" in out, out
    assert "Traceback" not in out and took < 20, took


def _with_password(dsn: str, password: str | None) -> str:
    """``dsn`` with ``password`` (none: without one), its host and port (or socket) kept."""
    parts = urlsplit(dsn)
    address = parts.netloc.rpartition("@")[2]
    secret = "" if password is None else f":{password}"
    return urlunsplit(parts._replace(netloc=f"{parts.username}{secret}@{address}"))


@pytest.mark.parametrize("db_route", [PGBOUNCER], indirect=True)
async def test_behind_pgbouncer_the_start_line_names_both_urls_without_passwords(
    tmp_path: Path, database_url: str, db_route: Route
) -> None:
    """A real serve behind PgBouncer starts, says where each connection goes and in which
    mode, shows no password (trust authentication ignores the ones in the URLs), and stops
    with 0."""
    settings = db_route.settings(database_url)
    pooled = _with_password(settings["database_url"], "pool-secret")
    direct = _with_password(database_url, "direct-secret")
    env = _complete(
        tmp_path,
        AQ_DATABASE_URL=pooled,
        AQ_DIRECT_DATABASE_URL=direct,
        AQ_DATABASE_POOLER="transaction",
    )
    proc = Proc("serve", cli("serve"), env, tmp_path / "serve.log")
    try:
        deadline = time.monotonic() + 30
        while '"service started"' not in proc.text():
            assert proc.alive and time.monotonic() < deadline, proc.text()[-3000:]
            await asyncio.sleep(0.1)
        proc.send(signal.SIGTERM)
        assert await proc.wait_exit(15) == 0, proc.text()[-3000:]
    finally:
        proc.kill()
    out = proc.text()
    started = next(json.loads(ln) for ln in out.splitlines() if '"service started"' in ln)
    assert started["database"] == _with_password(settings["database_url"], None), started
    assert started["direct_database"] == _with_password(database_url, None), started
    assert started["pooler"] == "transaction", started
    assert started["mode"] == "production", started
    assert started["core"] == env["AQ_CORE_URL"], started
    assert "pool-secret" not in out and "direct-secret" not in out, "a password in the logs"


async def test_a_failed_migration_ends_the_start(tmp_path: Path, database_url: str) -> None:
    await fetch(
        database_url, "UPDATE aq_schema_migrations SET checksum = 'edited' WHERE version = 11"
    )
    code, out, _ = _run(cli("serve"), _complete(tmp_path, AQ_DATABASE_URL=database_url))
    assert code == EXIT_FAILED, out
    assert "cannot start" in out and "11" in out, out
    assert "Traceback" not in out, out
    code, out, _ = _run(cli("migrate"), _complete(tmp_path, AQ_DATABASE_URL=database_url))
    assert code == EXIT_FAILED and "cannot migrate" in out, out


# A release whose next migration the server refuses, as a real process meets it: this code's
# migrations and, after them, one with a type that does not exist.
_BROKEN_MIGRATION = """
import sys
from analysis_queue.store import migrate
from analysis_queue.store.sqlfiles import Migration, migrations

broken = Migration(
    migrations()[-1].version + 1,
    "add_reviewer",
    "ALTER TABLE analysis_jobs ADD COLUMN reviewer no_such_type;",
)
migrate.migrations = lambda: (*migrations(), broken)
from analysis_queue.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_broken_migration_ends_the_start_naming_it(tmp_path: Path, database_url: str) -> None:
    """Not a traceback of an asyncpg exception: the version, the name, the server's message."""
    env = _complete(tmp_path, AQ_DATABASE_URL=database_url)
    version = migrations()[-1].version + 1
    for command, said in (("serve", "cannot start"), ("migrate", "cannot migrate")):
        code, out, _ = _run([sys.executable, "-c", _BROKEN_MIGRATION, command], env)
        assert code == EXIT_FAILED, out
        assert f"{said}: migration {version} (add_reviewer) failed: type " in out, out
        assert "no_such_type" in out and "does not exist [42704]" in out, out
        assert "Traceback" not in out, out


# A bug in a background loop, as a real process meets it: a pass raises past its own error
# handling. The process must not go on half-working.
_BROKEN_SWEEP = """
import sys
from analysis_queue.loops.sweep import Sweeper

async def broken(self):
    raise RuntimeError("a bug in the sweeper")

Sweeper.run_once = broken
from analysis_queue.cli import main
sys.exit(main(["serve"]))
"""
_BROKEN_RESYNC = """
import dataclasses, sys
from analysis_queue.loops import hub

def broken(self):
    raise RuntimeError("a bug in the events-resync")

hub.EventHub.resync_once = broken
_make = hub.EventHub.__init__
def soon(self, *args, **kwargs):  # the 15 s resync, every 0.2 s
    _make(self, *args, **kwargs)
    self.settings = dataclasses.replace(self.settings, resync_s=0.2)
hub.EventHub.__init__ = soon
from analysis_queue.cli import main
sys.exit(main(["serve"]))
"""


@pytest.mark.parametrize(
    ("loop", "script"), [("sweeper", _BROKEN_SWEEP), ("events-resync", _BROKEN_RESYNC)]
)
def test_a_dead_background_loop_ends_the_process_non_zero(
    tmp_path: Path, database_url: str, loop: str, script: str
) -> None:
    env = _complete(tmp_path, AQ_DATABASE_URL=database_url, AQ_SWEEP_INTERVAL_S="0.2")
    code, out, _ = _run([sys.executable, "-c", script], env)
    assert code == EXIT_FAILED, out
    assert "background loop died" in out and f"a bug in the {loop}" in out, out
    assert f'"loops":["{loop}"]' in out, out
