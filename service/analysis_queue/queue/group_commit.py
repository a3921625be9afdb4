"""Group commit: one statement for every caller that asked while the previous one ran.

A caller ``await``s ``submit(key)`` and gets back what the statement returned for its key. When
nothing is in flight, the keys submitted in the same turn of the event loop go out together at
once; while a statement is in flight, new keys wait for it and then go out together in the next.
Idle, a caller waits one loop turn more than a statement of its own would take. Under load, N
callers cost one round trip and one commit instead of N, and one turn at PostgreSQL's NOTIFY
commit lock, which every notifying commit in the cluster takes in turn.

A failed statement fails every caller of its batch with the same exception and nobody else's.
A caller may bound its wait for a place in a statement (``queue_timeout_s``): past it, if its key
is still waiting (nothing was written for it), it gets :class:`QueueTimeout`; once its key is in
a statement being written it waits for that statement's answer, which is bounded by the
statement's own timeout, so that a caller never learns less than what was written for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Generic, TypeVar

from analysis_queue import errors, tracing

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext

log = logging.getLogger(__name__)

# How long a decision's statement may be in flight before the keys behind it go out beside it:
# about one other batch's commit, the longest a user's lock is held but by a stuck holder.
STALLED_AFTER_S = 0.05

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class QueueTimeout(Exception):
    """A key waited for a place in a statement longer than its caller allowed; nothing was
    written for it."""


class GroupCommit(Generic[K, V]):
    """``flush(keys) -> {key: value}`` for batches of at most ``max_batch`` keys, one at a time.
    ``submit(key)`` returns the value for its key, or None when the flush returned none.

    With ``stalled_after_s``, a statement still in flight that long is taken to be waiting for
    a lock someone else holds (a user's, in the decisions), and the keys waiting behind it go out
    in a statement of their own beside it, up to ``max_in_flight`` statements in all: one
    user's lock holder then delays the clicks of its batch, not every click after them."""

    def __init__(
        self,
        flush: Callable[[list[K]], Awaitable[Mapping[K, V]]],
        *,
        name: str = "batch",
        max_batch: int = 256,
        on_batch: Callable[[int], None] | None = None,
        stalled_after_s: float | None = None,
        max_in_flight: int = 4,
    ) -> None:
        if max_batch < 1 or max_in_flight < 1:
            raise ValueError("max_batch and max_in_flight must be at least 1")
        self._flush = flush
        self._span_name = f"group commit {name}"  # its span, when tracing
        self._on_batch = on_batch  # called with each written batch's size (metrics)
        self._max_batch = max_batch
        self._stalled_after_s = stalled_after_s
        self._max_in_flight = max_in_flight
        # Each key, its caller's future, and its caller's span when tracing.
        self._waiting: list[tuple[K, asyncio.Future[V | None], SpanContext | None]] = []
        self._flusher: asyncio.Task[None] | None = None  # the one that loops while keys wait
        self._beside: set[asyncio.Task[None]] = set()  # one statement each, beside a stalled one
        self._started: dict[asyncio.Task[None], float] = {}  # statement in flight -> since
        self._timer: asyncio.TimerHandle | None = None
        self.batches = 0  # counters, for tests and the benchmark notes
        self.keys = 0

    async def submit(self, key: K, *, queue_timeout_s: float | None = None) -> V | None:
        future: asyncio.Future[V | None] = asyncio.get_running_loop().create_future()
        entry = (key, future, tracing.current())
        self._waiting.append(entry)
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._run(), name="group-commit")
        else:
            self._watch()
        if queue_timeout_s is None:
            return await future
        try:
            return await asyncio.wait_for(asyncio.shield(future), queue_timeout_s)
        except TimeoutError:
            if entry in self._waiting:  # still waiting for a statement: none will be written
                self._waiting.remove(entry)
                future.cancel()
                raise QueueTimeout() from None
            return await future  # in the statement being written: its answer is coming

    def _watch(self) -> None:
        """Keys wait behind statements in flight: once the newest of those has been in flight
        for ``stalled_after_s``, send the waiting keys beside it."""
        if self._stalled_after_s is None or self._timer is not None or not self._started:
            return
        if len(self._started) >= self._max_in_flight:
            return
        loop = asyncio.get_running_loop()
        due = max(self._started.values()) + self._stalled_after_s
        self._timer = loop.call_at(due, self._stalled)

    def _stalled(self) -> None:
        self._timer = None
        stall = self._stalled_after_s
        if stall is None or not self._waiting or len(self._started) >= self._max_in_flight:
            return
        loop = asyncio.get_running_loop()
        if self._started and loop.time() < max(self._started.values()) + stall:
            self._watch()  # a newer statement went out meanwhile: it is not stalled yet
            return
        task = asyncio.create_task(self._write_one(), name="group-commit-beside")
        self._beside.add(task)
        task.add_done_callback(self._beside.discard)

    async def _run(self) -> None:
        try:
            while self._waiting:
                await self._write_one()
        finally:
            self._flusher = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            for _, future, _ in self._waiting:  # only when cancelled mid-way
                future.cancel()
            self._waiting.clear()

    async def _write_one(self) -> None:
        """Take the next batch of waiting keys and write it."""
        batch = self._waiting[: self._max_batch]
        del self._waiting[: self._max_batch]
        # A caller cancelled while it waited (a dispatch cut short at shutdown) wants nothing
        # written for it any more.
        batch = [entry for entry in batch if not entry[1].done()]
        if not batch:
            return
        task = asyncio.current_task()
        assert task is not None
        self._started[task] = asyncio.get_running_loop().time()
        if self._waiting:
            self._watch()
        # Traced, the batch is a child of its first caller's span and links the others'.
        callers = [caller for _, _, caller in batch if caller is not None]
        try:
            with tracing.span(
                self._span_name,
                parent=callers[0] if callers else None,
                links=callers[1:],
                attributes={"aq.batch.size": len(batch)} if tracing.active() else None,
            ):
                found = await self._flush([key for key, _, _ in batch])
        except BaseException as exc:
            for _, future, _ in batch:
                if not future.done():
                    if isinstance(exc, asyncio.CancelledError):
                        future.cancel()
                    else:
                        future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            del self._started[task]
        for key, future, _ in batch:
            if not future.done():  # its caller may have been cancelled meanwhile
                future.set_result(found.get(key))
        if self._waiting:
            self._watch()
        self.batches += 1
        self.keys += len(batch)
        if self._on_batch is not None:
            try:
                self._on_batch(len(batch))
            except Exception:
                log.exception("group commit: the batch callback failed")

    async def idle(self) -> None:
        """Wait until nothing is being written (shutdown: no statement outlives its owner)."""
        while self._flusher is not None or self._beside:
            await asyncio.wait({t for t in (self._flusher, *self._beside) if t is not None})


async def in_batch(group: GroupCommit[K, V], request: K, wait_s: float) -> V | None:
    """``request``'s answer from the next batch (None when the flush returned none for it). A
    request waits for a place in a batch as long as it would for a pooled connection
    (``wait_s``), then it is a 503 too (``DatabaseUnavailable``), with nothing written for it;
    a batch that failed fails each of its requests with the batch's error."""
    try:
        return await group.submit(request, queue_timeout_s=wait_s)
    except QueueTimeout as exc:
        unavailable = errors.DatabaseUnavailable()
        unavailable.nothing_written = True
        raise unavailable from exc
