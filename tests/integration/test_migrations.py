"""Migrations on a real PostgreSQL: a fresh install and an upgrade from the previous release end
in the same catalog, repeatables follow their files, and nothing is applied twice.

The previous release (0.1, schema version 11) wrote its history migration by migration; its
files are kept as they were released in tests/fixtures/release_0011/, and ``_install_0_1``
applies them the way its runner did (each in a transaction, recorded with its checksum).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from analysis_queue.store.migrate import DatabaseTooOld, apply_migrations
from analysis_queue.store.schema import render, schema_file
from analysis_queue.store.sqlfiles import migrations, repeatables
from support import check_invariants, database_name, with_database

RELEASE_0_1 = Path(__file__).resolve().parents[1] / "fixtures" / "release_0011"
THESIS = '{"title": "On locks", "document_url": "https://uni.example/locks.pdf"}'

CATALOG = {
    "tables": """
        SELECT table_name, table_type FROM information_schema.tables
         WHERE table_schema = 'public' ORDER BY 1""",
    "columns": """
        SELECT table_name, column_name, ordinal_position, data_type, udt_name, is_nullable,
               column_default
          FROM information_schema.columns
         WHERE table_schema = 'public' ORDER BY 1, 3""",
    "indexes": """
        SELECT tablename, indexname, indexdef FROM pg_indexes
         WHERE schemaname = 'public' ORDER BY 1, 2""",
    "constraints": """
        SELECT c.conrelid::regclass::text, c.conname, pg_get_constraintdef(c.oid)
          FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace
         WHERE n.nspname = 'public' ORDER BY 1, 2""",
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid),
               pg_get_function_result(p.oid), md5(p.prosrc), l.lanname, p.provolatile,
               p.proconfig
          FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
          JOIN pg_language l ON l.oid = p.prolang
         WHERE n.nspname = 'public' ORDER BY 1, 2""",
    "triggers": """
        SELECT t.tgrelid::regclass::text, t.tgname, pg_get_triggerdef(t.oid)
          FROM pg_trigger t WHERE NOT t.tgisinternal ORDER BY 1, 2""",
    "views": """
        SELECT viewname, md5(definition) FROM pg_views WHERE schemaname = 'public' ORDER BY 1""",
    "sequences": """
        SELECT sequencename, data_type, start_value, increment_by FROM pg_sequences
         WHERE schemaname = 'public' ORDER BY 1""",
    "data": "SELECT id, global_max_running FROM queue_settings",
    "repeatables": "SELECT name, checksum FROM aq_schema_repeatables ORDER BY 1",
    "schema_version": "SELECT max(version) FROM aq_schema_migrations",
}


async def _catalog(dsn: str) -> dict[str, list[tuple[Any, ...]]]:
    c = await asyncpg.connect(dsn)
    try:
        return {k: [tuple(r) for r in await c.fetch(sql)] for k, sql in CATALOG.items()}
    finally:
        await c.close()


async def _install_0_1(dsn: str, *, upto: int = 11) -> None:
    """The database as release 0.1's runner left it at schema version ``upto``."""
    c = await asyncpg.connect(dsn)
    try:
        await c.execute(
            """CREATE TABLE aq_schema_migrations (
                   version integer PRIMARY KEY,
                   name text NOT NULL,
                   checksum text NOT NULL,
                   applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"""
        )
        for path in sorted(RELEASE_0_1.glob("*.sql")):
            match = re.fullmatch(r"(\d{4})_([a-z0-9_]+)\.sql", path.name)
            assert match is not None
            if int(match.group(1)) > upto:
                break
            sql = path.read_text()
            async with c.transaction():
                await c.execute(sql)
                await c.execute(
                    "INSERT INTO aq_schema_migrations (version, name, checksum)"
                    " VALUES ($1, $2, $3)",
                    int(match.group(1)),
                    match.group(2),
                    hashlib.sha256(sql.encode()).hexdigest(),
                )
    finally:
        await c.close()


async def _fetch(dsn: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    c = await asyncpg.connect(dsn)
    try:
        return list(await c.fetch(sql, *args))
    finally:
        await c.close()


def test_the_previous_release_is_kept_as_it_was_released() -> None:
    """Checksums of release 0.1's migration files as its databases recorded them: the upgrade
    test is only worth something against exactly those texts."""
    sums = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:12]
        for p in sorted(RELEASE_0_1.glob("*.sql"))
    }
    assert sums == {
        "0001_schema.sql": "71d13f08ddaa",
        "0002_queue_functions.sql": "98c37185fbe0",
        "0003_job_notify_v1.sql": "f12462bd31f1",
        "0004_job_events.sql": "c05523e3a138",
        "0005_job_events_v1.sql": "0c1e90f2b10e",
        "0006_running_quiet_index.sql": "0d58b75dbe23",
        "0007_job_notify_v2.sql": "c2df30c7bcd0",
        "0008_provider_ceiling.sql": "82d3631c5311",
        "0009_job_waiting_events.sql": "16cb5d8d330e",
        "0010_plpgsql_slot_lookup.sql": "c2be5af331d9",
        "0011_batched_dispatch.sql": "b4be2c7e6447",
    }


async def test_the_schema_file_is_what_a_fresh_migrate_makes(database_url: str) -> None:
    """sql/schema.sql, the tables and indexes in the present tense, is the test database's
    schema (a fresh migrate, the session's template) as ``render`` writes it: a migration
    that lands without ``make schema`` fails here."""
    c = await asyncpg.connect(database_url)
    try:
        rendered = await render(c)
    finally:
        await c.close()
    assert "CREATE TABLE analysis_jobs (" in rendered
    assert "CREATE UNIQUE INDEX analysis_jobs_user_slot ON" in rendered
    assert rendered == schema_file().read_text(), "sql/schema.sql is stale: run make schema"


async def test_a_fresh_install_and_an_upgrade_end_in_the_same_catalog(
    empty_database: str, pg_server: str, database_url: str
) -> None:
    fresh = empty_database
    assert await apply_migrations(fresh) == [m.version for m in migrations()]

    upgraded = with_database(database_url, f"aq_up_{uuid.uuid4().hex[:12]}")
    admin = await asyncpg.connect(pg_server)
    await admin.execute(f"CREATE DATABASE {database_name(upgraded)}")
    try:
        await _install_0_1(upgraded)
        before = await _fetch(upgraded, CATALOG["functions"])
        applied = await apply_migrations(upgraded)
        assert applied == [m.version for m in migrations() if not m.is_baseline]
        assert await apply_migrations(upgraded) == [], "a second run does nothing"

        a, b, template = (
            await _catalog(fresh),
            await _catalog(upgraded),
            await _catalog(database_url),
        )
        for key in CATALOG:
            assert a[key] == b[key], key
            assert a[key] == template[key], key
        # The upgrade did something: 0.1's unused trigger functions are gone, the new entry
        # points are there, 0.1's are kept for its instances during the deploy.
        names_before = {row[0] for row in before}
        names_after = {row[0] for row in a["functions"]}
        assert {"aq_job_notify_v1", "aq_job_event_v1"} <= names_before - names_after
        assert {
            "aq_admit_v3",
            "aq_finish_v3",
            "aq_promote_v4",
            "aq_promote_woken_v2",
        } <= names_after
        assert {"aq_admit_v1", "aq_finish_v1", "aq_promote_v2"} <= names_before & names_after
        assert {name for name, *_ in a["repeatables"]} == {r.name for r in repeatables()}
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {database_name(upgraded)} WITH (FORCE)")
        await admin.close()


async def test_an_upgrade_keeps_the_queue_and_serves_both_releases(empty_database: str) -> None:
    """Jobs admitted under 0.1 survive the upgrade; afterwards an instance of either release can
    finish one and promote the next (0.1 calls aq_finish_v1, this release aq_finish_v3)."""
    dsn = empty_database
    await _install_0_1(dsn)
    c = await asyncpg.connect(dsn)
    try:
        await c.execute("SELECT aq_credit_grant_v1('u', 3, 'test')")
        jobs = []
        for _ in range(3):
            run_id, job_id = uuid.uuid4(), uuid.uuid4()
            await c.execute(
                "SELECT * FROM aq_reserve_v1('u', $1, $2, 1, $3::jsonb, '[]', NULL, NULL)",
                run_id,
                job_id,
                THESIS,
            )
            row = await c.fetchrow(
                "SELECT (r.job).status FROM aq_admit_v1($1, 'u', $2, $3, $4::jsonb, '[]', 1,"
                " NULL, NULL, NULL) r",
                job_id,
                run_id,
                f"core-{job_id}",
                THESIS,
            )
            jobs.append((job_id, row["status"]))
        assert [status for _, status in jobs] == ["pending", "queued", "queued"]
    finally:
        await c.close()

    await apply_migrations(dsn)
    c = await asyncpg.connect(dsn)
    try:
        # An instance of 0.1, mid-deploy: its finish promotes the next job, as it did.
        old = await c.fetchrow(
            "SELECT (f.promoted).id AS promoted, f.changed FROM aq_finish_v1($1, NULL, NULL,"
            " 'succeeded', '{pending,running}', false, NULL, NULL, NULL, true) f",
            jobs[0][0],
        )
        assert (old["changed"], old["promoted"]) == (True, jobs[1][0])
        # This release: the same, and it says every job it promoted and whether it refunded.
        new = await c.fetchrow(
            "SELECT f.changed, f.refunded, (SELECT array_agg(p.id) FROM unnest(f.promoted) p)"
            " AS promoted FROM aq_finish_v3($1::jsonb, NULL, NULL) f",
            json.dumps(
                [
                    {
                        "item": 0,
                        "job_id": str(jobs[1][0]),
                        "status": "failed",
                        "from": ["pending", "running"],
                        "error_code": "analysis_failed",
                        "ran": True,
                    }
                ]
            ),
        )
        assert (new["changed"], new["refunded"], new["promoted"]) == (True, True, [jobs[2][0]])
    finally:
        await c.close()
    await check_invariants(dsn)


async def test_a_history_older_than_the_baseline_is_refused(empty_database: str) -> None:
    await _install_0_1(empty_database, upto=8)
    with pytest.raises(DatabaseTooOld):
        await apply_migrations(empty_database)


async def test_a_changed_repeatable_is_applied_again(database_url: str) -> None:
    """A function edited by hand (or by an older build) is put back by the next start."""
    c = await asyncpg.connect(database_url)
    try:
        await c.execute(
            "CREATE OR REPLACE FUNCTION aq_user_limit_v1(p_user_id text) RETURNS integer"
            " LANGUAGE sql STABLE AS $$ SELECT 42 $$"
        )
        await c.execute(
            "UPDATE aq_schema_repeatables SET checksum = 'stale' WHERE name = 'functions/slots.sql'"
        )
        assert await c.fetchval("SELECT aq_user_limit_v1('x')") == 42
        await apply_migrations(database_url)
        assert await c.fetchval("SELECT aq_user_limit_v1('x')") == 1
        recorded = await c.fetchval(
            "SELECT checksum FROM aq_schema_repeatables WHERE name = 'functions/slots.sql'"
        )
    finally:
        await c.close()
    assert recorded == next(r.checksum for r in repeatables() if r.name == "functions/slots.sql")


async def test_an_older_instance_does_not_put_its_function_bodies_back(database_url: str) -> None:
    """The database knows a migration this code does not (a newer release applied it): this
    code is an older instance restarting mid-deploy and leaves functions and triggers alone."""
    c = await asyncpg.connect(database_url)
    try:
        await c.execute(
            "INSERT INTO aq_schema_migrations (version, name, checksum)"
            " VALUES (9999, 'from_a_newer_release', 'x')"
        )
        await c.execute(
            "UPDATE aq_schema_repeatables SET checksum = 'newer' WHERE name = 'functions/slots.sql'"
        )
        assert await apply_migrations(database_url) == []
        assert (
            await c.fetchval(
                "SELECT checksum FROM aq_schema_repeatables WHERE name = 'functions/slots.sql'"
            )
            == "newer"
        )
    finally:
        await c.close()


async def test_concurrent_migrations_apply_each_version_once(empty_database: str) -> None:
    versions = [m.version for m in migrations()]
    runs = await asyncio.gather(*(apply_migrations(empty_database) for _ in range(4)))
    applied = sorted(v for run in runs for v in run)
    assert applied == versions, runs
    assert sorted(len(run) for run in runs) == [0, 0, 0, len(versions)]
    rows = await _fetch(
        empty_database, "SELECT version, count(*) AS n FROM aq_schema_migrations GROUP BY version"
    )
    assert {r["version"]: r["n"] for r in rows} == dict.fromkeys(versions, 1)
    assert await apply_migrations(empty_database) == []
