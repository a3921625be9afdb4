"""The API's rules through HTTP: refusals at admit, concurrency, idempotency, deletes, cancels,
ownership, Core callbacks, delta re-checks and Core-reported failures."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from analysis_queue.core.client import sign_callback
from analysis_queue.http.auth import mint_token
from support import (
    CALLBACK_SECRET,
    JWT_SECRET,
    Harness,
    Instance,
    assert_fifo_serial,
    check_invariants,
    fetch,
    fetchval,
    thesis_body,
    wait_for,
)

PROBLEM_JSON = "application/problem+json"
SLOW_JUDGE_S = 30.0  # a released run stays "judging" for the whole test


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    content_type: str
    body: Any


async def _call(
    h: Harness,
    method: str,
    path: str,
    *,
    user: str | None = None,
    json: Any = None,
    data: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> Reply:
    all_headers = {**(h.auth(user) if user is not None else {}), **(headers or {})}
    async with h.http.request(
        method,
        f"{h.instances[0].base_url}{path}",
        json=json,
        data=data,
        headers=all_headers,
    ) as r:
        raw = await r.read()
        body = orjson.loads(raw) if raw else None
        return Reply(r.status, dict(r.headers), r.content_type, body)


def _assert_problem(reply: Reply, status: int, code: str | None) -> None:
    assert reply.status == status, reply
    assert reply.content_type == PROBLEM_JSON, reply
    assert isinstance(reply.body, dict), reply
    assert reply.body["status"] == status, reply
    if code is not None:
        assert reply.body["code"] == code, reply


async def _money(h: Harness, user: str) -> tuple[int | None, list[tuple[str, int, Any]]]:
    balance = await fetchval(
        h.database_url, "SELECT balance FROM credit_accounts WHERE user_id = $1", user
    )
    ledger = await fetch(
        h.database_url,
        "SELECT kind, amount, job_id FROM credit_ledger WHERE user_id = $1 ORDER BY id",
        user,
    )
    return balance, [(r["kind"], r["amount"], r["job_id"]) for r in ledger]


async def _count(h: Harness, sql: str, *args: Any) -> int:
    return int(await fetchval(h.database_url, sql, *args))


async def _held_runs_without_job(h: Harness) -> list[str]:
    rows = await fetch(
        h.database_url, "SELECT core_run_id FROM analysis_jobs WHERE core_run_id IS NOT NULL"
    )
    owned = {r["core_run_id"] for r in rows}
    return [r["id"] for r in h.sim.runs_snapshot() if r["state"] == "held" and r["id"] not in owned]


async def _assert_nothing_left(
    h: Harness, user: str, money_before: tuple[int | None, list[tuple[str, int, Any]]]
) -> None:
    assert await _count(h, "SELECT count(*) FROM analysis_jobs WHERE user_id = $1", user) == 0
    assert await _count(h, "SELECT count(*) FROM core_run_reservations") == 0
    assert await _money(h, user) == money_before
    assert await _held_runs_without_job(h) == []


async def _status(h: Harness, job_id: str) -> str | None:
    value = await fetchval(
        h.database_url, "SELECT status FROM analysis_jobs WHERE id = $1::uuid", job_id
    )
    return str(value) if value is not None else None


def _status_is(h: Harness, job_id: str, *statuses: str) -> Any:
    async def predicate() -> bool:
        return await _status(h, job_id) in statuses

    return predicate


async def _core_run_id(h: Harness, job_id: str) -> str:
    value = await fetchval(
        h.database_url, "SELECT core_run_id FROM analysis_jobs WHERE id = $1::uuid", job_id
    )
    assert isinstance(value, str)
    return value


def _sim_run(h: Harness, core_run_id: str) -> dict[str, Any]:
    [run] = [r for r in h.sim.runs_snapshot() if r["id"] == core_run_id]
    return run


async def _admit_ok(h: Harness, user: str, n: int) -> dict[str, Any]:
    status, job = await h.admit(user, n)
    assert status == 201, job
    return job


async def _quiet_instance(h: Harness, **overrides: Any) -> Instance:
    """An instance whose start-up sweep pass (kicked by the listener connecting) is over."""
    instance = await h.start_instance(**overrides)
    await asyncio.wait_for(instance.services.sweeper.pass_done.wait(), 10)
    return instance


# -- 1. refusals at admit ---------------------------------------------------------------------


# The edge (analysis_queue.http.bodies) refuses a source that is not a DOI or an http(s) URL
# before Core is asked, so Core's own refusal needs a well-formed source Core does not accept:
# a DOI that does not resolve (the simulator's registry knows no 10.9999 registrant).
UNKNOWN_DOI = "10.9999/unknown-to-core"


def _invalid_source() -> dict[str, Any]:
    body = thesis_body(1)
    body["sources"] = ["10.1000/ok.1", UNKNOWN_DOI]
    return body


def _unparseable_thesis() -> dict[str, Any]:
    body = thesis_body(1)
    body["thesis"]["document_url"] = "https://uni.example/t/1.exe"
    return body


@pytest.mark.parametrize(
    ("make_body", "budget_runs", "status", "code"),
    [
        (_invalid_source, None, 422, "invalid_source"),
        (_unparseable_thesis, None, 422, "unparseable_thesis"),
        (thesis_body, 0, 429, "provider_budget_exhausted"),
    ],
    ids=["invalid_source", "unparseable_thesis", "provider_budget"],
)
async def test_core_refusal_at_admit_is_synchronous_and_leaves_nothing(
    harness: Harness,
    make_body: Any,
    budget_runs: int | None,
    status: int,
    code: str,
) -> None:
    h = harness
    await _quiet_instance(h)
    await h.grant("u", 3)
    h.sim.faults.budget_runs = budget_runs
    before = await _money(h, "u")
    assert before[0] == 3

    reply = await _call(h, "POST", "/v1/analyses", user="u", json=make_body())

    _assert_problem(reply, status, code)
    await _assert_nothing_left(h, "u", before)
    assert h.sim.runs_snapshot() == [], "Core refused, so it holds no run"
    await check_invariants(h.database_url)


async def test_no_credit_is_refused_before_core_is_asked(harness: Harness) -> None:
    h = harness
    await _quiet_instance(h)
    await h.grant("rich", 1)
    before = await _money(h, "broke")

    reply = await _call(h, "POST", "/v1/analyses", user="broke", json=thesis_body(1))

    _assert_problem(reply, 402, "insufficient_credits")
    await _assert_nothing_left(h, "broke", before)
    assert h.sim.runs_snapshot() == [], "Core must not be asked without credit"
    credits = await _call(h, "GET", "/v1/credits", user="broke")
    assert (credits.status, credits.body) == (200, {"balance": 0, "held": 0})

    # A user who spent their last credit is refused the same way.
    await _admit_ok(h, "rich", 1)
    runs_before = len(h.sim.runs_snapshot())
    reply = await _call(h, "POST", "/v1/analyses", user="rich", json=thesis_body(2))
    _assert_problem(reply, 402, "insufficient_credits")
    assert len(h.sim.runs_snapshot()) == runs_before
    assert await _count(h, "SELECT count(*) FROM analysis_jobs WHERE user_id = 'rich'") == 1
    await check_invariants(h.database_url)


@pytest.mark.parametrize("credits", [1, 10])
async def test_a_burst_of_clicks_asks_core_only_for_what_was_paid(
    harness: Harness, credits: int
) -> None:
    """50 concurrent clicks of one user across two instances: each click's credit is held
    before Core is asked, and the clicks see each other's holds, so Core creates exactly as
    many held runs as there are credits: every other click is a 402 without a Core call."""
    h = harness
    instances = [await _quiet_instance(h), await _quiet_instance(h)]
    await h.grant("burst", credits)
    answers = await asyncio.gather(
        *(h.admit("burst", n, instance=instances[n % 2]) for n in range(50))
    )
    statuses = sorted(status for status, _ in answers)
    assert statuses == [201] * credits + [402] * (50 - credits), statuses
    assert len(h.sim.runs_snapshot()) == credits, "a held run per paid click, no more"
    balance, ledger = await _money(h, "burst")
    admitted = {uuid.UUID(answer["id"]) for status, answer in answers if status == 201}
    assert balance == 0
    assert sorted(ledger, key=str) == sorted(
        [("grant", credits, None)] + [("debit", 1, job_id) for job_id in admitted], key=str
    ), "one debit per admitted click, nothing else"
    assert await _count(h, "SELECT count(*) FROM core_run_reservations") == 0
    await check_invariants(h.database_url)


def _too_many_sources() -> dict[str, Any]:
    return thesis_body(1, sources=201)


def _unknown_field() -> dict[str, Any]:
    return {**thesis_body(1), "priority": "high"}


def _missing_sources() -> dict[str, Any]:
    return {"thesis": thesis_body(1)["thesis"]}


@pytest.mark.parametrize(
    ("data", "content_type", "status", "code"),
    [
        (b'{"thesis": {"title": "T", ', "application/json", 400, "malformed_request"),
        (orjson.dumps(_unknown_field()), "application/json", 422, "invalid_body"),
        (orjson.dumps(_missing_sources()), "application/json", 422, "invalid_body"),
        (orjson.dumps(_too_many_sources()), "application/json", 422, "invalid_body"),
        (orjson.dumps(thesis_body(1)), "text/plain", 415, "unsupported_media_type"),
    ],
    ids=["malformed_json", "unknown_field", "missing_sources", "201_sources", "content_type"],
)
async def test_bad_request_body_is_refused_and_leaves_nothing(
    harness: Harness, data: bytes, content_type: str, status: int, code: str
) -> None:
    h = harness
    await _quiet_instance(h)
    await h.grant("u", 3)
    before = await _money(h, "u")

    reply = await _call(
        h, "POST", "/v1/analyses", user="u", data=data, headers={"Content-Type": content_type}
    )

    _assert_problem(reply, status, code)
    await _assert_nothing_left(h, "u", before)
    assert h.sim.runs_snapshot() == []


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "Bearer garbage.not.a-jwt",
        "Basic dXNlcjpwYXNz",
        "Bearer " + mint_token("u", JWT_SECRET, ttl_s=-60),
        "Bearer " + mint_token("u", "some-other-secret-0123456789abcdef"),
    ],
    ids=["missing", "garbage", "not_bearer", "expired", "wrong_secret"],
)
async def test_bad_credentials_get_401_with_www_authenticate(
    harness: Harness, authorization: str | None
) -> None:
    h = harness
    await _quiet_instance(h)
    await h.grant("u", 3)
    before = await _money(h, "u")
    headers = {"Authorization": authorization} if authorization is not None else {}

    reply = await _call(h, "POST", "/v1/analyses", json=thesis_body(1), headers=headers)

    _assert_problem(reply, 401, "unauthorized")
    assert reply.headers.get("WWW-Authenticate", "").startswith("Bearer"), reply.headers
    await _assert_nothing_left(h, "u", before)
    assert h.sim.runs_snapshot() == []


@pytest.mark.parametrize(
    ("method", "path", "repeated"),
    [
        ("POST", "/v1/analyses", "Authorization"),
        ("POST", "/v1/analyses", "Idempotency-Key"),
        ("GET", "/v1/events", "Last-Event-ID"),
        ("GET", "/v1/analyses", "authorization"),  # header names are case-insensitive
    ],
)
async def test_a_repeated_identity_header_is_a_400_that_names_it(
    harness: Harness, method: str, path: str, repeated: str
) -> None:
    """Two Authorization headers (or two keys, or two stream positions): a proxy in front may
    act on the last where the service would take the first, so the service takes neither."""
    h = harness
    await _quiet_instance(h)
    await h.grant("u", 3)
    await h.grant("v", 3)
    before = await _money(h, "u")
    values = {
        "authorization": [h.auth("u")["Authorization"], h.auth("v")["Authorization"]],
        "idempotency-key": ["key-1", "key-2"],
        "last-event-id": ["0", "5"],
    }[repeated.lower()]
    headers = [(repeated, value) for value in values]
    if repeated.lower() != "authorization":
        headers.append(("Authorization", h.auth("u")["Authorization"]))
    json = thesis_body(1) if method == "POST" else None
    async with h.http.request(
        method, f"{h.instances[0].base_url}{path}", json=json, headers=headers
    ) as r:
        reply = Reply(r.status, dict(r.headers), r.content_type, orjson.loads(await r.read()))

    _assert_problem(reply, 400, "malformed_request")
    assert reply.body["title"] == "A header that must come once came more than once."
    canonical = {"authorization": "Authorization"}.get(repeated, repeated)
    assert reply.body["errors"] == [
        {"field": canonical, "message": "sent 2 times; send it once"}
    ], reply.body
    await _assert_nothing_left(h, "u", before)
    assert h.sim.runs_snapshot() == []


async def test_the_credits_a_click_in_flight_holds_are_shown_until_it_is_admitted(
    harness: Harness,
) -> None:
    """A click's credit is held from its reservation (before Core is asked) to its admit, which
    debits it: meanwhile GET /v1/credits shows it held, part of the unchanged balance."""
    h = harness
    await _quiet_instance(h)
    await h.grant("u", 2)
    blocker = await h.db()
    try:
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute("SELECT aq_lock_global_v1()")  # the admit waits for it
        admitting = asyncio.create_task(h.admit("u", 1))

        async def credits() -> Any:
            reply = await _call(h, "GET", "/v1/credits", user="u")
            assert reply.status == 200, reply
            return reply.body

        async def held() -> bool:
            return bool((await credits())["held"])

        await wait_for(held, timeout_s=10, what="the click's hold")
        assert await credits() == {"balance": 2, "held": 1}
        await tx.rollback()
        status, _ = await asyncio.wait_for(admitting, 20)
    finally:
        await blocker.close()
    assert status == 201
    assert await credits() == {"balance": 1, "held": 0}
    await check_invariants(h.database_url)


async def test_core_offline_at_create_gives_503_and_the_sweep_cancels_the_orphan(
    harness: Harness,
) -> None:
    h = harness
    instance = await _quiet_instance(h, reservation_stale_s=0.05)
    await h.grant("u", 3)
    before = await _money(h, "u")
    await h.sim.go_offline()

    reply = await _call(h, "POST", "/v1/analyses", user="u", json=thesis_body(1))

    _assert_problem(reply, 503, "core_unavailable")
    assert await _count(h, "SELECT count(*) FROM analysis_jobs") == 0
    assert await _money(h, "u") == before
    # Core may or may not have made the run: the reservation tells the sweep to find out.
    reservations = await fetch(h.database_url, "SELECT * FROM core_run_reservations")
    assert len(reservations) == 1
    assert reservations[0]["user_id"] == "u"
    run_id = str(reservations[0]["run_id"])

    await h.sim.go_online()

    async def reservation_is_stale() -> bool:
        n = await fetchval(
            h.database_url,
            """SELECT count(*) FROM core_run_reservations
                WHERE created_at < clock_timestamp() - interval '0.1 seconds'""",
        )
        return bool(n == 1)

    await wait_for(reservation_is_stale, what="the reservation to age past reservation_stale_s")
    report = await instance.services.sweeper.run_once()

    assert report.reservations_cancelled == 1, report
    assert await _count(h, "SELECT count(*) FROM core_run_reservations") == 0
    assert await _held_runs_without_job(h) == []
    assert [r["state"] for r in h.sim.runs_snapshot() if r["run_id"] == run_id] == ["cancelled"]
    assert await _count(h, "SELECT count(*) FROM analysis_jobs") == 0
    assert await _money(h, "u") == before
    await check_invariants(h.database_url)


# -- 2. concurrent admits ---------------------------------------------------------------------


async def test_fifty_concurrent_admits_queue_up_without_gaps(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = SLOW_JUDGE_S
    await _quiet_instance(h)
    await h.grant("u", 50)

    replies = await asyncio.gather(*(h.admit("u", n) for n in range(50)))

    assert [status for status, _ in replies] == [201] * 50, replies
    answered = sorted((job["queue_position"] or 0, job["status"]) for _, job in replies)
    assert answered == [(0, "pending")] + [(p, "queued") for p in range(1, 50)]

    rows = await fetch(
        h.database_url,
        "SELECT id, status, queue_seq, created_at FROM analysis_jobs ORDER BY queue_seq",
    )
    assert len(rows) == 50
    assert rows[0]["status"] in ("pending", "running"), "the first admitted holds the slot"
    assert [r["status"] for r in rows[1:]] == ["queued"] * 49
    created = [r["created_at"] for r in rows]
    assert created == sorted(created), "queue_seq order disagrees with created_at"

    listing = await _call(h, "GET", "/v1/analyses", user="u")
    assert listing.status == 200
    position_of = {j["id"]: j["queue_position"] for j in listing.body["analyses"]}
    assert [position_of[str(r["id"])] for r in rows[1:]] == list(range(1, 50))
    assert position_of[str(rows[0]["id"])] is None
    singles = await asyncio.gather(
        *(_call(h, "GET", f"/v1/analyses/{r['id']}", user="u") for r in rows[1:])
    )
    assert [s.body["queue_position"] for s in singles] == list(range(1, 50))

    balance, ledger = await _money(h, "u")
    assert balance == 0
    debits = [job_id for kind, _, job_id in ledger if kind == "debit"]
    assert len(debits) == 50 and set(debits) == {r["id"] for r in rows}
    assert [kind for kind, _, _ in ledger if kind == "refund"] == []
    await check_invariants(h.database_url)


# -- 3. Idempotency-Key -----------------------------------------------------------------------


async def _admit_with_key(h: Harness, user: str, key: str, body: dict[str, Any]) -> Reply:
    return await _call(
        h, "POST", "/v1/analyses", user=user, json=body, headers={"Idempotency-Key": key}
    )


async def test_idempotency_key_replays_the_same_job_and_debits_once(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = SLOW_JUDGE_S
    await _quiet_instance(h)
    await h.grant("u", 5)

    first = await _admit_with_key(h, "u", "click-1", thesis_body(1))
    second = await _admit_with_key(h, "u", "click-1", thesis_body(1))

    assert first.status == 201, first
    assert "Idempotent-Replayed" not in first.headers
    assert second.status == 201, second
    assert second.headers.get("Idempotent-Replayed") == "true"
    assert second.body["id"] == first.body["id"]
    assert await _count(h, "SELECT count(*) FROM analysis_jobs WHERE user_id = 'u'") == 1
    balance, ledger = await _money(h, "u")
    assert balance == 4
    assert [(kind, amount) for kind, amount, _ in ledger] == [("grant", 5), ("debit", 1)]

    reused = await _admit_with_key(h, "u", "click-1", thesis_body(2))

    _assert_problem(reused, 409, "idempotency_key_reused")
    assert await _count(h, "SELECT count(*) FROM analysis_jobs WHERE user_id = 'u'") == 1
    assert (await _money(h, "u"))[0] == 4
    assert len(h.sim.runs_snapshot()) == 1
    await check_invariants(h.database_url)


async def test_concurrent_requests_with_one_key_make_one_job(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = SLOW_JUDGE_S
    await _quiet_instance(h)
    await h.grant("racer", 10)
    body = thesis_body(7)

    replies = await asyncio.gather(
        *(_admit_with_key(h, "racer", "double-click", body) for _ in range(10))
    )

    created = [r for r in replies if r.status == 201]
    others = [r for r in replies if r.status != 201]
    assert created, replies
    for reply in others:
        _assert_problem(reply, 409, "idempotency_in_progress")
    assert len({r.body["id"] for r in created}) == 1, created
    fresh = [r for r in created if r.headers.get("Idempotent-Replayed") != "true"]
    assert len(fresh) == 1, "exactly one answer created the job; the rest replayed it"

    jobs = await fetch(h.database_url, "SELECT id FROM analysis_jobs WHERE user_id = 'racer'")
    assert [str(j["id"]) for j in jobs] == [created[0].body["id"]]
    balance, ledger = await _money(h, "racer")
    assert balance == 9
    assert [kind for kind, _, _ in ledger].count("debit") == 1
    assert await _count(h, "SELECT count(*) FROM core_run_reservations") == 0
    assert len(h.sim.runs_snapshot()) == 1
    await check_invariants(h.database_url)


# -- 4. DELETE --------------------------------------------------------------------------------


async def test_delete_cancels_refunds_hides_and_frees_the_slot(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = SLOW_JUDGE_S
    await _quiet_instance(h)
    await h.grant("u", 3)
    await h.grant("other", 1)
    j1, j2, j3 = [(await _admit_ok(h, "u", n))["id"] for n in range(3)]
    await wait_for(_status_is(h, j1, "running"), what="first job running")
    assert (await _money(h, "u"))[0] == 0

    # A queued job: cancelled, refunded, hidden, its held run cancelled in Core.
    deleted = await _call(h, "DELETE", f"/v1/analyses/{j2}", user="u")

    assert deleted.status == 200, deleted
    assert deleted.body["status"] == "cancelled"
    balance, ledger = await _money(h, "u")
    assert balance == 1
    assert [(k, a) for k, a, job in ledger if str(job) == j2] == [("debit", 1), ("refund", 1)]
    _assert_problem(await _call(h, "GET", f"/v1/analyses/{j2}", user="u"), 404, "not_found")
    listing = await _call(h, "GET", "/v1/analyses", user="u")
    assert [j["id"] for j in listing.body["analyses"]] == [j3, j1]
    assert _sim_run(h, await _core_run_id(h, j2))["state"] == "cancelled"
    third = await _call(h, "GET", f"/v1/analyses/{j3}", user="u")
    assert (third.body["status"], third.body["queue_position"]) == ("queued", 1)

    # Twice: the second delete finds nothing.
    _assert_problem(await _call(h, "DELETE", f"/v1/analyses/{j2}", user="u"), 404, "not_found")
    assert (await _money(h, "u"))[0] == 1

    # Another user's job: 404, nothing changes.
    _assert_problem(await _call(h, "DELETE", f"/v1/analyses/{j1}", user="other"), 404, "not_found")
    assert await _status(h, j1) == "running"
    assert await _count(h, "SELECT count(*) FROM analysis_jobs WHERE deleted_at IS NOT NULL") == 1
    assert _sim_run(h, await _core_run_id(h, j1))["state"] == "judging"
    assert (await _money(h, "u"))[0] == 1
    assert (await _money(h, "other"))[0] == 1

    # The running job: cancelled in Core, no refund, the next queued job takes the slot.
    deleted = await _call(h, "DELETE", f"/v1/analyses/{j1}", user="u")

    assert deleted.status == 200, deleted
    assert deleted.body["status"] == "cancelled"
    assert _sim_run(h, await _core_run_id(h, j1))["state"] == "cancelled"
    await wait_for(_status_is(h, j3, "running"), what="next queued job running")
    assert _sim_run(h, await _core_run_id(h, j3))["state"] == "judging"
    balance, ledger = await _money(h, "u")
    assert balance == 1
    assert [(k, a) for k, a, job in ledger if str(job) == j1] == [("debit", 1)]
    _assert_problem(await _call(h, "GET", f"/v1/analyses/{j1}", user="u"), 404, "not_found")
    _assert_problem(await _call(h, "DELETE", f"/v1/analyses/{j1}", user="u"), 404, "not_found")
    await assert_fifo_serial(h.database_url)
    await check_invariants(h.database_url)


async def _finish_in_core(h: Harness, job_id: str, **body: Any) -> None:
    async with h.http.post(
        f"{h.sim.base_url}/_sim/runs/{await _core_run_id(h, job_id)}/finish", json=body
    ) as r:
        assert r.status == 200, await r.text()


async def test_delete_of_a_finished_job_only_hides_it_and_asks_core_nothing(
    harness: Harness,
) -> None:
    h = harness
    await _quiet_instance(h)
    await h.grant("u", 1)
    job_id = (await _admit_ok(h, "u", 1))["id"]
    await wait_for(_status_is(h, job_id, "succeeded"), what="job succeeded")
    money = await _money(h, "u")
    await h.sim.go_offline()  # a call to Core would fail, or wait out its retries
    try:
        deleted = await _call(h, "DELETE", f"/v1/analyses/{job_id}", user="u")
    finally:
        await h.sim.go_online()

    assert (deleted.status, deleted.body["status"]) == (200, "succeeded"), deleted
    _assert_problem(await _call(h, "GET", f"/v1/analyses/{job_id}", user="u"), 404, "not_found")
    # Nothing left for the sweep to cancel in Core: the run had ended.
    assert await _count(h, "SELECT count(*) FROM core_run_reservations") == 0
    assert _sim_run(h, await _core_run_id(h, job_id))["state"] == "completed"
    assert await _money(h, "u") == money
    await check_invariants(h.database_url)


async def _listed(h: Harness, user: str) -> list[tuple[str, str]]:
    listing = await _call(h, "GET", "/v1/analyses", user=user)
    assert listing.status == 200, listing
    return [(j["id"], j["status"]) for j in listing.body["analyses"]]


def _assert_cancelled_by_user(reply: Reply, job_id: str) -> None:
    assert reply.status == 200, reply
    assert (reply.body["id"], reply.body["status"]) == (job_id, "cancelled"), reply
    assert reply.body["error"]["code"] == "cancelled_by_user", reply


async def test_cancel_cancels_refunds_and_keeps_the_job_listed(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = SLOW_JUDGE_S
    await _quiet_instance(h)
    await h.grant("u", 3)
    await h.grant("other", 1)
    j1, j2, j3 = [(await _admit_ok(h, "u", n))["id"] for n in range(3)]
    await wait_for(_status_is(h, j1, "running"), what="first job running")
    assert (await _money(h, "u"))[0] == 0

    # A queued job: cancelled, refunded, its held run cancelled in Core; it stays listed.
    cancelled = await _call(h, "POST", f"/v1/analyses/{j2}/cancel", user="u")

    _assert_cancelled_by_user(cancelled, j2)
    assert cancelled.body["queue_position"] is None and cancelled.body["started_at"] is None
    balance, ledger = await _money(h, "u")
    assert balance == 1
    assert [(k, a) for k, a, job in ledger if str(job) == j2] == [("debit", 1), ("refund", 1)]
    _assert_cancelled_by_user(await _call(h, "GET", f"/v1/analyses/{j2}", user="u"), j2)
    assert await _listed(h, "u") == [(j3, "queued"), (j2, "cancelled"), (j1, "running")]
    assert _sim_run(h, await _core_run_id(h, j2))["state"] == "cancelled"
    third = await _call(h, "GET", f"/v1/analyses/{j3}", user="u")
    assert (third.body["status"], third.body["queue_position"]) == ("queued", 1)
    assert await _count(h, "SELECT count(*) FROM analysis_jobs WHERE deleted_at IS NOT NULL") == 0

    # Twice: the job as it is, nothing refunded twice.
    again = await _call(h, "POST", f"/v1/analyses/{j2}/cancel", user="u")
    _assert_cancelled_by_user(again, j2)
    assert again.body == cancelled.body
    assert await _money(h, "u") == (balance, ledger)

    # Another user's job: 404, nothing changes.
    _assert_problem(
        await _call(h, "POST", f"/v1/analyses/{j1}/cancel", user="other"), 404, "not_found"
    )
    assert await _status(h, j1) == "running"
    assert _sim_run(h, await _core_run_id(h, j1))["state"] == "judging"

    # The running job while Core cannot be told: 503, and it goes on holding its slot.
    await h.sim.go_offline()
    try:
        refused = await _call(h, "POST", f"/v1/analyses/{j1}/cancel", user="u")
    finally:
        await h.sim.go_online()
    _assert_problem(refused, 503, "core_unavailable")
    assert refused.headers.get("Retry-After"), refused.headers
    assert await _status(h, j1) == "running"
    assert await _status(h, j3) == "queued"
    assert _sim_run(h, await _core_run_id(h, j1))["state"] == "judging"

    # Told Core, then cancelled: no refund (it ran), the next queued job takes the slot.
    cancelled = await _call(h, "POST", f"/v1/analyses/{j1}/cancel", user="u")

    _assert_cancelled_by_user(cancelled, j1)
    assert _sim_run(h, await _core_run_id(h, j1))["state"] == "cancelled"
    await wait_for(_status_is(h, j3, "running"), what="next queued job running")
    assert _sim_run(h, await _core_run_id(h, j3))["state"] == "judging"
    balance, ledger = await _money(h, "u")
    assert balance == 1
    assert [(k, a) for k, a, job in ledger if str(job) == j1] == [("debit", 1)]
    assert await _listed(h, "u") == [(j3, "running"), (j2, "cancelled"), (j1, "cancelled")]

    # A finished job has nothing to cancel: 409, and it stays as it ended.
    await _finish_in_core(h, j3)
    await wait_for(_status_is(h, j3, "succeeded"), what="third job succeeded")
    _assert_problem(await _call(h, "POST", f"/v1/analyses/{j3}/cancel", user="u"), 409, "conflict")
    assert await _status(h, j3) == "succeeded"
    assert (await _money(h, "u"))[0] == 1

    # A deleted job is gone for a cancel too; DELETE of a cancelled job only hides it.
    deleted = await _call(h, "DELETE", f"/v1/analyses/{j2}", user="u")
    assert (deleted.status, deleted.body["status"]) == (200, "cancelled"), deleted
    _assert_problem(await _call(h, "POST", f"/v1/analyses/{j2}/cancel", user="u"), 404, "not_found")
    assert await _listed(h, "u") == [(j3, "succeeded"), (j1, "cancelled")]
    assert (await _money(h, "u"))[0] == 1
    await assert_fifo_serial(h.database_url)
    await check_invariants(h.database_url)


async def test_cancel_of_a_failed_job_is_a_conflict(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = SLOW_JUDGE_S
    await _quiet_instance(h)
    await h.grant("u", 1)
    job_id = (await _admit_ok(h, "u", 1))["id"]
    await wait_for(_status_is(h, job_id, "running"), what="job running")
    await _finish_in_core(h, job_id, state="failed", error="The document could not be fetched.")
    await wait_for(_status_is(h, job_id, "failed"), what="job failed")
    money = await _money(h, "u")

    reply = await _call(h, "POST", f"/v1/analyses/{job_id}/cancel", user="u")

    _assert_problem(reply, 409, "conflict")
    assert "failed" in reply.body["detail"], reply
    job = await _call(h, "GET", f"/v1/analyses/{job_id}", user="u")
    assert (job.body["status"], job.body["error"]["code"]) == ("failed", "analysis_failed")
    assert await _money(h, "u") == money
    assert _sim_run(h, await _core_run_id(h, job_id))["state"] == "failed"
    await check_invariants(h.database_url)


# -- 5. ownership -----------------------------------------------------------------------------


async def test_other_users_and_non_uuid_ids_are_not_found(harness: Harness) -> None:
    h = harness
    await _quiet_instance(h)
    await h.grant("owner", 1)
    await h.grant("intruder", 1)
    job_id = (await _admit_ok(h, "owner", 1))["id"]
    await wait_for(_status_is(h, job_id, "succeeded"), what="owner's job succeeded")
    recheck_body = {"sources": ["10.1000/extra.1"]}

    for method, path, body in [
        ("GET", f"/v1/analyses/{job_id}", None),
        ("DELETE", f"/v1/analyses/{job_id}", None),
        ("POST", f"/v1/analyses/{job_id}/cancel", None),
        ("POST", f"/v1/analyses/{job_id}/rechecks", recheck_body),
        ("GET", "/v1/analyses/not-a-uuid", None),
        ("DELETE", "/v1/analyses/not-a-uuid", None),
        ("POST", "/v1/analyses/not-a-uuid/cancel", None),
        ("POST", "/v1/analyses/not-a-uuid/rechecks", recheck_body),
        ("GET", f"/v1/analyses/{uuid.uuid4()}", None),
    ]:
        reply = await _call(h, method, path, user="intruder", json=body)
        _assert_problem(reply, 404, "not_found")

    # The owner still sees it untouched; the intruder got nothing and paid nothing.
    mine = await _call(h, "GET", f"/v1/analyses/{job_id}", user="owner")
    assert (mine.status, mine.body["status"]) == (200, "succeeded")
    for method, path in [("GET", "/v1/analyses/not-a-uuid"), ("GET", "/v1/analyses/123")]:
        _assert_problem(await _call(h, method, path, user="owner"), 404, "not_found")
    assert await _count(h, "SELECT count(*) FROM analysis_jobs") == 1
    assert await _count(h, "SELECT count(*) FROM analysis_jobs WHERE deleted_at IS NOT NULL") == 0
    assert (await _money(h, "intruder"))[0] == 1
    listing = await _call(h, "GET", "/v1/analyses", user="intruder")
    assert listing.body == {"analyses": [], "next": None}
    await check_invariants(h.database_url)


# -- 6. Core callbacks ------------------------------------------------------------------------


async def _post_event(h: Harness, body: bytes, headers: dict[str, str]) -> Reply:
    return await _call(
        h,
        "POST",
        "/v1/core/events",
        data=body,
        headers={"Content-Type": "application/json", **headers},
    )


def _signed(body: bytes, timestamp: int) -> dict[str, str]:
    return {
        "X-Core-Timestamp": str(timestamp),
        "X-Core-Signature": sign_callback(CALLBACK_SECRET, timestamp, body),
    }


async def test_core_callbacks_must_be_signed_and_fresh(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = SLOW_JUDGE_S
    await _quiet_instance(h)
    await h.grant("u", 1)
    job_id = (await _admit_ok(h, "u", 1))["id"]
    await wait_for(_status_is(h, job_id, "running"), what="job running")
    core_run_id = await _core_run_id(h, job_id)
    event = orjson.dumps({"id": core_run_id, "state": "completed", "verdicts": [], "error": None})
    money = await _money(h, "u")
    now = int(time.time())

    forged = {"X-Core-Timestamp": str(now), "X-Core-Signature": "sha256=" + "0" * 64}
    other_secret = {
        "X-Core-Timestamp": str(now),
        "X-Core-Signature": sign_callback("not-the-secret", now, event),
    }
    unsigned = {"X-Core-Timestamp": str(now)}
    stale = _signed(event, now - 600)
    for headers in (forged, other_secret, unsigned, stale, {}):
        reply = await _post_event(h, event, headers)
        _assert_problem(reply, 401, "invalid_signature")
        assert await _status(h, job_id) == "running"
        assert await _money(h, "u") == money

    # A valid event for a run nobody knows is acknowledged, so Core stops retrying.
    unknown = orjson.dumps({"id": "core-unknown", "state": "completed", "verdicts": []})
    reply = await _post_event(h, unknown, _signed(unknown, int(time.time())))
    assert (reply.status, reply.body) == (200, {"outcome": "unknown_run"})
    assert await _status(h, job_id) == "running"

    # The same event, signed properly, is applied: the refusals above were the signature's.
    reply = await _post_event(h, event, _signed(event, int(time.time())))
    assert (reply.status, reply.body) == (200, {"outcome": "applied"})
    assert await _status(h, job_id) == "succeeded"
    assert await _money(h, "u") == money
    await check_invariants(h.database_url)


async def test_duplicate_callbacks_finish_each_job_once(harness: Harness) -> None:
    h = harness
    h.sim.faults.duplicate_callbacks = True
    instance = await _quiet_instance(h)
    await h.grant("u", 3)
    ids = [(await _admit_ok(h, "u", n))["id"] for n in range(3)]

    async def every_copy_delivered() -> bool:
        runs = h.sim.runs_snapshot()
        return len(runs) == 3 and all(r["callbacks_sent"] == 2 for r in runs)

    await wait_for(every_copy_delivered, timeout_s=15, what="both copies of every callback")
    await instance.services.dispatcher.drain()

    rows = await fetch(
        h.database_url,
        """SELECT j.id, j.status, j.release_attempts, j.promoted_at, j.finished_at,
                  (SELECT count(*) FROM credit_ledger l
                    WHERE l.job_id = j.id AND l.kind = 'debit') AS debits,
                  (SELECT count(*) FROM credit_ledger l
                    WHERE l.job_id = j.id AND l.kind = 'refund') AS refunds
             FROM analysis_jobs j ORDER BY j.queue_seq""",
    )
    assert [str(r["id"]) for r in rows] == ids
    for row in rows:
        assert (row["status"], row["debits"], row["refunds"]) == ("succeeded", 1, 0), dict(row)
        assert row["release_attempts"] == 1, dict(row)
    assert instance.services.dispatcher.released == 3
    assert all(r["state"] == "completed" for r in h.sim.runs_snapshot())
    assert (await _money(h, "u"))[0] == 0
    await assert_fifo_serial(h.database_url)
    await check_invariants(h.database_url)


# -- 7. delta re-checks -----------------------------------------------------------------------


async def test_recheck_skips_the_queue_and_runs_beside_the_first_pass(harness: Harness) -> None:
    h = harness
    await _quiet_instance(h)
    await h.grant("u", 4)
    a = (await _admit_ok(h, "u", 0))["id"]
    await wait_for(_status_is(h, a, "succeeded"), what="job A succeeded")

    h.sim.judge_time_s = SLOW_JUDGE_S
    f1, f2, f3 = [(await _admit_ok(h, "u", n))["id"] for n in range(1, 4)]
    await wait_for(_status_is(h, f1, "running"), what="first-pass job running")
    positions = {
        f: (await _call(h, "GET", f"/v1/analyses/{f}", user="u")).body["queue_position"]
        for f in (f2, f3)
    }
    assert positions == {f2: 1, f3: 2}

    reply = await _call(
        h, "POST", f"/v1/analyses/{a}/rechecks", user="u", json={"sources": ["10.1000/new.1"]}
    )

    assert reply.status == 201, reply
    delta = reply.body
    assert delta["delta_of"] == a
    assert delta["status"] in ("pending", "running")
    assert delta["queue_position"] is None
    assert await _status(h, f2) == "queued" and await _status(h, f3) == "queued"

    await wait_for(_status_is(h, delta["id"], "running"), what="the re-check running")
    assert await _status(h, f1) == "running"
    judging = [r for r in h.sim.runs_snapshot() if r["state"] == "judging"]
    assert sorted(r["id"] for r in judging) == sorted(
        [await _core_run_id(h, f1), await _core_run_id(h, delta["id"])]
    )
    assert all(r["user_id"] == "u" for r in judging)
    after = {
        f: (await _call(h, "GET", f"/v1/analyses/{f}", user="u")).body["queue_position"]
        for f in (f2, f3)
    }
    assert after == positions

    for not_succeeded in (f1, f2):
        conflict = await _call(
            h,
            "POST",
            f"/v1/analyses/{not_succeeded}/rechecks",
            user="u",
            json={"sources": ["10.1000/new.2"]},
        )
        _assert_problem(conflict, 409, None)
    assert (
        await _count(h, "SELECT count(*) FROM analysis_jobs WHERE delta_of_job_id IS NOT NULL") == 1
    )
    await check_invariants(h.database_url)


# -- 8. Core-reported failure -----------------------------------------------------------------


async def test_core_reported_failure_fails_refunds_once_and_promotes_next(
    harness: Harness,
) -> None:
    h = harness
    h.sim.faults.fail_runs = True
    instance = await _quiet_instance(h)
    await h.grant("u", 2)
    first = (await _admit_ok(h, "u", 1))["id"]
    second = await _admit_ok(h, "u", 2)
    assert second["status"] == "queued"

    await wait_for(_status_is(h, first, "failed"), what="first job failed")
    await wait_for(
        _status_is(h, second["id"], "pending", "running", "failed"), what="next job promoted"
    )
    await wait_for(_status_is(h, second["id"], "failed"), what="second job failed")
    await instance.services.dispatcher.drain()

    for job_id in (first, second["id"]):
        shown = await _call(h, "GET", f"/v1/analyses/{job_id}", user="u")
        assert shown.body["status"] == "failed"
        assert shown.body["error"]["code"] == "analysis_failed"
        _, ledger = await _money(h, "u")
        assert [(k, a) for k, a, job in ledger if str(job) == job_id] == [
            ("debit", 1),
            ("refund", 1),
        ]
    assert (await _money(h, "u"))[0] == 2
    assert instance.services.dispatcher.released == 2
    await assert_fifo_serial(h.database_url)
    await check_invariants(h.database_url)
