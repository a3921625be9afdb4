"""The write-up's scenario through the HTTP API: admit at once, execute one at a time."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import pytest
from support import Harness, assert_fifo_serial, check_invariants, fetch, fetchval, wait_for


async def _all_finished(h: Harness, n: int) -> bool:
    done = await fetchval(
        h.database_url,
        "SELECT count(*) FROM analysis_jobs WHERE status IN ('succeeded','failed','cancelled')",
    )
    return bool(done == n)


async def test_five_clicks_admitted_at_once_then_run_in_order(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = 0.2
    await h.start_instance()
    await h.grant("lecturer", 5)

    statuses = []
    for n in range(1, 6):
        status, job = await h.admit("lecturer", n)
        assert status == 201, job
        statuses.append((job["status"], job["queue_position"]))
    assert statuses == [
        ("pending", None),
        ("queued", 1),
        ("queued", 2),
        ("queued", 3),
        ("queued", 4),
    ]

    status, credits = await h.get("lecturer", "/v1/credits")
    assert (status, credits) == (200, {"balance": 0})

    await wait_for(lambda: _all_finished(h, 5), timeout_s=20, what="five analyses")
    status, listing = await h.get("lecturer", "/v1/analyses")
    jobs = listing["analyses"]
    assert [j["status"] for j in jobs] == ["succeeded"] * 5
    assert all(sum(j["verdict_counts"].values()) == 2 for j in jobs)
    await assert_fifo_serial(h.database_url)
    await check_invariants(h.database_url)


async def test_queue_positions_move_up_as_jobs_finish(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = 30  # nothing finishes by itself
    await h.start_instance()
    await h.grant("u", 3)
    ids = []
    for n in range(3):
        _, job = await h.admit("u", n)
        ids.append(job["id"])
    await wait_for(lambda: _status_is(h, ids[0], "running"), what="first job running")
    _, third = await h.get("u", f"/v1/analyses/{ids[2]}")
    assert third["queue_position"] == 2

    run_id = await fetchval(
        h.database_url, "SELECT core_run_id FROM analysis_jobs WHERE id=$1::uuid", ids[0]
    )
    async with h.http.post(f"{h.sim.base_url}/_sim/runs/{run_id}/finish", json={}) as r:
        assert r.status == 200
    await wait_for(lambda: _status_is(h, ids[1], "running"), what="second job running")
    _, third = await h.get("u", f"/v1/analyses/{ids[2]}")
    assert third["queue_position"] == 1


async def _status_is(h: Harness, job_id: str, status: str) -> bool:
    value = await fetchval(
        h.database_url, "SELECT status FROM analysis_jobs WHERE id=$1::uuid", job_id
    )
    return bool(value == status)


async def test_two_instances_share_the_queue_in_fifo_order(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    h = harness
    h.sim.judge_time_s = 0.02
    a = await h.start_instance()
    b = await h.start_instance()
    users = [f"user-{i}" for i in range(6)]
    for u in users:
        await h.grant(u, 8)

    async def clicks(user: str) -> None:
        for n in range(8):
            status, job = await h.admit(user, n, instance=(a, b)[n % 2])
            assert status == 201, job

    await asyncio.gather(*(clicks(u) for u in users))
    await wait_for(lambda: _all_finished(h, 48), timeout_s=60, what="48 analyses")
    rows = await fetch(h.database_url, "SELECT status, count(*) FROM analysis_jobs GROUP BY 1")
    assert {r["status"]: r["count"] for r in rows} == {"succeeded": 48}
    await assert_fifo_serial(h.database_url)
    await check_invariants(h.database_url)

    def written(what: str, metric: str) -> float:
        return sum(
            i.services.metrics.registry.get_sample_value(f"{metric}_total", {"what": what}) or 0
            for i in (a, b)
        )

    # A running mark can be answered after its job's finish (Core is quick, and the mark may
    # wait for the finish's lock): the last releases may still be in flight here.
    await asyncio.wait_for(
        asyncio.gather(a.services.dispatcher.drain(), b.services.dispatcher.drain()), 30
    )
    logged = [r.getMessage() for r in caplog.records if r.name.endswith(".dispatch")]
    # The group commits wrote every release's running mark, in at most one statement each.
    assert written("running", "aq_group_commit_jobs") == 48, logged
    released = a.services.dispatcher.released + b.services.dispatcher.released
    assert released == 48, "each held run released exactly once across both instances"
    assert 1 <= written("running", "aq_group_commit_statements") <= 48
    # Each job was claimed once, by one instance: by the batch that started it, or by a claim
    # statement (both instances try); none was released twice.
    attempts = await fetch(h.database_url, "SELECT release_attempts FROM analysis_jobs")
    assert [r["release_attempts"] for r in attempts] == [1] * 48


async def test_metrics_show_open_jobs_and_promotions(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = 60
    inst = await h.start_instance()
    await h.grant("u", 3)
    for n in range(3):
        await h.admit("u", n)

    async def running() -> bool:
        return bool(
            await fetchval(
                h.database_url, "SELECT count(*) = 1 FROM analysis_jobs WHERE status='running'"
            )
        )

    await wait_for(running, what="one running")
    async with h.http.get(f"{inst.base_url}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    assert 'aq_jobs{status="queued"} 2.0' in text
    assert 'aq_jobs{status="running"} 1.0' in text
    assert 'aq_admits_total{outcome="admitted"} 3.0' in text
    assert 'aq_release_attempts_total{outcome="released"} 1.0' in text
    assert "aq_notification_lag_seconds_count" in text
    lag_count = next(
        float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("aq_notification_lag_seconds_count")
    )
    assert lag_count >= 3  # three inserts and a promotion were heard
    # The process's own: memory, file descriptors, the garbage collector.
    for name in (
        "process_resident_memory_bytes",
        "process_open_fds",
        "python_gc_collections_total",
    ):
        assert name in text, name


def _sample(text: str, series: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[1])
    return None


async def test_metrics_show_a_stuck_queue_and_the_answers_by_code(harness: Harness) -> None:
    """aq_users_stuck counts the users with a free slot whose queued job did not start (what the
    alert on a stuck queue reads, deploy/prometheus/); aq_http_responses_total counts answers."""
    h = harness
    h.sim.judge_time_s = 60
    inst = await h.start_instance(metrics_cache_s=0)
    await h.grant("u", 2)
    for n in range(2):
        await h.admit("u", n)
    assert (await h.admit("broke", 9))[0] == 402

    async def running() -> bool:
        return bool(
            await fetchval(
                h.database_url, "SELECT count(*) = 1 FROM analysis_jobs WHERE status='running'"
            )
        )

    await wait_for(running, what="one running")

    async def scrape() -> str:
        async with h.http.get(f"{inst.base_url}/metrics") as r:
            assert r.status == 200
            return await r.text()

    text = await scrape()
    assert _sample(text, "aq_users_stuck") == 0.0  # one running, one queued behind it
    assert _sample(text, 'aq_http_responses_total{code="201"}') == 2.0
    assert _sample(text, 'aq_http_responses_total{code="402"}') == 1.0
    # The running job ends behind the queue's back: no trigger, so no notification, and the
    # sweep is off in these tests. Its user has room and a queued job: stuck.
    conn = await h.db()
    try:
        await conn.execute("SET session_replication_role = replica")
        await conn.execute(
            "UPDATE analysis_jobs SET status = 'failed', finished_at = clock_timestamp()"
            " WHERE status = 'running'"
        )
    finally:
        await conn.close()
    assert _sample(await scrape(), "aq_users_stuck") == 1.0


@pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool is missing (apt-get install prometheus; .ci/run does)",
)
async def test_metrics_pass_promtools_check(harness: Harness) -> None:
    """What /metrics answers, with every family in use, is what Prometheus's own linter accepts."""
    h = harness
    inst = await h.start_instance()
    await h.grant("u", 1)
    await h.admit("u", 1)
    async with h.http.get(f"{inst.base_url}/metrics") as r:
        assert r.status == 200
        text = await r.read()
    done = await asyncio.to_thread(
        subprocess.run,
        ["promtool", "check", "metrics"],
        input=text,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr).decode()
