"""Core's callback signature scheme and the run it carries, without a network."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from analysis_queue.core.client import CoreRun, callback_timestamp, sign_callback, verify_callback

SECRET = "test-callback-secret"


def _signed(body: bytes = b'{"id":"core-1"}', at: int | None = None) -> tuple[str, str, bytes]:
    timestamp = int(time.time()) if at is None else at
    return str(timestamp), sign_callback(SECRET, timestamp, body), body


def test_valid_signature_verifies() -> None:
    timestamp, signature, body = _signed()
    assert signature.startswith("sha256=") and len(signature) == len("sha256=") + 64
    assert verify_callback(SECRET, timestamp, signature, body, now=time.time())


@pytest.mark.parametrize(
    ("secret", "tamper"),
    [
        ("wrong-secret", lambda t, s, b: (t, s, b)),
        ("", lambda t, s, b: (t, sign_callback("", int(t), b), b)),
        (SECRET, lambda t, s, b: (t, s, b + b" ")),
        (SECRET, lambda t, s, b: (str(int(t) + 1), s, b)),
        (SECRET, lambda t, s, b: (None, s, b)),
        (SECRET, lambda t, s, b: (t, None, b)),
        (SECRET, lambda t, s, b: ("", s, b)),
        (SECRET, lambda t, s, b: ("12.5", s, b)),
        (SECRET, lambda t, s, b: (" " + t, s, b)),
        (SECRET, lambda t, s, b: ("١٢", s, b)),
        (SECRET, lambda t, s, b: (t, s.removeprefix("sha256="), b)),
        (SECRET, lambda t, s, b: (t, s.upper(), b)),
        (SECRET, lambda t, s, b: (t, "sha256=zz", b)),
        (SECRET, lambda t, s, b: (t, s + "é", b)),
    ],
)
def test_bad_signature_does_not_verify(
    secret: str, tamper: Callable[[str, str, bytes], tuple[str | None, str | None, bytes]]
) -> None:
    timestamp, signature, body = tamper(*_signed())
    assert not verify_callback(secret, timestamp, signature, body, now=time.time())


@pytest.mark.parametrize("skew_s", [-301, 301, -10_000])
def test_stale_or_future_timestamp_does_not_verify(skew_s: int) -> None:
    now = time.time()
    timestamp, signature, body = _signed(at=int(now) + skew_s)
    assert not verify_callback(SECRET, timestamp, signature, body, now=now)
    assert verify_callback(SECRET, timestamp, signature, body, now=now, window_s=20_000)


def test_headers_are_judged_without_the_body() -> None:
    """What the callback route checks before reading a body: enough to refuse a forgery or a
    replay, never enough to accept one."""
    timestamp, signature, _ = _signed()
    now = time.time()
    assert callback_timestamp(SECRET, timestamp, signature, now=now) == int(timestamp)
    for bad_timestamp, bad_signature in [
        (None, signature),
        (timestamp, None),
        ("1" * 5000, signature),  # int() of it would raise, not refuse
        (str(int(now) - 301), signature),
        (timestamp, signature[:-1]),
        (timestamp, signature + "0"),
        (timestamp, signature.upper()),
        (timestamp, "sha1=" + "0" * 40),
    ]:
        assert callback_timestamp(SECRET, bad_timestamp, bad_signature, now=now) is None
    assert callback_timestamp("", timestamp, signature, now=now) is None


def test_core_run_from_json() -> None:
    held = CoreRun.from_json({"id": "core-1", "state": "held", "extra": "ignored"})
    assert (held.verdicts, held.error, held.finished) == ([], None, False)
    done = CoreRun.from_json(
        {"id": "c", "state": "completed", "verdicts": [{"source": "s", "verdict": "v", "x": 1}]}
    )
    assert done.finished
    assert [v.model_dump() for v in done.verdicts] == [{"source": "s", "verdict": "v"}]
    for bad in (
        {"state": "held"},
        {"id": "core-1"},
        {"id": "", "state": "held"},
        {"id": 7, "state": "held"},
        {"id": "c", "state": "x", "verdicts": [1]},
        {"id": "c", "state": "x", "verdicts": [{"source": "s"}]},
        {"id": "c", "state": "x", "error": 3},
        ["not", "an", "object"],
    ):
        with pytest.raises(ValueError):
            CoreRun.from_json(bad)
