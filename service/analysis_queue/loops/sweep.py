"""The sweep: the fallback that makes missed notifications, crashed instances and overlapping
deploys harmless. Every instance runs it every ``interval_s`` (jittered).

One pass (``run_once``):
  1. promotes for users who have a queued job and a free slot (or, with the provider ceiling
     on, re-derives their waits), then runs a promotion pass (fills free global slots; with
     the ceiling off it only learns that it is off);
  2. hands pending jobs nobody is releasing (and whose retry is due) to the dispatcher;
  3. asks Core about running jobs not heard of for a while (a lost callback);
  4. cancels held runs whose admit died (stale run reservations);
  5. prunes event-stream events older than their retention.
Every query reads the partial indexes of open work, so a pass costs what is open, not history.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import dataclass
from uuid import UUID

from analysis_queue import errors, tracing
from analysis_queue.core.client import CoreClient
from analysis_queue.loops.dispatch import Dispatcher
from analysis_queue.loops.promote import Promoter
from analysis_queue.metrics import Metrics
from analysis_queue.models import JobStatus, StaleReservation
from analysis_queue.queue.finish import Applied, Finisher
from analysis_queue.queue.followup import Trigger
from analysis_queue.store.database import Database

log = logging.getLogger(__name__)

POLL_CONCURRENCY = 16  # Core status requests in flight at once during a sweep
PRUNE_BATCHES = 10  # event-log deletes of ``batch`` rows at most per pass


@dataclass(frozen=True)
class SweepSettings:
    """How often and how far the sweep reaches."""

    interval_s: float = 30.0  # 0 disables the periodic pass (kick() still runs one)
    jitter: float = 0.2  # +-20% so instances do not sweep in lockstep
    running_quiet_s: float = 60.0  # poll Core for running jobs silent this long
    reservation_stale_s: float = 120.0  # a reservation older than this lost its admit
    event_retention_s: float = 7 * 24 * 3600.0  # Last-Event-ID older than this: a snapshot
    batch: int = 1000


@dataclass
class SweepReport:
    promoted: int = 0
    dispatched: int = 0
    polled: int = 0
    completed: int = 0
    reservations_cancelled: int = 0
    events_pruned: int = 0
    duration_s: float = 0.0


class Sweeper:
    def __init__(
        self,
        db: Database,
        core: CoreClient,
        dispatcher: Dispatcher,
        promoter: Promoter,
        finisher: Finisher,
        settings: SweepSettings,
        metrics: Metrics,
    ) -> None:
        self.db = db
        self.core = core
        self.dispatcher = dispatcher
        self.promoter = promoter
        self.finisher = finisher
        self.settings = settings
        self.metrics = metrics
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._kicked = asyncio.Event()
        self.passes = 0
        self.pass_done = asyncio.Event()  # set after every pass, for tests
        self.last_report: SweepReport | None = None

    async def run_once(self) -> SweepReport:
        report = SweepReport()
        started = time.perf_counter()
        steps = (
            self._promote,
            self._dispatch,
            self._poll_running,
            self._reservations,
            self._prune_events,
        )
        with tracing.span("sweep pass"):  # traced: what it repairs is its children
            for step in steps:
                try:
                    await step(report)
                except errors.DatabaseUnavailable:
                    log.warning("sweep: database unavailable", extra={"action": "sweep"})
                    break
                except Exception:
                    log.exception(
                        "sweep step failed", extra={"action": "sweep", "step": step.__name__}
                    )
        report.duration_s = time.perf_counter() - started
        self.metrics.sweep_seconds.observe(report.duration_s)
        self.passes += 1
        self.last_report = report
        if report.promoted or report.completed or report.reservations_cancelled:
            log.info("sweep", extra={"action": "sweep", **report.__dict__})
        self.pass_done.set()
        return report

    async def _promote(self, report: SweepReport) -> None:
        for user_id in await self.db.users_to_promote(self.settings.batch):
            report.promoted += len(await self.promoter.promote((user_id,), Trigger.SWEEP))
        report.promoted += await self.promoter.run_pass(Trigger.SWEEP)

    async def _dispatch(self, report: SweepReport) -> None:
        for job_id in await self.db.pending_due(self.settings.batch):
            self.dispatcher.submit(job_id)
            report.dispatched += 1

    async def _poll_running(self, report: SweepReport) -> None:
        quiet = await self.db.running_quiet(self.settings.running_quiet_s, self.settings.batch)
        if not quiet:
            return
        sem = asyncio.Semaphore(POLL_CONCURRENCY)

        async def poll(job_id: UUID, core_run_id: str) -> UUID | None:
            async with sem:
                try:
                    run = await self.core.get_run(core_run_id)
                except errors.CoreUnavailable:
                    return None  # "unknown", not "failed": ask again next pass
            report.polled += 1
            if run is None:
                await self._lost(job_id, report)
            elif (
                run.finished
                and await self.finisher.apply_core_run(run, source="poll") is Applied.APPLIED
            ):
                report.completed += 1
            return job_id

        results = await asyncio.gather(*(poll(j, r) for j, r in quiet))
        polled = [job_id for job_id in results if job_id is not None]
        if polled:
            await self.db.mark_polled(polled)

    async def _lost(self, job_id: UUID, report: SweepReport) -> None:
        """Core has no such run any more: the analysis is lost; fail and refund."""
        await self.finisher.fail(
            job_id,
            from_statuses=(JobStatus.RUNNING,),
            code="core_run_lost",
            detail="Core no longer knows this run.",
        )
        report.completed += 1

    async def _reservations(self, report: SweepReport) -> None:
        stale = await self.db.take_stale_reservations(
            self.settings.reservation_stale_s, self.settings.batch
        )
        for reservation in stale:
            if await self._cancel_orphan(reservation):
                report.reservations_cancelled += 1
            else:
                await self.db.put_back_reservation(reservation)

    async def _prune_events(self, report: SweepReport) -> None:
        # Oldest first, a bounded batch at a time; what is left waits for the next pass.
        for _ in range(PRUNE_BATCHES):
            deleted = await self.db.prune_events(
                self.settings.event_retention_s, self.settings.batch
            )
            report.events_pruned += deleted
            if deleted < self.settings.batch:
                return

    async def _cancel_orphan(self, r: StaleReservation) -> bool:
        """Cancel the held run of an admit that never finished; False to try again later."""
        try:
            core_run_id = r.core_run_id
            if core_run_id is None:
                # Create is idempotent on run_id: it names the run Core made, or makes one
                # that we cancel straight away.
                run = await self.core.create_held(str(r.run_id), r.user_id, r.thesis, r.sources)
                core_run_id = run.id
            await self.core.cancel(core_run_id)
        except errors.CoreRefused:
            return True  # Core refuses the request: it holds no run for it
        except errors.CoreUnavailable:
            return False
        log.info(
            "orphaned held run cancelled",
            extra={"action": "reservation_cancel", "run_id": str(r.run_id), "user_id": r.user_id},
        )
        return True

    # -- loop -------------------------------------------------------------------------------

    def kick(self) -> None:
        """Ask for a pass now (after the listener reconnects: notifications were lost)."""
        self._kicked.set()

    def _next_delay(self) -> float | None:
        if self.settings.interval_s <= 0:
            return None
        spread = self.settings.interval_s * self.settings.jitter
        return self.settings.interval_s + random.uniform(-spread, spread)

    async def _run(self) -> None:
        while not self._stopping.is_set():
            waiters = {
                asyncio.create_task(self._stopping.wait()),
                asyncio.create_task(self._kicked.wait()),
            }
            try:
                await asyncio.wait(
                    waiters, timeout=self._next_delay(), return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                for waiter in waiters:
                    waiter.cancel()
            if self._stopping.is_set():
                return
            self._kicked.clear()
            self.pass_done.clear()
            await self.run_once()

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._stopping.clear()
            self._task = asyncio.create_task(self._run(), name="sweeper")

    async def stop(self) -> None:
        self._stopping.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._task, timeout=10)
            self._task = None

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task
