"""Answers as the client's exceptions: the class for each code, Retry-After, stand-ins for
answers that are no problem document."""

from __future__ import annotations

import email.utils

import pytest
from analysis_queue.client import errors
from analysis_queue.client.errors import parse_retry_after, problem_from_answer


def _problem(status: int, code: str, **extra: object) -> dict[str, object]:
    return {
        "type": f"https://analysis-queue.invalid/problems/{code}",
        "title": "t",
        "status": status,
        "detail": "d",
        "code": code,
        "instance": "/v1/analyses",
        **extra,
    }


@pytest.mark.parametrize(
    ("status", "code", "cls"),
    [
        (402, "insufficient_credits", errors.InsufficientCredits),
        (422, "invalid_body", errors.InvalidBody),
        (400, "invalid_parameter", errors.InvalidParameter),
        (400, "malformed_request", errors.MalformedRequest),
        (422, "invalid_source", errors.InvalidSource),
        (422, "unparseable_thesis", errors.UnparseableThesis),
        (429, "provider_budget_exhausted", errors.ProviderBudgetExhausted),
        (409, "idempotency_key_reused", errors.IdempotencyKeyReused),
        (409, "idempotency_in_progress", errors.IdempotencyInProgress),
        (409, "conflict", errors.Conflict),
        (404, "not_found", errors.NotFound),
        (401, "unauthorized", errors.Unauthorized),
        (413, "job_too_large", errors.JobTooLarge),
        (413, "payload_too_large", errors.PayloadTooLarge),
        (429, "too_many_streams", errors.TooManyStreams),
        (503, "core_unavailable", errors.ServiceUnavailable),
        (503, "database_unavailable", errors.ServiceUnavailable),
        (503, "shutting_down", errors.ServiceUnavailable),
        (503, "too_many_connections", errors.ServiceUnavailable),
        (418, "a_code_from_the_future", errors.ProblemError),
        (404, "a_code_from_the_future", errors.NotFound),
    ],
)
def test_each_code_raises_its_class(status: int, code: str, cls: type[Exception]) -> None:
    exc = problem_from_answer(status, "R", _problem(status, code), {"X-Request-ID": "rq"})
    assert type(exc) is cls
    assert (exc.status, exc.code, exc.title, exc.detail, exc.request_id) == (
        status,
        code,
        "t",
        "d",
        "rq",
    )


def test_the_idempotency_conflicts_share_a_parent_and_core_refusals_too() -> None:
    assert issubclass(errors.IdempotencyKeyReused, errors.IdempotencyConflict)
    assert issubclass(errors.IdempotencyInProgress, errors.IdempotencyConflict)
    for cls in (errors.InvalidSource, errors.UnparseableThesis, errors.ProviderBudgetExhausted):
        assert issubclass(cls, errors.CoreRefused)
    assert issubclass(errors.ProblemError, errors.AnalysisQueueError)


def test_field_errors_and_extra_members_are_kept() -> None:
    body = _problem(422, "invalid_body", errors=[{"field": "sources.0", "message": "bad"}])
    exc = problem_from_answer(422, None, body, {})
    assert [(e.field, e.message) for e in exc.errors] == [("sources.0", "bad")]
    big = problem_from_answer(
        413, None, _problem(413, "job_too_large", limit_bytes=10, size_bytes=11), {}
    )
    assert isinstance(big, errors.JobTooLarge)
    assert (big.limit_bytes, big.size_bytes) == (10, 11)


def test_an_answer_that_is_no_problem_gets_a_stand_in_by_status() -> None:
    gateway = problem_from_answer(
        502, "Bad Gateway", "<html>upstream died</html>", {"Retry-After": "3"}
    )
    assert isinstance(gateway, errors.ServiceUnavailable)
    assert (gateway.code, gateway.detail, gateway.retry_after_s) == (
        "http_502",
        "<html>upstream died</html>",
        3.0,
    )
    teapot = problem_from_answer(418, None, {"not": "a problem"}, {})
    assert type(teapot) is errors.ProblemError and teapot.code == "http_418"


def test_retry_after_in_seconds_or_as_a_date_and_bounded() -> None:
    assert parse_retry_after(None) is None
    assert parse_retry_after("5") == 5.0
    assert parse_retry_after("99999") == errors.RETRY_AFTER_MAX_S
    assert parse_retry_after("soon") is None
    assert parse_retry_after("-1") is None
    now = 1_800_000_000.0
    date = email.utils.formatdate(now + 7, usegmt=True)
    assert parse_retry_after(date, now=now) == pytest.approx(7.0)
    assert parse_retry_after(email.utils.formatdate(now - 60, usegmt=True), now=now) == 0.0
