"""What ``/metrics`` reads from the database: the gauges of open work and of the provider's
capacity, read at most once per ``AQ_METRICS_CACHE_S`` however often, and however many at once,
scrapers ask. A scrape flood costs the database one set of queries per interval."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from analysis_queue import errors
from analysis_queue.metrics import Metrics
from analysis_queue.models import OPEN_STATUSES, Capacity

# How many of the users a promotion may have missed one scrape reads: enough to say "stuck", a
# bounded read however many there are.
STUCK_READ_LIMIT = 1000


class GaugeSource(Protocol):
    """What the gauges read (``store.database.Database``; a fake in the unit tests)."""

    async def open_job_counts(self) -> dict[str, int]: ...

    async def capacity(self) -> Capacity: ...

    async def users_to_promote(self, limit: int) -> list[str]: ...


class DatabaseGauges:
    """The database-backed gauges of :class:`Metrics`, refreshed on demand with a floor on the
    interval between reads. Concurrent scrapes share one read: they queue on the lock and find
    the gauges fresh. A failed read is not retried within the interval either (the scrape
    answers 503 as before, without asking the database again)."""

    def __init__(
        self,
        db: GaugeSource,
        metrics: Metrics,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._db = db
        self._metrics = metrics
        self._interval_s = interval_s
        self._clock = clock
        self._lock = asyncio.Lock()
        self._read_at: float | None = None
        self._failed = False

    async def refresh(self) -> None:
        async with self._lock:
            now = self._clock()
            if self._read_at is not None and now - self._read_at < self._interval_s:
                if self._failed:
                    raise errors.DatabaseUnavailable()
                return
            self._read_at = now  # the floor is between the starts of reads
            try:
                await self._read()
            except errors.DatabaseUnavailable:
                self._failed = True
                raise
            self._failed = False

    async def _read(self) -> None:
        m = self._metrics
        counts = await self._db.open_job_counts()
        for status in OPEN_STATUSES:
            m.jobs.labels(status).set(counts.get(status, 0))
        capacity = await self._db.capacity()
        m.ceiling.set(capacity.ceiling or 0)
        m.slots_in_use.set(capacity.active)
        m.waiting_for_capacity.labels("jobs").set(capacity.jobs_waiting)
        m.waiting_for_capacity.labels("users").set(capacity.users_waiting)
        m.users_stuck.set(len(await self._db.users_to_promote(STUCK_READ_LIMIT)))
