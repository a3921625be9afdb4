"""Finishing a job: Core's completion (a callback or the sweep's poll), a failed release, a run
Core lost, a user's cancel or delete. Each is an item of ``aq_finish_v3``
(sql/functions/finish.sql), which in the same transaction refunds what never reached judging
(the rule is ``aq_refund_if_due_v1`` in sql/functions/credits.sql) and fills the slots the jobs
free.

Idempotent by construction: the move to a terminal status is a compare-and-set from the statuses
the caller names, under the user lock, so a duplicate, late or out-of-order report changes
nothing twice. A completion accepts ``pending`` because Core's callback can arrive before the
releasing instance has written ``running``. What the finish promoted, and its refund, go to the
follow-up (queue/followup.py).

Core's reports (callbacks and the sweep's polls) are a group commit: those that arrive while the
previous batch is being written are finished in one transaction and one notifying commit, each
in order, and each answered after that commit; a lone report is a batch of one.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from enum import StrEnum
from uuid import UUID

from analysis_queue import errors
from analysis_queue.core.client import CoreClient, CoreRun, RunState
from analysis_queue.metrics import Metrics
from analysis_queue.models import (
    ACTIVE_STATUSES,
    CompletionRequest,
    Finish,
    JobStatus,
    StaleReservation,
)
from analysis_queue.queue.followup import Decision, FollowUp, Trigger
from analysis_queue.queue.group_commit import STALLED_AFTER_S, GroupCommit, in_batch
from analysis_queue.store.database import Claim, Database

log = logging.getLogger(__name__)

BATCH_MAX = 64  # reports per batch at most: each user lock it takes is held to its commit

_STATUS_OF_STATE: dict[str, JobStatus] = {
    RunState.COMPLETED: JobStatus.SUCCEEDED,
    RunState.FAILED: JobStatus.FAILED,
    RunState.CANCELLED: JobStatus.CANCELLED,
}
_ERROR_OF_STATUS = {JobStatus.FAILED: "analysis_failed", JobStatus.CANCELLED: "cancelled_in_core"}


class Applied(StrEnum):
    """What a report of Core's about a run did (the label of ``aq_core_callbacks_total``)."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"  # the job had already left pending/running
    NOT_FINISHED = "not_finished"  # the run is not over
    UNKNOWN_RUN = "unknown_run"


class Finisher:
    def __init__(
        self,
        db: Database,
        core: CoreClient,
        followup: FollowUp,
        metrics: Metrics,
        claim: Claim | None = None,
    ) -> None:
        self.db = db
        self.core = core
        self.followup = followup
        self.metrics = metrics
        self._completions: GroupCommit[CompletionRequest, Finish | None] = GroupCommit(
            functools.partial(db.finish_many, claim=claim),
            name="finish",
            max_batch=BATCH_MAX,
            on_batch=metrics.batch_counter("finish"),
            stalled_after_s=STALLED_AFTER_S,
        )

    def _followed(self, result: Finish) -> None:
        if not result.changed:
            return
        # Capacity the finish could not give out (the user next in turn was busy, or a ceiling
        # turned on meanwhile): a pass.
        asks_pass = Trigger.TAIL if result.asks_pass else None
        self.followup.after(
            Decision(
                Trigger.TAIL,
                user_id=result.job.user_id,
                promoted=result.promoted,
                refunded=result.job if result.refunded else None,
                asks_pass=asks_pass,
            )
        )

    async def apply_core_run(self, run: CoreRun, *, source: str = "callback") -> Applied:
        """Apply Core's report of a run's end (``source``: ``callback`` or ``poll``)."""
        outcome = await self._apply(run)
        label = outcome if source == "callback" else f"poll_{outcome}"
        self.metrics.callbacks.labels(label).inc()
        return outcome

    async def _apply(self, run: CoreRun) -> Applied:
        status = _STATUS_OF_STATE.get(run.state)
        if status is None:
            return Applied.NOT_FINISHED
        result = await self._complete(
            CompletionRequest(
                core_run_id=run.id,
                status=status,
                from_statuses=tuple(ACTIVE_STATUSES),
                error_code=_ERROR_OF_STATUS.get(status),
                error_detail=run.error,
                verdicts=[v.model_dump() for v in run.verdicts]
                if status is JobStatus.SUCCEEDED
                else None,
                ran=status is not JobStatus.CANCELLED,
            )
        )
        if result is None:
            log.warning(
                "core event for unknown run", extra={"action": "complete", "run_id": run.id}
            )
            return Applied.UNKNOWN_RUN
        self._followed(result)
        log.info(
            "run finished" if result.changed else "duplicate core event",
            extra={
                "action": "complete",
                "job_id": str(result.job.id),
                "user_id": result.job.user_id,
                "status": result.job.status,
                "promoted_job_ids": [str(j.id) for j in result.promoted],
            },
        )
        return Applied.APPLIED if result.changed else Applied.DUPLICATE

    async def _complete(self, request: CompletionRequest) -> Finish | None:
        """Finish the job of a completed run, in the next batch. None: no job has that run."""
        return await in_batch(self._completions, request, self.db.timeouts.acquire_s)

    async def fail(
        self, job_id: UUID, *, from_statuses: Sequence[JobStatus], code: str, detail: str
    ) -> Finish | None:
        """Fail a job that never got (or lost) its run in Core; it is refunded."""
        result = await self.db.finish(
            job_id=job_id,
            status=JobStatus.FAILED,
            from_statuses=from_statuses,
            error_code=code,
            error_detail=detail,
        )
        if result is not None:
            self._followed(result)
        return result

    async def cancel(self, job_id: UUID, user_id: str) -> Finish:
        """A user's cancel (``POST .../cancel``): the job ends ``cancelled`` and stays listed.

        The rules of :meth:`_end`. Cancelling a cancelled job is the job as it is; one that
        succeeded or failed has nothing to cancel (``Conflict``)."""
        result = await self._end(job_id, user_id, delete=False)
        status = result.job.status
        if status in (JobStatus.SUCCEEDED, JobStatus.FAILED):
            raise errors.Conflict(f"The analysis already {status}: there is nothing to cancel.")
        if status is not JobStatus.CANCELLED:
            raise errors.Conflict()  # still open, yet Core holds no run of it to cancel
        return result

    async def delete(self, job_id: UUID, user_id: str) -> Finish:
        """A user's delete (DELETE): soft-delete the job, cancelling it (:meth:`_end`) if it has
        not ended."""
        return await self._end(job_id, user_id, delete=True)

    async def _end(self, job_id: UUID, user_id: str, *, delete: bool) -> Finish:
        """Cancel the job if it has not ended; with ``delete``, soft-delete it too.

        A queued job is cancelled and refunded, then its held run cancelled in Core. A pending
        or running job is cancelled in Core *first*: its slot (the user's, and the provider's
        when the ceiling is on) frees only after Core stopped the run, so a job promoted into
        the slot never judges beside it. If Core cannot be told, ``CoreUnavailable`` is raised
        and the job goes on. ``NotFound`` for no such job of this user's, or a deleted one."""
        result = await self._cancel(job_id, user_id, (JobStatus.QUEUED,), delete=delete)
        if result is None or (not result.changed and result.job.deleted_at is not None):
            raise errors.NotFound()
        job = result.job
        if not result.changed and job.status in ACTIVE_STATUSES and job.core_run_id:
            await self.core.cancel(job.core_run_id)  # CoreUnavailable: the job goes on
            result = await self._cancel(job_id, user_id, tuple(ACTIVE_STATUSES), delete=delete)
            assert result is not None  # jobs are never hard-deleted
        elif result.changed and job.core_run_id and result.old_status is JobStatus.QUEUED:
            # A held run: Core judges nothing, so its cancel may come after the commit. (A
            # delete that only hid a finished job has no run left to cancel.)
            try:
                await self.core.cancel(job.core_run_id)
            except errors.AppError:
                # Left to the sweep, which cancels held runs it finds in the reservations.
                await self.db.put_back_reservation(
                    StaleReservation(
                        job.run_id, job.id, job.user_id, job.core_run_id, job.thesis, job.sources
                    )
                )
        action = "delete" if delete else "cancel"
        log.info(
            "deleted" if delete else "cancelled",
            extra={
                "action": action,
                "job_id": str(job_id),
                "user_id": user_id,
                "was": result.old_status,
                "changed": result.changed,
            },
        )
        return result

    async def _cancel(
        self, job_id: UUID, user_id: str, from_statuses: tuple[JobStatus, ...], *, delete: bool
    ) -> Finish | None:
        result = await self.db.finish(
            job_id=job_id,
            user_id=user_id,
            status=JobStatus.CANCELLED,
            from_statuses=from_statuses,
            delete=delete,
            error_code="cancelled_by_user",
            error_detail="Cancelled by the user.",
        )
        if result is not None and result.changed:
            # Capacity the cancel could not give out (the user next in turn was busy, or a
            # ceiling turned on meanwhile): a pass.
            asks_pass = Trigger.CANCEL if result.asks_pass else None
            self.followup.after(
                Decision(
                    Trigger.TAIL,
                    user_id=None,
                    promoted=result.promoted,
                    refunded=result.job if result.refunded else None,
                    asks_pass=asks_pass,
                )
            )
        return result
