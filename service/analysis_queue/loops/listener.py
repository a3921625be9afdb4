"""The listener: one dedicated LISTEN connection per instance, turning NOTIFY into wake-ups.

The connection goes to the direct database URL (``AQ_DIRECT_DATABASE_URL``), never through a
transaction pooler: LISTEN belongs to a session.

Every committed transaction that changed jobs notifies once (triggers/job_notify.sql), whichever
instance or writer made it. The listener turns each notification into wake-ups for the users it
names and nothing more: ``on_notice(notice, own)``, a typed ``ChangeNotice`` and whether this
instance committed it, which the application hands to the event hub (read those users' new
events) and the promoter (fill what their changes may have left to fill, read from the
database). NOTIFY is a hint, never the source
of truth. Notifications sent while the connection is down are lost for good, so each
(re)connect LISTENs first and then asks for a catch-up (``on_connected``: the sweep and the hub
re-read). A ping every few seconds notices a half-open connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

import pydantic

from analysis_queue import errors
from analysis_queue.metrics import Metrics
from analysis_queue.models import ChangeNotice
from analysis_queue.store.listen import ListenConnection

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ListenerSettings:
    """The LISTEN connection's health checks."""

    ping_interval_s: float = 5.0  # how quickly a silently dead connection is noticed
    ping_timeout_s: float = 3.0
    reconnect_max_s: float = 10.0  # cap of the reconnect backoff


class ListenTarget(Protocol):
    """Where the listener connects, and whose commits are this instance's own
    (``store.database.Database``; tests substitute their own)."""

    @property
    def direct_dsn(self) -> str: ...

    @property
    def application_name(self) -> str: ...

    @property
    def backend_pids(self) -> Collection[int]: ...


class Listener:
    def __init__(
        self,
        db: ListenTarget,
        settings: ListenerSettings,
        metrics: Metrics,
        *,
        on_notice: Callable[[ChangeNotice, bool], None],
        on_connected: Callable[[], None] | None = None,
    ) -> None:
        self.db = db
        self.settings = settings
        self.metrics = metrics
        self.on_notice = on_notice
        self.on_connected = on_connected
        self._conn: ListenConnection | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self.connected = asyncio.Event()
        self.reconnects = 0
        self.notifications = 0

    @property
    def healthy(self) -> bool:
        return self._conn is not None and self.connected.is_set()

    def backend_pid(self) -> int | None:
        return self._conn.backend_pid() if self._conn is not None else None

    def handle_payload(self, payload: str, sender_pid: int | None = None) -> None:
        """Called by asyncpg for each notification; must not block. ``sender_pid`` is the server
        process whose transaction sent it: one of this instance's pool means this instance
        committed the change (``own``)."""
        self.notifications += 1
        self.metrics.notifications.inc()
        try:
            notice = ChangeNotice.model_validate_json(payload)
        except pydantic.ValidationError:
            log.warning(
                "unreadable notification", extra={"action": "notify", "payload": payload[:200]}
            )
            return
        if notice.at is not None:
            # Both clocks are the same machine's or NTP-synced hosts'; a negative skew reads 0.
            self.metrics.notification_lag.observe(max(0.0, time.time() - notice.at))
        self.on_notice(notice, sender_pid in self.db.backend_pids)

    # -- connection lifecycle ---------------------------------------------------------------

    async def run_once(self) -> None:
        """Connect, LISTEN, ask for a catch-up, then watch the connection until it dies."""
        self._conn = await ListenConnection.open(
            self.db.direct_dsn, self.handle_payload, self.db.application_name
        )
        try:
            if self._conn.through_proxy:
                # Through a transaction pooler LISTEN goes to whichever server process runs it
                # and is never heard of again, while the pings keep succeeding.
                log.warning(
                    "the LISTEN connection goes through a proxy: it needs a direct connection "
                    "to PostgreSQL (or a session-mode pooler); check AQ_DIRECT_DATABASE_URL",
                    extra={"action": "listen"},
                )
            self.connected.set()
            self.metrics.listener_up.set(1)
            log.info("listening", extra={"action": "listen", "backend_pid": self.backend_pid()})
            if self.on_connected is not None:
                self.on_connected()
            while not self._stopping.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(
                        self._wait_lost_or_stopping(), timeout=self.settings.ping_interval_s
                    )
                if self._stopping.is_set():
                    return
                await self._conn.ping(self.settings.ping_timeout_s)
        finally:
            self.connected.clear()
            self.metrics.listener_up.set(0)
            conn, self._conn = self._conn, None
            await conn.close()

    async def _wait_lost_or_stopping(self) -> None:
        assert self._conn is not None
        lost = asyncio.create_task(self._conn.lost.wait())
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            await asyncio.wait({lost, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            stopping.cancel()
        if self._conn.lost.is_set():
            raise errors.DatabaseUnavailable("listener connection terminated")

    async def _run(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            try:
                await self.run_once()
                failures = 0
            except (errors.DatabaseUnavailable, OSError) as exc:
                failures += 1
                self.reconnects += 1
                self.metrics.listener_reconnects.inc()
                log.warning(
                    "listener connection lost",
                    extra={"action": "listen", "reason": str(exc), "attempt": failures},
                )
            except Exception:
                failures += 1
                self.reconnects += 1
                self.metrics.listener_reconnects.inc()
                log.exception("listener failed", extra={"action": "listen"})
            if self._stopping.is_set():
                break
            # Full jitter, capped: a restarted database is not hammered by every instance.
            delay = random.uniform(0, min(self.settings.reconnect_max_s, 0.1 * 2**failures))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=delay)

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._stopping.clear()
            self._task = asyncio.create_task(self._run(), name="listener")

    async def stop(self) -> None:
        self._stopping.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._task, timeout=5)
            self._task = None

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task
