"""The service's one error hierarchy.

Every condition a client can be told about is a subclass of :class:`AppError`. The class
docstring is the default human message, ``code`` is the stable machine-readable code, and
``status`` the HTTP status. ``api.problem_middleware`` turns any of them into
``application/problem+json``; handlers raise, they never build error responses by hand.
"""

from __future__ import annotations

from typing import Any, ClassVar


class AppError(Exception):
    """The service could not complete the request."""

    code: ClassVar[str] = "internal_error"
    status: ClassVar[int] = 500
    headers: ClassVar[dict[str, str]] = {}

    def __init__(self, detail: str | None = None, **extra: Any) -> None:
        self.detail = detail or (type(self).__doc__ or "").strip()
        self.extra = extra
        super().__init__(self.detail)

    @property
    def title(self) -> str:
        return (type(self).__doc__ or self.code).strip().splitlines()[0]


# --- 4xx: the request ------------------------------------------------------------------


class MalformedRequest(AppError):
    """The request body is not valid JSON."""

    code = "malformed_request"
    status = 400


class Unauthorized(AppError):
    """Missing or invalid credentials."""

    code = "unauthorized"
    status = 401
    headers: ClassVar[dict[str, str]] = {"WWW-Authenticate": 'Bearer realm="analysis-queue"'}


class InvalidSignature(AppError):
    """The callback signature or timestamp is missing or invalid."""

    code = "invalid_signature"
    status = 401
    headers: ClassVar[dict[str, str]] = {
        "WWW-Authenticate": (
            'HMAC-SHA256 realm="core-events", headers="X-Core-Timestamp X-Core-Signature"'
        )
    }


class Forbidden(AppError):
    """These credentials may not do this."""

    code = "forbidden"
    status = 403


class NotFound(AppError):
    """No such analysis."""

    code = "not_found"
    status = 404


class MethodNotAllowed(AppError):
    """This method is not allowed on this resource."""

    code = "method_not_allowed"
    status = 405


class IdempotencyKeyReused(AppError):
    """This Idempotency-Key was already used with a different request body."""

    code = "idempotency_key_reused"
    status = 409


class IdempotencyInProgress(AppError):
    """A request with this Idempotency-Key is still being processed; retry shortly."""

    code = "idempotency_in_progress"
    status = 409


class Conflict(AppError):
    """The analysis is not in a state that allows this."""

    code = "conflict"
    status = 409


class PayloadTooLarge(AppError):
    """The request body is too large."""

    code = "payload_too_large"
    status = 413


class UnsupportedMediaType(AppError):
    """The request body must be application/json."""

    code = "unsupported_media_type"
    status = 415


class InvalidBody(AppError):
    """The request body is invalid."""

    code = "invalid_body"
    status = 422


class BadRequest(AppError):
    """The request cannot be handled as sent."""

    code = "bad_request"
    status = 400


class InsufficientCredits(AppError):
    """Not enough credits to start this analysis."""

    code = "insufficient_credits"
    status = 402


# --- Core's refusals at admit time (synchronous 4xx on the click) --------------------------


class CoreRefused(AppError):
    """Core refused to create the analysis run."""

    code = "core_refused"
    status = 422


class InvalidSource(CoreRefused):
    """Core rejected one or more sources."""

    code = "invalid_source"
    status = 422


class UnparseableThesis(CoreRefused):
    """Core could not parse the thesis document."""

    code = "unparseable_thesis"
    status = 422


class ProviderBudgetExhausted(CoreRefused):
    """The analysis provider's budget is exhausted for now; try again later."""

    code = "provider_budget_exhausted"
    status = 429


# --- 5xx: us or our dependencies -----------------------------------------------------------


class CoreUnavailable(AppError):
    """The analysis engine is unreachable right now; try again shortly."""

    code = "core_unavailable"
    status = 503


class CoreRunGone(AppError):
    """Core no longer holds this run (unknown, cancelled or finished)."""

    code = "core_run_gone"
    status = 502


class DatabaseUnavailable(AppError):
    """The database is unreachable right now; try again shortly."""

    code = "database_unavailable"
    status = 503


class ShuttingDown(AppError):
    """This instance is shutting down; retry against another one."""

    code = "shutting_down"
    status = 503
