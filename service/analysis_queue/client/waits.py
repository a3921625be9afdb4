"""``wait_for``: a job once it is terminal, driven by the event stream, never by polling.

A client's waits share one event stream (the service caps streams per user at 20, and a
backend may wait for many jobs at once). It opens with the first wait and closes with the
last. Each wait reads its job with a GET only once the stream has a position (its first
``snapshot`` came): every event after that position is delivered, so a job that was not yet
terminal at the GET is seen ending on the stream. The GET is repeated only when there is
something to learn: a frame says the job is terminal (its frame can be ahead of its event, so
"terminal" is what the job's summary says), or a new snapshot came (the stream lost its
position: the events it skipped may have ended the job).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from uuid import UUID

from analysis_queue.client.models import Analysis, JobEvent, SnapshotEvent
from analysis_queue.client.stream import EventStream


class Waits:
    def __init__(
        self,
        open_stream: Callable[[], EventStream],
        get: Callable[[UUID], Awaitable[Analysis]],
    ) -> None:
        self._open_stream = open_stream
        self._get = get
        self._waiters: dict[UUID, set[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None
        self._positioned = False
        self._error: BaseException | None = None

    async def wait(self, job_id: UUID, timeout_s: float) -> Analysis:
        woken = asyncio.Event()
        self._waiters.setdefault(job_id, set()).add(woken)
        try:
            async with asyncio.timeout(timeout_s):
                self._start()
                while True:
                    if self._error is not None:
                        raise self._error
                    woken.clear()
                    if self._positioned:
                        job = await self._get(job_id)
                        if job.terminal:
                            return job
                    await woken.wait()
        finally:
            waiting = self._waiters.get(job_id, set())
            waiting.discard(woken)
            if not waiting:
                self._waiters.pop(job_id, None)
            if not self._waiters:
                await self.stop()

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._positioned, self._error = False, None
            self._task = asyncio.create_task(self._watch(), name="analysis-queue-waits")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _watch(self) -> None:
        try:
            async with self._open_stream() as stream:
                async for event in stream:
                    if isinstance(event, SnapshotEvent):
                        self._positioned = True
                        self._wake_all()
                    elif isinstance(event, JobEvent) and event.job is not None:
                        if event.job.terminal:
                            self._wake(event.job.id)
        except Exception as exc:
            self._error = exc  # the stream gave up: every wait raises it
            self._wake_all()

    def _wake(self, job_id: UUID) -> None:
        for woken in self._waiters.get(job_id, ()):
            woken.set()

    def _wake_all(self) -> None:
        for waiting in self._waiters.values():
            for woken in waiting:
                woken.set()
