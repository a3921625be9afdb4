"""The pool behind PgBouncer in transaction mode (a real pgbouncer, tests/bouncer.py).

What the service relies on there, each shown against the real thing: asyncpg's unnamed
statements stay on one server connection while many clients share a few (and the named ones
the statement cache would make do not, which shows the PgBouncer really multiplexes); the pool
sends no startup parameter, and a pool that would is refused at once with a message naming the
setting; every lock wait is still bounded, by the SQL function that waits, so a held user lock
is a 503 and not a hang; LISTEN goes to the direct URL, and one that does not is reported.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from analysis_queue.app import Dsns, StartupError, open_database
from analysis_queue.config import Pooler, Settings
from analysis_queue.store.database import Database
from analysis_queue.store.driver import StartupParametersRefused
from analysis_queue.store.listen import ListenConnection
from bouncer import PGBOUNCER, POOL_SIZE, ROUTES, Route
from support import Harness, database_name, wait_until_blocked

through_pgbouncer = pytest.mark.parametrize("db_route", [PGBOUNCER], indirect=True)

CLIENTS = 16  # pool connections, on bouncer.POOL_SIZE server connections
CALLS = 400


@pytest.fixture
async def pooled(database_url: str, db_route: Route) -> AsyncIterator[Database]:
    db = await Database.connect(
        db_route.bouncer(database_url).url(database_url),
        direct_dsn=database_url,
        pooler=Pooler.TRANSACTION,
        min_size=CLIENTS,
        max_size=CLIENTS,
    )
    try:
        yield db
    finally:
        await db.close()


@through_pgbouncer
async def test_unnamed_statements_stay_on_one_server_while_clients_share_them(
    pooled: Database, database_url: str, db_route: Route
) -> None:
    """Concurrent calls of different shapes (composite rows, jsonb, arrays, counts) through
    16 clients on 4 server connections: each gets its own answer, none an error."""
    users = [f"user-{i}" for i in range(CALLS // 4)]

    async def one(i: int, user: str) -> None:
        kind = i % 4
        if kind == 0:
            assert await pooled.grant_credits(user, i + 1, "pgbouncer") == i + 1
        elif kind == 1:
            assert await pooled.balance(user) in (0, i)
        elif kind == 2:
            assert await pooled.list_jobs(user) == []
        else:
            capacity = await pooled.capacity()
            assert (capacity.ceiling, capacity.active) == (None, 0)

    await asyncio.gather(*(one(i, users[i // 4]) for i in range(CALLS)))
    dbname = database_name(database_url)
    servers = await db_route.bouncer(database_url).show("SERVERS")
    assert 1 <= len([s for s in servers if s["database"] == dbname]) <= POOL_SIZE < CLIENTS
    assert pooled.backend_pids == set(), "no server process is a pooled connection's own"
    # The pool's own sessions have no lock_timeout: the functions carry it (next tests).
    assert await pooled.pool.fetchval("SHOW lock_timeout") == "0"


@through_pgbouncer
async def test_named_statements_do_not_survive_it(database_url: str, db_route: Route) -> None:
    """The control: asyncpg's statement cache (named statements) breaks through the same
    PgBouncer, so the test above passes because the pool uses none, not by luck."""
    url = db_route.bouncer(database_url).url(database_url)
    pool = await asyncpg.create_pool(url, min_size=CLIENTS, max_size=CLIENTS)
    assert pool is not None
    broken: list[BaseException] = []

    async def one(i: int) -> None:
        try:
            await pool.fetchval("SELECT $1::int + 1", i)
        except (asyncpg.InvalidSQLStatementNameError, asyncpg.DuplicatePreparedStatementError) as e:
            broken.append(e)

    try:
        await asyncio.gather(*(one(i) for i in range(CALLS)))
    finally:
        pool.terminate()
    assert broken, "named statements crossed server connections without an error"


@through_pgbouncer
async def test_a_pool_that_sends_startup_parameters_is_refused_at_once(
    database_url: str, db_route: Route, tmp_path: Path
) -> None:
    """Without AQ_DATABASE_POOLER=transaction the pool sends lock_timeout, which PgBouncer
    refuses: the start ends at once (no retry helps) and says which setting to change."""
    url = db_route.bouncer(database_url).url(database_url)
    with pytest.raises(StartupParametersRefused, match="lock_timeout"):
        await Database.connect(url)
    settings = Settings(
        database_url=url, direct_database_url=database_url, data_dir=tmp_path, instance_id="t"
    )
    started = time.monotonic()
    with pytest.raises(StartupError) as refused:
        await open_database(settings, Dsns(url, database_url))
    assert time.monotonic() - started < settings.startup_timeout_s / 3, "it was retried"
    message = str(refused.value)
    assert "AQ_DATABASE_URL" in message and "AQ_DATABASE_POOLER=transaction" in message, message


@pytest.mark.parametrize("db_route", ROUTES, indirect=True)
async def test_a_held_user_lock_is_a_503_not_a_hang(harness: Harness, db_route: Route) -> None:
    """The bound on a lock wait is the waiting function's own (``SET lock_timeout``), the same
    directly and through PgBouncer, where the session has none. Shortened here, in this test's
    database, so the test waits a moment rather than the production ten seconds."""
    instance = await harness.start_instance()
    await harness.grant("alice", 1)
    holder = await harness.db()
    try:
        await holder.execute(
            "ALTER FUNCTION aq_set_user_limit_v1(text, integer) SET lock_timeout = '300ms'"
        )
        async with holder.transaction():
            await holder.execute("SELECT aq_lock_user_v1('alice')")
            started = time.monotonic()
            put = asyncio.create_task(
                harness.admin("PUT", "/v1/admin/users/alice/limit", {"max_running": 2})
            )
            await wait_until_blocked(harness.database_url, holder.get_server_pid())
            status, body = await put
            took = time.monotonic() - started
    finally:
        await holder.close()
    assert (status, body["code"]) == (503, "database_unavailable"), body
    assert 0.3 <= took < 5, took
    # The lock is free again: the same call goes through.
    assert (await harness.admin("PUT", "/v1/admin/users/alice/limit", {"max_running": 2}))[0] == 200
    if db_route.pooled:
        assert await instance.services.db.pool.fetchval("SHOW lock_timeout") == "0"


@through_pgbouncer
async def test_the_listener_is_direct_and_a_proxied_one_is_reported(
    harness: Harness, db_route: Route
) -> None:
    instance = await harness.start_instance()
    seen = await db_route.assert_routed(harness.database_url, listeners=1)
    assert seen["pgbouncer_servers"] >= 1
    listener = instance.services.listener
    assert listener is not None and listener.healthy
    assert listener._conn is not None and not listener._conn.through_proxy

    url = db_route.bouncer(harness.database_url).url(harness.database_url)
    proxied = await ListenConnection.open(url, lambda _payload, _pid: None, "proxied")
    try:
        assert proxied.through_proxy
    finally:
        await proxied.close()
