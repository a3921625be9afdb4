"""What the client retries, how long it waits and when it stops (tenacity, no sockets)."""

from __future__ import annotations

from typing import Any

import pytest
from analysis_queue.client import errors
from analysis_queue.client.models import Problem
from analysis_queue.client.retries import NO_RETRIES, RetryPolicy, retryable, retrying


def _problem(status: int, code: str, retry_after_s: float | None = None) -> errors.ProblemError:
    cls = errors.error_class(status, code)
    doc = Problem(type="t", title="t", status=status, detail="d", code=code)
    return cls(doc, retry_after_s=retry_after_s)


NOT_SENT = errors.ConnectionFailed("refused", sent=False)
BROKEN = errors.ConnectionFailed("reset", sent=True)
BAD_CERT = errors.ConnectionFailed("tls", sent=False, transient=False)


@pytest.mark.parametrize(
    ("exc", "get", "keyed_post", "other"),
    [
        (NOT_SENT, True, True, True),  # nothing left the client: safe for every call
        (BROKEN, True, True, False),
        (BAD_CERT, False, False, False),
        (_problem(503, "core_unavailable"), True, True, False),
        (_problem(502, "http_502"), True, True, False),
        (_problem(504, "http_504"), True, True, False),
        (_problem(409, "idempotency_in_progress"), False, True, False),
        (_problem(409, "idempotency_key_reused"), False, False, False),
        (_problem(429, "provider_budget_exhausted"), False, False, False),
        (_problem(429, "too_many_streams", 5), False, False, False),
        (_problem(500, "internal_error"), False, False, False),
        (_problem(404, "not_found"), False, False, False),
        (errors.ProtocolError("garbage"), False, False, False),
    ],
)
def test_what_is_retried_for_which_call(
    exc: BaseException, get: bool, keyed_post: bool, other: bool
) -> None:
    assert retryable(exc, idempotent=True, keyed=False) is get
    assert retryable(exc, idempotent=True, keyed=True) is keyed_post
    assert retryable(exc, idempotent=False, keyed=False) is other


async def _run(policy: RetryPolicy, failures: list[BaseException], **kind: Any) -> list[float]:
    """Try a call that fails with ``failures`` in turn, then succeeds; the waits it took."""
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    loop = retrying(policy, action="test", **{"idempotent": True, "keyed": False, **kind})
    pending = list(failures)
    async for attempt in loop.copy(sleep=sleep):
        with attempt:
            if pending:
                raise pending.pop(0)
    return waits


async def test_waits_are_full_jitter_within_the_doubling_window() -> None:
    policy = RetryPolicy(attempts=6, within_s=60, backoff_base_s=0.5, backoff_max_s=2)
    for _ in range(50):
        waits = await _run(policy, [BROKEN] * 5)
        assert len(waits) == 5
        for n, wait in enumerate(waits):
            assert 0 <= wait <= min(2, 0.5 * 2**n)


async def test_a_retry_after_is_the_least_wait() -> None:
    policy = RetryPolicy(attempts=3, within_s=60, backoff_base_s=0.01, backoff_max_s=0.01)
    waits = await _run(policy, [_problem(503, "database_unavailable", 2.0)])
    assert waits == [2.0]


async def test_attempts_bound_the_tries_and_the_last_error_is_raised() -> None:
    policy = RetryPolicy(attempts=3, within_s=60, backoff_base_s=0.01)
    with pytest.raises(errors.ServiceUnavailable):
        await _run(policy, [_problem(503, "core_unavailable")] * 5)
    with pytest.raises(errors.ConnectionFailed):
        await _run(NO_RETRIES, [NOT_SENT])


async def test_a_wait_past_the_time_budget_ends_the_call_at_once() -> None:
    policy = RetryPolicy(attempts=10, within_s=3, backoff_base_s=0.01)
    with pytest.raises(errors.ServiceUnavailable) as caught:
        await _run(policy, [_problem(503, "core_unavailable", 30.0)])
    assert caught.value.retry_after_s == 30.0  # stop_before_delay: no sleep through the budget


async def test_a_refusal_is_never_retried() -> None:
    with pytest.raises(errors.InsufficientCredits):
        await _run(RetryPolicy(), [_problem(402, "insufficient_credits")])


def test_a_policy_needs_one_attempt_at_least() -> None:
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)
