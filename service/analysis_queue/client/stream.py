"""``GET /v1/events`` followed for as long as the caller reads: every stored event once, in id
order, across disconnects, server restarts and the ends of streams.

A connection ends for many reasons: the service ends each stream after 30 minutes, an instance
restarts or is killed, a proxy drops an idle socket, a read finds no byte (not even the
15-second keepalive) for ``idle_timeout_s``. :class:`EventStream` then reconnects by itself,
after a full-jitter wait whose window starts at the stream's ``retry`` (2 s) and doubles with
each failed attempt up to ``reconnect_max_s`` (never sooner than a ``Retry-After``), and sends
``Last-Event-ID`` so that the service replays what was missed.

Ids are per user, dense and in commit order, so the stream can check what it delivers: an id
it has delivered is dropped (a replay that overlaps), and an id past the next one means a frame
was lost, so it reconnects from the last one it delivered. ``position`` frames (no id) pass
through; a ``snapshot`` (the first frame when there is nothing to resume, or when the events
after ``Last-Event-ID`` are no longer kept) moves the position to its id.

It gives up only on an answer that another try cannot change (a 401 that a fresh token did not
cure, a malformed frame), or, with ``give_up_after_s``, when no connection could be opened for
that long.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import aiohttp
import pydantic

from analysis_queue.client.errors import (
    AnalysisQueueError,
    ConnectionFailed,
    ProtocolError,
    ServiceUnavailable,
    TooManyStreams,
)
from analysis_queue.client.models import Event, PositionEvent, SnapshotEvent, parse_event
from analysis_queue.client.sse import SseEvent, SseParser
from analysis_queue.client.transport import EVENT_STREAM, Transport, connection_failed, error_of

log = logging.getLogger("analysis_queue.client")

DEFAULT_RETRY_S = 2.0  # until the stream's ``retry:`` says otherwise


@dataclass(frozen=True)
class StreamSettings:
    """How an :class:`EventStream` reconnects."""

    reconnect_max_s: float = 30.0  # the widest window a reconnect wait is drawn from
    # No byte for this long (the service sends a keepalive every 15 s): the connection is dead.
    idle_timeout_s: float = 45.0
    # No connection could be opened for this long: raise the last error. None: never give up.
    give_up_after_s: float | None = None


class _Gap(Exception):
    """Internal: an event id past the next one arrived."""

    def __init__(self, last: int, got: int) -> None:
        super().__init__(f"event {got} arrived after {last}")
        self.last, self.got = last, got


# What a reconnect may cure.
_PASSING = (ConnectionFailed, ServiceUnavailable, TooManyStreams, _Gap)


class EventStream:
    """The user's events, as an async iterator that never ends by itself.

    ``last_event_id`` is the id of the last stored event delivered (or the snapshot's): keep it
    to resume in another process with ``client.events(last_event_id=...)``. Use it as an async
    context manager (or call :meth:`aclose`) so that its connection closes when you stop."""

    def __init__(
        self, transport: Transport, last_event_id: int | None, settings: StreamSettings
    ) -> None:
        self.last_event_id = last_event_id
        self.settings = settings
        self.connects = 0  # connections opened (the first one included)
        self.duplicates = 0  # replayed frames dropped because they had been delivered
        self.gaps = 0  # reconnects because a frame was missing
        self._transport = transport
        self._retry_s = DEFAULT_RETRY_S
        self._gen = self._run()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Event:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        await self._gen.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _run(self) -> AsyncGenerator[Event, None]:
        failures = 0  # attempts in a row that opened no stream
        down_since = time.monotonic()
        while True:
            opened = False
            try:
                async with self._open() as resp:
                    opened, failures = True, 0
                    async with contextlib.aclosing(self._events(resp)) as events:
                        async for event in events:
                            yield event
                reason: BaseException | str = "ended"
            except _PASSING as exc:
                if isinstance(exc, ConnectionFailed) and not exc.transient:
                    raise
                reason = exc
            if opened:
                down_since = time.monotonic()
            else:
                failures += 1
            delay = self._reconnect_wait(failures, reason)
            if not opened:
                self._give_up_if_down_too_long(reason, time.monotonic() - down_since + delay)
            self._log_reconnect(failures, reason, delay)
            await _sleep(delay)

    def _give_up_if_down_too_long(self, reason: BaseException | str, down_s: float) -> None:
        """Raise the last error when the next try would come ``give_up_after_s`` or more after
        the stream went down (like ``stop_before_delay``: no wait past the budget)."""
        limit = self.settings.give_up_after_s
        if limit is not None and down_s >= limit and isinstance(reason, AnalysisQueueError):
            raise reason

    def _reconnect_wait(self, failures: int, reason: BaseException | str) -> float:
        window = min(self.settings.reconnect_max_s, self._retry_s * 2 ** min(failures, 16))
        delay = random.uniform(0, window)
        retry_after = getattr(reason, "retry_after_s", None)
        if isinstance(retry_after, int | float):
            delay = max(delay, float(retry_after))
        return delay

    def _log_reconnect(self, failures: int, reason: BaseException | str, delay: float) -> None:
        if isinstance(reason, _Gap):
            self.gaps += 1
        log.info(
            "event stream reconnecting",
            extra={
                "action": "events_reconnect",
                "last_event_id": self.last_event_id,
                "reason": reason if isinstance(reason, str) else type(reason).__name__,
                "detail": str(reason),
                "failures": failures,
                "wait_s": round(delay, 3),
            },
        )

    @contextlib.asynccontextmanager
    async def _open(self) -> AsyncIterator[aiohttp.ClientResponse]:
        t = self._transport
        session = await t.session()
        extra = {"Accept": EVENT_STREAM, "Cache-Control": "no-store"}
        if self.last_event_id is not None:
            extra["Last-Event-ID"] = str(self.last_event_id)
        timeout = aiohttp.ClientTimeout(
            total=None, connect=t.timeout_s, sock_read=self.settings.idle_timeout_s
        )
        request_id = f"events-{self.connects + 1}-{random.getrandbits(48):012x}"

        async def send(token: str) -> aiohttp.ClientResponse:
            try:
                resp = await session.get(
                    t.base_url + "/v1/events",
                    headers=t.headers(token, request_id, extra),
                    timeout=timeout,
                )
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise connection_failed(exc, "events") from exc
            if resp.status != 200:
                try:
                    raise await error_of(resp)
                finally:
                    resp.release()
            if resp.content_type != EVENT_STREAM:
                resp.close()
                raise ProtocolError(f"events: the answer is {resp.content_type}, not a stream")
            return resp

        resp = await t.with_token(send)
        self.connects += 1
        try:
            yield resp
        finally:
            resp.close()  # a stream left half-read cannot go back to the pool

    async def _events(self, resp: aiohttp.ClientResponse) -> AsyncGenerator[Event, None]:
        parser = SseParser()
        try:
            async for chunk in resp.content.iter_any():
                for frame in parser.feed(chunk):
                    event = self._accept(frame)
                    if event is not None:
                        yield event
                if parser.retry_ms is not None:
                    self._retry_s = parser.retry_ms / 1000
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise connection_failed(exc, "events") from exc

    def _accept(self, frame: SseEvent) -> Event | None:
        """The frame as an event to deliver, or None for one already delivered."""
        try:
            event = parse_event(frame.event, frame.data)
        except pydantic.ValidationError as exc:
            raise ProtocolError(f"events: a malformed {frame.event!r} frame: {exc}") from exc
        if isinstance(event, SnapshotEvent):
            self.last_event_id = event.id
            return event
        if isinstance(event, PositionEvent):
            return event
        last = self.last_event_id
        if last is not None and event.id <= last:
            self.duplicates += 1
            return None
        if last is not None and event.id != last + 1:
            raise _Gap(last, event.id)
        self.last_event_id = event.id
        return event


async def _sleep(seconds: float) -> None:
    # One place to wait, so that a test can see the waits without sleeping through them.
    await asyncio.sleep(seconds)
