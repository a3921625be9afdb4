"""The fan-out benchmark's dashboards (``bench/run.py --only fanout``), in a process of their own
so that reading thousands of streams does not share an event loop with the load it measures.

Reads a JSON spec on stdin's first line: ``{"bases": [...], "users": [...], "tabs": 5,
"secret": ...}``. Opens ``tabs`` streams (``GET /v1/events``) per user, a user's tabs spread
over the instances in turn, and prints ``ready <streams>`` once each has its snapshot. Then
records, for every stored event, when each tab received it. On ``stop <events> <paced> <idle>``
(stdin) it waits until that many events reached every tab (at most 30 s), prints one JSON line
of results, the events before ``paced`` (epoch seconds: the drain), from then to ``idle`` and
after it apart, and exits.

Latency is the receipt (this machine's clock) minus the event's ``at`` (``job_events.created_at``,
``clock_timestamp()`` in the trigger, a moment before its transaction commits): a little more
than commit to delivery, never less.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from datetime import datetime
from typing import Any

import aiohttp
import orjson
from analysis_queue.http.auth import mint_token

NOT_EVENTS = (b"snapshot", b"position")
LAG_TICK_S = 0.01


class Lag:
    """How late this process's own event loop runs: a tick every LAG_TICK_S, and how much
    later than asked each one woke. A delivery is timed on receipt here, so a late loop adds
    its lateness to every latency it measures; this says how much of them is the reader's."""

    def __init__(self) -> None:
        self.ticks: list[tuple[float, float]] = []  # (epoch seconds, lateness in seconds)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time() + LAG_TICK_S
            await asyncio.sleep(LAG_TICK_S)
            self.ticks.append((time.time(), max(0.0, loop.time() - asked)))

    def summary(self, since: float, until: float) -> dict[str, float]:
        late = sorted(x for t, x in self.ticks if since <= t < until)
        if not late:
            return {"p50": 0.0, "p99": 0.0, "max": 0.0}
        return {
            "p50": late[len(late) // 2] * 1000,
            "p99": late[min(len(late) - 1, int(0.99 * len(late)))] * 1000,
            "max": late[-1] * 1000,
        }


class Deliveries:
    """Per (user, event id): the event's ``at``, how many tabs got it, the first and last."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, int], list[Any]] = {}
        self.complete = 0
        self.frames = 0

    def got(self, user: str, payload: bytes, now: float, tabs: int) -> None:
        self.frames += 1
        d = orjson.loads(payload)
        key = (user, d["id"])
        entry = self.seen.get(key)
        if entry is None:
            self.seen[key] = entry = [d["at"], 0, now, now]
        entry[1] += 1
        entry[3] = now
        if entry[1] == tabs:
            self.complete += 1

    def summary(self, tabs: int, since: float = 0.0, until: float = float("inf")) -> dict[str, Any]:
        """Latencies of the events whose ``at`` falls in [since, until)."""
        every: list[float] = []
        first: list[float] = []
        for at, count, t_first, t_last in self.seen.values():
            t_at = datetime.fromisoformat(at).timestamp()
            if not since <= t_at < until:
                continue
            first.append(t_first - t_at)
            if count == tabs:
                every.append(t_last - t_at)

        def pct(values: list[float], p: float) -> float:
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] if values else 0

        return {
            "events": len(first),
            "reached_every_tab": len(every),
            "every_tab_ms": {
                "p50": pct(every, 50) * 1000,
                "p99": pct(every, 99) * 1000,
                "max": max(every, default=0) * 1000,
            },
            "first_tab_ms": {"p50": pct(first, 50) * 1000, "p99": pct(first, 99) * 1000},
        }


async def _tab(
    http: aiohttp.ClientSession,
    url: str,
    token: str,
    user: str,
    tabs: int,
    out: Deliveries,
    snapshot: asyncio.Future[None],
) -> None:
    headers = {"Authorization": f"Bearer {token}", "Accept": "text/event-stream"}
    async with http.get(url, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: {r.status} {await r.text()}")
        event = b""
        async for line in r.content:
            if line.startswith(b"event: "):
                event = line[7:-1]
            elif line.startswith(b"data: "):
                if event == b"snapshot":
                    if not snapshot.done():
                        snapshot.set_result(None)
                elif event not in NOT_EVENTS:
                    out.got(user, line[6:], time.time(), tabs)


async def main() -> None:
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    spec = orjson.loads(await stdin.readline())
    bases, users, tabs = spec["bases"], spec["users"], spec["tabs"]
    out = Deliveries()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        snapshots: list[asyncio.Future[None]] = []
        tasks = []
        n = 0
        for user in users:
            token = mint_token(user, spec["secret"])
            for _ in range(tabs):
                base = bases[n % len(bases)]
                n += 1
                snapshot: asyncio.Future[None] = loop.create_future()
                snapshots.append(snapshot)
                tasks.append(
                    asyncio.create_task(
                        _tab(http, f"{base}/v1/events", token, user, tabs, out, snapshot)
                    )
                )
        pending = set(snapshots)
        while pending:  # a tab that failed to open fails the run
            _done, pending = await asyncio.wait(pending, timeout=1)
            failed = [t for t in tasks if t.done() and t.exception() is not None]
            if failed:
                raise failed[0].exception()  # type: ignore[misc]
        # This one process stands in for 5,000 browsers on as many machines: a collection of
        # its heap (every tab's objects, every delivery recorded) stalls all of them at once
        # and would add its pause to the latencies measured (a run collected generation 2
        # seven times, up to 400 ms each). What it allocates from here on is a few records
        # per event: it stays out of the collector for the measurement.
        gc.collect()
        gc.freeze()
        gc.disable()
        print(f"ready {len(tasks)}", flush=True)
        lag = Lag()
        lag_task = asyncio.create_task(lag.run())
        command = (await stdin.readline()).split()
        expected = int(command[1])
        deadline = time.monotonic() + 30
        while out.complete < expected and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        paced_from, idle_from = float(command[2]), float(command[3])
        lag_task.cancel()
        drain_from = lag.ticks[0][0] if lag.ticks else 0.0
        result = {
            "streams": len(tasks),
            "expected_events": expected,
            "frames_received": out.frames,
            **out.summary(tabs, until=paced_from),  # the drain
            "paced": out.summary(tabs, since=paced_from, until=idle_from),
            "idle": out.summary(tabs, since=idle_from),  # single clicks, a quiet machine
            "reader_lag_ms": {
                "drain": lag.summary(drain_from, paced_from),
                "paced": lag.summary(paced_from, idle_from),
                "idle": lag.summary(idle_from, float("inf")),
            },
        }
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    print(orjson.dumps(result).decode(), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
