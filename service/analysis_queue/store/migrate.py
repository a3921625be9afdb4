"""Schema migrations: numbered files once each, then the repeatable functions and triggers.

A run (at every start, and ``analysis-queue migrate``) holds a session advisory lock, so
instances that start together apply each file once: the second waits, then finds nothing to do.

1. **Numbered** (``sql/migrations/NNNN_name.sql``): tables, columns, indexes and data, applied
   in version order, each in its own transaction (or statement by statement, below), recorded
   in ``aq_schema_migrations`` with a checksum. An applied one never changes: a changed text
   stops the start (add a new one). An empty database gets the baseline file instead of the
   history it stands for; a database with history older than the baseline is refused (upgrade
   through the release that wrote it).
2. **Repeatable** (``sql/functions/*.sql``, then ``triggers/*.sql``): every function, trigger
   function and trigger, in the present tense, re-applied whenever a file's text differs from
   what ``aq_schema_repeatables`` records (``CREATE OR REPLACE``). An instance that finds a
   numbered migration it does not know leaves them alone: it is an older one restarting during a
   rolling deploy, and must not put its old function bodies back.

**Online.** The old instances keep writing while a deploy migrates, and a DDL statement that
waits for a lock makes every writer that comes after it wait too. So every statement runs with
a short ``lock_timeout`` (:class:`LockPolicy`); one that times out (55P03) is rolled back and
tried again after a capped, jittered pause, for a bounded time, then the run stops with a
:class:`MigrationLockTimeout` naming the file. A migration whose opening comment says
``-- aq:no-transaction`` runs one statement at a time outside a transaction (``CREATE INDEX
CONCURRENTLY``): before each index build it drops the invalid index a failed build of the same
name left behind, and it is recorded only once every statement succeeded. Any other SQL error is
a :class:`MigrationFailed` with the file and the server's message; a lost connection stays
``DatabaseUnavailable``, which the start retries.

How to change the schema, how to write an online migration, and the versioning rule for rolling
deploys: docs/operations.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from analysis_queue.store.driver import CONNECT_TIMEOUT_S, wrap_errors
from analysis_queue.store.sqlfiles import (
    IndexBuild,
    Migration,
    Repeatable,
    index_builds,
    migrations,
    repeatables,
)

log = logging.getLogger(__name__)

# A key of its own for the migration run (not a queue lock: docs/locking.md). Session-level,
# on a dedicated connection.
_TRY_LOCK_SQL = "SELECT pg_try_advisory_lock(hashtextextended('analysis_queue_migrations', 0))"
_UNLOCK_SQL = "SELECT pg_advisory_unlock(hashtextextended('analysis_queue_migrations', 0))"
_CREATE_HISTORY = """
    CREATE TABLE IF NOT EXISTS aq_schema_migrations (
        version     integer PRIMARY KEY,
        name        text NOT NULL,
        checksum    text NOT NULL,
        applied_at  timestamptz NOT NULL DEFAULT clock_timestamp())"""
_CREATE_REPEATABLES = """
    CREATE TABLE IF NOT EXISTS aq_schema_repeatables (
        name        text PRIMARY KEY,
        checksum    text NOT NULL,
        applied_at  timestamptz NOT NULL DEFAULT clock_timestamp())"""


# A lock wait that ran out (lock_timeout) or lost a deadlock: nothing is wrong with the SQL,
# someone else held the lock. Try again later.
_LOCK_CONFLICTS = (asyncpg.LockNotAvailableError, asyncpg.DeadlockDetectedError)
_INVALID_INDEX = """
    SELECT NOT i.indisvalid FROM pg_index i WHERE i.indexrelid = to_regclass($1)"""


@dataclass(frozen=True)
class LockPolicy:
    """How long a migration's statement may wait for a lock, and how long one that timed out is
    tried again. The defaults are the service's; tests pass shorter ones to the same runner.

    ``lock_timeout_s`` bounds how long writers can queue behind a DDL statement waiting for its
    lock. ``retry_for_s`` bounds, per statement (per transaction for a migration that runs in
    one), how long the run keeps trying; the pause between tries is full jitter,
    uniform(0, min(backoff_max_s, backoff_base_s * 2^(n-1))). ``CREATE INDEX CONCURRENTLY`` is
    the one statement that waits with the whole of ``retry_for_s`` as its lock timeout: its
    waits (for transactions older than the index) never make a writer queue, and a timeout
    there would throw away the build and leave an invalid index."""

    lock_timeout_s: float = 2.0
    retry_for_s: float = 60.0
    backoff_base_s: float = 0.25
    backoff_max_s: float = 10.0
    # How long a run waits for another instance's run to end (it may build an index).
    run_wait_s: float = 600.0
    run_poll_s: float = 0.5

    def backoff_s(self, attempt: int) -> float:
        """The pause after the ``attempt``-th try timed out (1-based)."""
        return random.uniform(0, min(self.backoff_max_s, self.backoff_base_s * 2 ** (attempt - 1)))


DEFAULT_LOCKS = LockPolicy()


def _server_message(exc: asyncpg.PostgresError) -> str:
    return exc.message or str(exc) or type(exc).__name__


class MigrationError(RuntimeError):
    """The database's schema cannot be brought to this code's."""


class MigrationFailed(MigrationError):
    """A migration's (or a repeatable file's) SQL failed on the server."""

    def __init__(
        self, step: Step, exc: asyncpg.PostgresError, *, statement: tuple[int, int] | None = None
    ) -> None:
        self.version, self.name, self.sqlstate = step.version, step.name, exc.sqlstate
        where = f" at statement {statement[0]} of {statement[1]}" if statement else ""
        message = f"{step} failed{where}: {_server_message(exc)} [{exc.sqlstate}]"
        detail = getattr(exc, "detail", None)
        if detail:
            message += f" ({detail})"
        if statement and statement[0] > 1:
            message += (
                "; the statements before it are applied, and the migration runs again from its"
                " first statement at the next start"
            )
        super().__init__(message)


class MigrationLockTimeout(MigrationError):
    """A migration could not take its locks within its bound: something holds them."""

    def __init__(
        self, step: Step, attempts: int, locks: LockPolicy, exc: asyncpg.PostgresError
    ) -> None:
        self.version, self.name, self.attempts = step.version, step.name, attempts
        super().__init__(
            f"{step} gave up waiting for its locks after {locks.retry_for_s:g} s and {attempts} "
            f"tries: {_server_message(exc)}; a long transaction holds a lock it needs, or is "
            "older than the index it builds (pg_stat_activity, pg_locks): start again once it ended"
        )


class MigrationChanged(MigrationError):
    """An applied migration's text differs from this code's: schemas would silently diverge."""

    def __init__(self, versions: Sequence[int]) -> None:
        self.versions = list(versions)
        super().__init__(
            f"applied migrations {self.versions} differ from this code's; "
            "never edit an applied migration, add a new one"
        )


class DatabaseTooOld(MigrationError):
    """The database's history ends before this code's baseline."""


@dataclass(frozen=True)
class Step:
    """What one retried unit applies, named for logs and errors."""

    version: int | None  # None: a repeatable file
    name: str

    def __str__(self) -> str:
        if self.version is None:
            return f"repeatable {self.name}"
        return f"migration {self.version} ({self.name})"

    @property
    def log_extra(self) -> dict[str, Any]:
        if self.version is None:
            return {"action": "migrate", "repeatable": self.name}
        return {"action": "migrate", "version": self.version, "migration": self.name}


@dataclass(frozen=True)
class Applied:
    """A numbered migration as ``aq_schema_migrations`` records it."""

    name: str
    checksum: str


@dataclass(frozen=True)
class Plan:
    """What a run does to a database with the given history."""

    migrations: tuple[Migration, ...]  # to apply, in order
    repeatables_allowed: bool  # False: the database is ahead of this code


def plan(history: Mapping[int, Applied], code: Sequence[Migration]) -> Plan:
    """The numbered migrations to apply, or MigrationError. Pure: tested without a database."""
    baseline = code[0] if code and code[0].is_baseline else None
    if not history:
        return Plan(tuple(code), repeatables_allowed=True)
    newest = max(history)
    if baseline is not None and newest < baseline.version:
        raise DatabaseTooOld(
            f"the database's schema is at version {newest}; this release starts from version "
            f"{baseline.version}: upgrade through the release that last shipped it first"
        )
    changed = []
    for migration in code:
        applied = history.get(migration.version)
        if applied is None:
            continue
        # A baselined database records the baseline; one with history records the file that
        # baseline stands for, whose text this code no longer has.
        if migration.is_baseline and applied.name != migration.name:
            continue
        if applied.checksum != migration.checksum:
            changed.append(migration.version)
    if changed:
        raise MigrationChanged(changed)
    todo = tuple(m for m in code if not m.is_baseline and m.version not in history)
    known = {m.version for m in code}
    ahead = any(v not in known and v > max(known, default=0) for v in history)
    return Plan(todo, repeatables_allowed=not ahead)


async def _history(conn: asyncpg.Pool[Any] | asyncpg.Connection[Any]) -> dict[int, Applied]:
    if not await conn.fetchval("SELECT to_regclass('aq_schema_migrations') IS NOT NULL"):
        return {}
    rows = await conn.fetch("SELECT version, name, checksum FROM aq_schema_migrations")
    return {r["version"]: Applied(r["name"], r["checksum"]) for r in rows}


async def _recorded(conn: asyncpg.Pool[Any] | asyncpg.Connection[Any]) -> dict[str, str]:
    if not await conn.fetchval("SELECT to_regclass('aq_schema_repeatables') IS NOT NULL"):
        return {}
    rows = await conn.fetch("SELECT name, checksum FROM aq_schema_repeatables")
    return {r["name"]: r["checksum"] for r in rows}


async def pending(conn: asyncpg.Pool[Any] | asyncpg.Connection[Any]) -> list[int]:
    """Numbered versions this code has that the database lacks, or recorded with other text
    (readiness). Repeatables do not count: during a rolling deploy old and new instances differ
    in them, and both are ready."""
    history = await _history(conn)
    if not history:
        return [m.version for m in migrations()]
    try:
        return [m.version for m in plan(history, migrations()).migrations]
    except MigrationChanged as exc:
        return exc.versions
    except DatabaseTooOld:
        return [m.version for m in migrations()]


def _connection_lost(exc: asyncpg.PostgresError) -> bool:
    """The server went away (or is going), not the migration's SQL: the start retries these."""
    return isinstance(
        exc,
        asyncpg.PostgresConnectionError
        | asyncpg.AdminShutdownError
        | asyncpg.CrashShutdownError
        | asyncpg.CannotConnectNowError
        | asyncpg.TooManyConnectionsError,
    )


async def retry_lock_conflicts(
    step: Step,
    locks: LockPolicy,
    attempt: Callable[[float], Awaitable[None]],
    *,
    statement: tuple[int, int] | None = None,
) -> int:
    """Run ``attempt(budget_s)`` until it gets through without a lock conflict, for at most
    ``locks.retry_for_s`` (``budget_s``: the time left, at least one lock timeout). Returns
    the number of tries. A lock conflict past the bound is :class:`MigrationLockTimeout`; any
    other SQL error :class:`MigrationFailed`; a lost connection goes up as it is."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + locks.retry_for_s
    tries = 0
    while True:
        tries += 1
        try:
            await attempt(max(deadline - loop.time(), locks.lock_timeout_s))
            return tries
        except _LOCK_CONFLICTS as exc:
            left = deadline - loop.time()
            if left <= 0:
                raise MigrationLockTimeout(step, tries, locks, exc) from exc
            pause = min(locks.backoff_s(tries), left)
            log.warning(
                "migration could not take a lock in time; trying again",
                extra={
                    **step.log_extra,
                    "attempt": tries,
                    "retry_in_s": round(pause, 3),
                    "reason": _server_message(exc),
                },
            )
            await asyncio.sleep(pause)
        except asyncpg.PostgresError as exc:
            if _connection_lost(exc):
                raise
            raise MigrationFailed(step, exc, statement=statement) from exc


async def _set_lock_timeout(conn: asyncpg.Connection[Any], seconds: float) -> None:
    # Session-level: a no-transaction statement has no transaction to SET LOCAL in.
    await conn.execute(
        "SELECT set_config('lock_timeout', $1, false)", str(max(1, round(seconds * 1000)))
    )


async def _record(conn: asyncpg.Connection[Any], migration: Migration) -> None:
    await conn.execute(
        "INSERT INTO aq_schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
        migration.version,
        migration.name,
        migration.checksum,
    )


async def _apply_in_transaction(
    conn: asyncpg.Connection[Any], migration: Migration, step: Step, locks: LockPolicy
) -> int:
    async def attempt(_budget_s: float) -> None:
        await _set_lock_timeout(conn, locks.lock_timeout_s)
        async with conn.transaction():
            await conn.execute(migration.sql)
            await _record(conn, migration)

    return await retry_lock_conflicts(step, locks, attempt)


async def _build_index(
    conn: asyncpg.Connection[Any],
    statement: str,
    build: IndexBuild,
    step: Step,
    locks: LockPolicy,
    budget_s: float,
) -> None:
    """A ``CREATE INDEX CONCURRENTLY IF NOT EXISTS``, after dropping the invalid index of the
    same name that a failed build (a lock timeout, a duplicate key, a lost connection) leaves
    behind: ``IF NOT EXISTS`` would take it for done, and it is never used for reads while
    every write still pays for it."""
    await _set_lock_timeout(conn, locks.lock_timeout_s)
    if await conn.fetchval(_INVALID_INDEX, build.name):
        log.warning(
            "dropping the invalid index a failed build left behind, to build it again",
            extra={**step.log_extra, "index": build.name},
        )
        await conn.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {build.name}")
    await _set_lock_timeout(conn, budget_s)
    await conn.execute(statement)


async def _apply_outside_transaction(
    conn: asyncpg.Connection[Any], migration: Migration, step: Step, locks: LockPolicy
) -> int:
    """One statement at a time, each in its own implicit transaction (a file sent whole would
    be one implicit transaction block, where CONCURRENTLY is refused); recorded after the last.
    After a failure the next run starts again from the first statement, which the file's
    ``IF NOT EXISTS`` clauses make safe (``sqlfiles.check_migration``)."""
    statements = migration.statements
    tries = 0
    for number, statement in enumerate(statements, 1):
        concurrent = [b for b in index_builds(statement) if b.concurrently and b.name]

        async def attempt(
            budget_s: float, statement: str = statement, concurrent: list[IndexBuild] = concurrent
        ) -> None:
            if concurrent:
                await _build_index(conn, statement, concurrent[0], step, locks, budget_s)
            else:
                await _set_lock_timeout(conn, locks.lock_timeout_s)
                await conn.execute(statement)

        tries += await retry_lock_conflicts(
            step, locks, attempt, statement=(number, len(statements))
        )

    async def record(_budget_s: float) -> None:
        await _set_lock_timeout(conn, locks.lock_timeout_s)
        await _record(conn, migration)

    await retry_lock_conflicts(step, locks, record)
    return tries


async def _apply_migration(
    conn: asyncpg.Connection[Any], migration: Migration, locks: LockPolicy
) -> None:
    step = Step(migration.version, migration.name)
    started = asyncio.get_running_loop().time()
    if migration.no_transaction:
        tries = await _apply_outside_transaction(conn, migration, step, locks)
    else:
        tries = await _apply_in_transaction(conn, migration, step, locks)
    log.info(
        "migration applied",
        extra={
            **step.log_extra,
            "no_transaction": migration.no_transaction,
            "tries": tries,
            "seconds": round(asyncio.get_running_loop().time() - started, 3),
        },
    )


async def _apply_repeatable(
    conn: asyncpg.Connection[Any], repeatable: Repeatable, locks: LockPolicy
) -> None:
    # CREATE OR REPLACE TRIGGER takes SHARE ROW EXCLUSIVE on its table: writers queue behind
    # it like behind any DDL, so a repeatable waits and retries like a migration.
    step = Step(None, repeatable.name)

    async def attempt(_budget_s: float) -> None:
        await _set_lock_timeout(conn, locks.lock_timeout_s)
        async with conn.transaction():
            await conn.execute(repeatable.sql)
            await conn.execute(
                """INSERT INTO aq_schema_repeatables (name, checksum) VALUES ($1, $2)
                   ON CONFLICT (name) DO UPDATE
                       SET checksum = EXCLUDED.checksum, applied_at = clock_timestamp()""",
                repeatable.name,
                repeatable.checksum,
            )

    await retry_lock_conflicts(step, locks, attempt)
    log.info("repeatable applied", extra=step.log_extra)


async def _take_run_lock(conn: asyncpg.Connection[Any], locks: LockPolicy) -> None:
    """Wait for another instance's run to end by trying the run lock again and again, never by
    a waiting ``pg_advisory_lock``: a waiting statement holds a snapshot, ``CREATE INDEX
    CONCURRENTLY`` waits for every statement in the database whose snapshot is older than its
    own, and the waiter waits for the builder's lock, a deadlock. Bounded by
    ``locks.run_wait_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + locks.run_wait_s
    while True:
        with wrap_errors():
            if await conn.fetchval(_TRY_LOCK_SQL):
                return
        if loop.time() >= deadline:
            raise MigrationError(
                f"another instance's migration run has held the lock for over "
                f"{locks.run_wait_s:g} s"
            )
        await asyncio.sleep(random.uniform(locks.run_poll_s / 2, locks.run_poll_s))


async def apply_migrations(
    dsn: str,
    *,
    numbered: Sequence[Migration] | None = None,
    repeatable: Sequence[Repeatable] | None = None,
    locks: LockPolicy = DEFAULT_LOCKS,
) -> list[int]:
    """Bring the database to this code's schema; returns the numbered versions applied.

    ``numbered`` and ``repeatable`` default to the service's files (:func:`migrations`,
    :func:`repeatables`); tests pass sets of their own, run by the same code."""
    code = migrations() if numbered is None else tuple(numbered)
    files = repeatables() if repeatable is None else tuple(repeatable)
    with wrap_errors():
        conn = await asyncpg.connect(
            dsn, timeout=CONNECT_TIMEOUT_S, server_settings={"application_name": "aq-migrate"}
        )
    try:
        await _take_run_lock(conn, locks)
        try:
            with wrap_errors():
                await _set_lock_timeout(conn, locks.lock_timeout_s)
                await conn.execute(_CREATE_HISTORY)
                await conn.execute(_CREATE_REPEATABLES)
                steps = plan(await _history(conn), code)
                for migration in steps.migrations:
                    await _apply_migration(conn, migration, locks)
                if not steps.repeatables_allowed:
                    log.warning(
                        "the database is ahead of this code: functions and triggers left as "
                        "they are",
                        extra={"action": "migrate"},
                    )
                    return [m.version for m in steps.migrations]
                recorded = await _recorded(conn)
                for file in files:
                    if recorded.get(file.name) != file.checksum:
                        await _apply_repeatable(conn, file, locks)
            return [m.version for m in steps.migrations]
        finally:
            with contextlib.suppress(Exception):
                await conn.execute(_UNLOCK_SQL)
    finally:
        await conn.close()
