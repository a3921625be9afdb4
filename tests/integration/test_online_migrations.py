"""Online migrations on a live queue: a running instance admits continuously (the HTTP API,
Core's create, ``aq_reserve_v1``/``aq_admit_v2``) while the migration runner applies
test-only migrations (tests/fixtures/online_migrations/) after the service's own, with the
same code that applies the service's (``apply_migrations(numbered=...)``).

What is measured is each admit's latency, end to end: none may wait longer than the
migration's lock timeout, whether the migration builds an index on a table with rows in it,
or waits behind a long transaction that holds a lock it needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from analysis_queue.store.migrate import (
    DEFAULT_LOCKS,
    LockPolicy,
    MigrationFailed,
    MigrationLockTimeout,
    apply_migrations,
)
from analysis_queue.store.sqlfiles import Migration, load_migrations, migrations
from support import Harness, fetchval, wait_for, wait_until_blocked

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ONLINE = {m.version: m for m in load_migrations(FIXTURES / "online_migrations")}
OFFLINE = {m.version: m for m in load_migrations(FIXTURES / "offline_migrations")}
THESIS_SEARCH = ONLINE[9001]  # CREATE INDEX CONCURRENTLY on analysis_jobs, no transaction
COST_CAP = ONLINE[9002]  # ALTER TABLE analysis_jobs ... NOT VALID: a moment's ACCESS EXCLUSIVE
# Enough finished jobs that building an index over them takes a measurable time here (about a
# second for the GIN index on the 2-core test machine), so admits run during the build.
ROWS = 150_000
ADMITTERS = 4
# Beyond the wait itself, an admit spends its ordinary time (HTTP, Core's create, three
# statements) on a shared 2-core machine.
ADMIT_SLACK_S = 0.75
RETRY_LOG = "migration could not take a lock in time; trying again"
# Short lock waits for the tests of a migration stuck behind a long transaction.
SHORT = LockPolicy(lock_timeout_s=1.0, retry_for_s=30.0, backoff_base_s=0.2, backoff_max_s=1.0)


def _with(*extra: Migration) -> tuple[Migration, ...]:
    return (*migrations(), *extra)


async def _seed(dsn: str, rows: int) -> None:
    """Finished jobs of a thousand users, as a year of history would leave them."""
    conn = await asyncpg.connect(dsn)
    try:
        # Loaded as a restore would: without the NOTIFY and event triggers.
        await conn.execute("SET session_replication_role = replica")
        await conn.execute(
            """INSERT INTO analysis_jobs (id, user_id, run_id, status, thesis, sources, cost,
                                          created_at, finished_at)
               SELECT gen_random_uuid(), 'history-' || (g % 1000), gen_random_uuid(),
                      'succeeded',
                      jsonb_build_object('title', 'Thesis ' || g,
                                         'document_url', 'https://uni.example/t/' || g || '.pdf',
                                         'keywords',
                                         jsonb_build_array('k' || g % 97, 'k' || g % 89)),
                      '[]'::jsonb, 0, clock_timestamp(), clock_timestamp()
                 FROM generate_series(1, $1) g""",
            rows,
        )
        await conn.execute("RESET session_replication_role")
        await conn.execute("ANALYZE analysis_jobs")
    finally:
        await conn.close()


@dataclass(frozen=True)
class Admit:
    started: float
    seconds: float
    status: int


@dataclass
class Admits:
    """Admits in a loop, one loop per user, each admit timed from request to answer."""

    harness: Harness
    users: list[str]
    done: list[Admit] = field(default_factory=list)
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)

    async def _loop(self, user: str) -> None:
        n = 0
        while not self._stopping.is_set():
            n += 1
            started = time.monotonic()
            status, body = await self.harness.admit(user, n)
            self.done.append(Admit(started, time.monotonic() - started, status))
            assert status == 201, body

    async def reach(self, count: int) -> None:
        await wait_for(lambda: _true(len(self.done) >= count), timeout_s=60, what=f"{count} admits")

    def between(self, start: float, end: float) -> list[Admit]:
        """The admits that were in flight at some moment of [start, end]."""
        return [a for a in self.done if a.started <= end and a.started + a.seconds >= start]

    @property
    def longest_s(self) -> float:
        return max(a.seconds for a in self.done)


async def _true(value: bool) -> bool:
    return value


@contextlib.asynccontextmanager
async def admitting(harness: Harness) -> AsyncIterator[Admits]:
    await harness.start_instance()
    users = [f"lecturer-{k}" for k in range(ADMITTERS)]
    for user in users:
        await harness.grant(user, 100_000)
    admits = Admits(harness, users)
    loops = [asyncio.create_task(admits._loop(user)) for user in users]
    try:
        await admits.reach(2 * ADMITTERS)  # warmed up: every loop has been through once
        yield admits
    finally:
        admits._stopping.set()
        results = await asyncio.gather(*loops, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, failures


async def _migrator_pid(dsn: str) -> int:
    """The backend of the migration run this test started (the instance's own has ended)."""
    sql = """SELECT pid FROM pg_stat_activity
              WHERE application_name = 'aq-migrate' AND datname = current_database()"""
    await wait_for(lambda: _is_not_none(fetchval(dsn, sql)), what="the migration's backend")
    pid = await fetchval(dsn, sql)
    assert isinstance(pid, int)
    return pid


async def _is_not_none(value: Any) -> bool:
    return (await value) is not None


async def _index(dsn: str, name: str) -> tuple[bool, str] | None:
    row = await fetchval(
        dsn,
        """SELECT (i.indisvalid, pg_get_indexdef(i.indexrelid)) FROM pg_index i
            WHERE i.indexrelid = to_regclass($1)""",
        name,
    )
    return None if row is None else (row[0], row[1])


async def _recorded(dsn: str, version: int) -> bool:
    return bool(
        await fetchval(dsn, "SELECT count(*) FROM aq_schema_migrations WHERE version = $1", version)
    )


def _retries(caplog: pytest.LogCaptureFixture) -> int:
    return sum(1 for r in caplog.records if r.getMessage() == RETRY_LOG)


# -- an index on a table with rows, while the queue admits ----------------------------------


async def test_an_index_built_concurrently_holds_up_no_admit(
    harness: Harness, database_url: str
) -> None:
    """The issue's test: CREATE INDEX CONCURRENTLY on analysis_jobs with 150,000 rows, while
    four users admit without pause. No admit waits longer than the lock timeout (in fact, none
    waits for the build at all)."""
    await _seed(database_url, ROWS)
    async with admitting(harness) as admits:
        started = time.monotonic()
        applied = await apply_migrations(database_url, numbered=_with(THESIS_SEARCH))
        ended = time.monotonic()
        await admits.reach(len(admits.done) + 2 * ADMITTERS)
    assert applied == [9001]
    index = await _index(database_url, "analysis_jobs_thesis_search")
    assert index is not None and index[0], "built, and valid"
    during = admits.between(started, ended)
    assert len(during) >= 10, f"the build took {ended - started:.2f} s: too short to show much"
    longest = max(a.seconds for a in during)
    print(
        f"\nCREATE INDEX CONCURRENTLY over {ROWS} rows: {ended - started:.2f} s; "
        f"{len(during)} admits during it, the longest {longest * 1000:.0f} ms; "
        f"longest of all {len(admits.done)}: {admits.longest_s * 1000:.0f} ms "
        f"(lock_timeout {DEFAULT_LOCKS.lock_timeout_s:g} s)"
    )
    assert admits.longest_s < DEFAULT_LOCKS.lock_timeout_s, admits.longest_s


async def test_the_same_index_built_in_a_transaction_holds_up_the_admits(
    harness: Harness, database_url: str
) -> None:
    """What the rule (tests/unit/store/test_online_rules.py) prevents: a plain CREATE INDEX
    holds SHARE on the table for the whole build, and every admit's INSERT waits behind it.
    The lock timeout does not help: the lock is granted at once, the build is what takes long."""
    await _seed(database_url, ROWS)
    async with admitting(harness) as admits:
        started = time.monotonic()
        run = asyncio.create_task(apply_migrations(database_url, numbered=_with(OFFLINE[9001])))
        migrator = await _migrator_pid(database_url)
        await wait_until_blocked(database_url, migrator)  # an admit waits for the build
        assert await run == [9001]
        ended = time.monotonic()
    during = admits.between(started, ended)
    print(
        f"\nplain CREATE INDEX over {ROWS} rows: {ended - started:.2f} s; the longest of "
        f"{len(during)} admits during it {max(a.seconds for a in during) * 1000:.0f} ms"
    )


# -- a migration stuck behind a long transaction ---------------------------------------------


@pytest.mark.parametrize("holder_ends", [True, False], ids=["holder-ends", "bound-passes"])
async def test_a_migration_behind_a_long_transaction_gives_way_to_the_admits(
    harness: Harness, database_url: str, caplog: pytest.LogCaptureFixture, holder_ends: bool
) -> None:
    """ADD CONSTRAINT needs ACCESS EXCLUSIVE on analysis_jobs; a long report holds ACCESS
    SHARE. Waiting for it, the migration makes every admit's INSERT queue behind it, so it
    gives up after its lock timeout, lets them through, and tries again later: until the
    report ends (then it is applied), or until its bound (then MigrationLockTimeout)."""
    locks = SHORT if holder_ends else dataclasses.replace(SHORT, retry_for_s=4.0)
    caplog.set_level(logging.WARNING, logger="analysis_queue.store.migrate")
    report = await asyncpg.connect(database_url)
    try:
        transaction = report.transaction()
        await transaction.start()
        await report.fetchval("SELECT count(*) FROM analysis_jobs")
        report_pid = await report.fetchval("SELECT pg_backend_pid()")
        async with admitting(harness) as admits:
            run = asyncio.create_task(
                apply_migrations(database_url, numbered=_with(COST_CAP), locks=locks)
            )
            migrator = await _migrator_pid(database_url)
            await wait_until_blocked(database_url, report_pid)  # the migration waits ...
            await wait_until_blocked(database_url, migrator)  # ... and an admit behind it
            await wait_for(lambda: _true(_retries(caplog) >= 2), timeout_s=20, what="2 retries")
            if holder_ends:
                await transaction.rollback()
                assert await run == [9002]
            else:
                with pytest.raises(MigrationLockTimeout) as caught:
                    await run
                assert str(caught.value).startswith(
                    "migration 9002 (analysis_jobs_cost_cap) gave up waiting for its locks"
                )
            await admits.reach(len(admits.done) + 2 * ADMITTERS)
    finally:
        await report.close()
    assert await _recorded(database_url, 9002) is holder_ends
    print(
        f"\nbehind a long transaction ({'it ended' if holder_ends else 'the bound passed'}): "
        f"{_retries(caplog)} retries; longest of {len(admits.done)} admits "
        f"{admits.longest_s * 1000:.0f} ms (lock_timeout {locks.lock_timeout_s:g} s)"
    )
    # An admit is a group commit: a click can wait for the batch ahead of it as well as its
    # own, each held up by one of the migration's tries at most (without the lock timeout
    # they would wait for the whole report, 4 s and more when the bound passes). And when
    # its user's lock is held by a completion batch that waits for a try itself, the click
    # leaves its batch and is admitted alone after that holder: a third try.
    assert admits.longest_s < 3 * locks.lock_timeout_s + ADMIT_SLACK_S, admits.longest_s


@pytest.mark.parametrize("holder_ends", [True, False], ids=["holder-ends", "bound-passes"])
async def test_an_index_build_waits_out_a_long_transaction_without_holding_up_admits(
    harness: Harness, database_url: str, caplog: pytest.LogCaptureFixture, holder_ends: bool
) -> None:
    """CREATE INDEX CONCURRENTLY waits for every transaction older than its index (a pg_dump,
    a long report) and nobody waits for it. Past its bound it fails and leaves an invalid
    index behind, which IF NOT EXISTS would take for done: the next run drops it first and
    builds it again."""
    locks = SHORT if holder_ends else dataclasses.replace(SHORT, retry_for_s=2.0)
    caplog.set_level(logging.WARNING, logger="analysis_queue.store.migrate")
    report = await asyncpg.connect(database_url)
    try:
        transaction = report.transaction(isolation="repeatable_read")
        await transaction.start()
        await report.fetchval("SELECT count(*) FROM analysis_jobs")  # its snapshot is taken
        report_pid = await report.fetchval("SELECT pg_backend_pid()")
        async with admitting(harness) as admits:
            run = asyncio.create_task(
                apply_migrations(database_url, numbered=_with(THESIS_SEARCH), locks=locks)
            )
            await wait_until_blocked(database_url, report_pid)  # the build waits for it
            waiting_since = len(admits.done)
            await admits.reach(waiting_since + 5 * ADMITTERS)  # ... and the admits go on
            if holder_ends:
                await transaction.rollback()
                assert await run == [9001]
            else:
                with pytest.raises(MigrationLockTimeout, match=r"^migration 9001 \("):
                    await run
                assert await _index(database_url, "analysis_jobs_thesis_search") == (
                    False,
                    THESIS_INDEX_DEF,
                ), "a failed build leaves an invalid index"
                await transaction.rollback()
                assert await apply_migrations(database_url, numbered=_with(THESIS_SEARCH)) == [9001]
                assert any("dropping the invalid index" in r.getMessage() for r in caplog.records)
            await admits.reach(len(admits.done) + 2 * ADMITTERS)
    finally:
        await report.close()
    assert await _index(database_url, "analysis_jobs_thesis_search") == (True, THESIS_INDEX_DEF)
    assert await _recorded(database_url, 9001)
    print(
        f"\nindex build behind a long transaction ({'it ended' if holder_ends else 'rebuilt'}):"
        f" longest of {len(admits.done)} admits {admits.longest_s * 1000:.0f} ms"
    )
    assert admits.longest_s < locks.lock_timeout_s, admits.longest_s


THESIS_INDEX_DEF = (
    "CREATE INDEX analysis_jobs_thesis_search ON public.analysis_jobs"
    " USING gin (thesis jsonb_path_ops)"
)


# -- statement by statement, and again after a failure ---------------------------------------


async def test_a_no_transaction_migration_runs_each_statement_and_again_after_a_failure(
    database_url: str,
) -> None:
    """Two CONCURRENTLY builds in one file (sent whole they would be one implicit transaction,
    which PostgreSQL refuses); the second fails; the first stays, the migration is not
    recorded, and the next run, with the file fixed, starts again from the top."""
    text = (
        "-- aq:no-transaction\n"
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS analysis_jobs_by_finish\n"
        "    ON analysis_jobs (user_id, finished_at);\n"
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS analysis_jobs_by_cost ON analysis_jobs ({});\n"
    )
    broken = Migration(9101, "two_indexes", text.format("costs"))
    with pytest.raises(MigrationFailed) as caught:
        await apply_migrations(database_url, numbered=_with(broken))
    assert (caught.value.version, caught.value.name, caught.value.sqlstate) == (
        9101,
        "two_indexes",
        "42703",
    )
    assert str(caught.value).startswith(
        'migration 9101 (two_indexes) failed at statement 2 of 2: column "costs" does not exist'
    )
    assert not await _recorded(database_url, 9101)
    first = await _index(database_url, "analysis_jobs_by_finish")
    assert first is not None and first[0]

    fixed = Migration(9101, "two_indexes", text.format("cost"))
    assert await apply_migrations(database_url, numbered=_with(fixed)) == [9101]
    for name in ("analysis_jobs_by_finish", "analysis_jobs_by_cost"):
        index = await _index(database_url, name)
        assert index is not None and index[0], name
    assert await apply_migrations(database_url, numbered=_with(fixed)) == []


async def test_an_invalid_index_of_the_same_name_is_dropped_and_built_again(
    database_url: str,
) -> None:
    """A unique build over duplicate values fails halfway, as any CONCURRENTLY build can, and
    leaves its index behind, INVALID. IF NOT EXISTS alone would take it for the index asked
    for; the runner drops it and builds the one the migration says."""
    await _seed(database_url, 2)
    conn = await asyncpg.connect(database_url)
    try:
        with pytest.raises(asyncpg.UniqueViolationError):
            await conn.execute(
                "CREATE UNIQUE INDEX CONCURRENTLY analysis_jobs_thesis_search"
                " ON analysis_jobs (cost)"
            )
    finally:
        await conn.close()
    left = await _index(database_url, "analysis_jobs_thesis_search")
    assert left is not None and not left[0] and "UNIQUE" in left[1]

    assert await apply_migrations(database_url, numbered=_with(THESIS_SEARCH)) == [9001]
    assert await _index(database_url, "analysis_jobs_thesis_search") == (True, THESIS_INDEX_DEF)


# -- every failure names its file ------------------------------------------------------------


async def test_a_broken_migration_is_a_migration_error_with_the_servers_message(
    database_url: str,
) -> None:
    broken = Migration(9102, "add_reviewer", "ALTER TABLE analysis_jobs ADD reviewer no_such;\n")
    with pytest.raises(MigrationFailed) as caught:
        await apply_migrations(database_url, numbered=_with(broken))
    assert str(caught.value) == (
        'migration 9102 (add_reviewer) failed: type "no_such" does not exist [42704]'
    )
    assert not await _recorded(database_url, 9102)
    assert await apply_migrations(database_url) == [], "the service's own are all applied"


async def test_a_repeatable_waits_and_retries_like_a_migration(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """CREATE OR REPLACE TRIGGER takes SHARE ROW EXCLUSIVE on analysis_jobs: behind a writer
    that does not finish it gives up in time, names its file, and is applied by a later run."""
    caplog.set_level(logging.WARNING, logger="analysis_queue.store.migrate")
    name = "triggers/job_notify.sql"
    await fetchval(
        database_url, "UPDATE aq_schema_repeatables SET checksum = 'stale' WHERE name = $1", name
    )
    writer = await asyncpg.connect(database_url)
    try:
        transaction = writer.transaction()
        await transaction.start()
        await writer.execute("LOCK TABLE analysis_jobs IN ROW EXCLUSIVE MODE")  # as an INSERT
        locks = LockPolicy(lock_timeout_s=0.2, retry_for_s=1.0, backoff_base_s=0.05)
        with pytest.raises(MigrationLockTimeout) as caught:
            await apply_migrations(database_url, locks=locks)
        assert caught.value.version is None and caught.value.name == name
        assert str(caught.value).startswith(f"repeatable {name} gave up waiting")
        assert _retries(caplog) >= 2
        await transaction.rollback()
    finally:
        await writer.close()
    assert await apply_migrations(database_url) == []
    assert (
        await fetchval(
            database_url, "SELECT checksum FROM aq_schema_repeatables WHERE name = $1", name
        )
        != "stale"
    )


# -- data changes in batches -----------------------------------------------------------------

ADD_TITLE = Migration(9103, "analysis_jobs_title", "ALTER TABLE analysis_jobs ADD title text;\n")
BACKFILL_TITLE = Migration(
    9104,
    "analysis_jobs_title_backfill",
    """-- The recipe of docs/operations.md, "Data changes": each batch commits on its own, so no
-- transaction holds thousands of row locks, and a run cut short goes on where it stopped.
-- aq:no-transaction
DO $$
DECLARE
    changed integer;
BEGIN
    LOOP
        UPDATE analysis_jobs SET title = thesis->>'title'
         WHERE id IN (SELECT id FROM analysis_jobs WHERE title IS NULL LIMIT 1000);
        GET DIAGNOSTICS changed = ROW_COUNT;
        EXIT WHEN changed = 0;
        COMMIT;
    END LOOP;
END
$$;
""",
)


async def test_a_backfill_commits_batch_by_batch(database_url: str) -> None:
    await _seed(database_url, 2_500)
    applied = await apply_migrations(database_url, numbered=_with(ADD_TITLE, BACKFILL_TITLE))
    assert applied == [9103, 9104]
    assert (
        await fetchval(database_url, "SELECT count(*) FROM analysis_jobs WHERE title IS NULL") == 0
    )
    # Each batch is its own transaction: the rows carry three writers' transaction ids.
    assert await fetchval(database_url, "SELECT count(DISTINCT xmin::text) FROM analysis_jobs") == 3
