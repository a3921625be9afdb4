"""Completion: apply what Core says about a run (callback or the sweep's poll) to its job.

Idempotent by construction: the move to a terminal status is a compare-and-set from
``pending``/``running`` under the user lock, so a duplicate, late or out-of-order report changes
nothing twice. ``pending`` is accepted because Core's callback can arrive before the releasing
instance has written ``running``. The user's next job is promoted in the same transaction (with
the provider ceiling on, when it is the fairest; otherwise a promotion pass, woken by the
completion's NOTIFY, gives the freed slot to whoever's turn it is).
"""

from __future__ import annotations

import logging

from analysis_queue.core.client import CoreRun
from analysis_queue.queue.dispatch import Dispatcher
from analysis_queue.store.database import Database

log = logging.getLogger(__name__)

_STATUS_OF_STATE = {"completed": "succeeded", "failed": "failed", "cancelled": "cancelled"}


async def apply_core_run(
    db: Database, dispatcher: Dispatcher, run: CoreRun, *, source: str = "callback"
) -> str:
    """Returns ``applied``, ``duplicate``, ``not_finished`` or ``unknown_run``."""
    outcome = await _apply(db, dispatcher, run)
    dispatcher.metrics.callbacks.labels(
        outcome if source == "callback" else f"poll_{outcome}"
    ).inc()
    return outcome


async def _apply(db: Database, dispatcher: Dispatcher, run: CoreRun) -> str:
    status = _STATUS_OF_STATE.get(run.state)
    if status is None:
        return "not_finished"
    error_code = None
    if status == "failed":
        error_code = "analysis_failed"
    elif status == "cancelled":
        error_code = "cancelled_in_core"
    result = await db.finish(
        core_run_id=run.id,
        status=status,
        from_statuses=("pending", "running"),
        error_code=error_code,
        error_detail=run.error,
        verdicts=run.verdicts if status == "succeeded" else None,
        ran=status != "cancelled",
    )
    if result is None:
        log.warning("core event for unknown run", extra={"action": "complete", "run_id": run.id})
        return "unknown_run"
    if result.promoted is not None:
        dispatcher.metrics.promotions.labels("tail").inc()
        dispatcher.submit(result.promoted.id)
    if result.changed and status == "failed" and result.job.cost > 0:
        dispatcher.metrics.refunds.labels("analysis_failed").inc()
    log.info(
        "run finished" if result.changed else "duplicate core event",
        extra={
            "action": "complete",
            "job_id": str(result.job.id),
            "user_id": result.job.user_id,
            "status": result.job.status,
            "promoted_job_id": str(result.promoted.id) if result.promoted else None,
        },
    )
    return "applied" if result.changed else "duplicate"
