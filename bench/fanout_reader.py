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

It stands in for browsers on other machines but shares the service's two cores, so it is kept
light: uvloop, a socket per tab parsed with a few byte searches per frame (0.07-0.08 of a core
during a drain, against 0.14-0.17 with aiohttp's line iterator), the collector off once the
streams are open, and its own loop's lateness reported beside the latencies it measures.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

import orjson
import uvloop
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


class _Tab(asyncio.Protocol):
    """One tab: a ``GET /v1/events`` over a socket of its own, its chunked body parsed here.
    The parsing is a few byte searches per frame (aiohttp's line iterator cost this process
    about 0.15 of a core during a drain, on the same two cores as the service it measures);
    a frame's receipt is the moment its bytes arrived."""

    def __init__(
        self, request: bytes, user: str, tabs: int, out: Deliveries, snapshot: asyncio.Future[None]
    ) -> None:
        self.request = request
        self.user, self.tabs, self.out, self.snapshot = user, tabs, out, snapshot
        self.head: bytearray | None = bytearray()  # None once the headers are in
        self.raw = bytearray()  # chunked bytes not yet taken apart
        self.need: int | None = None  # bytes of the current chunk and its CRLF still to come
        self.body = bytearray()  # the event stream: frames separated by a blank line
        self.closed: asyncio.Future[None] = snapshot.get_loop().create_future()
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        transport.write(self.request)  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.snapshot.done():
            self.snapshot.set_exception(exc or ConnectionError("closed before its snapshot"))
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        now = time.time()
        if self.head is not None:
            body = self._headers(data)
            if body is None:
                return
            data = body
        self._dechunk(data)
        self._frames(now)

    def _headers(self, data: bytes) -> bytes | None:
        """The body's first bytes once the headers are in (None before, or on a refusal)."""
        assert self.head is not None
        self.head += data
        end = self.head.find(b"\r\n\r\n")
        if end < 0:
            return None
        status = bytes(self.head[: self.head.find(b"\r\n")])
        body, self.head = bytes(self.head[end + 4 :]), None
        if status.split()[1:2] != [b"200"]:
            self.snapshot.set_exception(RuntimeError(f"{self.user}: {status.decode()}"))
            assert self.transport is not None
            self.transport.close()
            return None
        return body

    def _dechunk(self, data: bytes) -> None:
        """The chunked transfer encoding undone: whole chunks' bytes go to ``body``."""
        self.raw += data
        while True:
            if self.need is None:
                eol = self.raw.find(b"\r\n")
                if eol < 0:
                    return
                size = int(bytes(self.raw[:eol]).split(b";")[0], 16)
                del self.raw[: eol + 2]
                if size == 0:
                    return
                self.need = size + 2
            if len(self.raw) < self.need:
                return
            self.body += self.raw[: self.need - 2]
            del self.raw[: self.need]
            self.need = None

    def _frames(self, now: float) -> None:
        while (end := self.body.find(b"\n\n")) >= 0:
            frame = bytes(self.body[:end])
            del self.body[: end + 2]
            event = data = b""
            for line in frame.split(b"\n"):
                if line.startswith(b"event: "):
                    event = line[7:]
                elif line.startswith(b"data: "):
                    data = line[6:]
            if event == b"snapshot":
                if not self.snapshot.done():
                    self.snapshot.set_result(None)
            elif data and event not in NOT_EVENTS:
                self.out.got(self.user, data, now, self.tabs)


async def _tab(
    url: str, token: str, user: str, tabs: int, out: Deliveries, snapshot: asyncio.Future[None]
) -> None:
    parts = urlsplit(url)
    request = (
        f"GET {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Authorization: Bearer {token}\r\nAccept: text/event-stream\r\n\r\n"
    ).encode()
    loop = asyncio.get_running_loop()
    transport, tab = await loop.create_connection(
        lambda: _Tab(request, user, tabs, out, snapshot),
        parts.hostname or "127.0.0.1",
        parts.port or 80,
    )
    try:
        await tab.closed
    finally:
        transport.close()


async def main() -> None:
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    spec = orjson.loads(await stdin.readline())
    bases, users, tabs = spec["bases"], spec["users"], spec["tabs"]
    out = Deliveries()
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
                asyncio.create_task(_tab(f"{base}/v1/events", token, user, tabs, out, snapshot))
            )
    pending = set(snapshots)
    while pending:  # a tab that failed to open fails the run
        _done, pending = await asyncio.wait(pending, timeout=1)
        failed = [f for f in [*tasks, *snapshots] if f.done() and f.exception() is not None]
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
    uvloop.run(main())
