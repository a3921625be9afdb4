"""The online-migration rule, checked on the files (docs/operations.md, "Online migrations"):
a numbered migration builds an index on a table that already exists only ``CONCURRENTLY``, in a
no-transaction migration. A plain ``CREATE INDEX`` holds SHARE on the table for the whole build
(every INSERT and UPDATE of the running instances waits), and ``lock_timeout`` does not help:
the lock is granted at once, it is the build that is long.

A table created in the same file is empty and nobody writes it yet, so its indexes are built
plainly (the baseline's are)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from analysis_queue.store.sqlfiles import (
    Migration,
    index_builds,
    load_migrations,
    migrations,
    split_statements,
    sql_code,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
_NAME = r'(?:"(?:[^"]|"")+"|[A-Za-z_][\w$]*)(?:\.(?:"(?:[^"]|"")+"|[A-Za-z_][\w$]*))?'
CREATE_TABLE = re.compile(
    rf"\bCREATE\s+(?:UNLOGGED\s+)?TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?({_NAME})", re.IGNORECASE
)
ALTER_TABLE = re.compile(
    rf"^\s*ALTER\s+TABLE\s+(?:IF\s+EXISTS\s+)?(?:ONLY\s+)?({_NAME})", re.IGNORECASE
)
# An ALTER TABLE that builds an index: a new UNIQUE, PRIMARY KEY or EXCLUDE constraint, unless
# it adopts an index built beforehand (USING INDEX).
BUILDS_A_CONSTRAINT_INDEX = re.compile(r"\b(UNIQUE|PRIMARY\s+KEY|EXCLUDE)\b", re.IGNORECASE)
USING_INDEX = re.compile(r"\bUSING\s+INDEX\b", re.IGNORECASE)
PLAIN_REINDEX = re.compile(r"^\s*REINDEX\b(?!.*\bCONCURRENTLY\b)", re.IGNORECASE | re.DOTALL)


def _table(name: str) -> str:
    """A table's name as the rule compares it: unqualified (one schema), case-folded."""
    last = name.rsplit(".", 1)[-1]
    return last[1:-1].replace('""', '"') if last.startswith('"') else last.lower()


def offline_index_builds(migration: Migration) -> list[str]:
    """Where the migration would build an index on an existing table while writers wait."""
    where = migration.file_name
    code = sql_code(migration.sql)
    new_tables = {_table(m.group(1)) for m in CREATE_TABLE.finditer(code)}
    problems = []
    for build in index_builds(migration.sql):
        if _table(build.table) in new_tables:
            continue
        if not build.concurrently:
            problems.append(f"{where}: index {build.name} on {build.table} without CONCURRENTLY")
        elif not migration.no_transaction:
            problems.append(f"{where}: CONCURRENTLY, but the migration runs in a transaction")
    for statement in split_statements(code):
        alter = ALTER_TABLE.match(statement)
        if alter is not None and _table(alter.group(1)) not in new_tables:
            if BUILDS_A_CONSTRAINT_INDEX.search(statement) and not USING_INDEX.search(statement):
                problems.append(
                    f"{where}: a constraint on {alter.group(1)} builds its index under an ACCESS"
                    " EXCLUSIVE lock: build it CONCURRENTLY first, then ADD ... USING INDEX"
                )
        if PLAIN_REINDEX.match(statement):
            problems.append(f"{where}: REINDEX without CONCURRENTLY")
    return problems


ONLINE = load_migrations(FIXTURES / "online_migrations")
OFFLINE = load_migrations(FIXTURES / "offline_migrations")


@pytest.mark.parametrize("migration", migrations() + ONLINE, ids=lambda m: m.file_name)
def test_every_migration_builds_indexes_on_live_tables_concurrently(migration: Migration) -> None:
    """The service's migrations (the baseline's indexes are on tables it creates) and the
    test-only ones that tests/integration/test_online_migrations.py runs on a live queue."""
    assert offline_index_builds(migration) == []


def _m(sql: str) -> Migration:
    return Migration(13, "x", sql)


@pytest.mark.parametrize(
    ("migration", "problem"),
    [
        (OFFLINE[0], "analysis_jobs_thesis_search on analysis_jobs without CONCURRENTLY"),
        (_m("CREATE UNIQUE INDEX i ON public.analysis_jobs (run_id);"), "without CONCURRENTLY"),
        # Loading refuses this one already (sqlfiles.check_migration); the rule says it too.
        (_m("CREATE INDEX CONCURRENTLY IF NOT EXISTS i ON t (x);"), "runs in a transaction"),
        (_m("ALTER TABLE credit_ledger ADD CONSTRAINT u UNIQUE (note);"), "USING INDEX"),
        (_m("ALTER TABLE t ADD COLUMN id bigint PRIMARY KEY;"), "ACCESS EXCLUSIVE"),
        (_m("REINDEX INDEX analysis_jobs_active;"), "REINDEX without CONCURRENTLY"),
    ],
)
def test_the_rule_catches_an_index_built_under_a_writers_lock(
    migration: Migration, problem: str
) -> None:
    problems = offline_index_builds(migration)
    assert len(problems) == 1 and problem in problems[0], problems


@pytest.mark.parametrize(
    "sql",
    [
        "-- aq:no-transaction\nCREATE INDEX CONCURRENTLY IF NOT EXISTS i ON analysis_jobs (x);",
        "CREATE TABLE notes (id int, body text);\nCREATE INDEX notes_body ON notes (body);",
        "-- CREATE INDEX i ON analysis_jobs (x);\nSELECT 'CREATE INDEX j ON t (x)';",
        "ALTER TABLE t ADD CONSTRAINT t_u UNIQUE USING INDEX t_u_idx;",
        "ALTER TABLE t ADD COLUMN c text;",
        "-- aq:no-transaction\nREINDEX INDEX CONCURRENTLY analysis_jobs_active;",
    ],
)
def test_the_rule_lets_online_changes_through(sql: str) -> None:
    assert offline_index_builds(_m(sql)) == []
