"""Dispatch: turn ``pending`` jobs into ``running`` ones by releasing their held runs in Core.

A pending job is first *claimed* (a compare-and-set with a lease), so that of all the instances
that hear about it exactly one releases it. A release that fails with Core unreachable or 5xx is
retried on a capped full-jitter exponential schedule kept in the job row (attempts, next attempt
time), so a redeploy continues it; at ``promoted_at + release_window_s`` the job fails with
``release_timeout`` and is refunded. A 4xx at release (run gone) fails and refunds at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from uuid import UUID

import tenacity

from analysis_queue import errors, tracing
from analysis_queue.core.client import CoreClient, RunState
from analysis_queue.metrics import Metrics
from analysis_queue.models import Job, JobStatus, StaleReservation
from analysis_queue.queue.finish import Finisher
from analysis_queue.queue.group_commit import STALLED_AFTER_S, GroupCommit
from analysis_queue.store.database import Database

log = logging.getLogger(__name__)


class Released(StrEnum):
    """What one release attempt did (the label of ``aq_release_attempts_total``)."""

    RELEASED = "released"  # Core is judging the run (or has judged it)
    RETRY = "retry"  # Core could not be reached: tried again later, within the window
    FAILED = "failed"  # Core no longer holds the run: the job failed and was refunded
    GAVE_UP = "gave_up"  # the release window passed: the job failed and was refunded
    NOT_CLAIMED = "not_claimed"  # another instance has it, it moved on, or it is not due


@dataclass(frozen=True)
class DispatchSettings:
    """How releases are claimed and retried."""

    instance_id: str
    claim_lease_s: float = 60.0  # a claim older than this is an instance that died mid-release
    release_window_s: float = 1800.0  # give up this long after promotion
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    concurrency: int = 32  # releases in flight at once per instance


def next_attempt_at(
    now: datetime,
    attempt: int,
    deadline: datetime,
    *,
    base_s: float,
    max_s: float,
) -> datetime:
    """When to try the release again after ``attempt`` attempts: full jitter, AWS-style,
    uniform(0, min(max_s, base_s * 2^(attempt-1))) (tenacity's ``wait_random_exponential``),
    never past the window's deadline."""
    wait = tenacity.wait_random_exponential(multiplier=base_s, max=max_s)
    state = tenacity.RetryCallState(
        retry_object=tenacity.AsyncRetrying(), fn=None, args=(), kwargs={}
    )
    state.attempt_number = max(1, attempt)
    return min(now + timedelta(seconds=wait(state)), deadline)


class Dispatcher:
    """Releases pending jobs. ``submit(job_id)`` from anywhere; duplicates are folded."""

    def __init__(
        self,
        db: Database,
        core: CoreClient,
        settings: DispatchSettings,
        finisher: Finisher,
        metrics: Metrics,
    ) -> None:
        self.db = db
        self.core = core
        self.settings = settings
        self.finisher = finisher
        self.metrics = metrics
        self._inflight: set[UUID] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._timers: dict[UUID, asyncio.TimerHandle] = {}
        self._sem = asyncio.Semaphore(settings.concurrency)
        # Claims and running marks of concurrent dispatches go out as one statement each.
        self._claims: GroupCommit[UUID, Job] = GroupCommit(
            lambda ids: db.claim(ids, settings.instance_id, settings.claim_lease_s),
            name="claim",
            on_batch=metrics.batch_counter("claim"),
        )
        self._running: GroupCommit[UUID, bool] = GroupCommit(
            self._mark_running,
            name="running",
            on_batch=metrics.batch_counter("running"),
            stalled_after_s=STALLED_AFTER_S,
        )
        self._stopping = False
        self.released = 0  # counters for tests and metrics
        self.gave_up = 0

    async def _mark_running(self, job_ids: list[UUID]) -> dict[UUID, bool]:
        """One batch of running marks; returns the jobs moved to running."""
        moved = await self.db.mark_running(job_ids, self.settings.instance_id)
        return dict.fromkeys(moved, True)

    def submit(self, job_id: UUID) -> None:
        """Release ``job_id`` soon. A job already in flight here is not submitted twice; one
        another instance is releasing is refused by the claim."""
        self._start(job_id, None)

    def release(self, job: Job) -> None:
        """Release a pending job soon: at once when the transaction that made it pending
        already claimed it for this instance (a batch of admits or completions), else after a
        claim."""
        mine = job.claimed_by == self.settings.instance_id
        self._start(job.id, job if mine else None)

    def _start(self, job_id: UUID, claimed: Job | None) -> None:
        if self._stopping or job_id in self._inflight:
            return
        self._inflight.add(job_id)
        task = asyncio.create_task(self._run(job_id, claimed), name=f"dispatch-{job_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, job_id: UUID, claimed: Job | None) -> None:
        try:
            # Traced, a child of what started it: the click, the completion or the pass.
            traced = {"aq.job_id": str(job_id)} if tracing.active() else None
            with tracing.span("release", attributes=traced):
                async with self._sem:
                    if claimed is not None:
                        outcome = await self._release(claimed)
                    else:
                        outcome = await self.dispatch_once(job_id)
            if outcome is not Released.NOT_CLAIMED:
                self.metrics.releases.labels(outcome).inc()
        except errors.DatabaseUnavailable:
            log.warning("dispatch: database unavailable", extra={"job_id": str(job_id)})
        except Exception:
            log.exception("dispatch failed", extra={"action": "dispatch", "job_id": str(job_id)})
        finally:
            self._inflight.discard(job_id)

    async def dispatch_once(self, job_id: UUID) -> Released:
        """One release attempt. Returns what happened (for tests and logs)."""
        job = await self._claims.submit(job_id)
        if job is None:
            return Released.NOT_CLAIMED
        return await self._release(job)

    async def _release(self, job: Job) -> Released:
        """Release a job this instance has claimed."""
        assert job.core_run_id is not None and job.promoted_at is not None
        deadline = job.promoted_at + timedelta(seconds=self.settings.release_window_s)
        try:
            await self.core.release(job.core_run_id)
        except errors.CoreRunGone as exc:
            return await self._not_held(job, exc.detail)
        except errors.CoreUnavailable as exc:
            now = datetime.now(UTC)
            if now >= deadline:
                # Stop the run in Core before its slot frees: a release that reached Core
                # unseen must not judge beside the job promoted next. Core still unreachable:
                # the sweep keeps trying to cancel it (the reservation).
                try:
                    await self.core.cancel(job.core_run_id)
                    cancelled = True
                except errors.AppError:
                    cancelled = False
                await self._fail(job, "release_timeout", "Core did not accept the release in time.")
                if not cancelled:
                    await self.db.put_back_reservation(
                        StaleReservation(
                            job.run_id,
                            job.id,
                            job.user_id,
                            job.core_run_id,
                            job.thesis,
                            job.sources,
                        )
                    )
                self.gave_up += 1
                return Released.GAVE_UP
            at = await self._retry_later(job, exc.detail)
            log.info(
                "release retry scheduled",
                extra={
                    "action": "release_retry",
                    "job_id": str(job.id),
                    "user_id": job.user_id,
                    "attempt": job.release_attempts,
                    "next_attempt_at": at.isoformat(),
                },
            )
            return Released.RETRY
        self.released += 1  # Core holds it no longer, whatever becomes of the running mark
        running = await self._running.submit(job.id)
        log.info(
            "released",
            extra={
                "action": "release",
                "job_id": str(job.id),
                "user_id": job.user_id,
                "running": running is not None,
            },
        )
        return Released.RELEASED

    async def _not_held(self, job: Job, detail: str) -> Released:
        """Core refused the release: the run is not held. That is a lost run only if Core no
        longer has it or cancelled it. An earlier release may have gone through with its
        ``running`` never written (the database went away, the instance died): then Core is
        judging or has finished the run, and the job follows Core instead of failing."""
        assert job.core_run_id is not None
        try:
            run = await self.core.get_run(job.core_run_id)
        except errors.CoreUnavailable:
            await self._retry_later(job, "Core's state of the run is unknown")
            return Released.RETRY
        if run is None or run.state == RunState.CANCELLED:
            await self._fail(job, "core_run_gone", detail)
            return Released.FAILED
        if run.state == RunState.JUDGING:
            self.released += 1
            await self._running.submit(job.id)
            return Released.RELEASED
        if run.finished:
            await self.finisher.apply_core_run(run, source="poll")
            self.released += 1
            return Released.RELEASED
        await self._retry_later(job, f"Core reports the run {run.state}")
        return Released.RETRY

    async def _retry_later(self, job: Job, detail: str) -> datetime:
        """Put the job back on its retry schedule, never past the window; returns when."""
        assert job.promoted_at is not None
        now = datetime.now(UTC)
        deadline = job.promoted_at + timedelta(seconds=self.settings.release_window_s)
        at = next_attempt_at(
            now,
            job.release_attempts,
            deadline,
            base_s=self.settings.backoff_base_s,
            max_s=self.settings.backoff_max_s,
        )
        await self.db.schedule_release_retry(job.id, self.settings.instance_id, at, detail)
        self._schedule(job.id, (at - now).total_seconds())
        return at

    async def _fail(self, job: Job, code: str, detail: str) -> None:
        await self.finisher.fail(
            job.id, from_statuses=(JobStatus.PENDING,), code=code, detail=detail
        )
        log.warning(
            "release failed",
            extra={
                "action": "release_fail",
                "job_id": str(job.id),
                "user_id": job.user_id,
                "code": code,
            },
        )

    def _schedule(self, job_id: UUID, delay_s: float) -> None:
        if self._stopping:
            return
        old = self._timers.pop(job_id, None)
        if old is not None:
            old.cancel()

        def fire() -> None:
            self._timers.pop(job_id, None)
            self.submit(job_id)

        self._timers[job_id] = asyncio.get_running_loop().call_later(max(0.0, delay_s), fire)

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop taking work, cancel timers, wait for in-flight releases within a bound.

        A release cut short leaves its claim to expire; another instance's sweep retries it.
        """
        self._stopping = True
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        if self._tasks:
            _done, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1)
        # A claim or running mark still being written for a dispatch that ended meanwhile.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(self._claims.idle(), self._running.idle()), timeout=2
            )

    async def drain(self) -> None:
        """Wait until no release is in flight (tests)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))
