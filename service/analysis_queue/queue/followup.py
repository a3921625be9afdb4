"""The follow-up: what this process does after a queue decision commits, the same for every one.

A decision (an admit, a finish, a cancel, a promotion, a change of limit) is one transaction in
the database; what it changed there is done. What is left for the process is the same whatever
the decision was, and lives in :meth:`FollowUp.after`:

- every job the decision moved from queued to pending is counted once, by why it happened
  (``aq_promotions_total{trigger}``), and handed to the dispatcher, which releases its held run;
- a job that is pending for another reason (admitted straight into a free slot, or found
  pending with nobody releasing it) is handed to the dispatcher without being counted;
- a refund is counted by its reason (``aq_refunds_total{reason}``, the job's error code);
- a decision that changed who may use the provider's capacity without using it itself asks for
  a promotion pass, which gives free global slots to whoever's turn it is.

The dispatcher and the promoter are reached through the protocols below, so that this module
imports neither (they both use it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from analysis_queue.metrics import Metrics
from analysis_queue.models import Job

log = logging.getLogger(__name__)


class Trigger(StrEnum):
    """Why a promotion happened: the label of ``aq_promotions_total``."""

    TAIL = "tail"  # a finish (a cancel too) filled the slot it freed, or a pass it asked for did
    NOTIFY = "notify"  # a notification woke a promotion
    SWEEP = "sweep"  # the periodic fallback
    ADMIT = "admit"  # an admit started it (the ceiling on), or a pass it asked for did
    CANCEL = "cancel"  # a pass a cancel asked for
    LIMIT = "limit"  # a change of a user's limit, or a pass it asked for
    CEILING = "ceiling"  # the passes an instance runs after setting the ceiling at start


class Releases(Protocol):
    """Who releases held runs (``loops/dispatch.Dispatcher``): ``release(job)`` knows from the
    job whether its claim is already this instance's."""

    def release(self, job: Job) -> None: ...


class Passes(Protocol):
    """Who runs promotion passes (``loops/promote.Promoter``)."""

    def pass_soon(self, trigger: Trigger, user_id: str | None = None) -> None: ...


@dataclass(frozen=True, slots=True)
class Decision:
    """A committed queue decision, as far as what follows it is concerned."""

    trigger: Trigger  # the label of what it promoted
    user_id: str | None = None
    promoted: Sequence[Job] = ()  # moved queued -> pending by this decision
    unreleased: Sequence[Job] = ()  # pending for another reason, and nobody releases them yet
    refunded: Job | None = None  # its cost went back by this decision
    # It changed who may use the provider's capacity and left that to a pass, asked for with
    # this label (the ceiling on).
    asks_pass: Trigger | None = None


class FollowUp:
    """``after(decision)`` for every committed decision. Bound to the dispatcher and promoter
    once both exist (they take this object in their constructors)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._releases: Releases | None = None
        self._passes: Passes | None = None

    def bind(self, releases: Releases, passes: Passes) -> None:
        self._releases = releases
        self._passes = passes

    def after(self, decision: Decision) -> None:
        """React to a committed decision. Never blocks (it only schedules)."""
        if self._releases is None or self._passes is None:
            raise RuntimeError("FollowUp.bind() must be called before decisions are made")
        trigger = decision.trigger
        for job in decision.promoted:
            self._metrics.promotions.labels(trigger).inc()
            log.info(
                "promoted",
                extra={
                    "action": "promote",
                    "trigger": trigger,
                    "job_id": str(job.id),
                    "user_id": job.user_id,
                },
            )
            self._releases.release(job)
        for job in decision.unreleased:
            self._releases.release(job)
        if decision.refunded is not None:
            self._metrics.refunds.labels(decision.refunded.error_code or "unknown").inc()
        if decision.asks_pass is not None:
            self._passes.pass_soon(decision.asks_pass, decision.user_id)
