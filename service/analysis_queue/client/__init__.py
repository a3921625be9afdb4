"""A Python client of the analysis-queue HTTP API: typed, retrying, resumable.

    async with AnalysisQueueClient("https://aq.example", token) as aq:
        job = await aq.start_analysis("Thesis", "https://uni.example/t.pdf", ["10.1000/x"])
        done = await aq.wait_for(job.id, timeout_s=600)

It needs aiohttp, pydantic and tenacity, and nothing of the service: importing it starts
nothing, reads no setting and loads no database driver (a test checks).

- ``api.py``: :class:`AnalysisQueueClient` (a user's calls, events, waits) and
  :class:`AdminClient`;
- ``models.py``: the answers as pydantic models, checked against the live ``/openapi.json``;
- ``errors.py``: :class:`ProblemError` and a subclass per problem code;
- ``retries.py``: what is retried, and how long the client waits (:class:`RetryPolicy`);
- ``stream.py``: :class:`EventStream`, the event stream across reconnects; ``sse.py`` parses it;
- ``waits.py``: ``wait_for`` on the stream; ``transport.py``: one request, auth, the session.
"""

from __future__ import annotations

from analysis_queue.client.api import AdminClient, AnalysisQueueClient
from analysis_queue.client.errors import (
    AnalysisQueueError,
    Conflict,
    ConnectionFailed,
    CoreRefused,
    IdempotencyConflict,
    IdempotencyInProgress,
    IdempotencyKeyReused,
    InsufficientCredits,
    InvalidBody,
    InvalidParameter,
    InvalidSource,
    JobTooLarge,
    MalformedRequest,
    NotFound,
    PayloadTooLarge,
    ProblemError,
    ProtocolError,
    ProviderBudgetExhausted,
    ServiceUnavailable,
    TooManyStreams,
    Unauthorized,
    UnparseableThesis,
)
from analysis_queue.client.models import (
    Analysis,
    AnalysisPage,
    AnalysisStatus,
    AnalysisSummary,
    Capacity,
    ErrorDetail,
    Event,
    EventKind,
    FieldError,
    JobEvent,
    PositionEvent,
    Problem,
    QueuePosition,
    SnapshotEvent,
    Thesis,
    UserLimit,
    Verdict,
    WaitReason,
)
from analysis_queue.client.retries import NO_RETRIES, RetryPolicy
from analysis_queue.client.stream import EventStream, StreamSettings
from analysis_queue.client.transport import TokenSource

__all__ = [
    "NO_RETRIES",
    "AdminClient",
    "Analysis",
    "AnalysisPage",
    "AnalysisQueueClient",
    "AnalysisQueueError",
    "AnalysisStatus",
    "AnalysisSummary",
    "Capacity",
    "Conflict",
    "ConnectionFailed",
    "CoreRefused",
    "ErrorDetail",
    "Event",
    "EventKind",
    "EventStream",
    "FieldError",
    "IdempotencyConflict",
    "IdempotencyInProgress",
    "IdempotencyKeyReused",
    "InsufficientCredits",
    "InvalidBody",
    "InvalidParameter",
    "InvalidSource",
    "JobEvent",
    "JobTooLarge",
    "MalformedRequest",
    "NotFound",
    "PayloadTooLarge",
    "PositionEvent",
    "Problem",
    "ProblemError",
    "ProtocolError",
    "ProviderBudgetExhausted",
    "QueuePosition",
    "RetryPolicy",
    "ServiceUnavailable",
    "SnapshotEvent",
    "StreamSettings",
    "Thesis",
    "TokenSource",
    "TooManyStreams",
    "Unauthorized",
    "UnparseableThesis",
    "UserLimit",
    "Verdict",
    "WaitReason",
]
