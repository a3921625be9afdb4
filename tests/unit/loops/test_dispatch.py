"""When a failed release is tried again: full jitter, capped, never past the window."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from analysis_queue.loops.dispatch import next_attempt_at

SAMPLES = 2000


TIMEDELTA_RESOLUTION_S = 1e-6


def _tenacity_window(attempt: int, base_s: float, max_s: float) -> float:
    """wait_random_exponential draws uniform(0, min(max, multiplier * 2 ** (attempt_number - 1)));
    next_attempt_at passes attempt_number = max(1, attempt)."""
    return float(min(max_s, base_s * 2 ** (max(1, attempt) - 1)))


def _delays(attempt: int, base_s: float, max_s: float, deadline_in_s: float) -> list[float]:
    now = datetime(2030, 1, 1, tzinfo=UTC)
    deadline = now + timedelta(seconds=deadline_in_s)
    out = []
    for _ in range(SAMPLES):
        at = next_attempt_at(now, attempt, deadline, base_s=base_s, max_s=max_s)
        assert at <= deadline
        out.append((at - now).total_seconds())
    return out


@pytest.mark.parametrize("attempt", [0, 1, 2, 3, 5, 8, 12, 40])
def test_next_attempt_full_jitter_window(attempt: int) -> None:
    base_s, max_s = 0.5, 20.0
    window = _tenacity_window(attempt, base_s, max_s)
    delays = _delays(attempt, base_s, max_s, deadline_in_s=10_000)
    upper = min(max_s, base_s * 2**attempt)  # the documented AWS bound; tenacity's is <= it
    assert all(0 <= d <= window + TIMEDELTA_RESOLUTION_S for d in delays), (min(delays), window)
    assert all(d <= upper + TIMEDELTA_RESOLUTION_S for d in delays)
    # Full jitter: the draws fill the window, they are not constant or clustered.
    assert len(set(delays)) > SAMPLES * 0.9
    assert max(delays) > 0.9 * window
    assert min(delays) < 0.1 * window
    mean = sum(delays) / len(delays)
    assert 0.4 * window < mean < 0.6 * window


def test_next_attempt_window_grows_then_caps() -> None:
    base_s, max_s = 1.0, 60.0
    maxima = [max(_delays(n, base_s, max_s, deadline_in_s=10_000)) for n in (1, 3, 5, 7, 9)]
    # windows 1, 4, 16, 60 (capped from 64), 60 (capped from 256)
    assert maxima[0] <= 1.0 + TIMEDELTA_RESOLUTION_S
    assert 3.6 < maxima[1] <= 4.0 + TIMEDELTA_RESOLUTION_S
    assert 14.4 < maxima[2] <= 16.0 + TIMEDELTA_RESOLUTION_S
    assert 54.0 < maxima[3] <= 60.0 + TIMEDELTA_RESOLUTION_S
    assert 54.0 < maxima[4] <= 60.0 + TIMEDELTA_RESOLUTION_S


def test_next_attempt_never_after_deadline() -> None:
    base_s, max_s = 10.0, 600.0
    delays = _delays(6, base_s, max_s, deadline_in_s=2.5)  # window 320 s, deadline in 2.5 s
    assert max(delays) == 2.5
    assert all(0 <= d <= 2.5 for d in delays)
    # Most draws are clamped to the deadline, the few below it are still spread.
    assert sum(1 for d in delays if d == 2.5) > SAMPLES * 0.9
    assert len({d for d in delays if d < 2.5}) > 1

    now = datetime(2030, 1, 1, tzinfo=UTC)
    past = now - timedelta(seconds=1)
    assert next_attempt_at(now, 3, past, base_s=base_s, max_s=max_s) == past
