"""What one user can make an instance hold is bounded: the bytes one job stores, the jobs one
list answer or snapshot carries (pages, followed by a cursor), the bytes one replay page reads,
and the event streams open at once."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from analysis_queue.http import paging
from support import Harness, Instance, fetchval, thesis_body, wait_for

PROBLEM_JSON = "application/problem+json"


def _sized(n: int, total_bytes: int) -> dict[str, Any]:
    """An admit body whose stored JSON (thesis and sources) is about ``total_bytes``."""
    body = thesis_body(n, sources=1)
    filler = total_bytes - 120
    per = 1900
    body["sources"] = [
        f"https://library.example/{n}/{k}/" + "x" * min(per, filler - k * per)
        for k in range(max(1, -(-filler // per)))
    ]
    return body


async def _counts(h: Harness) -> tuple[int, int, int]:
    jobs = await fetchval(h.database_url, "SELECT count(*) FROM analysis_jobs")
    reservations = await fetchval(h.database_url, "SELECT count(*) FROM core_run_reservations")
    return int(jobs), int(reservations), len(h.sim.runs_snapshot())


async def test_a_job_larger_than_its_byte_budget_is_refused_before_anything_is_made(
    harness: Harness,
) -> None:
    h = harness
    await h.start_instance(job_max_bytes=8 * 1024)
    await h.grant("u", 3)
    # Four-byte characters: what counts is bytes, not characters.
    wide = thesis_body(1)
    wide["sources"] = [f"https://library.example/{k}/" + "\U0001d518" * 400 for k in range(6)]
    status, problem = await h.admit("u", body=wide)
    assert (status, problem["code"]) == (413, "job_too_large"), problem
    assert problem["limit_bytes"] == 8 * 1024 and problem["size_bytes"] > 8 * 1024
    assert "8192" in problem["detail"]
    assert await _counts(h) == (0, 0, 0), "no job, no reservation, no run in Core"
    assert await fetchval(h.database_url, "SELECT balance FROM credit_accounts") == 3

    status, job = await h.admit("u", body=_sized(2, 7 * 1024))
    assert status == 201, job

    # A re-check stores its parent's thesis and the new sources: the same budget.
    h.sim.judge_time_s = 0.01
    inst = h.instances[0]

    async def succeeded() -> bool:
        _, body = await h.get("u", f"/v1/analyses/{job['id']}")
        return bool(body["status"] == "succeeded")

    await wait_for(succeeded, what="the analysis to succeed")
    async with h.http.post(
        f"{inst.base_url}/v1/analyses/{job['id']}/rechecks",
        json={"sources": wide["sources"]},
        headers=h.auth("u"),
    ) as r:
        assert r.status == 413 and (await r.json(content_type=None))["code"] == "job_too_large"


async def _admit_many(h: Harness, user: str, count: int) -> list[str]:
    ids: list[str] = []
    for n in range(count):  # one at a time: admission order is the listing's order
        status, job = await h.admit(user, n)
        assert status == 201, job
        ids.append(job["id"])
    return ids


async def _pages(
    h: Harness, user: str, limit: int | None = None, between: Any = None
) -> list[list[dict[str, Any]]]:
    pages: list[list[dict[str, Any]]] = []
    query = f"?limit={limit}" if limit else ""
    while True:
        status, body = await h.get(user, f"/v1/analyses{query}")
        assert status == 200, body
        pages.append(body["analyses"])
        if body["next"] is None:
            return pages
        if between is not None:
            await between()
        query = f"?cursor={body['next']}" + (f"&limit={limit}" if limit else "")


async def test_lists_are_pages_of_summaries_followed_by_a_cursor(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = 600  # everything stays where it is
    await h.start_instance()
    await h.grant("u", 260)
    ids = await _admit_many(h, "u", 230)

    pages = await _pages(h, "u")
    assert [len(p) for p in pages] == [50, 50, 50, 50, 30], "default limit 50"
    listed = [j["id"] for p in pages for j in p]
    assert listed == ids[::-1], "newest first, each once"
    first = pages[0][0]
    assert "sources" not in first and "verdicts" not in first and first["source_count"] == 2
    positions = {j["id"]: j["queue_position"] for p in pages for j in p}
    assert positions[ids[0]] is None and positions[ids[1]] == 1 and positions[ids[-1]] == 229

    pages = await _pages(h, "u", limit=200)
    assert [len(p) for p in pages] == [200, 30]

    # Admits while a client pages: they sort before its first page and shift nothing after.
    added: list[str] = []

    async def admit_one() -> None:
        status, job = await h.admit("u", 900 + len(added))
        assert status == 201
        added.append(job["id"])

    pages = await _pages(h, "u", limit=40, between=admit_one)
    listed = [j["id"] for p in pages for j in p]
    assert listed == ids[::-1], "every job there when paging began, exactly once"
    assert not set(added) & set(listed)
    _, body = await h.get("u", "/v1/analyses?limit=1")
    assert body["analyses"][0]["id"] == added[-1]


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("limit=0", "limit"),
        ("limit=201", "limit"),
        ("limit=ten", "limit"),
        ("limit=-1", "limit"),
        ("cursor=not-a-cursor", "cursor"),
        (f"cursor={paging.encode_cursor(5)[:-2]}", "cursor"),
        ("cursor=" + "A" * 64, "cursor"),
    ],
)
async def test_a_bad_limit_or_cursor_is_refused(harness: Harness, query: str, field: str) -> None:
    h = harness
    await h.start_instance()
    async with h.http.get(
        f"{h.instances[0].base_url}/v1/analyses?{query}", headers=h.auth("u")
    ) as r:
        assert r.status == 400 and r.content_type == PROBLEM_JSON
        body = await r.json(content_type=None)
    assert body["code"] == "invalid_parameter" and body["errors"][0]["field"] == field


async def test_a_cursor_is_opaque_and_round_trips() -> None:
    for seq in (0, 1, 7, 2**63 - 1):
        assert paging.decode_cursor(paging.encode_cursor(seq)) == seq
    assert "=" not in paging.encode_cursor(12345)


@contextlib.asynccontextmanager
async def _open_stream(
    h: Harness, inst: Instance, user: str
) -> AsyncIterator[aiohttp.ClientResponse]:
    response = await h.http.get(f"{inst.base_url}/v1/events", headers=h.auth(user))
    try:
        yield response
    finally:
        response.close()


async def _first_frame(response: aiohttp.ClientResponse) -> dict[str, Any]:
    fields: dict[str, str] = {}
    while True:
        line = (await asyncio.wait_for(response.content.readline(), 10)).decode().rstrip("\n")
        if line == "" and "data" in fields:
            return {"event": fields.get("event"), "data": orjson.loads(fields["data"])}
        name, _, value = line.partition(":")
        if name in ("event", "data"):
            fields[name] = value.removeprefix(" ")


async def test_a_snapshot_is_the_first_page_and_says_where_the_rest_is(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = 600
    inst = await h.start_instance()
    inst.services.events.settings = dataclasses.replace(
        inst.services.events.settings, snapshot_jobs=5
    )
    await h.grant("u", 8)
    ids = await _admit_many(h, "u", 8)
    async with _open_stream(h, inst, "u") as response:
        assert response.status == 200
        frame = await _first_frame(response)
    assert frame["event"] == "snapshot"
    snapshot = frame["data"]
    assert [j["id"] for j in snapshot["analyses"]] == ids[::-1][:5]
    _, rest = await h.get("u", f"/v1/analyses?cursor={snapshot['next']}")
    assert [j["id"] for j in rest["analyses"]] == ids[::-1][5:] and rest["next"] is None


async def test_streams_are_capped_per_user_and_per_instance(harness: Harness) -> None:
    h = harness
    inst = await h.start_instance(event_streams_per_user=3, event_streams_max=5)
    hub = inst.services.events
    # A stream whose client left is noticed at its next heartbeat (aiohttp does not cancel the
    # handler): short here, so that the closed ones leave the hub within the test.
    hub.settings = dataclasses.replace(hub.settings, heartbeat_s=0.2)
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(3):
            response = await stack.enter_async_context(_open_stream(h, inst, "u"))
            assert response.status == 200
            await _first_frame(response)
        async with _open_stream(h, inst, "u") as refused:
            assert refused.status == 429 and refused.content_type == PROBLEM_JSON
            assert refused.headers["Retry-After"].isdigit()
            assert (await refused.json(content_type=None))["code"] == "too_many_streams"
        for user in ("v", "w"):  # other users still get theirs, up to the instance's cap
            response = await stack.enter_async_context(_open_stream(h, inst, user))
            assert response.status == 200
            await _first_frame(response)
        async with _open_stream(h, inst, "x") as full:
            assert full.status == 429
        assert hub.subscribers == 5

    async def all_closed() -> bool:  # closed streams leave the hub once their handlers see it
        return hub.subscribers == 0

    await wait_for(all_closed, what="the closed streams to leave the hub")
    async with _open_stream(h, inst, "u") as again:
        assert again.status == 200


async def test_a_replay_page_is_cut_by_bytes_but_always_makes_progress(
    harness: Harness,
) -> None:
    h = harness
    h.sim.judge_time_s = 600
    inst = await h.start_instance()
    await h.grant("u", 6)
    await _admit_many(h, "u", 6)
    db = inst.services.db

    async def first_started() -> bool:  # the release marks it running after its admit answered
        return len((await db.events_after("u", 0, 100)).events) == 7

    await wait_for(first_started, what="6 admitted and 1 started in the event log")
    everything = await db.events_after("u", 0, 100)
    assert len(everything.events) == 7 and not everything.more
    tiny = await db.events_after("u", 0, 100, max_bytes=1)
    assert len(tiny.events) == 1 and tiny.more, "one event whatever it weighs"
    some = await db.events_after("u", 0, 100, max_bytes=1500)
    assert 1 < len(some.events) < 7 and some.more
    counted = await db.events_after("u", 0, 3)
    assert len(counted.events) == 3 and counted.more
    last = await db.events_after("u", 6, 100, max_bytes=1)
    assert len(last.events) == 1 and not last.more


async def test_a_stream_ends_after_its_lifetime_and_resumes_where_it_ended(
    harness: Harness,
) -> None:
    h = harness
    h.sim.judge_time_s = 600
    inst = await h.start_instance()
    hub = inst.services.events
    hub.settings = dataclasses.replace(hub.settings, max_stream_s=0.5)
    await h.grant("u", 2)
    await h.admit("u", 1)
    async with _open_stream(h, inst, "u") as response:
        body = await asyncio.wait_for(response.read(), 10)  # it ends by itself
    assert b"event: snapshot" in body and body.endswith(b"\n\n")
    await h.admit("u", 2)
    head = int(await fetchval(h.database_url, "SELECT last_id FROM job_event_counters"))
    async with h.http.get(
        f"{inst.base_url}/v1/events", headers={**h.auth("u"), "Last-Event-ID": str(head - 1)}
    ) as again:
        resumed = await asyncio.wait_for(again.read(), 10)
    assert f"id: {head}\n".encode() in resumed and b"event: snapshot" not in resumed
    assert hub.subscribers == 0


async def _timed_get(h: Harness, inst: Instance, path: str, user: str | None = "u") -> Any:
    started = asyncio.get_running_loop().time()
    headers = h.auth(user) if user else {}
    async with h.http.get(f"{inst.base_url}{path}", headers=headers) as r:
        body = await r.json(content_type=None)
        return (
            r.status,
            r.headers.get("Retry-After"),
            body,
            asyncio.get_running_loop().time() - started,
        )


async def test_a_request_that_cannot_get_a_connection_fails_fast_and_readiness_still_answers(
    harness: Harness,
) -> None:
    h = harness
    inst = await h.start_instance(pool_min_size=2, pool_max_size=2, db_acquire_timeout_s=0.3)
    await h.grant("u", 1)
    pool = inst.services.db.pool
    held = [await pool.acquire() for _ in range(2)]  # every pooled connection is busy
    try:
        status, retry, body, took = await _timed_get(h, inst, "/v1/credits")
        assert (status, body["code"]) == (503, "database_unavailable") and retry == "1"
        assert 0.3 <= took < 10.0, "failed after the acquire bound, not hung"
        # Readiness pings on a connection of its own (within 1 s, or it says not ready): with
        # every pooled connection held, a ready answer proves it did not need the pool.
        status, _, body, _ = await _timed_get(h, inst, "/readyz", user=None)
        assert (status, body["checks"]["database"]) == (200, True), body
    finally:
        for conn in held:
            await pool.release(conn)
    status, _, body, _ = await _timed_get(h, inst, "/v1/credits")
    assert (status, body) == (200, {"balance": 1, "held": 0})


async def test_a_statement_stuck_behind_a_lock_is_cancelled_after_its_bound(
    harness: Harness,
) -> None:
    h = harness
    inst = await h.start_instance(db_statement_timeout_s=0.5)
    await h.grant("u", 1)
    blocker = await h.db()
    try:
        await blocker.execute("BEGIN; LOCK TABLE credit_accounts IN ACCESS EXCLUSIVE MODE")
        status, retry, body, took = await _timed_get(h, inst, "/v1/credits")
        assert (status, body["code"], retry) == (503, "database_unavailable", "1")
        assert 0.5 <= took < 10.0, "cancelled after the statement bound, not hung"
        status, _, body, _ = await _timed_get(h, inst, "/readyz", user=None)
        assert (status, body["checks"]["database"]) == (200, True), body

        async def nothing_waits() -> bool:  # the statement was cancelled, not abandoned
            waiting = await fetchval(
                h.database_url,
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND application_name LIKE 'analysis-queue%'",
            )
            return bool(waiting == 0)

        await wait_for(nothing_waits, timeout_s=5, what="the pool's backend to stop waiting")
    finally:
        await blocker.execute("ROLLBACK")
        await blocker.close()
    status, _, body, _ = await _timed_get(h, inst, "/v1/credits")
    assert (status, body) == (200, {"balance": 1, "held": 0})
