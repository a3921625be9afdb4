"""The service's answers as typed, frozen pydantic models: a job (whole or as a summary), the
event stream's frames, credits, capacity, user limits and problem documents.

They mirror the schemas of ``GET /openapi.json`` field for field (a test checks them against a
live instance), and ``model_dump(mode="json")`` gives back the JSON they were read from. Keys a
newer service adds are ignored, so an older client keeps working; the test says when to add them.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal
from uuid import UUID

from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer


def _iso(value: datetime) -> str:
    return value.isoformat()


# The service writes timestamps with ``isoformat()`` (``+00:00``); they are dumped the same way.
Timestamp = Annotated[datetime, PlainSerializer(_iso, return_type=str, when_used="json")]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class AnalysisStatus(StrEnum):
    """Where a job is: queued -> pending -> running -> succeeded | failed | cancelled."""

    QUEUED = "queued"  # admitted; waits for its turn (``waiting_for`` says why)
    PENDING = "pending"  # its turn came; Core is being told to start it
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({AnalysisStatus.SUCCEEDED, AnalysisStatus.FAILED, AnalysisStatus.CANCELLED})


class WaitReason(StrEnum):
    """Why a queued job waits."""

    YOUR_PREVIOUS_ANALYSIS = "your_previous_analysis"  # its user is at their limit
    PROVIDER_CAPACITY = "provider_capacity"  # the provider's global ceiling is full


class Thesis(_Model):
    title: str
    document_url: str


class ErrorDetail(_Model):
    """Why a job failed (or, while pending, why its last start attempt did)."""

    code: str
    detail: str | None


class Verdict(_Model):
    source: str
    verdict: str


class AnalysisSummary(_Model):
    """A job without its sources and verdicts, as lists and event frames carry it."""

    id: UUID
    run_id: UUID
    status: AnalysisStatus
    queue_position: int | None  # 1 = next; None unless queued
    waiting_for: WaitReason | None  # None unless queued
    delta_of: UUID | None  # the job a re-check re-checks
    thesis: Thesis
    source_count: int
    verdict_counts: dict[str, int] | None  # None until there are verdicts
    created_at: Timestamp
    promoted_at: Timestamp | None
    started_at: Timestamp | None
    finished_at: Timestamp | None
    error: ErrorDetail | None

    @property
    def terminal(self) -> bool:
        return self.status.terminal


class Analysis(AnalysisSummary):
    """A job, whole: its summary with its sources and verdicts."""

    sources: list[str]
    verdicts: list[Verdict] | None


class AnalysisPage(_Model):
    """One page of ``GET /v1/analyses``: newest first; ``next`` is the cursor of the page after
    it, None on the last."""

    analyses: list[AnalysisSummary]
    next: str | None


# -- the event stream ---------------------------------------------------------------------------


class EventKind(StrEnum):
    """The ``kind`` of a stream frame: a stored job event, or ``position`` / ``snapshot``."""

    ADMITTED = "admitted"
    PROMOTED = "promoted"
    STARTED = "started"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    DELETED = "deleted"
    WAITING = "waiting"
    CHANGED = "changed"
    POSITION = "position"  # queued jobs moved up; not stored, no id
    SNAPSHOT = "snapshot"  # the user's newest jobs, when there is nothing to resume


STORED_KINDS = frozenset(EventKind) - {EventKind.POSITION, EventKind.SNAPSHOT}


def _known_kind(value: Any) -> Any:
    """A kind this client knows becomes the enum; one a newer service added stays a string, so
    the stream goes on (a client that refused it would reconnect into the same frame for ever)."""
    if isinstance(value, str) and value in EventKind._value2member_map_:
        return EventKind(value)
    return value


class JobEvent(_Model):
    """A stored event: per user, ``id`` is dense (1, 2, 3, ...) and in commit order. ``job`` is
    the job's summary when the frame was sent, so it can be ahead of the event (an ``admitted``
    frame may already say ``running``): apply frames in order, the last one wins. None if the
    job is gone."""

    id: int
    kind: Annotated[EventKind | str, BeforeValidator(_known_kind)]
    at: Timestamp
    job: AnalysisSummary | None


class QueuePosition(_Model):
    id: UUID
    queue_position: int


class PositionEvent(_Model):
    """Queued jobs moved up (jobs ahead of them left the queue): the moved ones, where they stand
    now. Not stored and without an id: it never counts in ``last_event_id``."""

    id: None
    kind: Literal[EventKind.POSITION]
    at: Timestamp
    positions: list[QueuePosition]


class SnapshotEvent(_Model):
    """The first frame when there is nothing to resume (no ``last_event_id``, or one older than
    the events kept): the user's newest jobs as ``GET /v1/analyses`` lists them and the cursor
    of the page after them. ``id`` is the latest event id: the events after it follow."""

    id: int
    kind: Literal[EventKind.SNAPSHOT]
    at: Timestamp
    analyses: list[AnalysisSummary]
    next: str | None


Event = JobEvent | PositionEvent | SnapshotEvent


def parse_event(event_type: str, data: str) -> Event:
    """One stream frame, by its SSE ``event`` name; ``pydantic.ValidationError`` if malformed."""
    if event_type == EventKind.POSITION:
        return PositionEvent.model_validate_json(data)
    if event_type == EventKind.SNAPSHOT:
        return SnapshotEvent.model_validate_json(data)
    return JobEvent.model_validate_json(data)


# -- credits and administration -----------------------------------------------------------------


class Credits(_Model):
    balance: int
    held: int = 0  # of the balance, what clicks still being admitted hold


class CreditGrantResult(_Model):
    user_id: str
    balance: int


class Capacity(_Model):
    """The provider ceiling in force (None: off), slots in use and who waits for capacity."""

    global_max_running: int | None
    slots_in_use: int
    jobs_waiting_for_capacity: int
    users_waiting_for_capacity: int


class UserLimit(_Model):
    """How many of a user's first-pass analyses may run at once; ``default``: no plan set."""

    user_id: str
    max_running: int
    default: bool
    active: int
    queued: int


# -- problems ---------------------------------------------------------------------------------


class FieldError(_Model):
    field: str
    message: str


class Problem(BaseModel):
    """An ``application/problem+json`` answer (RFC 9457) with the service's stable ``code``.
    Members beyond the standard ones (``limit_bytes``, ``size_bytes`` of ``job_too_large``) are
    kept, as ``model_extra``."""

    model_config = ConfigDict(frozen=True, extra="allow")

    type: str
    title: str
    status: int
    detail: str
    code: str
    instance: str | None = None
    errors: list[FieldError] | None = None
