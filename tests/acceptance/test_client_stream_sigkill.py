"""The Python client's event stream across a SIGKILL and a restart of the instance it was
connected to, with real ``serve`` processes.

Two instances share a database and a ``core-sim``. The client follows its user's stream on
instance ``a`` while another client keeps admitting (and now and then cancelling) jobs through
``b``, so events are written the whole time, also while ``a`` is dead. ``a`` is killed with
SIGKILL and started again on the same port; the stream must reconnect by itself and, in the
end, have delivered every stored event of the user exactly once, in id order. The figures
(events across the outage, reconnect times) are printed (``pytest -s``) as well as asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from analysis_queue.client import (
    AdminClient,
    AnalysisQueueClient,
    Event,
    EventStream,
    JobEvent,
    RetryPolicy,
    SnapshotEvent,
)
from analysis_queue.http.auth import mint_token
from procs import SECRETS, SERVICE_ENV, Node, Proc, base_env, cli
from support import fetchval, free_port

pytestmark = pytest.mark.acceptance

USER = "stream-user"
LOAD_PERIOD_S = 0.08
PATIENT = RetryPolicy(attempts=10, within_s=30)


@dataclass
class Cluster:
    dsn: str
    tmp: Path
    http: aiohttp.ClientSession
    sim_port: int = field(default_factory=free_port)
    nodes: dict[str, Node] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)

    async def start(self) -> None:
        self.nodes = {name: Node(name, free_port()) for name in ("a", "b")}
        callbacks = [
            arg
            for n in self.nodes.values()
            for arg in ("--callback-url", f"{n.base}/v1/core/events")
        ]
        args = cli("core-sim", "--port", str(self.sim_port), "--judge-time", "0.2", *callbacks)
        sim = Proc("core-sim", args, base_env(self.tmp), self.tmp / "core-sim.log")
        self.procs.append(sim)
        await self.ready(f"http://127.0.0.1:{self.sim_port}/_sim/runs", sim)
        for node in self.nodes.values():
            await self.start_node(node)

    async def start_node(self, node: Node) -> float:
        """Start ``node``; when it answered ready (monotonic)."""
        node.starts += 1
        env = base_env(
            self.tmp,
            **SERVICE_ENV,
            AQ_DATABASE_URL=self.dsn,
            AQ_CORE_URL=f"http://127.0.0.1:{self.sim_port}",
            AQ_PORT=str(node.port),
            AQ_INSTANCE_ID=f"stream-{node.name}{node.starts}",
        )
        name = f"serve-{node.name}{node.starts}"
        node.proc = Proc(name, cli("serve"), env, self.tmp / f"{name}.log")
        self.procs.append(node.proc)
        return await self.ready(f"{node.base}/readyz", node.proc)

    async def ready(self, url: str, proc: Proc) -> float:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.alive, f"{proc.name} exited:\n{proc.text()[-3000:]}"
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with self.http.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return time.monotonic()
            await asyncio.sleep(0.05)
        raise AssertionError(f"{proc.name} not ready:\n{proc.text()[-3000:]}")

    async def head(self) -> int:
        return int(
            await fetchval(
                self.dsn,
                "SELECT coalesce((SELECT last_id FROM job_event_counters WHERE user_id = $1), 0)",
                USER,
            )
        )

    async def open_jobs(self) -> int:
        return int(
            await fetchval(
                self.dsn,
                "SELECT count(*) FROM analysis_jobs WHERE user_id = $1 "
                "AND status IN ('queued', 'pending', 'running')",
                USER,
            )
        )


@pytest.fixture
async def cluster(database_url: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    async with aiohttp.ClientSession() as http:
        c = Cluster(database_url, tmp_path, http)
        try:
            await c.start()
            yield c
        finally:
            for proc in c.procs:
                proc.kill()


@dataclass
class Reader:
    """Reads the stream in the background: each event, and when each connection opened."""

    stream: EventStream
    events: list[Event] = field(default_factory=list)
    connected_at: list[float] = field(default_factory=list)

    async def run(self) -> None:
        watcher = asyncio.create_task(self._watch_connects())
        try:
            async for event in self.stream:
                self.events.append(event)
        finally:
            watcher.cancel()

    async def _watch_connects(self) -> None:
        while True:
            if self.stream.connects > len(self.connected_at):
                self.connected_at.append(time.monotonic())
            await asyncio.sleep(0.005)

    def job_ids(self) -> list[int]:
        return [e.id for e in self.events if isinstance(e, JobEvent)]


async def _load(aq: AnalysisQueueClient, stop: asyncio.Event, counts: dict[str, int]) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        job = await aq.start_analysis(f"Thesis {n}", "https://u.example/t.pdf", [f"10.1000/s{n}"])
        counts["admitted"] += 1
        if n % 4 == 0:
            await aq.delete_analysis(job.id)  # cancels it first unless it ended
            counts["cancelled"] += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), LOAD_PERIOD_S)


async def _until(what: str, check: Any, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_the_stream_survives_a_sigkill_and_restart_of_its_instance(cluster: Cluster) -> None:
    c = cluster
    a, b = c.nodes["a"], c.nodes["b"]
    token = mint_token(USER, SECRETS["AQ_JWT_SECRET"])
    async with AdminClient(b.base, SECRETS["AQ_ADMIN_TOKEN"]) as admin:
        await admin.grant_credits(USER, 10_000)
    follower = AnalysisQueueClient(a.base, token)
    writer = AnalysisQueueClient(b.base, token, retry=PATIENT)
    async with follower, writer, follower.events() as stream:
        reader = Reader(stream)
        reading = asyncio.create_task(reader.run())

        async def snapshot_read() -> bool:  # the stream is open before the first click
            return bool(reader.events)

        await _until("the stream's snapshot", snapshot_read)
        stop, counts = asyncio.Event(), {"admitted": 0, "cancelled": 0}
        loading = asyncio.create_task(_load(writer, stop, counts))

        async def some_delivered() -> bool:
            return len(reader.job_ids()) >= 10

        await _until("ten events on the stream", some_delivered)

        assert a.proc is not None
        old_pid = a.proc.popen.pid
        last_before = stream.last_event_id or 0
        a.proc.send(signal.SIGKILL)
        killed_at = time.monotonic()
        assert await a.proc.wait_exit(10) == -signal.SIGKILL
        await asyncio.sleep(1.0)  # the load goes on through b: events the stream must catch up
        restarted_at = await c.start_node(a)
        assert a.proc.popen.pid != old_pid
        head_at_restart = await c.head()

        async def reconnected() -> bool:
            return len(reader.connected_at) >= 2

        await _until("the stream reconnected", reconnected)
        await asyncio.sleep(1.0)  # and more events after the reconnect
        stop.set()
        await loading

        async def settled() -> bool:
            return await c.open_jobs() == 0

        await _until("every job ended", settled, 60)
        head = await c.head()

        async def caught_up() -> bool:
            return stream.last_event_id == head

        await _until(f"event {head} delivered", caught_up)
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading

    ids = reader.job_ids()
    assert isinstance(reader.events[0], SnapshotEvent) and reader.events[0].id == 0
    assert ids == list(range(1, head + 1)), "an event lost, repeated or out of order"
    across = head_at_restart - last_before
    assert across > 0, "no event was written while the stream's instance was dead"
    reconnect_s = reader.connected_at[1] - killed_at
    after_ready_s = reader.connected_at[1] - restarted_at
    print(
        f"\nstream across SIGKILL: {len(ids)} events delivered once each, in order "
        f"({counts['admitted']} admits, {counts['cancelled']} cancels through b); "
        f"{across} written while a was down (kill to ready {restarted_at - killed_at:.2f}s); "
        f"reconnected {reconnect_s:.2f}s after the kill, {after_ready_s:.2f}s after a was "
        f"ready; {stream.connects} connections, {stream.duplicates} replayed duplicates dropped, "
        f"{stream.gaps} gaps"
    )
    assert stream.gaps == 0
