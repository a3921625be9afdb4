"""The schema on a real PostgreSQL: migrations, invariants, the user lock, NOTIFY, packaging."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import subprocess
import sys
import uuid
import zipfile
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from analysis_queue.core.client import CoreClient
from analysis_queue.loops.dispatch import Dispatcher, DispatchSettings
from analysis_queue.metrics import Metrics
from analysis_queue.models import Admission, AdmitRequest, Job, JobStatus, ReserveRequest
from analysis_queue.queue.finish import Finisher
from analysis_queue.queue.followup import FollowUp
from analysis_queue.store.database import Claim, Database
from analysis_queue.store.listen import JOBS_CHANNEL
from analysis_queue.store.sqlfiles import migrations, queries, repeatables
from support import check_invariants, fetch, wait_for, wait_until_blocked

REPO = Path(__file__).resolve().parents[2]
THESIS = {"title": "On locks", "document_url": "https://uni.example/locks.pdf"}
SOURCES = ["10.1000/a.1", "10.1000/a.2"]
NOTIFY_KEYS = {"v", "at", "u"}
WAIT_S = 10.0


@pytest.fixture
async def conn(database_url: str) -> AsyncIterator[asyncpg.Connection[Any]]:
    c = await asyncpg.connect(database_url)
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    d = await Database.connect(database_url, min_size=1, max_size=30)
    try:
        yield d
    finally:
        await d.close()


# -- invariants in the database ------------------------------------------------------------


async def _insert_job(
    c: asyncpg.Connection[Any],
    user: str,
    status: str,
    *,
    delta_of: uuid.UUID | None = None,
    user_slot: int | None = None,
    global_slot: int | None = None,
    waiting_for: str | None = None,
) -> uuid.UUID:
    """A row as the queue functions would write it, unless told otherwise: an active
    first-pass job in user slot 1, a queued one waiting for its user's previous analysis, a
    queued delta waiting for capacity."""
    job_id = uuid.uuid4()
    terminal = status in ("succeeded", "failed", "cancelled")
    if user_slot is None and status in ("pending", "running") and delta_of is None:
        user_slot = 1
    if waiting_for is None and status == "queued":
        waiting_for = "provider_capacity" if delta_of else "your_previous_analysis"
    await c.execute(
        """INSERT INTO analysis_jobs
               (id, user_id, run_id, status, delta_of_job_id, thesis, sources, cost, finished_at,
                user_slot, global_slot, waiting_for, turn_key)
           VALUES ($1, $2, $3, $4, $5, '{}'::jsonb, '[]'::jsonb, 1,
                   CASE WHEN $6 THEN clock_timestamp() END, $7, $8, $9::text,
                   CASE WHEN $9::text = 'provider_capacity' THEN clock_timestamp() END)""",
        job_id,
        user,
        uuid.uuid4(),
        status,
        delta_of,
        terminal,
        user_slot,
        global_slot,
        waiting_for,
    )
    return job_id


@pytest.mark.parametrize("second_status", ["pending", "running"])
async def test_one_active_first_pass_per_user_slot(
    conn: asyncpg.Connection[Any], second_status: str
) -> None:
    first = await _insert_job(conn, "alice", "pending")
    with pytest.raises(asyncpg.UniqueViolationError) as info:
        await _insert_job(conn, "alice", second_status)
    assert info.value.constraint_name == "analysis_jobs_user_slot"
    with pytest.raises(asyncpg.CheckViolationError) as unslotted:
        await _insert_job(conn, "alice", second_status, user_slot=0)
    assert unslotted.value.constraint_name == "analysis_jobs_user_slot_range"

    # Deltas run beside the first pass; other users and queued jobs are not limited.
    await _insert_job(conn, "alice", "pending", delta_of=first)
    await _insert_job(conn, "alice", "running", delta_of=first)
    await _insert_job(conn, "alice", "queued")
    await _insert_job(conn, "alice", "succeeded", user_slot=1)  # history keeps its slot
    await _insert_job(conn, "bob", "pending")
    counts = await conn.fetch(
        """SELECT user_id, count(*) AS n FROM analysis_jobs
            WHERE status IN ('pending', 'running') AND delta_of_job_id IS NULL
            GROUP BY user_id"""
    )
    assert {r["user_id"]: r["n"] for r in counts} == {"alice": 1, "bob": 1}


async def test_active_first_pass_job_holds_a_user_slot(conn: asyncpg.Connection[Any]) -> None:
    job = await _insert_job(conn, "alice", "queued")
    with pytest.raises(asyncpg.CheckViolationError) as info:
        await conn.execute(
            "UPDATE analysis_jobs SET status = 'pending', waiting_for = NULL WHERE id = $1", job
        )
    assert info.value.constraint_name == "analysis_jobs_active_has_user_slot"
    # A second slot is the plan limit's business (the functions hand out 1..limit); the index
    # only forbids sharing one.
    await _insert_job(conn, "alice", "running", user_slot=1)
    await _insert_job(conn, "alice", "running", user_slot=2)


async def test_no_two_active_jobs_share_a_global_slot(conn: asyncpg.Connection[Any]) -> None:
    done = await _insert_job(conn, "alice", "succeeded", global_slot=1)
    await _insert_job(conn, "alice", "running", global_slot=1)  # a finished job freed it
    with pytest.raises(asyncpg.UniqueViolationError) as info:
        await _insert_job(conn, "bob", "pending", global_slot=1)
    assert info.value.constraint_name == "analysis_jobs_global_slot"
    await _insert_job(conn, "alice", "pending", delta_of=done, global_slot=2)  # deltas too
    with pytest.raises(asyncpg.UniqueViolationError):
        await _insert_job(conn, "carol", "running", delta_of=done, global_slot=2)


async def test_a_queued_job_says_why_it_waits(conn: asyncpg.Connection[Any]) -> None:
    with pytest.raises(asyncpg.CheckViolationError) as missing:
        await conn.execute(
            """INSERT INTO analysis_jobs (id, user_id, run_id, status, thesis, sources, cost)
               VALUES ($1, 'alice', $2, 'queued', '{}'::jsonb, '[]'::jsonb, 1)""",
            uuid.uuid4(),
            uuid.uuid4(),
        )
    assert missing.value.constraint_name == "analysis_jobs_waiting_for"
    with pytest.raises(asyncpg.CheckViolationError) as stale:
        await _insert_job(conn, "alice", "succeeded", waiting_for="provider_capacity")
    assert stale.value.constraint_name == "analysis_jobs_waiting_for"
    ready = await _insert_job(conn, "alice", "queued", waiting_for="provider_capacity")
    with pytest.raises(asyncpg.CheckViolationError) as no_turn:
        await conn.execute("UPDATE analysis_jobs SET turn_key = NULL WHERE id = $1", ready)
    assert no_turn.value.constraint_name == "analysis_jobs_ready_has_turn"


async def test_one_debit_and_one_refund_per_job(conn: asyncpg.Connection[Any]) -> None:
    await conn.execute("INSERT INTO credit_accounts (user_id, balance) VALUES ('alice', 10)")
    job = await _insert_job(conn, "alice", "failed")
    ledger = "INSERT INTO credit_ledger (user_id, job_id, kind, amount) VALUES ('alice', $1, $2, 1)"
    await conn.execute(ledger, job, "debit")
    with pytest.raises(asyncpg.UniqueViolationError) as debit:
        await conn.execute(ledger, job, "debit")
    assert debit.value.constraint_name == "credit_ledger_one_debit"

    await conn.execute(ledger, job, "refund")
    with pytest.raises(asyncpg.UniqueViolationError) as refund:
        await conn.execute(ledger, job, "refund")
    assert refund.value.constraint_name == "credit_ledger_one_refund"

    other = await _insert_job(conn, "alice", "failed")
    await conn.execute(ledger, other, "debit")  # per job, not per user
    kinds = await conn.fetch("SELECT kind, count(*) AS n FROM credit_ledger GROUP BY kind")
    assert {r["kind"]: r["n"] for r in kinds} == {"debit": 2, "refund": 1}


async def test_balance_never_negative(conn: asyncpg.Connection[Any]) -> None:
    with pytest.raises(asyncpg.CheckViolationError) as insert:
        await conn.execute("INSERT INTO credit_accounts (user_id, balance) VALUES ('alice', -1)")
    assert insert.value.constraint_name == "credit_accounts_balance_nonnegative"

    await conn.execute("INSERT INTO credit_accounts (user_id, balance) VALUES ('alice', 1)")
    with pytest.raises(asyncpg.CheckViolationError) as update:
        await conn.execute("UPDATE credit_accounts SET balance = balance - 2")
    assert update.value.constraint_name == "credit_accounts_balance_nonnegative"
    await conn.execute("UPDATE credit_accounts SET balance = balance - 1")
    assert await conn.fetchval("SELECT balance FROM credit_accounts") == 0


async def test_delta_never_waits_behind_its_users_queue(conn: asyncpg.Connection[Any]) -> None:
    parent = await _insert_job(conn, "alice", "succeeded", user_slot=1)
    with pytest.raises(asyncpg.CheckViolationError) as insert:
        await _insert_job(
            conn, "alice", "queued", delta_of=parent, waiting_for="your_previous_analysis"
        )
    assert insert.value.constraint_name == "analysis_jobs_delta_waits_for_capacity"
    # It may wait for the provider (the ceiling is full), and only for it.
    waiting = await _insert_job(conn, "alice", "queued", delta_of=parent)
    with pytest.raises(asyncpg.CheckViolationError) as update:
        await conn.execute(
            """UPDATE analysis_jobs SET waiting_for = 'your_previous_analysis', turn_key = NULL
                WHERE id = $1""",
            waiting,
        )
    assert update.value.constraint_name == "analysis_jobs_delta_waits_for_capacity"


# -- the user lock -------------------------------------------------------------------------


async def _reserve(db: Database, user: str, cost: int) -> tuple[uuid.UUID, uuid.UUID]:
    run_id, job_id = uuid.uuid4(), uuid.uuid4()
    reservation = await db.reserve(
        ReserveRequest(
            user_id=user,
            run_id=run_id,
            job_id=job_id,
            cost=cost,
            thesis=THESIS,
            sources=SOURCES,
            idempotency_key=None,
            request_hash=None,
        )
    )
    assert reservation.outcome == "reserved", reservation
    return run_id, job_id


async def _admit_reserved(
    db: Database,
    user: str,
    run_id: uuid.UUID,
    job_id: uuid.UUID,
    cost: int,
    delta_of: uuid.UUID | None = None,
) -> Job:
    return (await _admission(db, user, run_id, job_id, cost, delta_of)).job


async def _admission(
    db: Database,
    user: str,
    run_id: uuid.UUID,
    job_id: uuid.UUID,
    cost: int,
    delta_of: uuid.UUID | None = None,
) -> Admission:
    return await db.admit(
        AdmitRequest(
            job_id=job_id,
            user_id=user,
            run_id=run_id,
            core_run_id=f"core-{job_id}",
            thesis=THESIS,
            sources=SOURCES,
            cost=cost,
            delta_of=delta_of,
            idempotency_key=None,
            request_hash=None,
        )
    )


async def _admit(db: Database, user: str, delta_of: uuid.UUID | None = None) -> Job:
    run_id, job_id = await _reserve(db, user, 0)
    return await _admit_reserved(db, user, run_id, job_id, 0, delta_of)


# cost 0: the user lock is the only thing admits of one user wait for; cost 1: the debit of
# the user's credit row comes first and must not change the outcome.
@pytest.mark.parametrize("cost", [0, 1])
async def test_concurrent_admits_are_serialized_by_the_user_lock(
    db: Database, database_url: str, cost: int
) -> None:
    n = 30
    assert await db.grant_credits("alice", n) == n
    reserved = await asyncio.gather(*(_reserve(db, "alice", cost) for _ in range(n)))

    # Hold alice's lock until every admit is waiting for it, so that they all really contend:
    # each one's transaction starts before the previous holder commits.
    holder = await asyncpg.connect(database_url)
    try:
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT aq_lock_user_v1('alice')")
        admits = asyncio.gather(
            *(_admit_reserved(db, "alice", run_id, job_id, cost) for run_id, job_id in reserved),
            return_exceptions=True,
        )

        async def all_waiting() -> bool:
            waiting = await holder.fetchval(
                """SELECT count(*) FROM pg_stat_activity
                    WHERE datname = current_database() AND wait_event_type = 'Lock'
                      AND pid <> pg_backend_pid()"""
            )
            return bool(waiting == n)

        try:
            await wait_for(all_waiting, timeout_s=WAIT_S, what="every admit to wait for the lock")
        finally:
            await tx.commit()
            results = await admits
        rows = await holder.fetch(
            "SELECT id, status, queue_seq, created_at FROM analysis_jobs ORDER BY queue_seq"
        )
    finally:
        await holder.close()

    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, failures
    jobs = [r for r in results if isinstance(r, Job)]
    assert sorted(j.status for j in jobs) == ["pending"] + ["queued"] * (n - 1)
    assert await db.balance("alice") == n - n * cost
    assert len(rows) == n
    assert [r["status"] for r in rows] == ["pending"] + ["queued"] * (n - 1)
    created = [r["created_at"] for r in rows]
    assert all(a < b for a, b in itertools.pairwise(created)), created
    listing = await db.list_jobs("alice")
    positions = [j.queue_position for j in listing if j.status == "queued"]
    assert sorted(p for p in positions if p is not None) == list(range(1, n))
    assert len(positions) == n - 1
    await check_invariants(database_url)


# -- NOTIFY --------------------------------------------------------------------------------


class Notifications:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[str] = asyncio.Queue()

    def __call__(self, _conn: object, _pid: int, _channel: str, payload: object) -> None:
        self.queue.put_nowait(str(payload))

    async def until_barrier(self, writer: asyncpg.Connection[Any]) -> list[str]:
        """Everything notified before now: commit order puts a barrier after all of it."""
        barrier = f"barrier-{uuid.uuid4()}"
        await writer.execute("SELECT pg_notify($1, $2)", JOBS_CHANNEL, barrier)
        out: list[str] = []
        while True:
            payload = await asyncio.wait_for(self.queue.get(), WAIT_S)
            if payload == barrier:
                return out
            out.append(payload)


def _decoded(payloads: list[str]) -> list[dict[str, int]]:
    """Each notification's users and their wake flags (the time it carries checked apart)."""
    out = []
    for raw in payloads:
        p = json.loads(raw)
        assert set(p) == NOTIFY_KEYS and p["v"] == 2, p
        assert isinstance(p["at"], float)
        out.append(p["u"])
    return out


async def test_one_notification_per_transaction_naming_users_and_wakes(
    db: Database, conn: asyncpg.Connection[Any], database_url: str
) -> None:
    notes = Notifications()
    listen = await asyncpg.connect(database_url)
    try:
        await listen.add_listener(JOBS_CHANNEL, notes)
        assert await notes.until_barrier(conn) == []

        job = await _admit(db, "alice")  # straight into the free slot: someone releases it
        await conn.execute(
            "UPDATE analysis_jobs SET release_attempts = release_attempts + 1 WHERE id = $1", job.id
        )
        # The service's own bookkeeping writes are silent too.
        assert job.id in await db.claim([job.id], "inst-1", 60)
        await db.schedule_release_retry(job.id, "inst-1", datetime.now(UTC), "Core is away")
        await db.mark_polled([job.id])
        queued = await _admit(db, "alice")  # behind it: nothing for a promotion to do
        assert _decoded(await notes.until_barrier(conn)) == [{"alice": 1}, {"alice": 0}]

        await conn.execute(
            """UPDATE analysis_jobs SET status = 'running', started_at = clock_timestamp()
                WHERE id = $1""",
            job.id,
        )
        # The finish frees the slot and promotes the next job in the same transaction.
        done = await db.finish(
            job_id=job.id, status="succeeded", from_statuses=("running",), ran=True
        )
        assert done is not None and done.changed and [j.id for j in done.promoted] == [queued.id]
        deleted = await db.finish(job_id=job.id, status=None, delete=True)
        assert deleted is not None and deleted.changed
        assert _decoded(await notes.until_barrier(conn)) == [
            {"alice": 0},  # started
            {"alice": 1},  # finished and promoted: two changes, one notification
            {"alice": 0},  # a delete of a finished job
        ]

        # Many users' changes in one transaction: one notification for all of them.
        async with conn.transaction():
            for user in ("bob", "carol", "dave"):
                await _insert_queued(conn, user)
            await conn.execute(
                "UPDATE analysis_jobs SET status = 'cancelled', waiting_for = NULL,"
                " finished_at = clock_timestamp() WHERE user_id = 'bob'"
            )
        assert _decoded(await notes.until_barrier(conn)) == [{"bob": 0, "carol": 0, "dave": 0}]

        # A user whose first change leaves no work and whose next one does is named once, as
        # waking; user ids are JSON-escaped whatever they hold.
        odd = 'q"uo\\te, ü'
        async with conn.transaction():
            await _insert_queued(conn, "erin")
            await _insert_queued(conn, odd)
            await conn.execute(
                "UPDATE analysis_jobs SET status = 'pending', waiting_for = NULL, user_slot = 1,"
                " promoted_at = clock_timestamp() WHERE user_id = 'erin'"
            )
            await _insert_queued(conn, "erin")
        assert _decoded(await notes.until_barrier(conn)) == [{"erin": 1, odd: 0}]
    finally:
        await listen.close()


@pytest.mark.parametrize(
    ("old", "new", "delete", "wakes"),
    [
        (None, "queued", False, 0),  # an admit into the queue decided all it allows
        (None, "pending", False, 1),  # admitted into a free slot: someone releases it
        ("queued", "pending", False, 1),  # promoted
        ("pending", "running", False, 0),  # started
        ("running", "succeeded", False, 1),  # a slot freed
        ("pending", "failed", False, 1),
        ("queued", "cancelled", True, 0),  # held no slot
        ("succeeded", "succeeded", True, 0),  # a delete of a finished job
        ("running", "cancelled", True, 1),  # deleted while running: its slot frees
    ],
)
async def test_which_changes_may_leave_work_for_a_promotion_or_a_release(
    conn: asyncpg.Connection[Any],
    database_url: str,
    old: str | None,
    new: str,
    delete: bool,
    wakes: int,
) -> None:
    job_id = uuid.uuid4()
    insert = """INSERT INTO analysis_jobs (id, user_id, run_id, status, thesis, sources, cost,
                                           waiting_for, user_slot, finished_at)
                VALUES ($1, 'u', $2, $3, '{}', '[]', 0,
                        CASE WHEN $3 = 'queued' THEN 'your_previous_analysis' END,
                        CASE WHEN $3 IN ('pending', 'running') THEN 1 END,
                        CASE WHEN $3 IN ('succeeded', 'failed', 'cancelled')
                             THEN clock_timestamp() END)"""
    if old is not None:
        await conn.execute(insert, job_id, uuid.uuid4(), old)
    notes = Notifications()
    listen = await asyncpg.connect(database_url)
    try:
        await listen.add_listener(JOBS_CHANNEL, notes)
        if old is None:
            await conn.execute(insert, job_id, uuid.uuid4(), new)
        else:
            await conn.execute(
                """UPDATE analysis_jobs
                      SET status = $2,
                          waiting_for = CASE WHEN $2 = 'queued' THEN waiting_for END,
                          user_slot = CASE WHEN $2 IN ('pending', 'running') THEN 1 END,
                          finished_at = CASE WHEN $2 IN ('succeeded', 'failed', 'cancelled')
                                             THEN coalesce(finished_at, clock_timestamp()) END,
                          deleted_at = CASE WHEN $3 THEN clock_timestamp() END
                    WHERE id = $1""",
                job_id,
                new,
                delete,
            )
        assert _decoded(await notes.until_barrier(conn)) == [{"u": wakes}]
    finally:
        await listen.close()


async def test_a_rolled_back_change_notifies_nothing(
    conn: asyncpg.Connection[Any], database_url: str
) -> None:
    notes = Notifications()
    listen = await asyncpg.connect(database_url)
    try:
        await listen.add_listener(JOBS_CHANNEL, notes)
        tx = conn.transaction()
        await tx.start()
        await _insert_queued(conn, "erin")
        await tx.rollback()
        assert await notes.until_barrier(conn) == []
    finally:
        await listen.close()


async def test_a_notification_stays_under_its_limit_whatever_the_transaction_changed(
    conn: asyncpg.Connection[Any], database_url: str
) -> None:
    notes = Notifications()
    listen = await asyncpg.connect(database_url)
    longest = ["ü" * 199 + str(n % 10) for n in range(10)]  # 200 characters, 2 bytes each
    try:
        await listen.add_listener(JOBS_CHANNEL, notes)
        async with conn.transaction():  # a few of the longest user ids still fit
            for user in longest[:5]:
                await _insert_queued(conn, user)
        async with conn.transaction():  # a thousand users do not: a hint to re-read all
            for n in range(1000):
                await _insert_queued(conn, f"user-{n:04d}")
        payloads = await notes.until_barrier(conn)
    finally:
        await listen.close()
    assert len(payloads) == 2
    assert all(len(p.encode()) < 7600 for p in payloads)
    assert sorted(json.loads(payloads[0])["u"]) == sorted(longest[:5])
    overflow = json.loads(payloads[1])
    assert overflow["overflow"] is True and "u" not in overflow


async def _insert_queued(conn: asyncpg.Connection[Any], user: str) -> None:
    await conn.execute(
        """INSERT INTO analysis_jobs (id, user_id, run_id, status, thesis, sources, cost,
                                      waiting_for)
           VALUES ($1, $2, $3, 'queued', '{}', '[]', 0, 'your_previous_analysis')""",
        uuid.uuid4(),
        user,
        uuid.uuid4(),
    )


# -- packaging -----------------------------------------------------------------------------

OFFLINE_HINTS = (
    "No matching distribution",
    "Could not find a version",
    "Failed to establish a new connection",
    "NewConnectionError",
    "Temporary failure in name resolution",
    "Network is unreachable",
)


def _build_wheel(out: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(REPO)]
    isolated = importlib.util.find_spec("hatchling") is None
    if not isolated:
        cmd.insert(5, "--no-build-isolation")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if result.returncode != 0:
        output = result.stdout + result.stderr
        if isolated and any(hint in output for hint in OFFLINE_HINTS):
            pytest.skip(f"cannot fetch the build backend offline: {output[-300:]}")
        pytest.fail(f"wheel build failed:\n{output}")
    wheels = list(out.glob("analysis_queue-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_carries_the_sql(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path / "dist")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for required in (
            "analysis_queue/_sql/migrations/0011_baseline.sql",
            "analysis_queue/_sql/migrations/SHA256SUMS",
            "analysis_queue/_sql/functions/locks.sql",
            "analysis_queue/_sql/queries.sql",
            "analysis_queue/_triggers/job_notify.sql",
            # The dashboard is package data: a non-editable install serves it too.
            "analysis_queue/http/static/index.html",
            "analysis_queue/http/static/app.js",
            "analysis_queue/http/static/app.css",
            "analysis_queue/http/static/favicon.svg",
        ):
            assert required in names, sorted(names)
        site = tmp_path / "site"
        zf.extractall(site)

    script = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); "
        "import analysis_queue.store.sqlfiles as s; "
        "print(json.dumps([len(s.migrations()), len(s.repeatables()), len(s.queries()), "
        "str(s.sql_dir('sql')), str(s.sql_dir('triggers')), s.__file__]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(site)],
        cwd=site,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    n_migrations, n_repeatables, n_queries, sql, triggers, module = json.loads(result.stdout)
    assert (n_migrations, n_repeatables, n_queries) == (
        len(migrations()),
        len(repeatables()),
        len(queries()),
    )
    assert Path(sql) == (site / "analysis_queue" / "_sql").resolve()
    assert Path(triggers) == (site / "analysis_queue" / "_triggers").resolve()
    assert Path(module).resolve().is_relative_to(site.resolve())


async def test_set_based_claims_race_to_exactly_one_claimer(
    db: Database, database_url: str
) -> None:
    """Two instances claim overlapping batches of the same pending jobs at once, in opposite
    orders: every job is claimed once, and only its claimer can mark it running."""
    jobs = [await _admit(db, f"claim-{i}") for i in range(40)]
    ids = [j.id for j in jobs]
    assert all(j.status == "pending" for j in jobs)
    batches_a = [ids[i : i + 7] for i in range(0, 40, 7)]
    batches_b = [list(reversed(ids[i : i + 11])) for i in range(0, 40, 11)]
    got_a, got_b = await asyncio.gather(
        asyncio.gather(*(db.claim(b, "inst-a", 60) for b in batches_a)),
        asyncio.gather(*(db.claim(b, "inst-b", 60) for b in batches_b)),
    )
    claimed_a = {k for d in got_a for k in d}
    claimed_b = {k for d in got_b for k in d}
    assert not claimed_a & claimed_b
    assert claimed_a | claimed_b == set(ids)

    # A job finished meanwhile (a fast completion callback) stays finished.
    done = next(iter(claimed_a))
    await db.finish(job_id=done, status="succeeded", from_statuses=("pending", "running"))
    moved_a, moved_b = await asyncio.gather(
        db.mark_running(ids, "inst-a"), db.mark_running(ids, "inst-b")
    )
    assert set(moved_a) == claimed_a - {done}
    assert set(moved_b) == claimed_b
    statuses = await fetch(
        database_url, "SELECT status FROM analysis_jobs WHERE id = ANY($1::uuid[])", list(moved_a)
    )
    assert {r["status"] for r in statuses} == {"running"}
    assert await db.mark_running(ids, "inst-a") == set(), "a second mark moves nothing"


async def test_a_batch_of_running_marks_waits_for_an_exclusive_promotion_pass(
    db: Database, database_url: str
) -> None:
    """Marking several users' jobs running locks their event counters; a promotion pass with
    the ceiling on locks users in turn order under the global lock held exclusively. The batch
    must take the global lock shared first, or the two deadlock on two users' counters."""
    jobs = [await _admit(db, f"batch-{i}") for i in range(3)]
    ids = [j.id for j in jobs]
    assert set(await db.claim(ids, "inst-a", 60)) == set(ids)
    holder = await asyncpg.connect(database_url)
    try:
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT aq_lock_global_v1()")
        marking = asyncio.create_task(db.mark_running(ids, "inst-a"))
        # The batch waits for the exclusive global lock (never finishing first proves nothing).
        await wait_until_blocked(database_url, holder.get_server_pid())
        assert not marking.done()
        await tx.commit()
        moved = await asyncio.wait_for(marking, 5)
    finally:
        await holder.close()
    assert set(moved) == set(ids)


async def test_a_batch_of_running_marks_waits_for_a_finish_of_the_same_user(
    db: Database, database_url: str
) -> None:
    """A user with two active jobs: one is finished (user lock, then its row, then the user's
    event counter) while the other's release is marked in a batch with both. The batch must
    wait for the user lock before it touches the user's rows and counter, or the two deadlock:
    the batch holding the counter (from the first job) and waiting for the second job's row."""
    await db.set_user_limit("two", 2)
    first, second = sorted([await _admit(db, "two"), await _admit(db, "two")], key=lambda j: j.id)
    assert (first.status, second.status) == ("pending", "pending")
    assert set(await db.claim([first.id, second.id], "inst-a", 60)) == {first.id, second.id}
    finisher = await asyncpg.connect(database_url)
    try:
        tx = finisher.transaction()
        await tx.start()
        await finisher.execute("SELECT aq_lock_user_v1('two')")
        await finisher.execute("SELECT 1 FROM analysis_jobs WHERE id = $1 FOR UPDATE", second.id)
        marking = asyncio.create_task(db.mark_running([first.id, second.id], "inst-a"))
        await wait_until_blocked(database_url, finisher.get_server_pid())
        waits_for = await finisher.fetchval(
            """SELECT l.locktype FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                WHERE NOT l.granted AND $1 = ANY(pg_blocking_pids(a.pid))""",
            finisher.get_server_pid(),
        )
        assert waits_for == "advisory", "the batch waits for the user's lock, not a row"
        assert not marking.done()
        # The finish goes on to write its event: it must not wait for the batch.
        await asyncio.wait_for(
            finisher.execute(
                "UPDATE analysis_jobs SET status = 'succeeded', finished_at = now() WHERE id = $1",
                second.id,
            ),
            timeout=0.5,
        )
        await tx.commit()
        moved = await asyncio.wait_for(marking, 5)
    finally:
        await finisher.close()
    assert set(moved) == {first.id}, "the finished job stays finished"


@pytest.mark.parametrize("ceiling", [None, 1])
async def test_the_warm_up_walks_one_job_through_todays_entry_points(
    db: Database, database_url: str, ceiling: int | None
) -> None:
    """A new connection's warm-up (aq_warm_up_v1, warm.sql) runs the functions the service
    calls (reserve, admit, running mark, finish, wake-up) end to end: two jobs, the first
    finished, the second promoted by that finish; rolled back, it leaves nothing behind. A
    warm-up that fails is skipped without a word (store/database.py), so only this shows it."""
    await db.set_ceiling(ceiling)
    conn = await asyncpg.connect(database_url)
    try:
        tx = conn.transaction()
        await tx.start()
        steps = await conn.fetchval("SELECT aq_warm_up_v1()")
        rows = await conn.fetch(
            "SELECT status FROM analysis_jobs WHERE user_id = E'\\x01warm-up/' || pg_backend_pid()"
            " ORDER BY queue_seq"
        )
        await tx.rollback()
        left = await conn.fetchval("SELECT count(*) FROM analysis_jobs")
    finally:
        await conn.close()
    assert steps == 2
    assert [r["status"] for r in rows] == ["succeeded", "pending"]
    assert left == 0


async def test_warm_ups_of_connections_opening_together_do_not_wait_for_each_other(
    database_url: str,
) -> None:
    """Each backend warms up as its own user: a second connection's warm-up finishes while the
    first's transaction still holds everything it locked (ceiling off: with it on, an admit that
    gives out a slot holds G exclusively, warm-up or not)."""
    first, second = await asyncpg.connect(database_url), await asyncpg.connect(database_url)
    try:
        tx = first.transaction()
        await tx.start()
        assert await first.fetchval("SELECT aq_warm_up_v1()") == 2
        async with second.transaction():
            # Bounded well inside the function's own lock_timeout (10 s): a warm-up that waited
            # for the first one's locks would still be waiting.
            steps = await asyncio.wait_for(second.fetchval("SELECT aq_warm_up_v1()"), 5)
        await tx.rollback()
    finally:
        await first.close()
        await second.close()
    assert steps == 2


async def test_with_the_ceiling_on_a_warm_up_waits_for_g_before_it_holds_anything(
    db: Database, database_url: str
) -> None:
    """Its steps are several decisions in one transaction, which take G shared, then
    exclusively: two warm-ups holding G shared, each waiting for it exclusively, deadlock (seen
    once in the ceiling stress test). With the ceiling on it takes G exclusively first: behind
    a holder of G shared it waits holding no lock at all, and goes on once the holder is done."""
    await db.set_ceiling(5)
    holder, warm = await asyncpg.connect(database_url), await asyncpg.connect(database_url)
    try:
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT aq_lock_global_shared_v1()")
        warm_tx = warm.transaction()
        await warm_tx.start()
        warming = asyncio.create_task(warm.fetchval("SELECT aq_warm_up_v1()"))
        await wait_until_blocked(database_url, holder.get_server_pid())
        held = await fetch(
            database_url,
            "SELECT locktype, mode FROM pg_locks WHERE pid = $1 AND granted "
            "AND locktype = 'advisory'",
            warm.get_server_pid(),
        )
        assert held == [], f"the warm-up waits for G holding {[dict(r) for r in held]}"
        await tx.commit()
        assert await asyncio.wait_for(warming, 5) == 2
        await warm_tx.rollback()
    finally:
        await holder.close()
        await warm.close()


async def test_the_dispatchers_running_marks_wait_for_a_busy_user_in_one_statement(
    db: Database, database_url: str
) -> None:
    """The dispatcher's batch of running marks over two users, one of whose locks another
    transaction holds: the one statement waits for that lock (in sorted order, within the
    functions' lock bound), then marks both jobs once the holder is done."""
    metrics = Metrics()
    core = CoreClient("http://127.0.0.1:9")  # never called: marks only
    followup = FollowUp(metrics)
    finisher = Finisher(db, core, followup, metrics)
    dispatcher = Dispatcher(db, core, DispatchSettings(instance_id="inst-a"), finisher, metrics)
    free, held = await _admit(db, "mark-free"), await _admit(db, "mark-held")
    assert set(await db.claim([free.id, held.id], "inst-a", 60)) == {free.id, held.id}
    holder = await asyncpg.connect(database_url)
    try:
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT aq_lock_user_v1('mark-held')")
        marking = asyncio.create_task(dispatcher._mark_running([free.id, held.id]))
        await wait_until_blocked(database_url, holder.get_server_pid())
        assert not marking.done()
        await tx.commit()
        assert await asyncio.wait_for(marking, 5) == {free.id: True, held.id: True}
    finally:
        await holder.close()
    rows = await fetch(
        database_url,
        "SELECT status FROM analysis_jobs WHERE id = ANY($1::uuid[])",
        [free.id, held.id],
    )
    assert {r["status"] for r in rows} == {"running"}
    assert await db.mark_running([free.id, held.id], "inst-a") == set(), "nothing left to mark"


async def test_with_the_ceiling_on_only_a_decision_that_may_start_a_job_waits_for_all_others(
    db: Database, database_url: str
) -> None:
    """With the provider ceiling on, a click that queues behind its own user's job gives out no
    global slot: it holds the global lock shared and is admitted beside another shared holder.
    A newcomer's click may start at once: it waits for the global lock exclusively, and gets a
    slot once the holder is done (docs/locking.md, "Why each mode")."""
    await db.set_ceiling(2)
    first = await _admit(db, "behind")
    assert first.status == "pending"
    holder = await asyncpg.connect(database_url)
    try:
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT aq_lock_global_shared_v1()")
        second = await asyncio.wait_for(_admit(db, "behind"), 5)
        assert (second.status, second.waiting_for) == ("queued", "your_previous_analysis")
        newcomer = asyncio.create_task(_admit(db, "newcomer"))
        await wait_until_blocked(database_url, holder.get_server_pid())
        assert not newcomer.done()
        await tx.commit()
        started = await asyncio.wait_for(newcomer, 5)
    finally:
        await holder.close()
    assert started.status == "pending"
    rows = await fetch(
        database_url, "SELECT global_slot FROM analysis_jobs WHERE id = $1", started.id
    )
    assert rows[0]["global_slot"] is not None


async def test_with_the_ceiling_full_a_newcomers_click_queues_beside_other_decisions(
    db: Database, database_url: str
) -> None:
    """With every global slot taken, a newcomer's click cannot start: it holds the global lock
    shared, is admitted beside another shared holder, waits for provider capacity, and asks for
    no pass (whoever frees a slot gives it on). The completion that frees the slot starts the
    newcomer's job itself, and leaves nothing for a pass."""
    await db.set_ceiling(1)
    full = await _admit(db, "holds-the-slot")
    assert full.status == "pending"
    holder = await asyncpg.connect(database_url)
    try:
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT aq_lock_global_shared_v1()")
        run_id, job_id = await _reserve(db, "newcomer", 0)
        clicked = await asyncio.wait_for(_admission(db, "newcomer", run_id, job_id, 0), 5)
        await tx.commit()
    finally:
        await holder.close()
    assert (clicked.job.status, clicked.job.waiting_for) == ("queued", "provider_capacity")
    assert clicked.promoted == () and not clicked.asks_pass
    assert set(await db.claim([full.id], "inst-a", 60)) == {full.id}
    assert await db.mark_running([full.id], "inst-a") == {full.id}
    finished = await db.finish(
        job_id=full.id, status="succeeded", from_statuses=("running",), ran=True
    )
    assert finished is not None and not finished.asks_pass
    assert [j.id for j in finished.promoted] == [clicked.job.id]
    rows = await fetch(
        database_url, "SELECT global_slot FROM analysis_jobs WHERE id = $1", clicked.job.id
    )
    assert rows[0]["global_slot"] == 1
    assert await db.promote([], 64) == (1, [])


async def test_with_the_ceiling_on_a_completion_hands_its_slot_on_beside_other_decisions(
    db: Database, database_url: str
) -> None:
    """With the ceiling on, a completion holds the global lock shared like the clicks, so it
    runs beside another shared holder: it frees the job's slots and gives the global one it
    freed to whoever's turn it is, here the user's own next job; no pass is needed."""
    await db.set_ceiling(1)
    done, waiting = await _admit(db, "turns"), await _admit(db, "turns")
    assert waiting.status == "queued"
    assert set(await db.claim([done.id], "inst-a", 60)) == {done.id}
    assert await db.mark_running([done.id], "inst-a") == {done.id}
    holder = await asyncpg.connect(database_url)
    try:
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT aq_lock_global_shared_v1()")
        finished = await asyncio.wait_for(
            db.finish(job_id=done.id, status="succeeded", from_statuses=("running",), ran=True),
            5,
        )
        await tx.commit()
    finally:
        await holder.close()
    assert finished is not None and finished.changed and not finished.asks_pass
    assert [j.id for j in finished.promoted] == [waiting.id]
    await check_invariants(database_url)


async def test_a_completion_gives_its_slot_to_whoever_waited_longest_not_its_own_user(
    db: Database, database_url: str
) -> None:
    """Fair turns hold when a completion hands its slot on: a user who has been waiting since
    before the finishing user last started gets the slot, and the finishing user's next job
    waits its turn."""
    await db.set_ceiling(1)
    done = await _admit(db, "a-finisher")
    longest = await _admit(db, "b-waited-longest")
    behind = await _admit(db, "a-finisher")
    assert (longest.status, behind.status) == ("queued", "queued")
    assert set(await db.claim([done.id], "inst-a", 60)) == {done.id}
    finished = await db.finish(
        job_id=done.id, status="cancelled", from_statuses=("pending",), ran=False
    )
    assert finished is not None and not finished.asks_pass
    assert [j.id for j in finished.promoted] == [longest.id]
    rows = await fetch(
        database_url, "SELECT status, waiting_for FROM analysis_jobs WHERE id = $1", behind.id
    )
    assert (rows[0]["status"], rows[0]["waiting_for"]) == ("queued", "provider_capacity")
    await check_invariants(database_url)


async def test_a_completion_passes_over_a_user_whose_lock_is_busy_and_asks_for_a_pass(
    db: Database, database_url: str
) -> None:
    """A completion holding the global lock shared only tries the lock of the user whose turn
    it is (waiting could close a cycle with the sorted order): when another decision holds it,
    the slot goes to the next in turn; when nobody else waits, the completion asks for a pass,
    which gives the slot once the busy decision has committed."""
    await db.set_ceiling(1)
    done = await _admit(db, "a-finisher")
    busy = await _admit(db, "b-busy")
    assert busy.status == "queued"
    assert set(await db.claim([done.id], "inst-a", 60)) == {done.id}
    holder = await asyncpg.connect(database_url)
    try:
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT aq_lock_user_v1('b-busy')")
        finished = await asyncio.wait_for(
            db.finish(job_id=done.id, status="cancelled", from_statuses=("pending",), ran=False),
            5,
        )
        assert finished is not None and finished.promoted == () and finished.asks_pass
        await tx.commit()
    finally:
        await holder.close()
    ceiling, promoted = await db.promote([], 64)
    assert ceiling == 1 and [j.id for j in promoted] == [busy.id]
    await check_invariants(database_url)


async def test_a_promotion_claims_what_it_starts_for_the_instance_that_releases_it(
    db: Database, database_url: str
) -> None:
    """A pass (ceiling on) and a wake-up (ceiling off) claim the jobs they start, in their own
    transaction, for the instance named: its dispatcher releases them with no claim of its own
    (loops/dispatch.py). Without a claim they are left for any instance to claim."""
    await db.set_ceiling(1)
    first, second = await _admit(db, "pass-holder"), await _admit(db, "pass-claims")
    assert (first.status, second.status) == ("pending", "queued")
    await db.set_ceiling(2)  # a raise: the slot it frees is a pass's to give
    ceiling, promoted = await db.promote([], 64, Claim("inst-a", 60))
    assert ceiling == 2
    assert [(j.id, j.status, j.claimed_by) for j in promoted] == [
        (second.id, JobStatus.PENDING, "inst-a")
    ]
    await db.set_ceiling(None)
    third = await _admit(db, "pass-claims")
    # A writer that does not take the locks ends the job: the wake-up fills the slot.
    await fetch(
        database_url,
        "UPDATE analysis_jobs SET status = 'cancelled', finished_at = now(), user_slot = NULL,"
        " global_slot = NULL, claimed_by = NULL, claim_expires_at = NULL WHERE id = $1",
        second.id,
    )
    woken = await db.promote_woken(["pass-claims"], 64, Claim("inst-b", 60))
    assert [(j.id, j.claimed_by) for j in woken.promoted] == [(third.id, "inst-b")]
    rows = await fetch(
        database_url,
        "SELECT claimed_by, claim_expires_at > now() AS leased FROM analysis_jobs WHERE id = $1",
        third.id,
    )
    assert (rows[0]["claimed_by"], rows[0]["leased"]) == ("inst-b", True)
    fourth = await _admit(db, "pass-claims")
    await fetch(
        database_url,
        "UPDATE analysis_jobs SET status = 'cancelled', finished_at = now(), user_slot = NULL,"
        " global_slot = NULL, claimed_by = NULL, claim_expires_at = NULL WHERE id = $1",
        third.id,
    )
    unclaimed = await db.promote_woken(["pass-claims"], 64)
    assert [(j.id, j.claimed_by) for j in unclaimed.promoted] == [(fourth.id, None)]
    await check_invariants(database_url)
