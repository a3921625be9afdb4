"""The database gauges of /metrics (http/scrape.py): one read per interval, shared by the
scrapes that arrive together, and a failed read not retried within the interval."""

from __future__ import annotations

import asyncio

import pytest
from analysis_queue import errors
from analysis_queue.http.scrape import DatabaseGauges
from analysis_queue.metrics import Metrics
from analysis_queue.models import Capacity


class FakeSource:
    def __init__(self) -> None:
        self.reads = 0
        self.queued = 0
        self.down = False
        self.gate: asyncio.Event | None = None

    async def open_job_counts(self) -> dict[str, int]:
        self.reads += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.down:
            raise errors.DatabaseUnavailable()
        return {"queued": self.queued}

    async def capacity(self) -> Capacity:
        return Capacity(ceiling=None, active=0, jobs_waiting=0, users_waiting=0)

    async def users_to_promote(self, limit: int) -> list[str]:
        return []


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _queued(metrics: Metrics) -> float:
    value = metrics.registry.get_sample_value("aq_jobs", {"status": "queued"})
    assert value is not None
    return value


async def test_reads_at_most_once_per_interval() -> None:
    source, clock, metrics = FakeSource(), Clock(), Metrics()
    gauges = DatabaseGauges(source, metrics, interval_s=5.0, clock=clock)
    source.queued = 3
    await gauges.refresh()
    source.queued = 4
    clock.now += 4.9
    await gauges.refresh()
    assert (source.reads, _queued(metrics)) == (1, 3)  # the cached value
    clock.now += 0.1
    await gauges.refresh()
    assert (source.reads, _queued(metrics)) == (2, 4)


async def test_concurrent_scrapes_share_one_read() -> None:
    source, metrics = FakeSource(), Metrics()
    gauges = DatabaseGauges(source, metrics, interval_s=5.0, clock=Clock())
    source.gate = asyncio.Event()
    scrapes = [asyncio.create_task(gauges.refresh()) for _ in range(20)]
    await asyncio.sleep(0)
    source.gate.set()
    await asyncio.gather(*scrapes)
    assert source.reads == 1


async def test_a_failed_read_is_not_retried_within_the_interval() -> None:
    source, clock, metrics = FakeSource(), Clock(), Metrics()
    gauges = DatabaseGauges(source, metrics, interval_s=5.0, clock=clock)
    source.down = True
    for _ in range(3):
        with pytest.raises(errors.DatabaseUnavailable):
            await gauges.refresh()
    assert source.reads == 1
    source.down = False
    clock.now += 5
    await gauges.refresh()
    await gauges.refresh()
    assert source.reads == 2


async def test_interval_zero_reads_every_time() -> None:
    source = FakeSource()
    gauges = DatabaseGauges(source, Metrics(), interval_s=0, clock=Clock())
    for _ in range(3):
        await gauges.refresh()
    assert source.reads == 3
