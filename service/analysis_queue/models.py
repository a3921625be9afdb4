"""The queue's values: the frozen ``Job`` the database layer returns and its JSON shape, the
closed sets the database's CHECK constraints allow, and the NOTIFY payload."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Generic, TypeVar
from uuid import UUID

import pydantic
from pydantic import BaseModel, ConfigDict

T = TypeVar("T")


class JobStatus(StrEnum):
    """``analysis_jobs.status``: queued -> pending -> running -> a terminal status."""

    QUEUED = "queued"  # admitted; waits for its turn (see WaitReason)
    PENDING = "pending"  # holds its slots; its held run in Core is being released
    RUNNING = "running"  # Core is judging it
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


ACTIVE_STATUSES = frozenset({JobStatus.PENDING, JobStatus.RUNNING})
TERMINAL_STATUSES = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})
OPEN_STATUSES = frozenset({JobStatus.QUEUED, *ACTIVE_STATUSES})


class WaitReason(StrEnum):
    """Why a queued job waits (``analysis_jobs.waiting_for``)."""

    YOUR_PREVIOUS_ANALYSIS = "your_previous_analysis"  # its user is at their limit
    PROVIDER_CAPACITY = "provider_capacity"  # its user has room; the provider ceiling is full


class EventKind(StrEnum):
    """``job_events.kind``: what a committed job change was (triggers/job_events.sql)."""

    ADMITTED = "admitted"
    PROMOTED = "promoted"
    STARTED = "started"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    DELETED = "deleted"
    WAITING = "waiting"
    CHANGED = "changed"


class ChangeNotice(BaseModel):
    """The payload of a NOTIFY on ``aq_jobs_v2`` (triggers/job_notify.sql), one per committed
    transaction that changed jobs: a wake-up hint naming the users whose jobs changed, never
    the source of truth. ``users`` maps each to whether a change of theirs may leave work for a
    promotion or a release (a job left pending/running: its slots freed, and the writer may not
    have filled them; or a job became pending: someone must release it). An admit into the
    queue, a start or a change of wait cannot: the transaction decided all it allows.
    ``overflow``: too many users to name; re-read everything. Unknown keys are ignored: the
    payload only ever gains keys, so listeners of every version read it."""

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    v: int = 2
    at: float | None = None  # epoch seconds of the transaction's first change
    users: dict[str, int] = pydantic.Field(default_factory=dict, alias="u")
    overflow: bool = False

    def wakes(self) -> list[str]:
        """The users a change of whose may have left work, in a stable order."""
        return sorted(user for user, wake in self.users.items() if wake)


# A pending job shows the error of its last release attempt (release_retrying).
_ERROR_SHOWN = TERMINAL_STATUSES | {JobStatus.PENDING}


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _wait(value: str | None) -> WaitReason | None:
    return WaitReason(value) if value is not None else None


@dataclass(frozen=True, slots=True)
class Job:
    id: UUID
    user_id: str
    run_id: UUID
    core_run_id: str | None
    status: JobStatus
    queue_seq: int
    delta_of_job_id: UUID | None
    deleted_at: datetime | None
    thesis: dict[str, Any]
    sources: list[str]
    cost: int
    created_at: datetime
    promoted_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    release_attempts: int
    next_release_at: datetime | None
    error_code: str | None
    error_detail: str | None
    verdicts: list[dict[str, Any]] | None
    queue_position: int | None = None
    waiting_for: WaitReason | None = None  # queued only
    claimed_by: str | None = None  # the instance releasing it, while pending

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Job:
        return cls(
            id=row["id"],
            user_id=row["user_id"],
            run_id=row["run_id"],
            core_run_id=row["core_run_id"],
            status=JobStatus(row["status"]),
            queue_seq=row["queue_seq"],
            delta_of_job_id=row["delta_of_job_id"],
            deleted_at=row["deleted_at"],
            thesis=row["thesis"],
            sources=row["sources"],
            cost=row["cost"],
            created_at=row["created_at"],
            promoted_at=row["promoted_at"],
            started_at=row["started_at"],
            finished_at=row["finished_at"],
            release_attempts=row["release_attempts"],
            next_release_at=row["next_release_at"],
            error_code=row["error_code"],
            error_detail=row["error_detail"],
            verdicts=row["verdicts"],
            queue_position=row.get("queue_position"),
            waiting_for=_wait(row.get("waiting_for")),
            claimed_by=row.get("claimed_by"),
        )

    @property
    def is_first_pass(self) -> bool:
        return self.delta_of_job_id is None

    def summary(self) -> JobSummary:
        return JobSummary(
            id=self.id,
            user_id=self.user_id,
            run_id=self.run_id,
            status=self.status,
            queue_seq=self.queue_seq,
            delta_of_job_id=self.delta_of_job_id,
            thesis=self.thesis,
            source_count=len(self.sources),
            verdict_counts=count_verdicts(self.verdicts),
            created_at=self.created_at,
            promoted_at=self.promoted_at,
            started_at=self.started_at,
            finished_at=self.finished_at,
            error_code=self.error_code,
            error_detail=self.error_detail,
            queue_position=self.queue_position,
            waiting_for=self.waiting_for,
        )

    def to_json(self) -> dict[str, Any]:
        """The whole job, as ``GET /v1/analyses/{id}`` and a create answer show it: its summary
        with the sources and the verdicts."""
        return {**self.summary().to_json(), "sources": self.sources, "verdicts": self.verdicts}


def count_verdicts(verdicts: list[dict[str, Any]] | None) -> dict[str, int] | None:
    """How many sources got each verdict; None before there are verdicts."""
    if verdicts is None:
        return None
    counts: dict[str, int] = {}
    for verdict in verdicts:
        name = str(verdict.get("verdict"))
        counts[name] = counts.get(name, 0) + 1
    return counts


@dataclass(frozen=True, slots=True)
class JobSummary:
    """A job without its sources and verdicts: what lists and event frames carry, so that their
    size does not grow with the jobs' (the whole job is ``GET /v1/analyses/{id}``)."""

    id: UUID
    user_id: str
    run_id: UUID
    status: JobStatus
    queue_seq: int
    delta_of_job_id: UUID | None
    thesis: dict[str, Any]
    source_count: int
    verdict_counts: dict[str, int] | None
    created_at: datetime
    promoted_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    error_code: str | None
    error_detail: str | None
    queue_position: int | None = None
    waiting_for: WaitReason | None = None  # queued only

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> JobSummary:
        return cls(
            id=row["id"],
            user_id=row["user_id"],
            run_id=row["run_id"],
            status=JobStatus(row["status"]),
            queue_seq=row["queue_seq"],
            delta_of_job_id=row["delta_of_job_id"],
            thesis=row["thesis"],
            source_count=row["source_count"],
            verdict_counts=row["verdict_counts"],
            created_at=row["created_at"],
            promoted_at=row["promoted_at"],
            started_at=row["started_at"],
            finished_at=row["finished_at"],
            error_code=row["error_code"],
            error_detail=row["error_detail"],
            queue_position=row.get("queue_position"),
            waiting_for=_wait(row.get("waiting_for")),
        )

    def to_json(self) -> dict[str, Any]:
        """The job as lists (``GET /v1/analyses``, the stream's snapshot) and event frames show
        it."""
        error = None
        if self.error_code is not None and self.status in _ERROR_SHOWN:
            error = {"code": self.error_code, "detail": self.error_detail}
        queued = self.status == JobStatus.QUEUED
        return {
            "id": str(self.id),
            "run_id": str(self.run_id),
            "status": self.status,
            "queue_position": self.queue_position if queued else None,
            "waiting_for": self.waiting_for if queued else None,
            "delta_of": str(self.delta_of_job_id) if self.delta_of_job_id else None,
            "thesis": self.thesis,
            "source_count": self.source_count,
            "verdict_counts": self.verdict_counts,
            "created_at": _iso(self.created_at),
            "promoted_at": _iso(self.promoted_at),
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
            "error": error,
        }


@dataclass(frozen=True, slots=True)
class JobEvent:
    """One entry of a user's event log (ids per user, in commit order), with its job as it is
    now; ``job`` is None if the job's row is gone."""

    event_id: int
    kind: EventKind
    created_at: datetime
    job: JobSummary | None


@dataclass(frozen=True, slots=True)
class EventPage:
    """A page of a user's event log; ``more``: events after it may be waiting. ``queued``: the
    user's queued first-pass jobs in queue order, read with the page (empty with no events)."""

    events: tuple[JobEvent, ...]
    more: bool
    queued: tuple[UUID, ...] = ()


@dataclass(frozen=True, slots=True)
class QueuePosition:
    """Where a queued first-pass job stands in its user's queue (1 = next)."""

    job_id: UUID
    position: int


class ReservationOutcome(StrEnum):
    """What ``aq_reserve_v2`` found for one click (sql/functions/admit.sql)."""

    RESERVED = "reserved"  # a run id is reserved and the cost held: ask Core for a held run
    EXISTING = "existing"  # the Idempotency-Key names a job admitted with this very body
    IN_PROGRESS = "in_progress"  # ... a request with this body that is still being admitted
    KEY_REUSED = "key_reused"  # ... a different body
    INSUFFICIENT_CREDITS = "insufficient_credits"


@dataclass(frozen=True, slots=True)
class Reservation:
    """The answer of ``reserve``: what to do with an admit before Core is called."""

    outcome: ReservationOutcome
    job_id: UUID | None
    balance: int | None


@dataclass(frozen=True, slots=True)
class Finish:
    """The answer of ``finish``: the job after the call, and what the call changed."""

    job: Job
    old_status: JobStatus
    changed: bool
    refunded: bool  # this call gave the job's cost back (sql/functions/credits.sql)
    promoted: tuple[Job, ...]  # the jobs it moved from queued to pending, in the slot it freed
    asks_pass: bool = False  # capacity is left that a promotion pass must give out


# -- the requests group commits carry (eq=False: hashed by identity, one per caller) ----------


@dataclass(frozen=True, slots=True, eq=False)
class ReserveRequest:
    """One click's reservation (an item of ``aq_reserve_v2``)."""

    user_id: str
    run_id: UUID
    job_id: UUID
    cost: int
    thesis: dict[str, Any]
    sources: list[str]
    idempotency_key: str | None
    request_hash: str | None


@dataclass(frozen=True, slots=True, eq=False)
class AdmitRequest:
    """One click's admit once Core holds its run (an item of ``aq_admit_v3``)."""

    job_id: UUID
    user_id: str
    run_id: UUID
    core_run_id: str
    thesis: dict[str, Any]
    sources: list[str]
    cost: int
    delta_of: UUID | None
    idempotency_key: str | None
    request_hash: str | None


@dataclass(frozen=True, slots=True, eq=False)
class CompletionRequest:
    """Core's report that a run ended, to finish its job (an item of ``aq_finish_v3``)."""

    core_run_id: str
    status: JobStatus
    from_statuses: tuple[JobStatus, ...]
    error_code: str | None
    error_detail: str | None
    verdicts: list[dict[str, Any]] | None
    ran: bool


class BatchOutcome(StrEnum):
    """What a group commit did with one request (sql/functions/admit.sql, finish.sql)."""

    DONE = "done"  # decided in the batch: see the result
    INSUFFICIENT_CREDITS = "insufficient_credits"
    RESERVATION_GONE = "reservation_gone"  # the sweep reclaimed the click's reservation
    UNKNOWN = "unknown"  # no job has this Core run


@dataclass(frozen=True, slots=True)
class Batched(Generic[T]):
    """One request's answer from a group commit: its outcome, and the result when DONE."""

    outcome: BatchOutcome
    result: T | None = None


@dataclass(frozen=True, slots=True)
class Admission:
    """The answer of ``admit``: the job, and the jobs the admit moved from queued to pending
    (others' jobs, which the placement of its batch started), and whether capacity is left
    that a promotion pass must give out."""

    job: Job
    promoted: tuple[Job, ...]
    asks_pass: bool = False


@dataclass(frozen=True, slots=True)
class Woken:
    """The answer of a wake-up (``aq_promote_woken_v2``)."""

    ceiling: int | None
    promoted: tuple[Job, ...]  # moved from queued to pending by the wake-up
    unreleased: tuple[Job, ...]  # pending, and nobody is releasing them


@dataclass(frozen=True, slots=True)
class Capacity:
    """The provider ceiling as the database holds it: ``ceiling`` None when off."""

    ceiling: int | None
    active: int  # jobs pending or running, each holding a global slot when the ceiling is on
    jobs_waiting: int  # queued jobs whose user has room: they wait for the provider
    users_waiting: int

    def to_json(self) -> dict[str, Any]:
        return {
            "global_max_running": self.ceiling,
            "slots_in_use": self.active,
            "jobs_waiting_for_capacity": self.jobs_waiting,
            "users_waiting_for_capacity": self.users_waiting,
        }


@dataclass(frozen=True, slots=True)
class UserLimit:
    """A user's concurrency: how many of their first-pass analyses may run at once."""

    user_id: str
    max_running: int
    custom: bool  # False: the default of 1
    active: int
    queued: int

    def to_json(self) -> dict[str, Any]:
        return {
            "user_id": self.user_id,
            "max_running": self.max_running,
            "default": not self.custom,
            "active": self.active,
            "queued": self.queued,
        }


@dataclass(frozen=True, slots=True)
class StaleReservation:
    run_id: UUID
    job_id: UUID
    user_id: str
    core_run_id: str | None
    thesis: dict[str, Any]
    sources: list[str]
