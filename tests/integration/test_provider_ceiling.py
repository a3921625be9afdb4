"""The provider ceiling: a global bound on running analyses, plan limits, fair turns.

Runs judge "forever" in these tests (the simulator's judging time is an hour) and the test
finishes them one at a time through the simulator, so every start is caused by one completion
and the order of starts is the scheduler's alone. Each runs twice: with the instances connected
directly, and with their pools through PgBouncer in transaction mode (tests/bouncer.py); but
the newcomers' test runs only its four-user case through PgBouncer (the other differs in
backlog alone), and the previous version's call only directly (that version cannot run behind
PgBouncer: it sends lock_timeout at startup).
"""

from __future__ import annotations

import asyncio
import math
import uuid
from typing import Any

import asyncpg
import pytest
from analysis_queue.models import OPEN_STATUSES
from bouncer import DIRECT, PGBOUNCER, ROUTES
from support import (
    Harness,
    assert_within_limits,
    check_invariants,
    fetch,
    fetchval,
    wait_for,
    wait_until_blocked,
)

CEILING = 4
FOREVER_S = 3600.0
both_routes = pytest.mark.parametrize("db_route", ROUTES, indirect=True)
FOUR_USERS = {"a": 1, "b": 1, "c": 1, "d": 1}


async def _active(h: Harness) -> int:
    return int(
        await fetchval(
            h.database_url,
            "SELECT count(*) FROM analysis_jobs WHERE status IN ('pending', 'running')",
        )
    )


async def _ready(h: Harness) -> int:
    return int(
        await fetchval(
            h.database_url,
            """SELECT count(*) FROM analysis_jobs
                WHERE status = 'queued' AND waiting_for = 'provider_capacity'""",
        )
    )


async def _settled(h: Harness, ceiling: int = CEILING) -> bool:
    """No release in flight, and every free slot that someone waits for is taken. One
    statement, one snapshot: counted apart, a promotion landing between the counts reads as
    "nothing pending, slots full" while the promoted job is still pending."""
    rows = await fetch(
        h.database_url,
        """SELECT count(*) FILTER (WHERE status = 'pending') AS pending,
                  count(*) FILTER (WHERE status IN ('pending', 'running')) AS active,
                  count(*) FILTER (WHERE status = 'queued' AND waiting_for = 'provider_capacity')
                      AS ready
             FROM analysis_jobs""",
    )
    counts = rows[0]
    return counts["pending"] == 0 and (counts["active"] >= ceiling or counts["ready"] == 0)


async def _finish_oldest_running(h: Harness, ceiling: int = CEILING) -> None:
    rows = await fetch(
        h.database_url,
        """SELECT id, core_run_id FROM analysis_jobs WHERE status = 'running'
            ORDER BY promoted_at LIMIT 1""",
    )
    assert rows, "nothing is running"
    job_id, run_id = rows[0]["id"], rows[0]["core_run_id"]
    async with h.http.post(f"{h.sim.base_url}/_sim/runs/{run_id}/finish", json={}) as r:
        assert r.status == 200, await r.text()

    async def done() -> bool:
        status = await fetchval(
            h.database_url, "SELECT status FROM analysis_jobs WHERE id=$1", job_id
        )
        return status == "succeeded" and await _settled(h, ceiling)

    await wait_for(done, timeout_s=10, what="completion and the promotion it causes")


async def _statuses_are(h: Harness, job_ids: list[str], status: str) -> bool:
    rows = await fetch(
        h.database_url, "SELECT status FROM analysis_jobs WHERE id = ANY($1::uuid[])", job_ids
    )
    return len(rows) == len(job_ids) and all(r["status"] == status for r in rows)


async def _admit_ok(h: Harness, user: str, n: int = 1) -> dict[str, Any]:
    status, job = await h.admit(user, n)
    assert status == 201, job
    return job


async def _cancel_everything(h: Harness) -> None:
    db = h.instances[0].services.db
    while True:
        rows = await fetch(
            h.database_url,
            """SELECT id FROM analysis_jobs WHERE status IN ('queued', 'pending', 'running')
                ORDER BY status = 'queued' DESC""",
        )
        if not rows:
            return
        for row in rows:
            await db.finish(job_id=row["id"], status="cancelled", from_statuses=OPEN_STATUSES)


async def _waits_of_newcomers(
    h: Harness, prefix: str, backlog: dict[str, int], per_user: int
) -> list[int]:
    """Users in ``backlog`` (user -> plan limit) admit ``per_user`` jobs each; then ten users
    admit one each. Completions free one slot at a time. Returns, for each of the ten, how many
    starts (of anyone's jobs) it took until theirs, counting theirs."""
    for user, limit in backlog.items():
        await h.grant(prefix + user, per_user)
        if limit != 1:
            await h.set_limit(prefix + user, limit)
        for n in range(per_user):
            await _admit_ok(h, prefix + user, n)
    await wait_for(lambda: _settled(h), what="the ceiling filled")
    assert await _active(h) == CEILING
    mark = await fetchval(h.database_url, "SELECT clock_timestamp()")

    newcomers = [f"{prefix}newcomer-{i}" for i in range(10)]
    for user in newcomers:
        await h.grant(user, 1)
        job = await _admit_ok(h, user)
        assert (job["status"], job["waiting_for"]) == ("queued", "provider_capacity"), job

    async def newcomers_started() -> bool:
        n = await fetchval(
            h.database_url,
            """SELECT count(*) FROM analysis_jobs
                WHERE user_id = ANY ($1) AND promoted_at IS NOT NULL""",
            newcomers,
        )
        return bool(n == len(newcomers))

    while not await newcomers_started():
        await _finish_oldest_running(h)
        assert await _active(h) <= CEILING

    starts = await fetch(
        h.database_url,
        "SELECT user_id FROM analysis_jobs WHERE promoted_at > $1 ORDER BY promoted_at",
        mark,
    )
    order = [r["user_id"] for r in starts]
    return [order.index(user) + 1 for user in newcomers]


@pytest.mark.parametrize(
    ("backlog", "per_user", "db_route"),
    [
        pytest.param({"big": 4}, 50, DIRECT, id="one-user-allowed-4-admits-50-direct"),
        pytest.param(FOUR_USERS, 10, DIRECT, id="four-users-admit-10-each-direct"),
        pytest.param(FOUR_USERS, 10, PGBOUNCER, id="four-users-admit-10-each-pgbouncer"),
    ],
    indirect=["db_route"],
)
async def test_ten_newcomers_start_within_bounded_turns_whatever_the_backlog(
    harness: Harness, backlog: dict[str, int], per_user: int
) -> None:
    h = harness
    h.sim.judge_time_s = FOREVER_S
    await h.start_instance(global_max_running=CEILING, sweep_interval_s=0)
    bound_turns = math.ceil(10 / CEILING) + 1

    waits = await _waits_of_newcomers(h, "x1-", backlog, per_user)
    await assert_within_limits(h.database_url)
    await _cancel_everything(h)
    waits_x10 = await _waits_of_newcomers(h, "x10-", backlog, per_user * 10)

    turns = [math.ceil(w / CEILING) for w in waits]
    turns_x10 = [math.ceil(w / CEILING) for w in waits_x10]
    print(f"\nbacklog {per_user}/user: starts until each newcomer's own: {waits}, turns {turns}")
    print(f"backlog {per_user * 10}/user: starts {waits_x10}, turns {turns_x10}")
    assert max(turns) <= bound_turns, waits
    assert max(turns_x10) <= bound_turns, waits_x10
    assert waits_x10 == waits, "the newcomers' waits depend on the backlog"
    await assert_within_limits(h.database_url)
    await check_invariants(h.database_url)


@both_routes
async def test_ceiling_bounds_what_runs_and_says_why_jobs_wait(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = FOREVER_S
    await h.start_instance(global_max_running=2, sweep_interval_s=0)
    for user in ("u1", "u2", "u3"):
        await h.grant(user, 2)
    first = {user: await _admit_ok(h, user) for user in ("u1", "u2", "u3")}
    second = {user: await _admit_ok(h, user, 2) for user in ("u1", "u2", "u3")}
    # A free slot is taken at admission when its try of the global lock wins; while a batch of
    # running marks holds that lock shared the try fails, the job waits for capacity and the
    # pass its admit asked for starts it a moment later (docs/locking.md).
    for user in ("u1", "u2"):
        assert first[user]["status"] == "pending" or (
            first[user]["status"],
            first[user]["waiting_for"],
        ) == ("queued", "provider_capacity"), first[user]
    await wait_for(lambda: _statuses_are(h, [first["u1"]["id"], first["u2"]["id"]], "running"))
    _, u3_first = await h.get("u3", f"/v1/analyses/{first['u3']['id']}")
    assert (u3_first["status"], u3_first["waiting_for"]) == ("queued", "provider_capacity")
    assert u3_first["queue_position"] == 1
    assert (second["u1"]["waiting_for"], second["u1"]["queue_position"]) == (
        "your_previous_analysis",
        1,
    )
    assert second["u3"]["waiting_for"] == "your_previous_analysis"
    await wait_for(lambda: _settled(h, 2), what="two running")

    status, capacity = await h.admin("GET", "/v1/admin/capacity")
    assert status == 200
    assert capacity == {
        "global_max_running": 2,
        "slots_in_use": 2,
        "jobs_waiting_for_capacity": 1,
        "users_waiting_for_capacity": 1,
    }
    async with h.http.get(f"{h.instances[0].base_url}/metrics") as r:
        metrics = await r.text()
    assert "aq_global_max_running 2.0" in metrics
    assert "aq_global_slots_in_use 2.0" in metrics
    assert 'aq_waiting_for_capacity{unit="users"} 1.0' in metrics

    # u1's first run ends: u1's next job now waits for capacity too, but u3 waited longer.
    await _finish_oldest_running(h, 2)
    _, u3 = await h.get("u3", f"/v1/analyses/{first['u3']['id']}")
    assert u3["status"] in ("pending", "running")
    _, u1 = await h.get("u1", f"/v1/analyses/{second['u1']['id']}")
    assert (u1["status"], u1["waiting_for"]) == ("queued", "provider_capacity")
    assert await _active(h) == 2
    # The change of wait is an event of u1's stream, like a change of status.
    kinds = await fetch(
        h.database_url,
        "SELECT kind, job_id FROM job_events WHERE user_id = 'u1' ORDER BY event_id",
    )
    assert ("waiting", second["u1"]["id"]) in [(k, str(j)) for k, j in kinds]
    await assert_within_limits(h.database_url)
    await check_invariants(h.database_url)


@both_routes
async def test_a_delta_takes_the_next_free_slot_ahead_of_first_pass_jobs(
    harness: Harness,
) -> None:
    h = harness
    h.sim.judge_time_s = FOREVER_S
    await h.start_instance(global_max_running=2, sweep_interval_s=0, recheck_cost=0)
    for user in ("a", "b", "c", "d"):
        await h.grant(user, 2)
    parent = await _admit_ok(h, "a")
    await wait_for(lambda: _settled(h, 2), what="a running")
    await _finish_oldest_running(h, 2)  # a's analysis succeeded: it can be re-checked
    await _admit_ok(h, "b")
    await _admit_ok(h, "c")
    waiting = await _admit_ok(h, "d")  # first-pass, waiting for capacity, admitted first
    assert waiting["waiting_for"] == "provider_capacity"
    await wait_for(lambda: _settled(h, 2), what="b and c running")

    async with h.http.post(
        f"{h.instances[0].base_url}/v1/analyses/{parent['id']}/rechecks",
        json={"sources": ["10.1000/new"]},
        headers=h.auth("a"),
    ) as r:
        assert r.status == 201
        delta = await r.json()
    assert (delta["status"], delta["waiting_for"], delta["queue_position"]) == (
        "queued",
        "provider_capacity",
        None,
    )
    await _finish_oldest_running(h, 2)  # b's run ends: one slot, two waiting
    _, d = await h.get("a", f"/v1/analyses/{delta['id']}")
    assert d["status"] in ("pending", "running")
    _, w = await h.get("d", f"/v1/analyses/{waiting['id']}")
    assert w["status"] == "queued"
    await check_invariants(h.database_url)


@both_routes
async def test_a_plan_limit_runs_several_at_once_still_in_order(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = FOREVER_S
    await h.start_instance(sweep_interval_s=0)  # ceiling off
    await h.grant("team", 6)
    jobs = [await _admit_ok(h, "team", n) for n in range(6)]
    assert [j["status"] for j in jobs] == ["pending"] + ["queued"] * 5
    assert {j["waiting_for"] for j in jobs[1:]} == {"your_previous_analysis"}

    await h.set_limit("team", 3)  # two more start at once, the oldest first
    await wait_for(lambda: _settled(h, 3), what="three running")
    status, limit = await h.admin("GET", "/v1/admin/users/team/limit")
    assert (status, limit) == (
        200,
        {"user_id": "team", "max_running": 3, "default": False, "active": 3, "queued": 3},
    )
    rows = await fetch(
        h.database_url,
        "SELECT status, user_slot FROM analysis_jobs ORDER BY queue_seq",
    )
    assert [r["status"] for r in rows] == ["running"] * 3 + ["queued"] * 3
    assert sorted(r["user_slot"] for r in rows[:3]) == [1, 2, 3]
    await _finish_oldest_running(h, 3)  # a slot frees: the next in line takes it
    assert await _active(h) == 3
    seen = await assert_within_limits(h.database_url)
    assert seen["team"] == 3

    await h.set_limit("team", None)  # back to one: running jobs finish, none starts meanwhile
    await _finish_oldest_running(h, 1)
    await _finish_oldest_running(h, 1)
    assert await _active(h) == 1
    await _finish_oldest_running(h, 1)
    assert await _active(h) == 1  # the next one started
    await check_invariants(h.database_url)

    status, problem = await h.admin("PUT", "/v1/admin/users/team/limit", {"max_running": 0})
    assert (status, problem["code"]) == (422, "invalid_body")


@both_routes
async def test_a_lowered_plan_limit_sends_a_waiting_job_back_behind_the_previous(
    harness: Harness,
) -> None:
    h = harness
    h.sim.judge_time_s = FOREVER_S
    await h.start_instance(global_max_running=1, sweep_interval_s=0)
    await h.grant("other", 1)
    await h.grant("team", 3)
    await _admit_ok(h, "other")  # takes the one global slot
    await wait_for(lambda: _settled(h, 1), what="other's job running")
    await h.set_limit("team", 2)
    jobs = [await _admit_ok(h, "team", n) for n in range(3)]

    async def waits() -> list[tuple[str, str]]:
        rows = await fetch(
            h.database_url,
            """SELECT status, waiting_for FROM analysis_jobs
                WHERE user_id = 'team' ORDER BY queue_seq""",
        )
        return [(r["status"], r["waiting_for"]) for r in rows]

    async def events_of_the_second() -> list[str]:
        rows = await fetch(
            h.database_url,
            "SELECT kind FROM job_events WHERE job_id = $1::uuid ORDER BY event_id",
            jobs[1]["id"],
        )
        return [r["kind"] for r in rows]

    # Room for two of team's jobs, none in the ceiling: the first two wait for capacity.
    capacity, previous = ("queued", "provider_capacity"), ("queued", "your_previous_analysis")
    assert await waits() == [capacity, capacity, previous]
    before = await events_of_the_second()

    await h.set_limit("team", None)  # back to one: the second waits for the first again
    assert await waits() == [capacity, previous, previous]
    _, second = await h.get("team", f"/v1/analyses/{jobs[1]['id']}")
    assert (second["waiting_for"], second["queue_position"]) == ("your_previous_analysis", 2)
    assert await events_of_the_second() == [*before, "waiting"]
    await check_invariants(h.database_url)


@both_routes
async def test_the_last_instance_started_sets_the_ceiling(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = FOREVER_S
    await h.start_instance(global_max_running=1, sweep_interval_s=0)
    for user in ("p", "q", "r"):
        await h.grant(user, 1)
        await _admit_ok(h, user)
    await wait_for(lambda: _settled(h, 1), what="one running")
    assert await _ready(h) == 2

    # A deploy whose instances have the ceiling off: what waited for capacity starts.
    await h.start_instance(global_max_running=0, sweep_interval_s=0)
    await wait_for(lambda: _settled(h, 3), what="all three running")
    assert await _ready(h) == 0
    assert await fetchval(h.database_url, "SELECT global_max_running FROM queue_settings") is None
    waits = await fetchval(
        h.database_url, "SELECT count(*) FROM analysis_jobs WHERE waiting_for IS NOT NULL"
    )
    assert waits == 0
    await check_invariants(h.database_url)


@both_routes
async def test_a_completion_written_behind_the_service_fills_the_slot_by_notify(
    harness: Harness,
) -> None:
    """An external writer (an older version, an operator) ends a job without the queue's
    functions: no wait is re-derived and nothing is promoted in its transaction; the NOTIFY it
    triggers makes a pass re-derive that user's waits and fill the slot, sweep off."""
    h = harness
    h.sim.judge_time_s = FOREVER_S
    inst = await h.start_instance(global_max_running=2, sweep_interval_s=0)
    # The one pass the listener's connecting kicks must be over before the sweep is counted.
    await asyncio.wait_for(inst.services.sweeper.pass_done.wait(), 10)
    await h.grant("e", 2)
    first = await _admit_ok(h, "e")
    second = await _admit_ok(h, "e", 2)
    assert second["waiting_for"] == "your_previous_analysis"
    await wait_for(lambda: _settled(h, 2), what="first running")
    passes_before = inst.services.sweeper.passes
    await fetchval(
        h.database_url,
        """UPDATE analysis_jobs SET status = 'succeeded', finished_at = clock_timestamp()
            WHERE id = $1::uuid RETURNING id""",
        first["id"],
    )

    async def second_started() -> bool:
        status = await fetchval(
            h.database_url, "SELECT status FROM analysis_jobs WHERE id = $1::uuid", second["id"]
        )
        return status in ("pending", "running")

    await wait_for(second_started, timeout_s=5, what="promotion by NOTIFY")
    assert inst.services.sweeper.passes == passes_before, "the sweep did not run"
    await check_invariants(h.database_url)


@pytest.mark.parametrize("ceiling", [None, 1], ids=["ceiling-off", "ceiling-on"])
async def test_the_previous_versions_promotion_call_follows_the_new_rules(
    harness: Harness, ceiling: int | None
) -> None:
    """During a rolling deploy, instances of the version before the ceiling still call
    ``aq_promote_next_v1`` when a user's slot frees; it now takes the same path as everything
    else (a pass when the ceiling is on)."""
    h = harness
    h.sim.judge_time_s = FOREVER_S
    await h.start_instance(
        global_max_running=ceiling or 0, sweep_interval_s=0, listen_enabled=False
    )
    await h.grant("old", 2)
    first = await _admit_ok(h, "old")
    second = await _admit_ok(h, "old", 2)
    await fetchval(
        h.database_url,
        """UPDATE analysis_jobs SET status = 'succeeded', finished_at = clock_timestamp()
            WHERE id = $1::uuid RETURNING id""",
        first["id"],
    )
    promoted = await fetch(h.database_url, "SELECT * FROM aq_promote_next_v1('old')")
    assert [str(r["id"]) for r in promoted] == [second["id"]]
    assert promoted[0]["status"] == "pending"
    assert (promoted[0]["global_slot"] is not None) == (ceiling is not None)
    await check_invariants(h.database_url)


@both_routes
async def test_a_slot_held_by_a_dead_instances_job_is_recovered_by_the_sweep(
    harness: Harness,
) -> None:
    """An instance dies mid-release: its job stays pending, claimed, holding the only global
    slot. Nothing can start until the sweep of a live instance takes the job over after the claim
    lease, releases it, and its completion frees the slot."""
    h = harness
    h.sim.judge_time_s = FOREVER_S
    h.sim.faults.release_status = 503  # the release never gets through before the "crash"
    first = await h.start_instance(global_max_running=1, sweep_interval_s=0)
    await h.grant("a", 1)
    await h.grant("b", 1)
    stuck = await _admit_ok(h, "a")
    assert stuck["status"] == "pending"
    await h.stop_instance(first)
    await fetchval(
        h.database_url,
        """UPDATE analysis_jobs
              SET claimed_by = 'dead-instance', next_release_at = NULL,
                  claim_expires_at = clock_timestamp() + interval '1 second'
            WHERE id = $1::uuid RETURNING id""",
        stuck["id"],
    )
    h.sim.faults.release_status = None

    await h.start_instance(global_max_running=1, sweep_interval_s=0.3)
    waiting = await _admit_ok(h, "b")
    assert (waiting["status"], waiting["waiting_for"]) == ("queued", "provider_capacity")

    async def stuck_running() -> bool:
        status = await fetchval(
            h.database_url, "SELECT status FROM analysis_jobs WHERE id = $1::uuid", stuck["id"]
        )
        return status == "running"

    await wait_for(stuck_running, timeout_s=10, what="the sweep releasing the dead claim's job")
    _, still = await h.get("b", f"/v1/analyses/{waiting['id']}")
    assert still["status"] == "queued"
    await _finish_oldest_running(h, 1)
    _, started = await h.get("b", f"/v1/analyses/{waiting['id']}")
    assert started["status"] in ("pending", "running")
    await check_invariants(h.database_url)


@both_routes
async def test_a_running_job_frees_its_slot_only_after_core_stopped_it(harness: Harness) -> None:
    """Cancelling a running analysis: Core is told first. Until Core confirms, the job keeps its
    slot (and the click gets a 503), so the job waiting for the slot never judges beside it."""
    h = harness
    h.sim.judge_time_s = FOREVER_S
    await h.start_instance(global_max_running=1, sweep_interval_s=0)
    await h.grant("a", 1)
    await h.grant("b", 1)
    running = await _admit_ok(h, "a")
    await wait_for(lambda: _settled(h, 1), what="a running")
    waiting = await _admit_ok(h, "b")
    assert waiting["waiting_for"] == "provider_capacity"
    path = f"{h.instances[0].base_url}/v1/analyses/{running['id']}"

    await h.sim.go_offline()
    try:
        async with h.http.delete(path, headers=h.auth("a")) as r:
            assert r.status == 503
            assert (await r.json())["code"] == "core_unavailable"
    finally:
        await h.sim.go_online()
    _, still = await h.get("a", f"/v1/analyses/{running['id']}")
    assert still["status"] == "running"
    _, queued = await h.get("b", f"/v1/analyses/{waiting['id']}")
    assert queued["status"] == "queued"

    async with h.http.delete(path, headers=h.auth("a")) as r:
        assert r.status == 200
        assert (await r.json())["status"] == "cancelled"
    await wait_for(lambda: _settled(h, 1), what="b promoted into the freed slot")
    _, started = await h.get("b", f"/v1/analyses/{waiting['id']}")
    assert started["status"] == "running"
    assert h.sim.stats()["max_judging"] == 1  # Core never judged both at once
    await check_invariants(h.database_url)


@both_routes
async def test_a_lowered_ceiling_lets_running_jobs_finish_before_anything_starts(
    harness: Harness,
) -> None:
    """A completion restarts its user's next job in the slot it frees only while the ceiling
    has room: after the ceiling is lowered, the running jobs drain down to it first."""
    h = harness
    h.sim.judge_time_s = FOREVER_S
    await h.start_instance(global_max_running=3, sweep_interval_s=0)
    await h.grant("p", 6)
    await h.set_limit("p", 3)
    for n in range(6):
        await _admit_ok(h, "p", n)
    await wait_for(lambda: _settled(h, 3), what="three running")

    await h.start_instance(global_max_running=1, sweep_interval_s=0)  # a deploy lowers it
    await _finish_oldest_running(h, 1)
    assert await _active(h) == 2  # nothing started in the freed slot
    await _finish_oldest_running(h, 1)
    assert await _active(h) == 1
    await _finish_oldest_running(h, 1)
    assert await _active(h) == 1  # now under the ceiling: the next one took the slot
    await check_invariants(h.database_url)


@both_routes
async def test_a_completion_in_flight_when_the_ceiling_is_lowered_obeys_the_new_one(
    harness: Harness,
) -> None:
    """A completion reads the ceiling, then waits for the global lock, which a change of the
    ceiling holds; meanwhile the ceiling is lowered. Once it runs, it must judge by the new
    ceiling, not the one it read."""
    h = harness
    h.sim.judge_time_s = FOREVER_S
    inst = await h.start_instance(global_max_running=3, sweep_interval_s=0, listen_enabled=False)
    await h.grant("p", 4)
    await h.set_limit("p", 3)
    jobs = [await _admit_ok(h, "p", n) for n in range(4)]
    await wait_for(lambda: _settled(h, 3), what="three running")

    holder = await asyncpg.connect(h.database_url)
    try:
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT aq_set_ceiling_v1(1)")  # holds G until it commits
        finish = asyncio.create_task(
            inst.services.db.finish(
                job_id=uuid.UUID(jobs[0]["id"]),
                status="succeeded",
                from_statuses=("pending", "running"),
                ran=True,
            )
        )
        # It has read the ceiling (3) and waits for the global lock.
        await wait_until_blocked(h.database_url, holder.get_server_pid())
        assert not finish.done()
        await tx.commit()
        result = await finish
    finally:
        await holder.close()
    assert result is not None and result.changed
    assert result.promoted == (), "started a job over the lowered ceiling"
    assert await _active(h) == 2
