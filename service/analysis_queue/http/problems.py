"""Errors as HTTP answers: the one place that maps the service's errors (``errors.py``, which know
nothing of HTTP) to statuses and ``application/problem+json`` (RFC 9457), and the middleware that
does it for every route. No traceback, SQL or secret ever reaches a client."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong

from analysis_queue import errors

log = logging.getLogger(__name__)

PROBLEM_TYPE_BASE = "https://analysis-queue.invalid/problems/"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Each error's HTTP status. A subclass not listed answers as its nearest listed ancestor; a test
# checks that every error has one on purpose.
STATUS: dict[type[errors.AppError], int] = {
    errors.AppError: 500,
    errors.MalformedRequest: 400,
    errors.MalformedHttp: 400,
    errors.RepeatedHeader: 400,
    errors.BadRequest: 400,
    errors.InvalidParameter: 400,
    errors.Unauthorized: 401,
    errors.InvalidSignature: 401,
    errors.InsufficientCredits: 402,
    errors.Forbidden: 403,
    errors.NotFound: 404,
    errors.MethodNotAllowed: 405,
    errors.RequestTimeout: 408,
    errors.IdempotencyKeyReused: 409,
    errors.IdempotencyInProgress: 409,
    errors.Conflict: 409,
    errors.PayloadTooLarge: 413,
    errors.JobTooLarge: 413,
    errors.UnsupportedMediaType: 415,
    errors.HeadersTooLarge: 431,
    errors.InvalidBody: 422,
    errors.CoreRefused: 422,
    errors.InvalidSource: 422,
    errors.UnparseableThesis: 422,
    errors.ProviderBudgetExhausted: 429,
    errors.TooManyStreams: 429,
    errors.CoreRunGone: 502,
    errors.CoreUnavailable: 503,
    errors.DatabaseUnavailable: 503,
    errors.ShuttingDown: 503,
    errors.TooManyConnections: 503,
}
# What a client is told to wait before it tries again, where the answer is about load.

# Headers an answer must carry: RFC 9110 15.5.2, a 401 says how to authenticate.
HEADERS: dict[type[errors.AppError], dict[str, str]] = {
    errors.Unauthorized: {"WWW-Authenticate": 'Bearer realm="analysis-queue"'},
    errors.InvalidSignature: {
        "WWW-Authenticate": (
            'HMAC-SHA256 realm="core-events", headers="X-Core-Timestamp X-Core-Signature"'
        )
    },
}

# Answers after which the connection is closed: the rest of the request may still be arriving.
CLOSES_CONNECTION: frozenset[type[errors.AppError]] = frozenset({errors.RequestTimeout})

# aiohttp's own HTTP errors (raised before or around a handler), as the service's errors.
_HTTP_ERRORS: dict[int, type[errors.AppError]] = {
    400: errors.MalformedRequest,
    404: errors.NotFound,
    405: errors.MethodNotAllowed,
    413: errors.PayloadTooLarge,
    415: errors.UnsupportedMediaType,
}
# Headers of aiohttp's own HTTP errors that a client needs (405 must say what is allowed).
_KEPT_HEADERS = ("Allow",)
# aiohttp's parser says "too many headers" only in this message (a BadHttpMessage like others).
_TOO_MANY_HEADERS = "Too many headers"


def parser_error(exc: HttpProcessingError) -> errors.AppError:
    """What aiohttp's HTTP parser refused, before any route ran, as the service's error: an
    oversized line or too many headers is 431, anything else it cannot parse is 400."""
    if isinstance(exc, LineTooLong) or _TOO_MANY_HEADERS in exc.message:
        return errors.HeadersTooLarge()
    return errors.MalformedHttp()


def status_of(error: errors.AppError | type[errors.AppError]) -> int:
    cls = error if isinstance(error, type) else type(error)
    for klass in cls.__mro__:
        if klass in STATUS:
            return STATUS[klass]
    return 500


def problem_document(error: errors.AppError, instance: str) -> dict[str, Any]:
    """The RFC 9457 document of ``error``."""
    body: dict[str, Any] = {
        "type": PROBLEM_TYPE_BASE + error.code,
        "title": error.title,
        "status": status_of(error),
        "detail": error.detail,
        "code": error.code,
        "instance": instance,
    }
    body.update({k: v for k, v in error.extra.items() if k not in body})
    return body


def headers_of(error: errors.AppError) -> dict[str, str]:
    """The headers ``error``'s answer carries: how to authenticate, when to retry."""
    retry = {} if error.retry_after_s is None else {"Retry-After": str(error.retry_after_s)}
    return {**HEADERS.get(type(error), {}), **retry}


def problem(
    error: errors.AppError, instance: str, headers: dict[str, str] | None = None
) -> web.Response:
    status = status_of(error)
    response = web.Response(
        body=orjson.dumps(problem_document(error, instance)),
        status=status,
        content_type="application/problem+json",
        headers={**headers_of(error), **(headers or {})},
    )
    if type(error) in CLOSES_CONNECTION:
        response.force_close()
    return response


@web.middleware
async def problem_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error becomes application/problem+json; no traceback ever reaches a client."""
    try:
        return await handler(request)
    except errors.AppError as exc:
        if status_of(exc) >= 500:
            log.warning(
                "request failed",
                extra={"action": "http", "code": exc.code, "path": request.path},
            )
        return problem(exc, request.path)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # Whatever else aiohttp may raise is still a problem, never its text page.
        fallback = errors.BadRequest if exc.status < 500 else errors.AppError
        error = _HTTP_ERRORS.get(exc.status, fallback)()
        kept = {name: exc.headers[name] for name in _KEPT_HEADERS if name in exc.headers}
        return problem(error, request.path, kept)
    except Exception:
        log.exception("unhandled error", extra={"action": "http", "path": request.path})
        return problem(errors.AppError(), request.path)
