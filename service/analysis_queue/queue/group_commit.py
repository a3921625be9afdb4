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
from typing import Any, Generic, TypeVar

from analysis_queue import errors
from analysis_queue.models import Batched, BatchOutcome

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class QueueTimeout(Exception):
    """A key waited for a place in a statement longer than its caller allowed; nothing was
    written for it."""


class GroupCommit(Generic[K, V]):
    """``flush(keys) -> {key: value}`` for batches of at most ``max_batch`` keys, one at a time.
    ``submit(key)`` returns the value for its key, or None when the flush returned none."""

    def __init__(
        self,
        flush: Callable[[list[K]], Awaitable[Mapping[K, V]]],
        *,
        max_batch: int = 256,
        on_batch: Callable[[int], None] | None = None,
        on_alone: Callable[[str], None] | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self._flush = flush
        self._on_batch = on_batch  # called with each written batch's size (metrics)
        # called by in_batch for each key left to be decided alone, with why (metrics)
        self.on_alone = on_alone
        self._max_batch = max_batch
        self._waiting: list[tuple[K, asyncio.Future[V | None]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self.batches = 0  # counters, for tests and the benchmark notes
        self.keys = 0

    async def submit(self, key: K, *, queue_timeout_s: float | None = None) -> V | None:
        future: asyncio.Future[V | None] = asyncio.get_running_loop().create_future()
        entry = (key, future)
        self._waiting.append(entry)
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._run(), name="group-commit")
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

    async def _run(self) -> None:
        try:
            while self._waiting:
                batch = self._waiting[: self._max_batch]
                del self._waiting[: self._max_batch]
                # A caller cancelled while it waited (a dispatch cut short at shutdown) wants
                # nothing written for it any more.
                batch = [(key, future) for key, future in batch if not future.done()]
                if not batch:
                    continue
                try:
                    found = await self._flush([key for key, _ in batch])
                except BaseException as exc:
                    for _, future in batch:
                        if not future.done():
                            if isinstance(exc, asyncio.CancelledError):
                                future.cancel()
                            else:
                                future.set_exception(exc)
                    if not isinstance(exc, Exception):
                        raise
                    continue
                for key, future in batch:
                    if not future.done():  # its caller may have been cancelled meanwhile
                        future.set_result(found.get(key))
                self.batches += 1
                self.keys += len(batch)
                if self._on_batch is not None:
                    try:
                        self._on_batch(len(batch))
                    except Exception:
                        log.exception("group commit: the batch callback failed")
        finally:
            self._flusher = None
            for _, future in self._waiting:  # only when cancelled mid-way
                future.cancel()
            self._waiting.clear()

    async def idle(self) -> None:
        """Wait until nothing is being written (shutdown: no statement outlives its owner)."""
        while self._flusher is not None:
            await asyncio.wait({self._flusher})


R = TypeVar("R")


async def in_batch(
    group: GroupCommit[K, Batched[R]], request: K, what: str, wait_s: float
) -> Batched[R] | None:
    """``request``'s answer from its batch; None when it must be decided alone: its user was
    busy, or the batch failed for a reason that is not this request's (a retry alone then
    either succeeds or fails with the request's own error). A database that is unavailable is
    everyone's answer: no retry. A request waits for a place in a batch as long as it would for
    a pooled connection (``wait_s``), then it is a 503 too, with nothing written for it."""
    try:
        batched = await group.submit(request, queue_timeout_s=wait_s)
    except QueueTimeout as exc:
        raise errors.DatabaseUnavailable() from exc
    except errors.DatabaseUnavailable:
        raise
    except Exception:
        log.exception("group commit failed; deciding alone", extra={"action": what})
        _alone(group, "failed")
        return None
    if batched is None or batched.outcome is BatchOutcome.BUSY:
        _alone(group, "busy")
        return None
    return batched


def _alone(group: GroupCommit[Any, Any], reason: str) -> None:
    if group.on_alone is not None:
        group.on_alone(reason)
