"""The event hub: one instance's in-process fan-out of job events to its stream subscribers.

The instance's one LISTEN connection (``listener.py``) calls :meth:`EventHub.notify` with the
user id of every job change, committed through any instance. The hub keeps a *feed* for each
user who has subscribers here: a cursor (the last event id it fanned out). A wake-up reads that
user's events after the cursor from the database once, encodes each as a Server-Sent Events
frame once, and offers the frames to each of the user's subscribers. The users woken meanwhile
are read together, one statement for up to ``batch_users`` of them (a drain wakes hundreds at
once: one read each would queue them behind each other's round trips). NOTIFY is only the
wake-up; the events come from ``job_events``, whose per-user ids follow commit order, so "after
the cursor" misses nothing. A reconnecting listener and a slow periodic resync catch up on
notifications that were lost.

Bounds. Each subscriber has a bounded buffer; one that is full is dropped (its connection
aborted; the client reconnects with ``Last-Event-ID`` and misses nothing), so a slow reader never
slows the listener, promotion or another subscriber. Streams are capped per user and per
instance (``TooManyStreams``, a 429). Frames carry job summaries, never sources or verdicts, so
a frame's size does not grow with the job's. ``notify`` only schedules; no connection is held
per subscriber. Database reads come in two budgets: live delivery (the feeds' reads) has its
own, so that new streams' catch-up (a snapshot or a replay, one at a time per user, a few at
once in all) never delays another user's events.

"Position changed": a job leaving a user's queue (promoted, cancelled, deleted) moves the
user's other queued jobs up. These moves are not stored: the read of a user's events also reads
the user's queue, and after a batch holding such an event the hub sends one ``position`` frame,
without an id, that lists ``{id, queue_position}`` for each job whose position differs from
what the feed last sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol, TypeVar
from uuid import UUID

import orjson

from analysis_queue import errors
from analysis_queue.metrics import Metrics
from analysis_queue.models import EventKind, EventPage, JobEvent, JobSummary, QueuePosition

log = logging.getLogger(__name__)

# Kinds after which the user's other queued jobs may have moved up.
QUEUE_LEAVING_KINDS = frozenset(
    {EventKind.PROMOTED, EventKind.CANCELLED, EventKind.DELETED, EventKind.CHANGED}
)


class StreamKind(StrEnum):
    """Frames of the stream that are not stored events (those are ``EventKind``)."""

    POSITION = "position"  # a queued job's position moved; no id
    SNAPSHOT = "snapshot"  # every job, when there is nothing to resume; the latest event id


HEARTBEAT = b": keepalive\n\n"
T = TypeVar("T")


@dataclass(frozen=True)
class HubSettings:
    """Buffers and timings of the event streams."""

    buffer_frames: int = 256  # per subscriber; a batch offered to a full one drops it
    heartbeat_s: float = 15.0  # an SSE comment on an idle stream; also finds gone clients
    write_timeout_s: float = 10.0  # a write that cannot drain this long drops the subscriber
    resync_s: float = 15.0  # re-read every feed this often, in case a NOTIFY was lost
    page: int = 500  # events per database read
    page_bytes: int = 1 << 20  # ... and about this many bytes of job summaries
    snapshot_jobs: int = 200  # jobs in a snapshot frame (the rest: GET /v1/analyses?cursor=)
    read_concurrency: int = 4  # live delivery's database reads in flight
    batch_users: int = 500  # users whose events one live read fetches
    catchup_concurrency: int = 2  # new streams' snapshots and replays in flight, in all
    max_streams_per_user: int = 20
    max_streams: int = 5000  # per instance
    retry_ms: int = 2000  # the reconnect delay the stream asks EventSource for
    # A stream ends after this long; the client reconnects with Last-Event-ID and misses
    # nothing. Bounds what one connection holds, and spreads streams over instances again
    # after a deploy.
    max_stream_s: float = 1800.0
    positions_per_frame: int = 500  # entries of one position frame


@dataclass(frozen=True, slots=True)
class Frame:
    """One encoded SSE event. ``event_id`` is None for frames that are not stored events."""

    event_id: int | None
    data: bytes


def encode(event_type: str, payload: dict[str, Any], event_id: int | None = None) -> bytes:
    """An SSE frame. orjson escapes control characters, so ``data`` is one line."""
    head = b"id: %d\n" % event_id if event_id is not None else b""
    return head + b"event: " + event_type.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def event_frame(event: JobEvent) -> Frame:
    payload = {
        "id": event.event_id,
        "kind": event.kind,
        "at": event.created_at.isoformat(),
        "job": event.job.to_json() if event.job is not None else None,
    }
    return Frame(event.event_id, encode(event.kind, payload, event.event_id))


def event_frames(events: Sequence[JobEvent]) -> list[Frame]:
    return [event_frame(e) for e in events]


def position_frames(moves: Sequence[QueuePosition], per_frame: int = 500) -> list[Frame]:
    """The moves as ``position`` frames of at most ``per_frame`` entries each: ids and
    positions, never whole jobs."""
    at = datetime.now(UTC).isoformat()
    frames = []
    for start in range(0, len(moves), per_frame):
        payload = {
            "id": None,
            "kind": StreamKind.POSITION,
            "at": at,
            "positions": [
                {"id": str(m.job_id), "queue_position": m.position}
                for m in moves[start : start + per_frame]
            ],
        }
        frames.append(Frame(None, encode(StreamKind.POSITION, payload)))
    return frames


def snapshot_frame(head: int, jobs: Iterable[JobSummary], next_cursor: str | None) -> Frame:
    """The user's newest jobs as ``GET /v1/analyses`` lists them, and the cursor of the page
    after them (None: these are all)."""
    payload = {
        "id": head,
        "kind": StreamKind.SNAPSHOT,
        "at": datetime.now(UTC).isoformat(),
        "analyses": [j.to_json() for j in jobs],
        "next": next_cursor,
    }
    return Frame(head, encode(StreamKind.SNAPSHOT, payload, head))


ENCODE_INLINE_MAX = 64  # frames to encode on the event loop; more go to a thread


async def encoded(make: Callable[[Sequence[T]], list[Frame]], items: Sequence[T]) -> list[Frame]:
    """``make(items)``, off the event loop when there are many: a large page must not stall
    every other stream and request for the time its JSON takes."""
    if len(items) <= ENCODE_INLINE_MAX:
        return make(items)
    return await asyncio.to_thread(make, items)


class Subscription:
    """One open stream's buffer. The hub offers frames; the stream takes them.

    A plain deque and one future per wait: a drain wakes every stream once per batch, so
    the wake-up is one future's result, not a queue's getter task and timer each time."""

    def __init__(self, user_id: str, buffer_frames: int) -> None:
        self.user_id = user_id
        self._limit = buffer_frames
        self._frames: deque[Frame] = deque()
        self._waiter: asyncio.Future[None] | None = None  # the stream's wait in next()
        self.closed = False
        self.reason: str | None = None
        self.writing = False  # the stream is inside a write to its client
        self.on_abort: Callable[[], None] | None = None  # the stream aborts its connection

    def offer(self, frames: list[Frame]) -> bool:
        """Buffer a batch; False if the buffer is already full (the reader is not keeping up).
        The buffer thus never holds more than ``buffer_frames`` plus one batch."""
        if self.closed:
            return True
        if len(self._frames) >= self._limit:
            return False
        self._frames.extend(frames)
        self._wake()
        return True

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self, reason: str) -> None:
        """Wake the reader and let it end its stream. A reader that is stuck in a write (its
        client does not read) or that overflowed has its connection aborted."""
        if self.closed:
            return
        self.closed = True
        self.reason = reason
        self._frames.clear()
        self._wake()
        if (reason == "overflow" or self.writing) and self.on_abort is not None:
            self.on_abort()

    async def next(self, timeout_s: float) -> list[Frame] | None:
        """Every frame buffered now, waiting up to ``timeout_s`` for the first; ``[]`` on a
        timeout; None once the subscription is closed."""
        if not self._frames and not self.closed:
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            expiry = loop.call_later(timeout_s, _expire, waiter)
            try:
                await waiter
            finally:
                expiry.cancel()
                self._waiter = None
        if self.closed:
            return None
        frames = list(self._frames)
        self._frames.clear()
        return frames


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _Feed:
    """One user's subscribers on this instance and what the hub sent them."""

    def __init__(self, user_id: str) -> None:
        self.user_id = user_id
        self.subs: set[Subscription] = set()
        self.cursor: int | None = None  # last event id fanned out; None until read
        self.ready: asyncio.Future[None] | None = None
        self.dirty = False
        self.pumping = False
        self.positions: dict[UUID, int | None] = {}
        self.catching_up = asyncio.Lock()  # one snapshot or replay at a time for this user


class EventReads(Protocol):
    """The reads of a user's event log and queue that the hub and its streams make
    (``store.database.Database`` is the one used; tests substitute their own)."""

    async def event_head(self, user_id: str) -> int: ...

    async def events_after(
        self, user_id: str, after_id: int, limit: int, max_bytes: int = ...
    ) -> EventPage: ...

    async def events_after_many(
        self, cursors: Mapping[str, int], limit: int, max_bytes: int = ...
    ) -> dict[str, EventPage]: ...

    async def queue_positions(self, user_id: str) -> list[QueuePosition]: ...

    async def list_jobs(
        self, user_id: str, *, before_seq: int | None = None, limit: int = 50
    ) -> list[JobSummary]: ...


class EventHub:
    """``await subscribe(user)`` / ``unsubscribe(sub)``; ``notify(user)`` from the listener."""

    def __init__(self, db: EventReads, settings: HubSettings, metrics: Metrics) -> None:
        self.db = db
        self.settings = settings
        self.metrics = metrics
        self._feeds: dict[str, _Feed] = {}
        self._reads = asyncio.Semaphore(settings.read_concurrency)
        self._catchups = asyncio.Semaphore(settings.catchup_concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self._wanted: dict[str, _Feed] = {}  # feeds to read, in the order they asked
        self._pumps = 0  # pumps running (at most read_concurrency)
        self._resync_task: asyncio.Task[None] | None = None
        self.closed = False
        self._count = 0  # subscribers across feeds
        self.dropped = 0  # subscribers dropped for a full buffer (tests, logs)
        self.batches = 0  # database reads that fanned something out

    # -- subscribers ------------------------------------------------------------------------

    @property
    def subscribers(self) -> int:
        return self._count

    async def subscribe(self, user_id: str) -> Subscription:
        """Register a subscriber. Returns once the user's feed knows its cursor: every event
        committed after that is offered to the subscriber; everything before it is in the
        database for the stream's replay or snapshot, which it reads after this returns."""
        if self.closed:
            raise errors.ShuttingDown()
        feed = self._feeds.get(user_id)
        if feed is not None and len(feed.subs) >= self.settings.max_streams_per_user:
            raise errors.TooManyStreams(
                f"At most {self.settings.max_streams_per_user} event streams per user are open "
                "at once; close one first."
            )
        if self._count >= self.settings.max_streams:
            raise errors.TooManyStreams("This instance has no room for another event stream.")
        sub = Subscription(user_id, self.settings.buffer_frames)
        if feed is None:
            feed = self._feeds[user_id] = _Feed(user_id)
            feed.ready = asyncio.ensure_future(self._init_feed(feed))
            # Retrieved here so a failure no subscriber awaits is not reported as lost.
            feed.ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        feed.subs.add(sub)
        self._count += 1
        self._gauge()
        assert feed.ready is not None
        try:
            await asyncio.shield(feed.ready)
        except BaseException:
            self.unsubscribe(sub)
            raise
        return sub

    async def _init_feed(self, feed: _Feed) -> None:
        async with self._reads:
            feed.cursor = await self.db.event_head(feed.user_id)
        if feed.dirty:
            self.notify(feed.user_id)

    def unsubscribe(self, sub: Subscription) -> None:
        feed = self._feeds.get(sub.user_id)
        if feed is not None and sub in feed.subs:
            feed.subs.discard(sub)
            if not feed.subs:
                del self._feeds[sub.user_id]
            self._count -= 1
            self._gauge()

    def _drop(self, sub: Subscription) -> None:
        self.unsubscribe(sub)
        self.dropped += 1
        sub.close("overflow")
        log.warning(
            "event subscriber dropped: buffer full",
            extra={"action": "events_drop", "user_id": sub.user_id},
        )

    def _gauge(self) -> None:
        self.metrics.event_subscribers.set(self._count)

    # -- wake-ups ---------------------------------------------------------------------------

    def notify(self, user_id: str) -> None:
        """A job of ``user_id`` changed (a NOTIFY). Never blocks; a no-op without subscribers."""
        feed = self._feeds.get(user_id)
        if feed is None:
            return
        feed.dirty = True
        if feed.cursor is not None:  # else _init_feed pumps once the cursor is known
            self._wanted[user_id] = feed
            self._pump_soon()

    def wake_all(self) -> None:
        """Re-read every feed (after the listener reconnected: notifications were lost)."""
        for user_id in list(self._feeds):
            self.notify(user_id)

    def _pump_soon(self) -> None:
        if self.closed or self._pumps >= self.settings.read_concurrency:
            return
        self._pumps += 1
        task = asyncio.create_task(self._pump(), name="events-pump")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _take(self) -> list[_Feed]:
        """Up to ``batch_users`` of the feeds that want a read, oldest wish first, leaving those
        another pump is reading: a feed is in one read at a time, so its frames keep order."""
        taken: list[_Feed] = []
        for user_id, feed in list(self._wanted.items()):
            if len(taken) >= self.settings.batch_users:
                break
            if feed.pumping:
                continue
            del self._wanted[user_id]
            if self._feeds.get(user_id) is not feed:
                continue  # its last subscriber left
            feed.pumping, feed.dirty = True, False
            taken.append(feed)
        return taken

    def _want_again(self, feed: _Feed) -> None:
        feed.dirty = True
        if self._feeds.get(feed.user_id) is feed:
            self._wanted[feed.user_id] = feed

    async def _pump(self) -> None:
        """Read the wanted feeds, a batch at a time, until none is left. A failed read leaves
        its feeds wanted for the next notification or resync (no retry loop here)."""
        try:
            while not self.closed:
                feeds = self._take()
                if not feeds:
                    return
                try:
                    await self._fan_out(await self._read(feeds))
                except Exception as exc:
                    for feed in feeds:
                        self._want_again(feed)
                    extra = {"action": "events_read", "users": len(feeds)}
                    if isinstance(exc, errors.DatabaseUnavailable):
                        log.warning("events: database unavailable", extra=extra)
                    else:
                        log.exception("events: read failed", extra=extra)
                    return
                finally:
                    for feed in feeds:
                        feed.pumping = False
        finally:
            self._pumps -= 1

    async def _read(self, feeds: list[_Feed]) -> list[tuple[_Feed, EventPage]]:
        """The new events of every feed in ``feeds``, with each user's queue, in one statement;
        cursors move past them. A feed whose page was cut is wanted again."""
        async with self._reads:
            pages = await self.db.events_after_many(
                {f.user_id: f.cursor or 0 for f in feeds},
                self.settings.page,
                self.settings.page_bytes,
            )
        read: list[tuple[_Feed, EventPage]] = []
        for feed in feeds:
            page = pages[feed.user_id]
            if page.more:
                self._want_again(feed)  # read on, in the next batch
            if page.events:
                read.append((feed, page))
                feed.cursor = page.events[-1].event_id
        return read

    async def _fan_out(self, read: list[tuple[_Feed, EventPage]]) -> None:
        """The events read as frames to each feed's subscribers, each followed, where the
        user's queue moved, by a ``position`` frame from the queue read with them."""
        if not read:
            return
        every = await encoded(event_frames, [e for _, page in read for e in page.events])
        at = 0
        for feed, page in read:
            events = page.events
            self._offer(feed, every[at : at + len(events)])
            at += len(events)
            for event in events:
                if event.job is not None:
                    feed.positions[event.job.id] = event.job.queue_position
            if any(e.kind in QUEUE_LEAVING_KINDS for e in events):
                queue = [QueuePosition(job, n) for n, job in enumerate(page.queued, 1)]
                moved = self._moved(feed, queue)
                if moved:
                    self._offer(feed, moved)
        self.batches += 1

    def _offer(self, feed: _Feed, frames: list[Frame]) -> None:
        for sub in list(feed.subs):
            if not sub.offer(frames):
                self._drop(sub)

    def _moved(self, feed: _Feed, positions: list[QueuePosition]) -> list[Frame]:
        moved = [p for p in positions if feed.positions.get(p.job_id) != p.position]
        feed.positions = {p.job_id: p.position for p in positions}
        return position_frames(moved, self.settings.positions_per_frame)

    # -- reads for the streams' catch-up ----------------------------------------------------

    @contextlib.asynccontextmanager
    async def catching_up(self, sub: Subscription) -> AsyncIterator[EventReads]:
        """The database for a new stream's snapshot or replay: one at a time for its user, a
        few at once in all, apart from live delivery's reads."""
        feed = self._feeds.get(sub.user_id)
        lock = feed.catching_up if feed is not None else asyncio.Lock()
        async with lock, self._catchups:
            yield self.db

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        if self.settings.resync_s > 0 and (self._resync_task is None or self._resync_task.done()):
            self._resync_task = asyncio.create_task(self._resync(), name="events-resync")

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The resync loop, while it runs (app.py watches it: a dead loop ends the process)."""
        return self._resync_task

    async def _resync(self) -> None:
        while not self.closed:
            await asyncio.sleep(self.settings.resync_s)
            self.resync_once()

    def resync_once(self) -> None:
        """One resync pass: every feed re-reads its user's events (a lost NOTIFY's repair)."""
        try:
            self.wake_all()
        except Exception:
            log.exception("event resync failed", extra={"action": "events_resync"})

    def close(self) -> None:
        """Stop taking subscribers and wake every open stream so that it ends now (shutdown
        would otherwise wait for them until its timeout)."""
        self.closed = True
        for feed in list(self._feeds.values()):
            for sub in list(feed.subs):
                sub.close("shutdown")

    async def stop(self) -> None:
        self.close()
        tasks = set(self._tasks)
        if self._resync_task is not None:
            tasks.add(self._resync_task)
            self._resync_task = None
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
