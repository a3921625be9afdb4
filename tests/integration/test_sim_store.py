"""The development simulator's run store (dev/sim_runs.py) outlives its connection: a
terminated backend or a database that is away for a while costs at most the writes made while
it was away, and a restart finds every run written after it came back."""

from __future__ import annotations

import asyncio
import time

import pytest
from analysis_queue import errors
from analysis_queue.dev.sim_runs import RECONNECT_BACKOFF_MAX_S, PgRunStore
from support import fetchval

APP = "aq-core-simulator"


def _run(n: int, state: str = "held") -> dict[str, object]:
    return {"id": f"core-{n}", "run_id": f"run-{n}", "state": state}


async def _terminate_store_backend(dsn: str, database: str) -> int:
    """The store's backends on ``database``, terminated (from ``dsn``): how many there were."""
    return int(
        await fetchval(
            dsn,
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = $1 AND application_name = $2",
            database,
            APP,
        )
    )


async def _saved_after_restart(dsn: str) -> dict[str, object]:
    restarted = PgRunStore(dsn)
    try:
        return {run["id"]: run["state"] for run in await restarted.load()}
    finally:
        await restarted.close()


async def test_a_terminated_backend_costs_no_write(database_url: str) -> None:
    store = PgRunStore(database_url)
    try:
        assert await store.load() == []
        await store.save(_run(1))
        name = await fetchval(database_url, "SELECT current_database()")
        assert await _terminate_store_backend(database_url, name) == 1
        await store.save(_run(1, "judging"))  # found the connection gone, wrote again
        await store.save(_run(2))
    finally:
        await store.close()
    assert await _saved_after_restart(database_url) == {"core-1": "judging", "core-2": "held"}


async def test_while_the_database_is_away_writes_fail_fast_and_resume_after(
    database_url: str, pg_server: str
) -> None:
    store = PgRunStore(database_url)
    name = await fetchval(database_url, "SELECT current_database()")
    admin = pg_server  # the server's own database: the test's refuses connections a while
    try:
        await store.load()
        await store.save(_run(1))
        await fetchval(admin, f"ALTER DATABASE {name} ALLOW_CONNECTIONS false")
        assert await _terminate_store_backend(admin, name) == 1
        with pytest.raises(errors.DatabaseUnavailable):
            await store.save(_run(1, "judging"))  # lost: the run's next write makes it good
        started = time.monotonic()
        with pytest.raises(errors.DatabaseUnavailable, match="reconnecting"):
            await store.save(_run(2))  # within the backoff: no connect attempt at all
        assert time.monotonic() - started < 1
    finally:
        await fetchval(admin, f"ALTER DATABASE {name} ALLOW_CONNECTIONS true")

    async def saved() -> None:
        # The backoff doubles from its start, bounded: the first write after it has passed
        # reconnects.
        deadline = time.monotonic() + RECONNECT_BACKOFF_MAX_S + 10
        while True:
            try:
                await store.save(_run(2))
                return
            except errors.DatabaseUnavailable:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)

    try:
        await saved()
        await store.save(_run(1, "succeeded"))
    finally:
        await store.close()
    assert await _saved_after_restart(database_url) == {"core-1": "succeeded", "core-2": "held"}
