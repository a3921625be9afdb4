"""``GET /v1/events``: the caller's job changes as a Server-Sent Events stream.

A stream first subscribes to the instance's event hub, then catches up from the database, then
forwards the hub's live frames, dropping those it already sent:

- with ``Last-Event-ID`` (header, or ``last_event_id`` in the query): the user's events after
  that id, replayed from ``job_events`` page by page (bounded in events and bytes), then one
  ``position`` frame with every queued job's position;
- without one, or with one older than the kept events (pruned) or unknown: a ``snapshot``
  frame with the user's newest jobs as the first page of ``GET /v1/analyses`` lists them, and
  the cursor of the next page.

A stream's catch-up (the snapshot or the replay) waits its turn: one at a time per user, a few
at once per instance (``EventHub.catching_up``); live frames buffer meanwhile.

Ids are per user, dense and in commit order (``triggers/job_events.sql``): a replay that does
not continue at ``Last-Event-ID + 1`` has lost events to pruning. Live frames are
dropped by the ids the replay actually sent (or those covered by the snapshot), so nothing is
sent twice and nothing is missed.

Auth is the REST API's Bearer JWT. Browsers cannot set headers on an EventSource, so this
route, and only this one, also takes the token as the query parameter ``access_token``. No log
line of ours carries a URL's query; ``logs.RedactTokens`` redacts the token from any that would.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable

from aiohttp import web

from analysis_queue import errors
from analysis_queue.http.paging import split_page
from analysis_queue.http.state import SERVICES
from analysis_queue.loops.hub import (
    HEARTBEAT,
    EventHub,
    Frame,
    Subscription,
    encoded,
    event_frames,
    position_frames,
    snapshot_frame,
)
from analysis_queue.models import QueuePosition

log = logging.getLogger(__name__)

ACCESS_TOKEN_PARAM = "access_token"
MAX_EVENT_ID = 2**63 - 1
WRITE_CHUNK_BYTES = 64 * 1024
_EVENT_ID = re.compile(r"[0-9]{1,19}")  # ASCII digits only (str.isdecimal takes any script's)

routes = web.RouteTableDef()


def _authorization(request: web.Request) -> str | None:
    header = request.headers.get("Authorization")
    if header:
        return header
    token = request.query.get(ACCESS_TOKEN_PARAM)
    return f"Bearer {token}" if token else None


def _last_event_id(request: web.Request) -> int | None:
    """The id to resume after; None (a snapshot) when absent or not one of ours."""
    raw = request.headers.get("Last-Event-ID") or request.query.get("last_event_id")
    if raw is None or _EVENT_ID.fullmatch(raw.strip()) is None:
        return None
    value = int(raw.strip())
    return value if value <= MAX_EVENT_ID else None


class _Stream:
    """One client's stream: catch up, then forward the hub's frames and heartbeats."""

    def __init__(
        self, request: web.Request, response: web.StreamResponse, hub: EventHub, sub: Subscription
    ) -> None:
        self.request = request
        self.response = response
        self.hub = hub
        self.sub = sub
        self.user_id = sub.user_id
        self.floor = 0  # every id up to this one is covered (sent, or in a snapshot)
        self.replayed: set[int] = set()  # ids above the floor that the replay sent
        self.replay_top = 0  # the highest of them
        sub.on_abort = self.abort

    def abort(self) -> None:
        transport = self.request.transport
        if transport is not None:
            transport.abort()

    async def write(self, data: bytes) -> None:
        self.sub.writing = True
        try:
            async with asyncio.timeout(self.hub.settings.write_timeout_s):
                await self.response.write(data)
        except TimeoutError:
            self.abort()
            raise ConnectionResetError("the client does not read") from None
        finally:
            self.sub.writing = False

    async def write_all(self, frames: Iterable[bytes]) -> None:
        """Frames in writes of about WRITE_CHUNK_BYTES: each write's timeout then bounds the
        wait for one chunk to drain, not for a whole replay."""
        chunk: list[bytes] = []
        size = 0
        for frame in frames:
            chunk.append(frame)
            size += len(frame)
            if size >= WRITE_CHUNK_BYTES:
                await self.write(b"".join(chunk))
                chunk, size = [], 0
        if chunk:
            await self.write(b"".join(chunk))

    async def run(self, after: int | None) -> None:
        ends_at = asyncio.get_running_loop().time() + self.hub.settings.max_stream_s
        await self.write(b"retry: %d\n\n" % self.hub.settings.retry_ms)
        if after is None or not await self.replay(after):
            await self.snapshot()
        await self.forward(ends_at)

    async def snapshot(self) -> None:
        limit = self.hub.settings.snapshot_jobs
        async with self.hub.catching_up(self.sub) as db:
            head = await db.event_head(self.user_id)
            rows = await db.list_jobs(self.user_id, limit=limit + 1)
        self.floor, self.replayed = head, set()
        page, cursor = split_page(rows, limit)
        frame = await encoded(lambda jobs: [snapshot_frame(head, jobs, cursor)], page)
        await self.write(frame[0].data)

    async def replay(self, after: int) -> bool:
        """Send the events after ``after``; False if they are not all kept (or ``after`` is
        not an id of this user's), so that a snapshot must stand in for them."""
        settings = self.hub.settings
        async with self.hub.catching_up(self.sub) as db:
            head = await db.event_head(self.user_id)
        if after > head:
            return False
        self.floor = after
        cursor = after
        while cursor < head:
            # The read takes the catch-up budget; the write to this client does not.
            async with self.hub.catching_up(self.sub) as db:
                page = await db.events_after(
                    self.user_id, cursor, settings.page, settings.page_bytes
                )
            events = page.events
            if not events or events[0].event_id != cursor + 1:
                return False  # pruned: older than what is kept
            for event in events:
                if event.event_id != cursor + 1:
                    return False  # a hole left by an interrupted prune
                cursor = self.replay_top = event.event_id
                self.replayed.add(cursor)
            frames = await encoded(event_frames, events)
            await self.write_all(f.data for f in frames)
            if not page.more:
                break
        # Queued jobs the replay did not mention may have moved up meanwhile.
        async with self.hub.catching_up(self.sub) as db:
            positions: list[QueuePosition] = await db.queue_positions(self.user_id)
        await self.write_all(
            f.data for f in position_frames(positions, settings.positions_per_frame)
        )
        return True

    def fresh(self, frame: Frame) -> bool:
        """A live frame not sent yet. Once the live feed is past the replay, the replayed ids
        are summed up by the floor."""
        if frame.event_id is None:
            return True
        if frame.event_id <= self.floor or frame.event_id in self.replayed:
            return False
        if self.replayed and frame.event_id > self.replay_top:
            self.floor, self.replayed = self.replay_top, set()
        return True

    async def forward(self, ends_at: float) -> None:
        heartbeat_s = self.hub.settings.heartbeat_s
        loop = asyncio.get_running_loop()
        while True:
            left = ends_at - loop.time()
            if left <= 0:
                return  # its time is up: the client reconnects with its Last-Event-ID
            frames = await self.sub.next(min(heartbeat_s, left))
            if frames is None:
                return
            transport = self.request.transport
            if transport is None or transport.is_closing():
                return
            if frames:
                await self.write_all(f.data for f in frames if self.fresh(f))
            elif loop.time() < ends_at:
                await self.write(HEARTBEAT)

    async def finish(self) -> None:
        """End the response within a bound: a client that does not read cannot hold up a
        shutdown on the chunked terminator."""
        try:
            async with asyncio.timeout(1.0):
                await self.response.write_eof()
        except TimeoutError:
            self.abort()


@routes.get("/v1/events", allow_head=False)
async def event_stream(request: web.Request) -> web.StreamResponse:
    services = request.app[SERVICES]
    user_id = services.tokens.user(_authorization(request))
    after = _last_event_id(request)
    hub = services.events
    sub = await hub.subscribe(user_id)
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-store",
            "X-Accel-Buffering": "no",  # a buffering proxy would hold the stream back
        }
    )
    stream = _Stream(request, response, hub, sub)
    log.info(
        "event stream opened",
        extra={"action": "events_open", "user_id": user_id, "resume": after is not None},
    )
    try:
        await response.prepare(request)
        await stream.run(after)
        await stream.finish()
    except ConnectionError:
        pass  # the client left, or was dropped for not reading
    except Exception as exc:
        # The headers are out: no problem+json can follow. The client reconnects with its
        # Last-Event-ID and misses nothing.
        if not isinstance(exc, errors.DatabaseUnavailable):
            log.exception("event stream failed", extra={"action": "events", "user_id": user_id})
        stream.abort()
    finally:
        hub.unsubscribe(sub)
        log.info(
            "event stream closed",
            extra={"action": "events_close", "user_id": user_id, "reason": sub.reason or "client"},
        )
    return response
