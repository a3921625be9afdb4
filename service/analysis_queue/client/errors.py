"""What the client raises: every problem+json answer as :class:`ProblemError` or the subclass
for its ``code``, a service that could not be reached as :class:`ConnectionFailed`, and an
answer that breaks the contract as :class:`ProtocolError`. All are :class:`AnalysisQueueError`.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Mapping
from typing import Any

from analysis_queue.client.models import FieldError, Problem

# Retry-After values past this are read as this: a client should not sleep for an hour because
# one answer said so (its retry budget stops it earlier anyway).
RETRY_AFTER_MAX_S = 300.0
# How much of a non-problem error body (a proxy's HTML page) is kept as the detail.
DETAIL_MAX_CHARS = 300


class AnalysisQueueError(Exception):
    """Anything the client raises."""


class ConnectionFailed(AnalysisQueueError):
    """The service could not be reached, the connection broke, or no answer came in time.

    ``sent`` is False when no connection could be opened, so the request never left: such a
    failure is retried for every call, not only for the idempotent ones. ``transient`` is False
    where another try cannot help (a TLS certificate that does not verify)."""

    def __init__(self, message: str, *, sent: bool, transient: bool = True) -> None:
        super().__init__(message)
        self.sent = sent
        self.transient = transient


class ProtocolError(AnalysisQueueError):
    """An answer that does not follow the service's contract (not JSON, not the documented
    shape, not an event stream)."""


class ProblemError(AnalysisQueueError):
    """The service answered with an error: ``status``, its stable ``code``, ``title`` and
    ``detail``; ``errors`` names each bad field (``invalid_body``, ``invalid_parameter``);
    ``retry_after_s`` is the answer's Retry-After, when it has one; ``request_id`` is the
    ``X-Request-ID`` the service logged the request under."""

    def __init__(
        self,
        problem: Problem,
        *,
        retry_after_s: float | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(f"{problem.status} {problem.code}: {problem.detail}")
        self.problem = problem
        self.retry_after_s = retry_after_s
        self.request_id = request_id

    @property
    def status(self) -> int:
        return self.problem.status

    @property
    def code(self) -> str:
        return self.problem.code

    @property
    def title(self) -> str:
        return self.problem.title

    @property
    def detail(self) -> str:
        return self.problem.detail

    @property
    def errors(self) -> list[FieldError]:
        return list(self.problem.errors or ())


class InvalidBody(ProblemError):
    """422 invalid_body: the request body broke a rule; ``errors`` names each field."""


class InvalidParameter(ProblemError):
    """400 invalid_parameter: a query parameter (a page's ``limit`` or ``cursor``)."""


class MalformedRequest(ProblemError):
    """400 malformed_request: not JSON, not well-formed HTTP, or a header that must come once
    (Authorization, Idempotency-Key, Last-Event-ID) repeated."""


class Unauthorized(ProblemError):
    """401: the token is missing, invalid, expired or not this service's."""


class InsufficientCredits(ProblemError):
    """402: not enough credits to start this analysis."""


class NotFound(ProblemError):
    """404: no such job of yours (it may never have existed, be deleted, or another user's)."""


class Conflict(ProblemError):
    """409 conflict: the job is not in a state that allows this (a re-check of a job that did
    not succeed)."""


class IdempotencyConflict(ProblemError):
    """409: an Idempotency-Key that was used with another body, or whose first request is
    still being admitted (:class:`IdempotencyKeyReused`, :class:`IdempotencyInProgress`)."""


class IdempotencyKeyReused(IdempotencyConflict):
    """409 idempotency_key_reused: the key was already used with a different body."""


class IdempotencyInProgress(IdempotencyConflict):
    """409 idempotency_in_progress: the request with this key is still being admitted."""


class PayloadTooLarge(ProblemError):
    """413 payload_too_large: the body is over 1 MiB."""


class JobTooLarge(PayloadTooLarge):
    """413 job_too_large: thesis and sources take more than one job may store."""

    @property
    def limit_bytes(self) -> int | None:
        return _int_member(self.problem, "limit_bytes")

    @property
    def size_bytes(self) -> int | None:
        return _int_member(self.problem, "size_bytes")


class CoreRefused(ProblemError):
    """422 or 429: the analysis engine refused to create the run."""


class InvalidSource(CoreRefused):
    """422 invalid_source: a source does not exist or cannot be read."""


class UnparseableThesis(CoreRefused):
    """422 unparseable_thesis: the thesis document cannot be parsed."""


class ProviderBudgetExhausted(CoreRefused):
    """429 provider_budget_exhausted: the provider's budget is spent for now."""


class TooManyStreams(ProblemError):
    """429 too_many_streams: the user has as many event streams open as they may."""


class ServiceUnavailable(ProblemError):
    """502, 503, 504: the service or what it depends on is briefly unavailable
    (``core_unavailable``, ``database_unavailable``, ``shutting_down``, ``too_many_connections``,
    or a proxy's gateway error); ``retry_after_s`` says when to try again."""


BY_CODE: dict[str, type[ProblemError]] = {
    "invalid_body": InvalidBody,
    "invalid_parameter": InvalidParameter,
    "malformed_request": MalformedRequest,
    "unauthorized": Unauthorized,
    "insufficient_credits": InsufficientCredits,
    "not_found": NotFound,
    "conflict": Conflict,
    "idempotency_key_reused": IdempotencyKeyReused,
    "idempotency_in_progress": IdempotencyInProgress,
    "payload_too_large": PayloadTooLarge,
    "job_too_large": JobTooLarge,
    "core_refused": CoreRefused,
    "invalid_source": InvalidSource,
    "unparseable_thesis": UnparseableThesis,
    "provider_budget_exhausted": ProviderBudgetExhausted,
    "too_many_streams": TooManyStreams,
}
# A code this client does not know (or an answer that is no problem document) by its status.
BY_STATUS: dict[int, type[ProblemError]] = {
    400: MalformedRequest,
    401: Unauthorized,
    402: InsufficientCredits,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    422: InvalidBody,
    502: ServiceUnavailable,
    503: ServiceUnavailable,
    504: ServiceUnavailable,
}


def _int_member(problem: Problem, name: str) -> int | None:
    value = (problem.model_extra or {}).get(name)
    return value if isinstance(value, int) else None


def error_class(status: int, code: str) -> type[ProblemError]:
    if status in (502, 503, 504):
        return ServiceUnavailable  # whatever the code: what matters is that it passes
    return BY_CODE.get(code) or BY_STATUS.get(status) or ProblemError


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header: delta-seconds or an HTTP-date (RFC 9110
    10.2.3); None when absent or unreadable. Bounded by RETRY_AFTER_MAX_S."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return min(float(value), RETRY_AFTER_MAX_S)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    delay = when.timestamp() - (time.time() if now is None else now)
    return min(max(delay, 0.0), RETRY_AFTER_MAX_S)


def problem_from_answer(
    status: int, reason: str | None, body: Any, headers: Mapping[str, str]
) -> ProblemError:
    """The error for a non-2xx answer: its problem document when it is one, else a stand-in
    built from the status (a proxy's HTML 502 still is a :class:`ServiceUnavailable`)."""
    problem: Problem | None = None
    if isinstance(body, dict):
        try:
            problem = Problem.model_validate(body)
        except ValueError:
            problem = None
    if problem is None:
        text = body if isinstance(body, str) else ""
        problem = Problem(
            type="about:blank",
            title=reason or f"HTTP {status}",
            status=status,
            detail=text.strip()[:DETAIL_MAX_CHARS] or (reason or f"HTTP {status}"),
            code=f"http_{status}",
        )
    cls = error_class(status, problem.code)
    return cls(
        problem,
        retry_after_s=parse_retry_after(headers.get("Retry-After")),
        request_id=headers.get("X-Request-ID"),
    )
