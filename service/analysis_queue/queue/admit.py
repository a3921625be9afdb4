"""Admission: every check a click can fail happens here, synchronously, before the job exists.

Order of an admit (no database transaction is ever held across the call to Core):
  1. ``reserve``: resolve the Idempotency-Key, hold the cost against the balance (less every
     hold in flight), reserve a fresh run id: a click that cannot be paid for never reaches Core.
  2. Core creates the run *held*: it validates sources and thesis and can refuse.
  3. ``admit``: under the user lock, turn the hold into the debit and insert the job, ``queued``
     or ``pending``.
A refusal at any step leaves no job, no debit and no held run behind; where the process dies
between steps, the reservation row tells the sweep which held run to cancel.

Steps 1 and 3 are group commits (queue/group_commit.py): the clicks that arrive while the
previous batch is being written share one transaction, and step 3 one notifying commit; a lone
click is a batch of one. Each click is still decided for itself, in arrival order
(sql/functions/admit.sql, ``aq_reserve_v2`` and ``aq_admit_v3``).
"""

from __future__ import annotations

import contextlib
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
    Job,
    JobStatus,
    Reservation,
    ReservationOutcome,
    ReserveRequest,
    StaleReservation,
)
from analysis_queue.queue.followup import Decision, FollowUp, Trigger
from analysis_queue.queue.group_commit import STALLED_AFTER_S, GroupCommit, in_batch
from analysis_queue.store.database import Claim, Database, admission_of

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
        self._reservations: GroupCommit[ReserveRequest, Reservation] = GroupCommit(
            db.reserve_many,
            name="reserve",
            max_batch=BATCH_MAX,
            on_batch=metrics.batch_counter("reserve"),
            stalled_after_s=STALLED_AFTER_S,
        )
        self._admissions: GroupCommit[AdmitRequest, Batched[Admission]] = GroupCommit(
            functools.partial(db.admit_many, claim=claim),
            name="admit",
            max_batch=BATCH_MAX,
            on_batch=metrics.batch_counter("admit"),
            stalled_after_s=STALLED_AFTER_S,
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

        # What the sweep needs to cancel the held run, should this click not be admitted.
        held = StaleReservation(run_id, job_id, user_id, core_run.id, thesis, sources)
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
            # A hold the previous release did not make, spent meanwhile: a definite refusal,
            # rolled back.
            await self._abandon(held)
            raise
        except errors.DatabaseUnavailable:
            # Committed or not, the reservation says: if the admit did commit, the reservation
            # is gone with it; if not, it stays for the sweep to cancel the held run (its key
            # in progress meanwhile, so that a retry during the outage asks Core for nothing),
            # but its credit is released now when the database answers, else by the sweep.
            with contextlib.suppress(errors.AppError):
                await self.db.release_hold(run_id)
            raise
        job = admission.job
        started = job.status is JobStatus.PENDING and all(
            p.id != job.id for p in admission.promoted
        )
        self.followup.after(
            Decision(
                Trigger.ADMIT,
                user_id=user_id,
                promoted=admission.promoted,
                unreleased=(job,) if started else (),
                asks_pass=Trigger.ADMIT if admission.asks_pass else None,
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
        reservation = await in_batch(self._reservations, request, self._wait_s)
        assert reservation is not None  # the batch answers every click
        return reservation

    async def _admit_now(self, request: AdmitRequest) -> Admission:
        """The admit of one click, in the next batch; its refusals raised."""
        batched = await in_batch(self._admissions, request, self._wait_s)
        assert batched is not None  # the batch answers every click
        return admission_of(batched)

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

    async def _abandon(self, reservation: StaleReservation) -> None:
        """A click that was not admitted, or may not have been: take its reservation back,
        which releases its hold. Found, it says the admit did not happen (an admit in flight
        holds the row until it ends, and deletes it when it commits): cancel the held run,
        or leave it to the sweep, holding nothing, when Core cannot be told."""
        if not await self.db.release_reservation(reservation.run_id):
            return  # admitted after all, or the sweep has it
        try:
            assert reservation.core_run_id is not None
            await self.core.cancel(reservation.core_run_id)
        except errors.AppError:
            await self.db.put_back_reservation(reservation)
