"""The map from the service's errors to HTTP (``http/problems.py``), without a server."""

from __future__ import annotations

from analysis_queue import errors
from analysis_queue.http.problems import HEADERS, STATUS, headers_of, status_of


def _all(cls: type[errors.AppError]) -> list[type[errors.AppError]]:
    return [cls, *(sub for direct in cls.__subclasses__() for sub in _all(direct))]


def test_every_error_has_its_own_status_on_purpose() -> None:
    every = _all(errors.AppError)
    assert len(every) > 15
    assert [cls.__name__ for cls in every if cls not in STATUS] == []
    assert all(400 <= STATUS[cls] <= 599 for cls in every)


def test_errors_know_nothing_of_http() -> None:
    for cls in _all(errors.AppError):
        assert not hasattr(cls, "status") and not hasattr(cls, "headers"), cls.__name__


def test_statuses_of_core_refusals_and_unavailability() -> None:
    assert status_of(errors.InvalidSource("x")) == 422
    assert status_of(errors.ProviderBudgetExhausted) == 429
    assert status_of(errors.DatabaseUnavailable()) == 503
    assert {status_of(cls) for cls in HEADERS} == {401}


def test_answers_a_retry_may_change_say_when() -> None:
    retried = {cls for cls in _all(errors.AppError) if cls.retry_after_s is not None}
    assert {status_of(cls) for cls in retried} == {429, 503}
    assert errors.ProviderBudgetExhausted not in retried, "Core says when, not us"
    for cls in (errors.TooManyConnections, errors.DatabaseUnavailable, errors.TooManyStreams):
        assert headers_of(cls())["Retry-After"].isdigit()
    assert "Retry-After" not in headers_of(errors.NotFound())
    assert headers_of(errors.DatabaseUnavailable(retry_after_s=7))["Retry-After"] == "7"
