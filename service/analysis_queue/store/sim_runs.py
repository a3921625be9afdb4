"""Where the Core simulator keeps its runs in development: a table of its own in the development
database, so that a restart of ``analysis-queue dev`` finds every held run it created (the jobs
that wait for them would otherwise fail as ``core_run_lost``).

The simulator stands in for another system, so its table is not part of the service's schema:
it lives in the schema ``core_simulator``, created on first use and never touched by the
service's migrations. One connection writes it, one statement at a time, each write the run's
whole current state: the last write of a run is always its latest state.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import asyncpg

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


class PgRunStore:
    """The simulator's runs in PostgreSQL (``core/sim.RunStore``)."""

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._conn: asyncpg.Connection[Any] | None = None
        self._lock = asyncio.Lock()

    async def load(self) -> list[dict[str, Any]]:
        """Open the store (creating its table) and return every run it keeps."""
        with wrap_errors():
            self._conn = await asyncpg.connect(
                self._dsn,
                timeout=CONNECT_TIMEOUT_S,
                server_settings={"application_name": "aq-core-simulator"},
            )
            await init_connection(self._conn)
            await self._conn.execute(_SCHEMA)
            return [dict(row["run"]) for row in await self._conn.fetch(_LOAD)]

    async def save(self, run: dict[str, Any]) -> None:
        async with self._lock:
            if self._conn is None:
                raise RuntimeError("PgRunStore.load() must be awaited first")
            with wrap_errors():
                await self._conn.execute(_SAVE, run["id"], run["run_id"], run)

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close(timeout=5)
