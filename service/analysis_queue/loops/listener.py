"""The listener: one dedicated LISTEN connection per instance, turning NOTIFY into work.

- A job that became ``pending`` is handed to the dispatcher (claim + release).
- A first-pass job that left ``pending``/``running`` frees its user's slot: the user's next
  queued job is promoted under the user lock, within milliseconds of the commit.
- With the provider ceiling on, any job leaving ``pending``/``running`` frees a global slot and
  a queued job that may wait for capacity may take one: both ask for a promotion pass, which
  gives free slots to whoever's turn it is (``queue/promote.py``).
NOTIFY is only a wake-up: every action re-reads the database under the lock. Notifications sent
while the connection is down are lost for good, so each (re)connect LISTENs first and then asks
the sweep for a catch-up pass. A ping every few seconds notices a half-open connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import orjson

from analysis_queue import errors
from analysis_queue.queue.dispatch import Dispatcher
from analysis_queue.queue.promote import Promoter
from analysis_queue.store.database import Database
from analysis_queue.store.listen import ListenConnection

log = logging.getLogger(__name__)

_FREEING_STATUSES = frozenset({"pending", "running"})


@dataclass(frozen=True)
class ListenerSettings:
    """The LISTEN connection's health checks."""

    ping_interval_s: float = 5.0  # how quickly a silently dead connection is noticed
    ping_timeout_s: float = 3.0
    reconnect_max_s: float = 10.0  # cap of the reconnect backoff


class Listener:
    def __init__(
        self,
        db: Database,
        dispatcher: Dispatcher,
        promoter: Promoter,
        settings: ListenerSettings,
        *,
        on_connected: Callable[[], None] | None = None,
        on_job_change: Callable[[str], None] | None = None,
    ) -> None:
        self.db = db
        self.dispatcher = dispatcher
        self.promoter = promoter
        self.settings = settings
        self.on_connected = on_connected  # the app points this at the sweep's kick()
        self.on_job_change = on_job_change  # the app points this at the event hub's notify()
        self._conn: ListenConnection | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        # Per user, in this notification batch: slots freed (or jobs admitted to wait for one)
        # minus the user's jobs started meanwhile.
        self._freed: dict[str, int] = {}
        self._refresh: set[str] = set()  # of those, users whose waits a pass re-derives
        self._flush_scheduled = False
        self.connected = asyncio.Event()
        self.reconnects = 0
        self.notifications = 0

    @property
    def promotions(self) -> int:
        return self.promoter.promotions

    @property
    def healthy(self) -> bool:
        return self._conn is not None and self.connected.is_set()

    def backend_pid(self) -> int | None:
        return self._conn.backend_pid() if self._conn is not None else None

    # -- notifications ----------------------------------------------------------------------

    def handle_payload(self, payload: str) -> None:
        """Called by asyncpg for each notification; must not block."""
        self.notifications += 1
        self.dispatcher.metrics.notifications.inc()
        try:
            event: dict[str, Any] = orjson.loads(payload)
            job_id = UUID(event["id"])
            user_id = str(event["user_id"])
        except (ValueError, KeyError, TypeError):
            log.warning(
                "unreadable notification", extra={"action": "notify", "payload": payload[:200]}
            )
            return
        written_at = event.get("at")
        if isinstance(written_at, int | float):
            # Both clocks are the same machine's or NTP-synced hosts'; a negative skew reads 0.
            lag = max(0.0, time.time() - float(written_at))
            self.dispatcher.metrics.notification_lag.observe(lag)
        if self.on_job_change is not None:
            self.on_job_change(user_id)  # event streams: schedules a read, never blocks
        new, old = event.get("new"), event.get("old")
        first_pass = not event.get("delta")
        leaves_active = old in _FREEING_STATUSES and (
            new not in _FREEING_STATUSES or event.get("deleted")
        )
        ceiling_on = self.promoter.ceiling_on
        if ceiling_on:
            # A global slot freed, or a job that may wait for one was admitted: a pass decides,
            # unless a commit of the same batch started the user's next job in it. (A change of
            # wait alone needs no pass: the commit that made it frees a slot, or its caller
            # asks for one.)
            if leaves_active or (new == "queued" and old is None):
                self._mark_free(user_id, refresh=bool(leaves_active and first_pass))
        elif first_pass and leaves_active:
            self._mark_free(user_id, refresh=False)
        if new == "pending":
            self.dispatcher.submit(job_id, hint=True)
            if (first_pass or ceiling_on) and self._freed.get(user_id, 0) > 0:
                self._freed[user_id] -= 1  # one of the user's freed slots is filled again

    def _mark_free(self, user_id: str, *, refresh: bool) -> None:
        self._freed[user_id] = self._freed.get(user_id, 0) + 1
        if refresh:
            self._refresh.add(user_id)
        if not self._flush_scheduled:
            # asyncpg queues every notification of one read with call_soon; this runs after
            # all of them, so a finish and the promotion committed with it (its "pending")
            # are seen together and need no second promotion.
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_freed)

    def _flush_freed(self) -> None:
        self._flush_scheduled = False
        freed, self._freed = self._freed, {}
        refresh, self._refresh = self._refresh, set()
        if self.promoter.ceiling_on:
            # One pass for the whole batch; it re-derives the waits of the users whose slot
            # freed (their completion may have been written by something that did not).
            if any(n > 0 for n in freed.values()):
                users: list[str | None] = [u for u, n in freed.items() if n > 0 and u in refresh]
                for user_id in users or [None]:
                    self.promoter.pass_soon(user_id=user_id)  # folds into one pass
            return
        for user_id, still_free in freed.items():
            if still_free > 0:
                self.promoter.slot_freed(user_id)

    # -- connection lifecycle ---------------------------------------------------------------

    async def run_once(self) -> None:
        """Connect, LISTEN, ask for a catch-up, then watch the connection until it dies."""
        self._conn = await ListenConnection.open(
            self.db.dsn, self.handle_payload, self.db.application_name
        )
        try:
            self.connected.set()
            self.dispatcher.metrics.listener_up.set(1)
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
            self.dispatcher.metrics.listener_up.set(0)
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
                self.dispatcher.metrics.listener_reconnects.inc()
                log.warning(
                    "listener connection lost",
                    extra={"action": "listen", "reason": str(exc), "attempt": failures},
                )
            except Exception:
                failures += 1
                self.reconnects += 1
                self.dispatcher.metrics.listener_reconnects.inc()
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
        await self.promoter.stop()

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task
