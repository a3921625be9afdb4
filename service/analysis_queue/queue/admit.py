"""Admission: every check a click can fail happens here, synchronously, before the job exists.

Order of an admit (no database transaction is ever held across the call to Core):
  1. ``reserve``: resolve the Idempotency-Key, check the balance, reserve a fresh run id.
  2. Core creates the run *held*: it validates sources and thesis and can refuse.
  3. ``admit``: under the user lock, debit and insert the job, ``queued`` or ``pending``.
A refusal at any step leaves no job, no debit and no held run behind; where the process dies
between steps, the reservation row tells the sweep which held run to cancel.

Steps 1 and 3 are group commits (queue/group_commit.py): the clicks that arrive while the
previous batch is being written share one transaction, and step 3 one notifying commit, the
cost every click used to pay alone. Each click is still decided for itself, in arrival order
(sql/functions/admit.sql, ``aq_reserve_many_v1`` and ``aq_admit_many_v1``); one whose user's
lock is held elsewhere, or whose batch failed for a reason of its own, is decided alone, as it
was before the batches.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import orjson

from analysis_queue import errors
from analysis_queue.core.client import CoreClient
from analysis_queue.metrics import Metrics
from analysis_queue.models import (
    Admission,
    AdmitRequest,
    Batched,
    BatchOutcome,
    Job,
    JobStatus,
    Reservation,
    ReservationOutcome,
    ReserveRequest,
    WaitReason,
)
from analysis_queue.queue.followup import Decision, FollowUp, Trigger
from analysis_queue.queue.group_commit import GroupCommit, in_batch
from analysis_queue.store.database import Claim, Database

log = logging.getLogger(__name__)

# Clicks per batch at most: every user lock a batch takes is held until its commit.
BATCH_MAX = 64


def request_hash(body: dict[str, Any]) -> str:
    """A stable fingerprint of a request body, to tell a retry from a different request."""
    return hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()


@dataclass(frozen=True)
class Admitted:
    job: Job
    created: bool  # False when an Idempotency-Key replay returned the earlier job


class Admitter:
    def __init__(
        self,
        db: Database,
        core: CoreClient,
        followup: FollowUp,
        metrics: Metrics,
        *,
        analysis_cost: int,
        recheck_cost: int,
        job_max_bytes: int = 64 * 1024,
        claim: Claim | None = None,
    ) -> None:
        self.db = db
        self.core = core
        self.followup = followup
        self.metrics = metrics
        self.analysis_cost = analysis_cost
        self.recheck_cost = recheck_cost
        self.job_max_bytes = job_max_bytes
        self._wait_s = db.timeouts.acquire_s
        self._reservations: GroupCommit[ReserveRequest, Batched[Reservation]] = GroupCommit(
            db.reserve_many,
            max_batch=BATCH_MAX,
            on_batch=metrics.batch_counter("reserve"),
            on_alone=metrics.alone_counter("reserve"),
        )
        self._admissions: GroupCommit[AdmitRequest, Batched[Admission]] = GroupCommit(
            functools.partial(db.admit_many, claim=claim),
            max_batch=BATCH_MAX,
            on_batch=metrics.batch_counter("admit"),
            on_alone=metrics.alone_counter("admit"),
        )

    async def admit(
        self,
        user_id: str,
        thesis: dict[str, Any],
        sources: list[str],
        *,
        idempotency_key: str | None = None,
    ) -> Admitted:
        body_hash = request_hash({"thesis": thesis, "sources": sources})
        return await self._counted(
            self._admit(
                user_id,
                thesis,
                sources,
                cost=self.analysis_cost,
                delta_of=None,
                idempotency_key=idempotency_key,
                body_hash=body_hash,
            )
        )

    async def recheck(self, user_id: str, parent_id: UUID, sources: list[str]) -> Admitted:
        """A delta re-check: skips the queue and never blocks first-pass jobs."""
        parent = await self.db.job_for_recheck(parent_id, user_id)
        if parent is None:
            raise errors.NotFound()
        if parent["status"] != JobStatus.SUCCEEDED:
            raise errors.Conflict("Only a succeeded analysis can be re-checked.")
        root = parent["delta_of_job_id"] or parent["id"]
        return await self._counted(
            self._admit(
                user_id,
                parent["thesis"],
                sources,
                cost=self.recheck_cost,
                delta_of=root,
                idempotency_key=None,
                body_hash=None,
            )
        )

    async def _counted(self, admission: Awaitable[Admitted]) -> Admitted:
        """Await an admission, counting its outcome and latency."""
        started = time.perf_counter()
        try:
            admitted = await admission
        except errors.AppError as exc:
            self.metrics.admits.labels(exc.code).inc()
            raise
        self.metrics.admits.labels("admitted" if admitted.created else "replayed").inc()
        self.metrics.admit_seconds.observe(time.perf_counter() - started)
        return admitted

    async def _admit(
        self,
        user_id: str,
        thesis: dict[str, Any],
        sources: list[str],
        *,
        cost: int,
        delta_of: UUID | None,
        idempotency_key: str | None,
        body_hash: str | None,
    ) -> Admitted:
        self._check_size(thesis, sources)
        job_id, run_id = uuid.uuid4(), uuid.uuid4()
        reservation = await self._reserve(
            ReserveRequest(
                user_id=user_id,
                run_id=run_id,
                job_id=job_id,
                cost=cost,
                thesis=thesis,
                sources=sources,
                idempotency_key=idempotency_key,
                request_hash=body_hash,
            )
        )
        if reservation.outcome is ReservationOutcome.EXISTING and reservation.job_id is not None:
            earlier = await self.db.get_job(reservation.job_id, user_id)
            if earlier is None:  # admitted, then deleted by the user: still the same request
                raise errors.Conflict("The analysis admitted with this key was deleted.")
            return Admitted(earlier, created=False)
        if reservation.outcome is ReservationOutcome.KEY_REUSED:
            raise errors.IdempotencyKeyReused()
        if reservation.outcome is ReservationOutcome.IN_PROGRESS:
            raise errors.IdempotencyInProgress()
        if reservation.outcome is ReservationOutcome.INSUFFICIENT_CREDITS:
            raise errors.InsufficientCredits(
                f"Starting an analysis costs {cost} credit(s); the balance is "
                f"{reservation.balance}."
            )

        try:
            core_run = await self.core.create_held(str(run_id), user_id, thesis, sources)
        except errors.CoreRefused:
            # Core refused: it made no run. Nothing is left behind.
            await self.db.release_reservation(run_id)
            raise
        except errors.CoreUnavailable:
            # Core may or may not have made the run; the sweep re-asks it and cancels.
            await self.db.orphan_reservation(run_id)
            raise

        try:
            admission = await self._admit_now(
                AdmitRequest(
                    job_id=job_id,
                    user_id=user_id,
                    run_id=run_id,
                    core_run_id=core_run.id,
                    thesis=thesis,
                    sources=sources,
                    cost=cost,
                    delta_of=delta_of,
                    idempotency_key=idempotency_key,
                    request_hash=body_hash,
                )
            )
        except errors.InsufficientCredits:
            # A concurrent admit spent the credit between reserve and debit: a definite
            # refusal, rolled back. Cancel the held run now; the sweep covers a failure.
            await self._abandon(run_id, core_run.id)
            raise
        # Any other failure (database gone, commit outcome unknown) leaves the reservation:
        # if the admit did commit, the reservation is gone with it; if not, the sweep cancels.
        job = admission.job
        started = job.status is JobStatus.PENDING and all(
            p.id != job.id for p in admission.promoted
        )
        # A job that waits only for the provider may be given a free global slot by a pass
        # (which names the user: a ceiling turned off meanwhile fills the user's slots instead).
        waits_for_capacity = (
            job.status is JobStatus.QUEUED and job.waiting_for is WaitReason.PROVIDER_CAPACITY
        )
        self.followup.after(
            Decision(
                Trigger.ADMIT,
                user_id=user_id,
                promoted=admission.promoted,
                unreleased=(job,) if started else (),
                asks_pass=Trigger.ADMIT if waits_for_capacity else None,
            )
        )
        log.info(
            "admitted",
            extra={
                "action": "admit",
                "job_id": str(job.id),
                "user_id": user_id,
                "status": job.status,
                "delta": delta_of is not None,
            },
        )
        return Admitted(job, created=True)

    async def _reserve(self, request: ReserveRequest) -> Reservation:
        batched = await in_batch(self._reservations, request, "reserve", self._wait_s)
        if batched is not None and batched.result is not None:
            return batched.result
        return await self.db.reserve(
            user_id=request.user_id,
            run_id=request.run_id,
            job_id=request.job_id,
            cost=request.cost,
            thesis=request.thesis,
            sources=request.sources,
            idempotency_key=request.idempotency_key,
            request_hash=request.request_hash,
        )

    async def _admit_now(self, request: AdmitRequest) -> Admission:
        """The admit of one click: in the next batch, or alone when the batch cannot decide
        it. Raises what ``Database.admit`` raises for the click's own refusals."""
        batched = await in_batch(self._admissions, request, "admit", self._wait_s)
        if batched is not None:
            if batched.outcome is BatchOutcome.INSUFFICIENT_CREDITS:
                raise errors.InsufficientCredits()
            if batched.outcome is BatchOutcome.RESERVATION_GONE:
                raise errors.CoreUnavailable("The admission timed out; try again.")
            if batched.result is not None:
                return batched.result
        return await self.db.admit(
            job_id=request.job_id,
            user_id=request.user_id,
            run_id=request.run_id,
            core_run_id=request.core_run_id,
            thesis=request.thesis,
            sources=request.sources,
            cost=request.cost,
            delta_of=request.delta_of,
            idempotency_key=request.idempotency_key,
            request_hash=request.request_hash,
        )

    def _check_size(self, thesis: dict[str, Any], sources: list[str]) -> None:
        """What a job stores is bounded in bytes, not characters: everything that serves it
        (lists, event streams, replays, Core's request) then has a bound too."""
        size = len(orjson.dumps({"thesis": thesis, "sources": sources}))
        if size > self.job_max_bytes:
            raise errors.JobTooLarge(
                f"The thesis and sources take {size} bytes; one analysis may store at most "
                f"{self.job_max_bytes} (AQ_JOB_MAX_BYTES).",
                limit_bytes=self.job_max_bytes,
                size_bytes=size,
            )

    async def _abandon(self, run_id: UUID, core_run_id: str) -> None:
        try:
            await self.core.cancel(core_run_id)
        except errors.AppError:
            await self.db.set_reservation_core_run(run_id, core_run_id)
            return
        await self.db.release_reservation(run_id)
