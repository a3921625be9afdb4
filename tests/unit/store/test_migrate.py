"""What a migration run does to a database with a given history (the plan, without a database;
tests/integration/test_migrations.py runs it on PostgreSQL)."""

from __future__ import annotations

import asyncio
import time

import asyncpg
import pytest
from analysis_queue.store.migrate import (
    Applied,
    DatabaseTooOld,
    LockPolicy,
    MigrationChanged,
    MigrationFailed,
    MigrationLockTimeout,
    Step,
    plan,
    retry_lock_conflicts,
)
from analysis_queue.store.sqlfiles import Migration

BASELINE = Migration(11, "baseline", "CREATE TABLE t (id int);")
M12 = Migration(12, "add_index", "CREATE INDEX t_id ON t (id);")
M13 = Migration(13, "add_column", "ALTER TABLE t ADD COLUMN x int;")
CODE = (BASELINE, M12, M13)


def _legacy(upto: int) -> dict[int, Applied]:
    """A history written migration by migration by a release before the baseline."""
    return {v: Applied(f"legacy_{v}", f"sum{v}") for v in range(1, upto + 1)}


def test_an_empty_database_gets_the_baseline_then_the_rest() -> None:
    steps = plan({}, CODE)
    assert steps.migrations == CODE
    assert steps.repeatables_allowed


def test_a_database_with_the_history_skips_the_baseline() -> None:
    steps = plan(_legacy(11), CODE)
    assert steps.migrations == (M12, M13)
    assert steps.repeatables_allowed


def test_a_baselined_database_goes_on_from_it() -> None:
    history = {11: Applied("baseline", BASELINE.checksum), 12: Applied("add_index", M12.checksum)}
    assert plan(history, CODE).migrations == (M13,)


def test_a_history_older_than_the_baseline_is_refused() -> None:
    with pytest.raises(DatabaseTooOld, match="version 8"):
        plan(_legacy(8), CODE)


def test_an_edited_migration_is_refused() -> None:
    history = {**_legacy(11), 12: Applied("add_index", "edited")}
    with pytest.raises(MigrationChanged) as caught:
        plan(history, CODE)
    assert caught.value.versions == [12]


def test_an_edited_baseline_is_refused_where_it_was_applied() -> None:
    with pytest.raises(MigrationChanged):
        plan({11: Applied("baseline", "edited")}, CODE)


def test_an_older_instance_leaves_the_repeatables_to_the_newer_schema() -> None:
    """An instance of the previous release restarting during a rolling deploy finds a migration
    it does not know: it must not re-apply its older function bodies."""
    history = {
        11: Applied("baseline", BASELINE.checksum),
        12: Applied("add_index", M12.checksum),
        13: Applied("add_column", M13.checksum),
        14: Applied("newer", "sum14"),
    }
    steps = plan(history, CODE)
    assert steps.migrations == ()
    assert not steps.repeatables_allowed


# -- lock conflicts: retried with capped, jittered pauses, for a bounded time -----------------

STEP = Step(13, "add_index")
FAST = LockPolicy(lock_timeout_s=0.05, retry_for_s=0.3, backoff_base_s=0.01, backoff_max_s=0.04)


def _server_error(sqlstate: str, message: str) -> asyncpg.PostgresError:
    return asyncpg.PostgresError.new({"C": sqlstate, "M": message, "S": "ERROR"})


def _lock_timeout() -> asyncpg.PostgresError:
    return _server_error("55P03", "canceling statement due to lock timeout")


def test_the_pause_is_full_jitter_under_a_doubling_cap() -> None:
    locks = LockPolicy(backoff_base_s=0.25, backoff_max_s=10.0)
    for attempt, cap in [(1, 0.25), (2, 0.5), (3, 1.0), (6, 8.0), (7, 10.0), (30, 10.0)]:
        pauses = [locks.backoff_s(attempt) for _ in range(200)]
        assert all(0 <= p <= cap for p in pauses), attempt
        assert max(pauses) > cap / 2 and min(pauses) < cap / 2, "spread over [0, cap]"


async def test_a_lock_conflict_is_tried_again_until_it_gets_through() -> None:
    budgets: list[float] = []

    async def attempt(budget_s: float) -> None:
        budgets.append(budget_s)
        if len(budgets) < 3:
            raise _lock_timeout()

    assert await retry_lock_conflicts(STEP, FAST, attempt) == 3
    # Each try is told the time left, never less than one lock timeout.
    assert budgets == sorted(budgets, reverse=True)
    assert all(FAST.lock_timeout_s <= b <= FAST.retry_for_s for b in budgets)


async def test_a_deadlock_is_a_lock_conflict_too() -> None:
    calls = 0

    async def attempt(_budget_s: float) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise _server_error("40P01", "deadlock detected")

    assert await retry_lock_conflicts(STEP, FAST, attempt) == 2


async def test_lock_conflicts_past_the_bound_name_the_migration() -> None:
    calls = 0

    async def attempt(_budget_s: float) -> None:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.01)  # as a statement that waited for its lock
        raise _lock_timeout()

    started = time.monotonic()
    with pytest.raises(MigrationLockTimeout) as caught:
        await retry_lock_conflicts(STEP, FAST, attempt)
    took = time.monotonic() - started
    assert FAST.retry_for_s <= took < FAST.retry_for_s + 0.2, took
    assert caught.value.attempts == calls > 2
    assert (caught.value.version, caught.value.name) == (13, "add_index")
    assert str(caught.value).startswith("migration 13 (add_index) gave up waiting for its locks")
    assert "lock timeout" in str(caught.value)


async def test_any_other_sql_error_fails_at_once_with_the_servers_message() -> None:
    calls = 0

    async def attempt(_budget_s: float) -> None:
        nonlocal calls
        calls += 1
        raise _server_error("42704", 'type "no_such_type" does not exist')

    with pytest.raises(MigrationFailed) as caught:
        await retry_lock_conflicts(Step(None, "triggers/job_notify.sql"), FAST, attempt)
    assert calls == 1
    assert str(caught.value) == (
        'repeatable triggers/job_notify.sql failed: type "no_such_type" does not exist [42704]'
    )
    assert (caught.value.version, caught.value.sqlstate) == (None, "42704")


async def test_a_failed_statement_of_a_no_transaction_migration_says_which() -> None:
    async def attempt(_budget_s: float) -> None:
        raise _server_error("42703", 'column "nope" does not exist')

    with pytest.raises(MigrationFailed) as caught:
        await retry_lock_conflicts(STEP, FAST, attempt, statement=(2, 3))
    message = str(caught.value)
    assert message.startswith('migration 13 (add_index) failed at statement 2 of 3: column "nope"')
    assert "runs again from its first statement" in message


async def test_a_lost_connection_is_not_the_migrations_fault() -> None:
    """It goes up as it is: the start turns it into DatabaseUnavailable and tries again."""

    async def attempt(_budget_s: float) -> None:
        raise _server_error("57P01", "terminating connection due to administrator command")

    with pytest.raises(asyncpg.AdminShutdownError):
        await retry_lock_conflicts(STEP, FAST, attempt)
