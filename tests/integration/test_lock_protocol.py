"""The lock protocol (docs/locking.md) holds: every pair of queue operations, run against each
other on overlapping users, neither deadlocks nor waits past a lock timeout.

Each operation is the service's own SQL (the named queries of sql/queries.sql and the functions
they call), run on its own connection with ``deadlock_timeout`` low (a deadlock surfaces within
milliseconds as 40P01) and ``lock_timeout`` set (a wait that does not end is 55P03, not a hang;
inside the functions their own bound applies, which the last test checks).
For every pair, two tasks run their operation several times, at once, on the users ``a`` and
``b``; the set of operations includes changing the ceiling, so both modes are crossed. At the end
no operation failed, PostgreSQL counted no deadlock in this database, and the queue's
invariants hold.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import re
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest
from analysis_queue.store.driver import LOCK_TIMEOUT_MS as SERVICE_LOCK_TIMEOUT_MS
from analysis_queue.store.driver import init_connection
from analysis_queue.store.sqlfiles import queries
from support import check_invariants, fetch

USERS = ("a", "b")
ROUNDS = 5  # runs of each side's operation per pair
LOCK_TIMEOUT_MS = 5000
THESIS = {"title": "On locks", "document_url": "https://uni.example/locks.pdf"}

Q = queries()
Op = Callable[["asyncpg.Connection[Any]", random.Random], Awaitable[None]]


def _reservation(item: int, user: str, key: str | None = None) -> dict[str, Any]:
    return {
        "item": item,
        "user_id": user,
        "run_id": uuid.uuid4(),
        "job_id": uuid.uuid4(),
        "cost": 1,
        "thesis": THESIS,
        "sources": [],
        "idempotency_key": key,
        "request_hash": "h" if key else None,
    }


async def _reserve_and_admit(
    conn: asyncpg.Connection[Any], clicks: list[dict[str, Any]], instance: str | None
) -> None:
    """The clicks' reservations in one transaction, then their admits in another, in arrival
    order, as queue/admit.py does around Core's call."""
    reserved = {
        r["item"] for r in await conn.fetch(Q["reserve"], clicks) if r["outcome"] == "reserved"
    }
    admits = [
        {
            **{k: c[k] for k in ("user_id", "run_id", "job_id", "thesis", "sources", "cost")},
            "core_run_id": f"core-{c['job_id']}",
            "delta_of": c.get("delta_of"),
            "idempotency_key": None,
            "request_hash": None,
        }
        for c in clicks
        if c["item"] in reserved
    ]
    for n, a in enumerate(admits):
        a["item"] = n
    if admits:
        await conn.fetch(Q["admit"], admits, instance, 0.05 if instance else None)


async def admit(conn: asyncpg.Connection[Any], rng: random.Random) -> None:
    """One click: a batch of one."""
    click = _reservation(0, rng.choice(USERS))
    if rng.random() < 0.2:
        click["delta_of"] = await conn.fetchval(
            "SELECT id FROM analysis_jobs WHERE user_id = $1 AND status = 'succeeded'"
            " AND delta_of_job_id IS NULL LIMIT 1",
            click["user_id"],
        )
    await _reserve_and_admit(conn, [click], None)


async def reserve_with_key(conn: asyncpg.Connection[Any], rng: random.Random) -> None:
    user = rng.choice(USERS)
    await conn.fetch(Q["reserve"], [_reservation(0, user, "same-key")])
    await conn.execute(
        "DELETE FROM core_run_reservations WHERE user_id = $1 AND idempotency_key = 'same-key'",
        user,
    )


async def admit_batch(conn: asyncpg.Connection[Any], rng: random.Random) -> None:
    """A group commit of clicks of both users (queue/admit.py)."""
    clicks = [_reservation(n, rng.choice(USERS)) for n in range(rng.randint(2, 5))]
    await _reserve_and_admit(conn, clicks, f"inst-{rng.random()}")


async def finish_batch(conn: asyncpg.Connection[Any], rng: random.Random) -> None:
    """A group commit of Core's completions of active jobs of both users."""
    runs = await conn.fetch(
        "SELECT core_run_id FROM analysis_jobs WHERE status IN ('pending', 'running')"
        " AND core_run_id IS NOT NULL ORDER BY random() LIMIT 4"
    )
    items = [
        {
            "item": n,
            "core_run_id": r["core_run_id"],
            "status": rng.choice(("succeeded", "failed")),
            "from": ["pending", "running"],
            "error_code": None,
            "error_detail": None,
            "verdicts": None,
            "ran": True,
        }
        for n, r in enumerate(runs)
    ]
    if items:
        await conn.fetch(Q["finish"], items, f"inst-{rng.random()}", 0.05)


async def _finish(conn: asyncpg.Connection[Any], job_id: Any, status: str, fr: list[str]) -> None:
    item = {"item": 0, "job_id": job_id, "status": status, "from": fr, "ran": True}
    await conn.fetch(Q["finish"], [{**item, "delete": status == "cancelled"}], None, None)


async def finish(conn: asyncpg.Connection[Any], rng: random.Random) -> None:
    """Core's completion of one of the user's active jobs (a callback or a poll)."""
    job_id = await conn.fetchval(
        "SELECT id FROM analysis_jobs WHERE user_id = $1 AND status IN ('pending', 'running')"
        " ORDER BY random() LIMIT 1",
        rng.choice(USERS),
    )
    if job_id is not None:
        await _finish(conn, job_id, rng.choice(("succeeded", "failed")), ["pending", "running"])


async def cancel(conn: asyncpg.Connection[Any], rng: random.Random) -> None:
    """A user's DELETE of one of their queued or active jobs."""
    job_id = await conn.fetchval(
        "SELECT id FROM analysis_jobs WHERE user_id = $1"
        " AND status IN ('queued', 'pending', 'running') ORDER BY random() LIMIT 1",
        rng.choice(USERS),
    )
    if job_id is not None:
        await _finish(conn, job_id, "cancelled", ["queued", "pending", "running"])


async def promotion_pass(conn: asyncpg.Connection[Any], rng: random.Random) -> None:
    await conn.fetch(Q["promote"], rng.sample(USERS, rng.randint(0, 2)), 64, "inst-a", 60)


async def wake_up(conn: asyncpg.Connection[Any], rng: random.Random) -> None:
    await conn.fetch(Q["promote_woken"], list(USERS), 64, "inst-a", 60)


async def claim(conn: asyncpg.Connection[Any], rng: random.Random) -> None:
    pending = await conn.fetch("SELECT id FROM analysis_jobs WHERE status = 'pending'")
    await conn.fetch(Q["jobs_claim"], [r["id"] for r in pending], f"inst-{rng.random()}", 0.05)


async def mark_running(conn: asyncpg.Connection[Any], rng: random.Random) -> None:
    """A claim, then a batch of running marks across the users, as the dispatcher does."""
    instance = f"inst-{rng.random()}"
    pending = await conn.fetch("SELECT id FROM analysis_jobs WHERE status = 'pending'")
    claimed = await conn.fetch(Q["jobs_claim"], [r["id"] for r in pending], instance, 60)
    await conn.fetch(Q["jobs_mark_running"], [r["id"] for r in claimed], instance)


async def release_retry(conn: asyncpg.Connection[Any], rng: random.Random) -> None:
    """A claim, then a failed release put back on its retry schedule (dispatch.py)."""
    instance = f"inst-{rng.random()}"
    pending = await conn.fetch("SELECT id FROM analysis_jobs WHERE status = 'pending'")
    for row in await conn.fetch(Q["jobs_claim"], [r["id"] for r in pending], instance, 60):
        await conn.execute(
            Q["job_release_retry"], row["id"], instance, datetime.now(UTC), "Core is down"
        )


async def stale_reservations(conn: asyncpg.Connection[Any], rng: random.Random) -> None:
    """A reservation whose admit died, taken by the sweep, and put back when Core cannot be
    told to cancel its held run (loops/sweep.py)."""
    click = _reservation(0, rng.choice(USERS))
    run_id = click["run_id"]
    await conn.fetch(Q["reserve"], [click])
    await conn.execute(
        "UPDATE core_run_reservations SET created_at = now() - interval '1 hour' WHERE run_id = $1",
        run_id,
    )
    for row in await conn.fetch(Q["reservation_take_stale"], 600, 10):
        if rng.random() < 0.5:
            await conn.execute(
                Q["reservation_put_back"],
                row["run_id"],
                row["job_id"],
                row["user_id"],
                f"core-{row['run_id']}",
                row["thesis"],
                row["sources"],
            )


async def sweep(conn: asyncpg.Connection[Any], rng: random.Random) -> None:
    """One sweep pass's statements, in its order (loops/sweep.py)."""
    for row in await conn.fetch(Q["sweep_users_to_promote"], 1000):
        await conn.fetch(Q["promote"], [row["user_id"]], 64, None, None)
    await conn.fetch(Q["promote"], [], 64, None, None)
    await conn.fetch(Q["sweep_pending_due"], 1000)
    quiet = await conn.fetch(Q["sweep_running_quiet"], 0, 1000)
    await conn.execute(Q["job_mark_polled"], [r["id"] for r in quiet])
    await conn.fetch(Q["reservation_take_stale"], 3600, 1000)
    await conn.fetchrow(Q["job_event_prune"], 3600, 1000)


async def set_ceiling(conn: asyncpg.Connection[Any], rng: random.Random) -> None:
    await conn.fetchrow(Q["ceiling_set"], rng.choice((None, 1, 2, 3)))


async def set_limit(conn: asyncpg.Connection[Any], rng: random.Random) -> None:
    await conn.fetch(Q["user_limit_set"], rng.choice(USERS), rng.choice((None, 2, 3)))


async def grant(conn: asyncpg.Connection[Any], rng: random.Random) -> None:
    await conn.fetchrow(Q["credit_grant"], rng.choice(USERS), 1, None)


OPERATIONS: dict[str, Op] = {
    "admit": admit,
    "admit_batch": admit_batch,
    "finish_batch": finish_batch,
    "reserve_with_key": reserve_with_key,
    "finish": finish,
    "cancel": cancel,
    "promotion_pass": promotion_pass,
    "wake_up": wake_up,
    "claim": claim,
    "mark_running": mark_running,
    "sweep": sweep,
    "release_retry": release_retry,
    "stale_reservations": stale_reservations,
    "set_ceiling": set_ceiling,
    "set_limit": set_limit,
    "grant": grant,
}


async def _deadlocks(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(
            await conn.fetchval(
                "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
            )
        )
    finally:
        await conn.close()


@pytest.mark.parametrize("ceiling", [None, 2], ids=["ceiling-off-first", "ceiling-on-first"])
async def test_every_pair_of_operations_runs_without_deadlock_or_lock_timeout(
    database_url: str, ceiling: int | None
) -> None:
    rng = random.Random(7 if ceiling is None else 11)
    settings = {"lock_timeout": str(LOCK_TIMEOUT_MS), "deadlock_timeout": "10ms"}
    pool = await asyncpg.create_pool(
        database_url, min_size=2, max_size=2, init=init_connection, server_settings=settings
    )
    assert pool is not None
    try:
        async with pool.acquire() as conn:
            await conn.execute("SELECT aq_set_ceiling_v1($1)", ceiling)
            for user in USERS:
                await conn.execute("SELECT aq_credit_grant_v1($1, 100000, 'test')", user)
            for _ in range(12):
                await admit(conn, rng)
        deadlocks_before = await _deadlocks(database_url)

        failures: list[tuple[str, str, BaseException]] = []
        pairs = list(itertools.combinations_with_replacement(sorted(OPERATIONS), 2))

        async def side(name: str, other: str, seed: int) -> None:
            side_rng = random.Random(seed)
            async with pool.acquire() as conn:
                for _ in range(ROUNDS):
                    try:
                        await OPERATIONS[name](conn, side_rng)
                    except (asyncpg.DeadlockDetectedError, asyncpg.LockNotAvailableError) as exc:
                        failures.append((name, other, exc))
                    await asyncio.sleep(side_rng.uniform(0, 0.002))

        for first, second in pairs:
            async with pool.acquire() as conn:  # keep work to do for every pair
                if (
                    await conn.fetchval(
                        "SELECT count(*) FROM analysis_jobs WHERE status = 'queued'"
                    )
                    < 4
                ):
                    for _ in range(6):
                        await admit(conn, rng)
            seed = rng.randrange(1 << 30)
            await asyncio.gather(side(first, second, seed), side(second, first, seed + 1))
    finally:
        await pool.close()

    assert failures == [], failures
    assert len(pairs) == len(OPERATIONS) * (len(OPERATIONS) + 1) // 2
    assert await _deadlocks(database_url) == deadlocks_before
    # A lowered limit or ceiling lets active jobs finish above it: judge by the highest limit
    # used, and without the ceiling (tests/acceptance/test_ceiling_stress.py holds it to one).
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("SELECT aq_set_ceiling_v1(NULL)")
        for user in USERS:
            await conn.execute("SELECT aq_set_user_limit_v1($1, 3)", user)
        moved = await conn.fetchval("SELECT count(*) FROM job_events")
    finally:
        await conn.close()
    assert moved > len(pairs), "the operations did change the queue"
    await check_invariants(database_url)


async def test_every_decision_the_queries_call_keeps_generic_plans(database_url: str) -> None:
    """docs/locking.md, "The bound": each decision a named query calls (every VOLATILE one)
    declares ``plan_cache_mode = force_generic_plan``, which its nested functions inherit: a
    custom plan of their CTE queries is planned again on every call, four times the cost."""
    called = sorted({name for sql in Q.values() for name in re.findall(r"\b(aq_\w+)\s*\(", sql)})
    rows = await fetch(
        database_url,
        """SELECT p.proname, coalesce(p.proconfig, '{}') AS config
             FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
            WHERE n.nspname = 'public' AND p.proname = ANY ($1::text[]) AND p.provolatile = 'v'""",
        called,
    )
    assert len(rows) >= 8, rows
    assert [
        r["proname"] for r in rows if "plan_cache_mode=force_generic_plan" not in r["config"]
    ] == []


async def test_every_function_the_queries_call_bounds_its_own_lock_waits(database_url: str) -> None:
    """docs/locking.md, "The bound": each function a named query calls that can wait for a lock
    (every VOLATILE one) declares ``lock_timeout`` itself, so the bound holds however its caller
    connected, through a transaction pooler too; and it is the bound direct sessions get."""
    called = sorted({name for sql in Q.values() for name in re.findall(r"\b(aq_\w+)\s*\(", sql)})
    rows = await fetch(
        database_url,
        """SELECT p.proname, p.provolatile::text, coalesce(p.proconfig, '{}') AS config
             FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
            WHERE n.nspname = 'public' AND p.proname = ANY ($1::text[])""",
        called,
    )
    assert sorted(r["proname"] for r in rows) == called
    bounds = {
        r["proname"]: [c.split("=", 1)[1] for c in r["config"] if c.startswith("lock_timeout=")]
        for r in rows
        if r["provolatile"] == "v"
    }
    assert len(bounds) >= 8, bounds
    assert [name for name, values in bounds.items() if not values] == []
    conn = await asyncpg.connect(database_url)
    try:
        for value in {v for values in bounds.values() for v in values}:
            async with conn.transaction():
                await conn.execute(f"SET LOCAL lock_timeout = '{value}'")
                ms = await conn.fetchval(
                    "SELECT setting::int FROM pg_settings WHERE name = $1", "lock_timeout"
                )
            assert ms == SERVICE_LOCK_TIMEOUT_MS, (value, ms)
    finally:
        await conn.close()
