"""Cheap refusals: a forged or stale Core callback is refused on its headers before its body is
read, ``/metrics`` can require a bearer token, and a flood of scrapes reaches the database once
per ``AQ_METRICS_CACHE_S``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from analysis_queue.core.client import sign_callback
from rawhttp import Raw, request_head
from support import CALLBACK_SECRET, Harness, Instance

PROBLEM_JSON = "application/problem+json"
# Far below any wait a server blocked on the body would need, far above a loaded machine's
# answer to headers it can refuse at once.
AT_ONCE_S = 2.0
ONE_MB = 1_000_000


def _callback_head(content_length: int, **headers: str) -> bytes:
    return request_head(
        "POST",
        "/v1/core/events",
        {"Content-Type": "application/json", "Content-Length": str(content_length), **headers},
    )


def _fresh() -> dict[str, str]:
    """Headers that pass every check made before the body: signed over no body in particular."""
    now = int(time.time())
    return {"X-Core-Timestamp": str(now), "X-Core-Signature": sign_callback("x", now, b"")}


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"X-Core-Timestamp": str(int(time.time()))},
        {"X-Core-Signature": "sha256=" + "0" * 64},
        {"X-Core-Timestamp": str(int(time.time()) - 600), "X-Core-Signature": "sha256=" + "0" * 64},
        {"X-Core-Timestamp": "1" * 5000, "X-Core-Signature": "sha256=" + "0" * 64},
        {"X-Core-Timestamp": str(int(time.time())), "X-Core-Signature": "sha256=" + "0" * 63},
        {"X-Core-Timestamp": str(int(time.time())), "X-Core-Signature": "md5=" + "0" * 32},
    ],
    ids=[
        "none",
        "no_signature",
        "no_timestamp",
        "stale",
        "huge_timestamp",
        "short_signature",
        "other_scheme",
    ],
)
async def test_a_callback_is_refused_on_its_headers_before_its_body(
    harness: Harness, headers: dict[str, str]
) -> None:
    """The client sends the headers of a 1 MB body and then nothing: the 401 comes at once."""
    instance = await harness.start_instance()
    raw = await Raw.connect(instance.base_url)
    try:
        started = time.monotonic()
        await raw.send(_callback_head(ONE_MB, **headers))
        reply = await raw.reply(timeout_s=AT_ONCE_S)
        elapsed = time.monotonic() - started
    finally:
        await raw.close()
    assert (reply.status, reply.content_type) == (401, PROBLEM_JSON), reply
    assert reply.json()["code"] == "invalid_signature"
    assert reply.headers["www-authenticate"].startswith("HMAC-SHA256")
    assert elapsed < AT_ONCE_S


async def test_a_well_formed_callback_over_the_size_limit_is_refused_before_its_body(
    harness: Harness,
) -> None:
    instance = await harness.start_instance()
    raw = await Raw.connect(instance.base_url)
    try:
        await raw.send(_callback_head(10 * ONE_MB, **_fresh()))
        reply = await raw.reply(timeout_s=AT_ONCE_S)
    finally:
        await raw.close()
    assert (reply.status, reply.json()["code"]) == (413, "payload_too_large")


async def test_a_well_formed_callback_is_read_and_its_signature_checked(
    harness: Harness,
) -> None:
    """Passing the header checks is not passing the signature: a wrong one over the body it
    arrived with is still 401, and a right one is applied."""
    instance = await harness.start_instance()
    body = b'{"id": "core-nobody-knows", "state": "completed", "verdicts": []}'
    now = int(time.time())
    wrong = {"X-Core-Timestamp": str(now), "X-Core-Signature": sign_callback("x", now, body)}
    right = {
        "X-Core-Timestamp": str(now),
        "X-Core-Signature": sign_callback(CALLBACK_SECRET, now, body),
    }
    replies = []
    for headers in (wrong, right):
        async with harness.http.post(
            f"{instance.base_url}/v1/core/events",
            data=body,
            headers={"Content-Type": "application/json", **headers},
        ) as r:
            replies.append((r.status, await r.json(content_type=None)))
    assert replies[0][0] == 401 and replies[0][1]["code"] == "invalid_signature"
    assert replies[1] == (200, {"outcome": "unknown_run"})


# -- /metrics -----------------------------------------------------------------------------------


async def _scrape(h: Harness, instance: Instance, headers: dict[str, str] | None = None) -> int:
    async with h.http.get(f"{instance.base_url}/metrics", headers=headers) as r:
        await r.read()
        return r.status


async def test_metrics_token_is_required_when_set(harness: Harness) -> None:
    h = harness
    open_instance = await h.start_instance()
    guarded = await h.start_instance(metrics_token="metrics-token-0123")

    assert await _scrape(h, open_instance) == 200
    async with h.http.get(f"{guarded.base_url}/metrics") as r:
        assert (r.status, r.content_type) == (401, PROBLEM_JSON)
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
        assert (await r.json(content_type=None))["code"] == "unauthorized"
    for wrong in ("Bearer metrics-token-012", "Bearer metrics-token-01234", "Basic x", "Bearer "):
        assert await _scrape(h, guarded, {"Authorization": wrong}) == 401, wrong
    assert await _scrape(h, guarded, {"Authorization": "Bearer metrics-token-0123"}) == 200


def _count_calls(instance: Instance, *names: str) -> dict[str, int]:
    """Wrap the instance's Database methods ``names`` to count their calls."""
    counts = dict.fromkeys(names, 0)
    db = instance.services.db
    for name in names:
        original: Callable[..., Awaitable[Any]] = getattr(db, name)

        async def counted(
            *args: Any, _name: str = name, _original: Callable[..., Awaitable[Any]] = original
        ) -> Any:
            counts[_name] += 1
            return await _original(*args)

        setattr(db, name, counted)
    return counts


async def test_a_flood_of_scrapes_reads_the_database_once_per_interval(harness: Harness) -> None:
    h = harness
    instance = await h.start_instance(metrics_cache_s=3600)
    counts = _count_calls(instance, "open_job_counts", "capacity")

    statuses = await asyncio.gather(*(_scrape(h, instance) for _ in range(50)))
    statuses += [await _scrape(h, instance) for _ in range(10)]

    assert statuses == [200] * 60
    assert counts == {"open_job_counts": 1, "capacity": 1}


async def test_without_a_cache_every_scrape_reads_the_database(harness: Harness) -> None:
    h = harness
    instance = await h.start_instance(metrics_cache_s=0)
    counts = _count_calls(instance, "open_job_counts", "capacity")
    for _ in range(3):
        assert await _scrape(h, instance) == 200
    assert counts == {"open_job_counts": 3, "capacity": 3}
