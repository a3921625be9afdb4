"""Schema migrations: numbered files once each, then the repeatable functions and triggers.

A run (at every start, and ``analysis-queue migrate``) holds a session advisory lock, so
instances that start together apply each file once: the second waits, then finds nothing to do.

1. **Numbered** (``sql/migrations/NNNN_name.sql``): tables, columns, indexes and data, applied
   in version order, each in its own transaction, recorded in ``aq_schema_migrations`` with a
   checksum. An applied one never changes: a changed text stops the start (add a new one). An
   empty database gets the baseline file instead of the history it stands for; a database with
   history older than the baseline is refused (upgrade through the release that wrote it).
2. **Repeatable** (``sql/functions/*.sql``, then ``triggers/*.sql``): every function, trigger
   function and trigger, in the present tense, re-applied whenever a file's text differs from
   what ``aq_schema_repeatables`` records (``CREATE OR REPLACE``). An instance that finds a
   numbered migration it does not know leaves them alone: it is an older one restarting during a
   rolling deploy, and must not put its old function bodies back.

How to change the schema, and the versioning rule for rolling deploys: docs/operations.md.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from analysis_queue.store.driver import CONNECT_TIMEOUT_S, wrap_errors
from analysis_queue.store.sqlfiles import Migration, Repeatable, migrations, repeatables

log = logging.getLogger(__name__)

# A key of its own for the migration run (not a queue lock: docs/locking.md). Session-level,
# on a dedicated connection.
_LOCK_SQL = "SELECT pg_advisory_lock(hashtextextended('analysis_queue_migrations', 0))"
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


class MigrationError(RuntimeError):
    """The database's schema cannot be brought to this code's."""


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


async def _apply_migration(conn: asyncpg.Connection[Any], migration: Migration) -> None:
    async with conn.transaction():
        await conn.execute(migration.sql)
        await conn.execute(
            "INSERT INTO aq_schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
            migration.version,
            migration.name,
            migration.checksum,
        )
    log.info(
        "migration applied",
        extra={"action": "migrate", "version": migration.version, "migration": migration.name},
    )


async def _apply_repeatable(conn: asyncpg.Connection[Any], repeatable: Repeatable) -> None:
    async with conn.transaction():
        await conn.execute(repeatable.sql)
        await conn.execute(
            """INSERT INTO aq_schema_repeatables (name, checksum) VALUES ($1, $2)
               ON CONFLICT (name) DO UPDATE
                   SET checksum = EXCLUDED.checksum, applied_at = clock_timestamp()""",
            repeatable.name,
            repeatable.checksum,
        )
    log.info("repeatable applied", extra={"action": "migrate", "repeatable": repeatable.name})


async def apply_migrations(dsn: str) -> list[int]:
    """Bring the database to this code's schema; returns the numbered versions applied."""
    with wrap_errors():
        conn = await asyncpg.connect(
            dsn, timeout=CONNECT_TIMEOUT_S, server_settings={"application_name": "aq-migrate"}
        )
    try:
        with wrap_errors():
            await conn.execute(_LOCK_SQL)
        try:
            with wrap_errors():
                await conn.execute(_CREATE_HISTORY)
                await conn.execute(_CREATE_REPEATABLES)
                steps = plan(await _history(conn), migrations())
                for migration in steps.migrations:
                    await _apply_migration(conn, migration)
                if not steps.repeatables_allowed:
                    log.warning(
                        "the database is ahead of this code: functions and triggers left as "
                        "they are",
                        extra={"action": "migrate"},
                    )
                    return [m.version for m in steps.migrations]
                recorded = await _recorded(conn)
                for repeatable in repeatables():
                    if recorded.get(repeatable.name) != repeatable.checksum:
                        await _apply_repeatable(conn, repeatable)
            return [m.version for m in steps.migrations]
        finally:
            with contextlib.suppress(Exception):
                await conn.execute(_UNLOCK_SQL)
    finally:
        await conn.close()
