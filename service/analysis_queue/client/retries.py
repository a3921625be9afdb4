"""When a call is tried again, and how long the client waits before it does.

A call is retried only where a retry cannot do anything twice:

- a connection that could not be opened (nothing was sent), for every call;
- for a GET, and for the POST that starts an analysis (it always carries an Idempotency-Key,
  so the service replays the first job instead of admitting another): a connection that broke
  or an answer that did not come in time, and 502, 503 and 504 answers;
- for that POST also ``409 idempotency_in_progress``: the first attempt (one the client gave up
  waiting for) is still being admitted, and only asking again tells how it ended.

Never another 4xx: the answer would be the same. Waits are full jitter (a uniform draw from a
window that doubles from ``backoff_base_s`` up to ``backoff_max_s``), and never shorter than
the answer's Retry-After. A call stops after ``attempts`` tries, or when the next try would
start more than ``within_s`` after the first (tenacity's ``stop_before_delay``: a Retry-After
past the budget ends the call at once instead of sleeping through it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import tenacity
from tenacity import RetryCallState

from analysis_queue.client.errors import (
    ConnectionFailed,
    IdempotencyInProgress,
    ProblemError,
    ServiceUnavailable,
)

log = logging.getLogger("analysis_queue.client")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and for how long a retryable call is tried."""

    attempts: int = 4  # tries in all, the first one included
    within_s: float = 20.0  # no try starts later than this after the first
    backoff_base_s: float = 0.25  # the first wait is drawn from [0, this]
    backoff_max_s: float = 5.0  # the widest window a wait is drawn from

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.within_s < 0:
            raise ValueError("a RetryPolicy needs attempts >= 1 and within_s >= 0")


NO_RETRIES = RetryPolicy(attempts=1, within_s=0)


def retryable(exc: BaseException, *, idempotent: bool, keyed: bool) -> bool:
    """Whether ``exc`` may be followed by another try of the same request."""
    if isinstance(exc, ConnectionFailed):
        return exc.transient and (idempotent or not exc.sent)
    if isinstance(exc, IdempotencyInProgress):
        return keyed
    if isinstance(exc, ServiceUnavailable):
        return idempotent
    return False


class wait_retry_after(tenacity.wait.wait_base):
    """Full jitter, but never less than what the last answer's Retry-After asked for."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.jitter = tenacity.wait_random_exponential(
            multiplier=policy.backoff_base_s, max=policy.backoff_max_s
        )

    def __call__(self, retry_state: RetryCallState) -> float:
        jitter = float(self.jitter(retry_state))
        outcome = retry_state.outcome
        exc = outcome.exception() if outcome is not None else None
        if isinstance(exc, ProblemError) and exc.retry_after_s is not None:
            return max(jitter, exc.retry_after_s)
        return jitter


def retrying(
    policy: RetryPolicy, *, idempotent: bool, keyed: bool, action: str
) -> tenacity.AsyncRetrying:
    """The tenacity loop of one call (``action`` names it in the log)."""

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        log.info(
            "retrying",
            extra={
                "action": action,
                "attempt": state.attempt_number,
                "wait_s": round(state.upcoming_sleep, 3),
                "error": type(exc).__name__,
                "code": getattr(exc, "code", None),
            },
        )

    return tenacity.AsyncRetrying(
        stop=tenacity.stop_after_attempt(policy.attempts)
        | tenacity.stop_before_delay(policy.within_s),
        wait=wait_retry_after(policy),
        retry=tenacity.retry_if_exception(
            lambda exc: retryable(exc, idempotent=idempotent, keyed=keyed)
        ),
        before_sleep=before_sleep,
        reraise=True,
    )
