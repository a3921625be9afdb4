"""How work is woken: NOTIFY first, the sweep as the fallback, durable release retries."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import asyncpg
from support import Harness, assert_fifo_serial, check_invariants, fetch, fetchval, wait_for


async def _status(h: Harness, job_id: str) -> str:
    return str(
        await fetchval(h.database_url, "SELECT status FROM analysis_jobs WHERE id=$1::uuid", job_id)
    )


async def _is(h: Harness, job_id: str, *statuses: str) -> bool:
    return await _status(h, job_id) in statuses


async def _complete_behind_the_service(h: Harness, job_id: str) -> None:
    """An external writer (an older version, an operator) finishes a job: no tail promotion,
    only the trigger's NOTIFY says the slot is free."""
    conn = await asyncpg.connect(h.database_url)
    try:
        await conn.execute(
            """UPDATE analysis_jobs SET status = 'succeeded', finished_at = clock_timestamp()
                WHERE id = $1::uuid""",
            job_id,
        )
    finally:
        await conn.close()


async def test_promotion_after_completion_comes_from_notify(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = 60
    inst = await h.start_instance(sweep_interval_s=0)
    # The one pass the listener's connecting kicks must be over before the sweep is counted.
    await asyncio.wait_for(inst.services.sweeper.pass_done.wait(), 10)
    await h.grant("u", 3)
    _, a = await h.admit("u", 1)
    _, b = await h.admit("u", 2)
    await wait_for(lambda: _is(h, a["id"], "running"), what="first job running")
    assert b["status"] == "queued"
    assert inst.services.listener is not None
    promoter = inst.services.promoter
    sweeps_before = inst.services.sweeper.passes
    promotions_before = promoter.promotions

    await _complete_behind_the_service(h, a["id"])
    await wait_for(lambda: _is(h, b["id"], "running"), timeout_s=5, what="promotion by NOTIFY")

    assert promoter.promotions == promotions_before + 1
    assert inst.services.sweeper.passes == sweeps_before, "the sweep did not run"
    await assert_fifo_serial(h.database_url)


async def test_an_instances_own_changes_wake_only_the_other_instances(harness: Harness) -> None:
    """Every instance hears every change. The one that committed it followed it up already (its
    pool's backends sent the notification), so only the others spend a read on it."""
    h = harness
    h.sim.judge_time_s = 0.02
    a = await h.start_instance(sweep_interval_s=0)
    b = await h.start_instance(sweep_interval_s=0)
    h.sim.callback_urls.remove(f"{b.base_url}/v1/core/events")  # Core calls a back
    await h.grant("u", 3)
    for n in range(3):
        assert (await h.admit("u", n, instance=a))[0] == 201

    async def all_done() -> bool:
        return bool(
            await fetchval(
                h.database_url, "SELECT bool_and(status = 'succeeded') FROM analysis_jobs"
            )
        )

    await wait_for(all_done, what="three analyses")
    assert a.services.promoter.promotions + b.services.promoter.promotions == 0, "tail only"
    await wait_for(lambda: _settled_wakes(b), what="the other instance to wake for the freed slots")
    assert a.services.db.backend_pids, "the pool knows its server processes"
    # a committed every change that could leave work (admits, promotions, completions); b only
    # read, or released what it found pending.
    assert a.services.promoter.wake_calls == 0
    await assert_fifo_serial(h.database_url)


async def _settled_wakes(instance: Any) -> bool:
    return bool(instance.services.promoter.wake_calls > 0)


async def test_sweep_alone_drains_the_queue_without_listen(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = 0.02
    h.sim.faults.drop_callbacks = True  # completions are learnt by polling Core
    inst = await h.start_instance(listen_enabled=False, sweep_interval_s=0.1, running_quiet_s=0.05)
    assert inst.services.listener is None
    await h.grant("u", 4)
    await h.grant("v", 2)
    for n in range(4):
        assert (await h.admit("u", n))[0] == 201
    for n in range(2):
        assert (await h.admit("v", n))[0] == 201

    async def done() -> bool:
        rows = await fetch(h.database_url, "SELECT status FROM analysis_jobs")
        return all(r["status"] == "succeeded" for r in rows)

    await wait_for(done, timeout_s=20, what="sweep-only drain")
    await assert_fifo_serial(h.database_url)
    await check_invariants(h.database_url)


async def test_sweep_promotes_when_a_notification_was_missed(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = 60
    inst = await h.start_instance(listen_enabled=False, sweep_interval_s=0)
    await h.grant("u", 2)
    _, a = await h.admit("u", 1)
    _, b = await h.admit("u", 2)
    await wait_for(lambda: _is(h, a["id"], "running"), what="first job running")
    await _complete_behind_the_service(h, a["id"])
    assert await _status(h, b["id"]) == "queued"  # nobody heard about it

    report = await inst.services.sweeper.run_once()
    assert report.promoted == 1
    await wait_for(lambda: _is(h, b["id"], "running"), what="swept job released")


async def test_release_retries_until_core_is_back(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = 60
    h.sim.faults.release_status = 503
    await h.start_instance(release_backoff_base_s=0.02, release_backoff_max_s=0.05)
    await h.grant("u", 1)
    _, a = await h.admit("u", 1)

    async def attempts_at_least(n: int) -> bool:
        value = await fetchval(
            h.database_url, "SELECT release_attempts FROM analysis_jobs WHERE id=$1::uuid", a["id"]
        )
        return bool(value >= n)

    await wait_for(lambda: attempts_at_least(3), what="three release attempts")
    row = (await fetch(h.database_url, "SELECT * FROM analysis_jobs WHERE id=$1::uuid", a["id"]))[0]
    assert row["status"] == "pending"
    assert row["error_code"] == "release_retrying"
    assert row["next_release_at"] is not None

    h.sim.faults.release_status = None
    await wait_for(lambda: _is(h, a["id"], "running"), what="release after Core recovered")


async def test_release_gives_up_after_the_window_and_refunds(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = 0.02
    h.sim.faults.release_status = 503
    await h.start_instance(
        release_window_s=0.4, release_backoff_base_s=0.02, release_backoff_max_s=0.05
    )
    await h.grant("u", 2)
    _, a = await h.admit("u", 1)
    _, b = await h.admit("u", 2)
    await wait_for(lambda: _is(h, a["id"], "failed"), what="first job given up")
    row = (await fetch(h.database_url, "SELECT * FROM analysis_jobs WHERE id=$1::uuid", a["id"]))[0]
    assert row["error_code"] == "release_timeout"
    # The next job was promoted by the give-up; Core is back, so it runs to the end.
    h.sim.faults.release_status = None
    await wait_for(lambda: _is(h, b["id"], "succeeded"), what="next job ran")
    refunds = await fetchval(
        h.database_url,
        "SELECT count(*) FROM credit_ledger WHERE kind='refund' AND job_id=$1::uuid",
        a["id"],
    )
    assert refunds == 1
    held = [r for r in h.sim.runs_snapshot() if r["state"] == "held"]
    assert held == [], "the given-up run was cancelled in Core"
    await check_invariants(h.database_url)


async def test_release_refused_by_core_fails_at_once_and_promotes(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = 60
    await h.start_instance()
    await h.grant("u", 3)
    _, a = await h.admit("u", 1)
    _, b = await h.admit("u", 2)
    _, c = await h.admit("u", 3)
    await wait_for(lambda: _is(h, a["id"], "running"), what="first job running")
    b_run = await fetchval(
        h.database_url, "SELECT core_run_id FROM analysis_jobs WHERE id=$1::uuid", b["id"]
    )
    async with h.http.post(f"{h.sim.base_url}/v1/runs/{b_run}/cancel") as r:
        assert r.status == 200  # someone cancelled B's held run in Core behind our back
    a_run = await fetchval(
        h.database_url, "SELECT core_run_id FROM analysis_jobs WHERE id=$1::uuid", a["id"]
    )
    async with h.http.post(f"{h.sim.base_url}/_sim/runs/{a_run}/finish", json={}) as r:
        assert r.status == 200
    await wait_for(lambda: _is(h, b["id"], "failed"), what="B failed at release")
    await wait_for(lambda: _is(h, c["id"], "running"), what="C promoted after B")
    row = (
        await fetch(
            h.database_url, "SELECT error_code FROM analysis_jobs WHERE id=$1::uuid", b["id"]
        )
    )[0]
    assert row["error_code"] == "core_run_gone"
    await check_invariants(h.database_url)


async def test_listener_reconnects_after_its_backend_is_killed(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = 60
    inst = await h.start_instance(listener_ping_s=0.2)
    listener = inst.services.listener
    assert listener is not None
    pid = listener.backend_pid()
    await fetchval(h.database_url, "SELECT pg_terminate_backend($1)", pid)

    async def reconnected() -> bool:
        return listener.healthy and listener.backend_pid() not in (None, pid)

    await wait_for(reconnected, timeout_s=10, what="listener reconnect")
    assert listener.reconnects >= 1

    # Notifications work again: a completion behind the service's back still promotes.
    await h.grant("u", 2)
    _, a = await h.admit("u", 1)
    _, b = await h.admit("u", 2)
    await wait_for(lambda: _is(h, a["id"], "running"), what="first job running")
    await _complete_behind_the_service(h, a["id"])
    await wait_for(lambda: _is(h, b["id"], "running"), what="promotion after reconnect")


async def test_two_instances_racing_promotions_never_double_start(harness: Harness) -> None:
    """Both instances hear every NOTIFY and both try to promote and claim."""
    h = harness
    h.sim.judge_time_s = 0.01
    a = await h.start_instance()
    b = await h.start_instance()
    await h.grant("u", 30)
    results = await asyncio.gather(*(h.admit("u", n, instance=(a, b)[n % 2]) for n in range(30)))
    assert all(status == 201 for status, _ in results)

    async def done() -> bool:
        return bool(
            await fetchval(
                h.database_url, "SELECT count(*) = 30 FROM analysis_jobs WHERE status='succeeded'"
            )
        )

    await wait_for(done, timeout_s=30, what="30 jobs")
    await assert_fifo_serial(h.database_url)
    await check_invariants(h.database_url)


async def test_release_refused_because_an_earlier_release_went_through(harness: Harness) -> None:
    """Core refuses a release (409) when an earlier one already went through but its ``running``
    was never written (database gone, instance killed). The job must follow Core's state of the
    run, not fail: here Core has already finished it."""
    h = harness
    h.sim.judge_time_s = 60
    await h.start_instance()
    await h.grant("u", 2)
    _, a = await h.admit("u", 1)
    _, b = await h.admit("u", 2)
    await wait_for(lambda: _is(h, a["id"], "running"), what="first job running")
    a_run, b_run = [
        await fetchval(
            h.database_url, "SELECT core_run_id FROM analysis_jobs WHERE id=$1::uuid", j["id"]
        )
        for j in (a, b)
    ]
    # The earlier release of B, as if made by an instance that died before writing "running".
    h.sim.judge_time_s = 0.01
    async with h.http.post(f"{h.sim.base_url}/v1/runs/{b_run}/release") as r:
        assert r.status == 200

    async def b_run_completed() -> bool:
        return any(r["id"] == b_run and r["state"] == "completed" for r in h.sim.runs_snapshot())

    await wait_for(b_run_completed, what="B's run completed in Core")
    assert await _status(h, b["id"]) == "queued"
    async with h.http.post(f"{h.sim.base_url}/_sim/runs/{a_run}/finish", json={}) as r:
        assert r.status == 200

    await wait_for(lambda: _is(h, b["id"], "succeeded", "failed"), what="B settled")
    row = (await fetch(h.database_url, "SELECT * FROM analysis_jobs WHERE id=$1::uuid", b["id"]))[0]
    assert row["status"] == "succeeded", row["error_code"]
    assert len(json.loads(row["verdicts"])) == 2  # Core's verdicts, one per source
    await check_invariants(h.database_url)
