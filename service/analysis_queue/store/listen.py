"""The dedicated LISTEN connection: the one connection of an instance outside the pool."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import asyncpg

from analysis_queue import errors
from analysis_queue.store.driver import through_proxy, wrap_errors

JOBS_CHANNEL = "aq_jobs_v2"

# (payload, the server process of the transaction that sent it)
NotifyCallback = Callable[[str, int], None]


class ListenConnection:
    """A dedicated connection LISTENing on the jobs channel.

    Not from the pool: releasing a pooled connection runs ``UNLISTEN *``, and LISTEN must not
    sit behind a transaction-pooling proxy (it is opened on the direct URL; ``through_proxy``
    says when that URL is a proxy after all). It never opens a transaction.
    """

    def __init__(
        self, conn: asyncpg.Connection[Any], lost: asyncio.Event, *, proxied: bool = False
    ) -> None:
        self._conn = conn
        self.lost = lost
        self.through_proxy = proxied

    @classmethod
    async def open(
        cls, dsn: str, on_payload: NotifyCallback, application_name: str
    ) -> ListenConnection:
        lost = asyncio.Event()

        def _on_notify(_c: Any, pid: int, _channel: str, payload: object) -> None:
            on_payload(str(payload), pid)

        def _on_terminate(_c: Any) -> None:
            lost.set()

        with wrap_errors():
            conn = await asyncpg.connect(
                dsn,
                timeout=5,
                server_settings={"application_name": f"{application_name}-listen"[:63]},
            )
        try:
            conn.add_termination_listener(_on_terminate)
            with wrap_errors():
                await conn.add_listener(JOBS_CHANNEL, _on_notify)
                proxied = await through_proxy(conn)
        except BaseException:
            conn.terminate()
            raise
        return cls(conn, lost, proxied=proxied)

    async def ping(self, timeout_s: float) -> None:
        """Raises DatabaseUnavailable when the connection is dead or half-open."""
        if self._conn.is_closed():
            raise errors.DatabaseUnavailable("listener connection closed")
        with wrap_errors():
            await self._conn.fetchval("SELECT 1", timeout=timeout_s)

    def backend_pid(self) -> int:
        return int(self._conn.get_server_pid())

    async def close(self) -> None:
        if self._conn.is_closed():
            return
        try:
            await asyncio.wait_for(self._conn.close(), timeout=2)
        except Exception:
            self._conn.terminate()
