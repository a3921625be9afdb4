"""A backend terminated under a request (pg_terminate_backend, a failover) costs no request
whose statement is safe to repeat: the statement is sent once more on another connection
(store/database.py, SAFE_TO_REPEAT)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable

import asyncpg
from analysis_queue.store.database import Database
from support import Harness, check_invariants


async def _cut_under(
    h: Harness, app_name: str, load: Callable[[asyncio.Event], Awaitable[None]], query: str
) -> int:
    """Run ``load`` until twelve running statements of the pool ``app_name`` whose text is
    like ``query`` were terminated, one at a time and well apart, so that a request's second
    try lands between two; how many were."""
    stop = asyncio.Event()
    killer_conn = await asyncpg.connect(h.database_url)
    terminated = 0
    running = asyncio.create_task(load(stop))
    try:
        for _ in range(12):
            await asyncio.sleep(0.3)
            for _ in range(2000):  # until one statement is caught running (a few seconds)
                cut = await killer_conn.fetchval(
                    """SELECT count(pg_terminate_backend(pid)) FROM (
                           SELECT pid FROM pg_stat_activity
                            WHERE datname = current_database() AND application_name = $1
                              AND state = 'active' AND pid <> pg_backend_pid()
                              AND query LIKE $2
                            LIMIT 1) s""",
                    app_name,
                    query,
                )
                if cut:
                    terminated += cut
                    break
    finally:
        stop.set()
        await running
        await killer_conn.close()
    return terminated


async def test_a_lost_connection_is_not_the_second_try(database_url: str) -> None:
    """A backend terminated between a statement's prepare and its execute can reach asyncpg
    (0.30) as its FATAL before the socket closes: the execute fails with "cannot switch to state
    12", on a connection still open. The pool hands out the last connection returned first, so
    unless that one is dropped, the second try runs on it and fails the same way (a 503 seen
    in CI). Here the driver's error is raised on the first try: the second runs on another
    connection, and the first one's backend is gone."""
    db = await Database.connect(database_url, min_size=2, max_size=2)
    tried: list[int] = []

    async def statement(conn: asyncpg.pool.PoolConnectionProxy[object]) -> int:
        tried.append(conn.get_server_pid())
        if len(tried) == 1:
            raise asyncpg.InternalClientError(
                "cannot switch to state 12; another operation (2) is in progress"
            )
        return tried[-1]

    try:
        assert await db._send("job_get", statement) == tried[1]
        assert len(tried) == 2 and tried[0] != tried[1], tried
        conn = await asyncpg.connect(database_url)
        try:
            alive = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", tried[0]
            )
            for _ in range(100):  # the terminated backend leaves pg_stat_activity shortly
                if not alive:
                    break
                await asyncio.sleep(0.05)
                alive = await conn.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", tried[0]
                )
        finally:
            await conn.close()
        assert alive == 0
    finally:
        await db.close()


async def test_backends_terminated_under_reads_and_reservations_cost_no_request(
    harness: Harness,
) -> None:
    """Readers page their jobs and read their credits while, twelve times, a statement of the
    instance's pool is terminated as it runs: no answer is a 5xx, and statements were really
    cut under requests."""
    h = harness
    instance = await h.start_instance()
    users = [f"reader-{n}" for n in range(8)]
    for user in users:
        await h.grant(user, 5)
        assert (await h.admit(user, 1))[0] == 201
    statuses: Counter[int] = Counter()

    async def reader(user: str, stop: asyncio.Event) -> None:
        paths = ["/v1/credits", "/v1/analyses", "/v1/analyses?limit=1"]
        n = 0
        while not stop.is_set():
            path = paths[n % len(paths)]
            n += 1
            async with h.http.get(f"{instance.base_url}{path}", headers=h.auth(user)) as r:
                await r.read()
                statuses[r.status] += 1

    async def readers(stop: asyncio.Event) -> None:
        await asyncio.gather(*(reader(u, stop) for u in users for _ in range(3)))

    terminated = await _cut_under(h, instance.services.db.application_name, readers, "%")
    assert terminated >= 8, f"only {terminated} statements were cut: the test proved nothing"
    assert sum(statuses.values()) > 100
    assert set(statuses) == {200}, (statuses, terminated)


async def test_backends_terminated_under_admits_cost_no_click(harness: Harness) -> None:
    """Users click while, twelve times, an admit of the instance's pool is terminated as it
    runs: no click is a 5xx, every 201 names a job that exists once, debited once, and the
    ledger holds. An admit cut before its commit is sent again and admits; one cut after it
    finds its own jobs and answers with them ('repeated', sql/functions/admit.sql)."""
    h = harness
    instance = await h.start_instance()
    users = [f"clicker-{n}" for n in range(6)]
    for user in users:
        await h.grant(user, 1000)
    statuses: Counter[int] = Counter()
    admitted: list[str] = []

    async def clicker(user: str, stop: asyncio.Event) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            status, body = await h.admit(user, n, headers={})
            statuses[status] += 1
            if status == 201:
                admitted.append(body["id"])

    async def clickers(stop: asyncio.Event) -> None:
        await asyncio.gather(*(clicker(u, stop) for u in users for _ in range(2)))

    terminated = await _cut_under(
        h, instance.services.db.application_name, clickers, "%aq_admit_v3%"
    )
    assert terminated >= 8, f"only {terminated} admits were cut: the test proved nothing"
    assert set(statuses) == {201}, (statuses, terminated)
    assert len(admitted) == len(set(admitted)) > 50
    conn = await asyncpg.connect(h.database_url)
    try:
        jobs = await conn.fetchval("SELECT count(*) FROM analysis_jobs")
        debits = await conn.fetchval(
            "SELECT count(*) FROM credit_ledger WHERE kind = 'debit' AND job_id::text = ANY($1)",
            admitted,
        )
    finally:
        await conn.close()
    assert jobs == len(admitted) == debits
    await check_invariants(h.database_url)
