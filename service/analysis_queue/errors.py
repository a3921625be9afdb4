"""The service's one error hierarchy: what went wrong, in the queue's words.

Every condition a client can be told about is a subclass of :class:`AppError`. The class
docstring is the default human message and ``code`` the stable machine-readable code. The errors
know nothing of HTTP: ``http/problems.py`` alone maps each to a status and turns it into
``application/problem+json``; handlers raise, they never build error responses by hand.
"""

from __future__ import annotations

from typing import Any, ClassVar


class AppError(Exception):
    """The service could not complete the request."""

    code: ClassVar[str] = "internal_error"
    # Seconds after which a retry may succeed, for a condition that passes (a 503, a 429);
    # None for an answer that a retry does not change.
    retry_after_s: int | None = None

    def __init__(
        self, detail: str | None = None, *, retry_after_s: int | None = None, **extra: Any
    ) -> None:
        self.detail = detail or (type(self).__doc__ or "").strip()
        self.extra = extra
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s
        super().__init__(self.detail)

    @property
    def title(self) -> str:
        return (type(self).__doc__ or self.code).strip().splitlines()[0]


# --- the request ------------------------------------------------------------------


class MalformedRequest(AppError):
    """The request body is not valid JSON."""

    code = "malformed_request"


class MalformedHttp(MalformedRequest):
    """The request is not well-formed HTTP."""


class RepeatedHeader(MalformedRequest):
    """A header that must come once came more than once."""


class RequestTimeout(AppError):
    """The request was not received in time."""

    code = "request_timeout"


class HeadersTooLarge(AppError):
    """The request line or a header field is too large, or there are too many headers."""

    code = "headers_too_large"


class Unauthorized(AppError):
    """Missing or invalid credentials."""

    code = "unauthorized"


class InvalidSignature(AppError):
    """The callback signature or timestamp is missing or invalid."""

    code = "invalid_signature"


class Forbidden(AppError):
    """These credentials may not do this."""

    code = "forbidden"


class NotFound(AppError):
    """No such analysis."""

    code = "not_found"


class MethodNotAllowed(AppError):
    """This method is not allowed on this resource."""

    code = "method_not_allowed"


class IdempotencyKeyReused(AppError):
    """This Idempotency-Key was already used with a different request body."""

    code = "idempotency_key_reused"


class IdempotencyInProgress(AppError):
    """A request with this Idempotency-Key is still being processed; retry shortly."""

    code = "idempotency_in_progress"


class Conflict(AppError):
    """The analysis is not in a state that allows this."""

    code = "conflict"


class PayloadTooLarge(AppError):
    """The request body is too large."""

    code = "payload_too_large"


class JobTooLarge(PayloadTooLarge):
    """The analysis is larger than one job may store."""

    code = "job_too_large"


class UnsupportedMediaType(AppError):
    """The request body must be application/json."""

    code = "unsupported_media_type"


class InvalidBody(AppError):
    """The request body is invalid."""

    code = "invalid_body"


class BadRequest(AppError):
    """The request cannot be handled as sent."""

    code = "bad_request"


class InvalidParameter(BadRequest):
    """A query parameter is invalid."""

    code = "invalid_parameter"


class InsufficientCredits(AppError):
    """Not enough credits to start this analysis."""

    code = "insufficient_credits"


# --- Core's refusals at admit time (synchronous, on the click) --------------------------


class CoreRefused(AppError):
    """Core refused to create the analysis run."""

    code = "core_refused"


class InvalidSource(CoreRefused):
    """Core rejected one or more sources."""

    code = "invalid_source"


class UnparseableThesis(CoreRefused):
    """Core could not parse the thesis document."""

    code = "unparseable_thesis"


class ProviderBudgetExhausted(CoreRefused):
    """The analysis provider's budget is exhausted for now; try again later."""

    code = "provider_budget_exhausted"


# --- us or our dependencies -----------------------------------------------------------


class CoreUnavailable(AppError):
    """The analysis engine is unreachable right now; try again shortly."""

    code = "core_unavailable"
    retry_after_s = 2


class CoreRunGone(AppError):
    """Core no longer holds this run (unknown, cancelled or finished)."""

    code = "core_run_gone"


class DatabaseUnavailable(AppError):
    """The database is unreachable right now; try again shortly."""

    code = "database_unavailable"
    retry_after_s = 1
    # True when the statement certainly did not commit (the server refused it, or it never got
    # a place in a statement); False when its outcome is unknown (a connection lost mid-way).
    nothing_written = False
    # True when the connection died under the statement (a terminated backend, a reset socket):
    # a statement that is safe to repeat may be sent once more, on another connection.
    connection_lost = False


class TooManyConnections(AppError):
    """This instance holds as many connections as it may; retry shortly."""

    code = "too_many_connections"
    retry_after_s = 1


class ShuttingDown(AppError):
    """This instance is shutting down; retry against another one."""

    code = "shutting_down"
    retry_after_s = 1


class TooManyStreams(AppError):
    """Too many event streams are open; close one, or try again later."""

    code = "too_many_streams"
    retry_after_s = 5
