"""Where the Core simulator keeps its runs in development: a table of its own in the development
database, so that a restart of ``analysis-queue dev`` finds every held run it created (the jobs
that wait for them would otherwise fail as ``core_run_lost``).

The simulator stands in for another system, so its table is not part of the service's schema:
it lives in the schema ``core_simulator``, created on first use and never touched by the
service's migrations. One connection writes it, one statement at a time, each write the run's
whole current state: the last write of a run is always its latest state, so a write lost while
the database was away is made good by the run's next one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import asyncpg

from analysis_queue import errors
from analysis_queue.store.driver import CONNECT_TIMEOUT_S, init_connection, wrap_errors

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE SCHEMA IF NOT EXISTS core_simulator;
CREATE TABLE IF NOT EXISTS core_simulator.runs (
    id     text PRIMARY KEY,
    run_id text NOT NULL UNIQUE,
    run    jsonb NOT NULL
);
"""
_LOAD = "SELECT run FROM core_simulator.runs"
_SAVE = """
INSERT INTO core_simulator.runs (id, run_id, run) VALUES ($1, $2, $3)
ON CONFLICT (id) DO UPDATE SET run = EXCLUDED.run
"""


# A write that finds its connection gone reconnects and writes again, once; while the database
# stays away, a new connection is tried at most this often (doubling up to the maximum), so
# that the simulator's saves fail fast instead of each waiting for a connect timeout.
RECONNECT_BACKOFF_S = 0.1
RECONNECT_BACKOFF_MAX_S = 5.0


class PgRunStore:
    """The simulator's runs in PostgreSQL (``dev/core_sim.RunStore``). Its one connection is opened
    again when it dies (a terminated backend, a database restart)."""

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._conn: asyncpg.Connection[Any] | None = None
        self._lock = asyncio.Lock()
        self._loaded = False
        self._backoff_s = RECONNECT_BACKOFF_S
        self._next_connect = 0.0

    async def load(self) -> list[dict[str, Any]]:
        """Open the store (creating its table) and return every run it keeps."""
        async with self._lock:
            conn = await self._connection()
            with wrap_errors():
                await conn.execute(_SCHEMA)
                runs = [dict(row["run"]) for row in await conn.fetch(_LOAD)]
            self._loaded = True
            return runs

    async def save(self, run: dict[str, Any]) -> None:
        async with self._lock:
            if not self._loaded:
                raise RuntimeError("PgRunStore.load() must be awaited first")
            for attempt in (1, 2):
                conn = await self._connection()
                try:
                    with wrap_errors():
                        await conn.execute(_SAVE, run["id"], run["run_id"], run)
                    return
                except errors.DatabaseUnavailable:
                    if not conn.is_closed() or attempt == 2:
                        raise
                    self._conn = None  # gone under the write: once more, on a new one

    async def _connection(self) -> asyncpg.Connection[Any]:
        if self._conn is not None and not self._conn.is_closed():
            return self._conn
        self._conn = None
        now = time.monotonic()
        if now < self._next_connect:
            raise errors.DatabaseUnavailable("The simulator's store is reconnecting.")
        try:
            with wrap_errors():
                conn = await asyncpg.connect(
                    self._dsn,
                    timeout=CONNECT_TIMEOUT_S,
                    server_settings={"application_name": "aq-core-simulator"},
                )
                await init_connection(conn)
        except (errors.DatabaseUnavailable, asyncpg.PostgresError, OSError, TimeoutError) as exc:
            # Refused (restarting, not accepting connections), unreachable or too slow.
            self._next_connect = now + self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, RECONNECT_BACKOFF_MAX_S)
            raise errors.DatabaseUnavailable(
                f"The simulator's store cannot connect: {exc}"
            ) from exc
        self._backoff_s = RECONNECT_BACKOFF_S
        self._conn = conn
        return conn

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close(timeout=5)
