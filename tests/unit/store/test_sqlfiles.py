"""The SQL beside the code: named queries, frozen migrations, the database in the present tense."""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from pathlib import Path

import pytest
from analysis_queue.store.sqlfiles import (
    NO_TRANSACTION,
    IndexBuild,
    index_builds,
    load_migrations,
    migrations,
    parse_directives,
    parse_queries,
    queries,
    repeatables,
    split_statements,
    sql_code,
    sql_dir,
)

REPO = Path(__file__).resolve().parents[3]
PACKAGE = REPO / "service" / "analysis_queue"
CREATE_FUNCTION = re.compile(
    r"^CREATE\s+(OR\s+REPLACE\s+)?FUNCTION\s+([a-z_0-9]+)\s*\(", re.MULTILINE | re.IGNORECASE
)
CREATE_TRIGGER = re.compile(
    r"^CREATE\s+(OR\s+REPLACE\s+)?TRIGGER\s+([a-z_0-9]+)", re.MULTILINE | re.IGNORECASE
)
CREATE_VIEW = re.compile(
    r"^CREATE\s+(OR\s+REPLACE\s+)?VIEW\s+([a-z_0-9]*)", re.MULTILINE | re.IGNORECASE
)


# -- named queries -------------------------------------------------------------------------


def test_parse_queries_names_bodies_and_comments() -> None:
    text = (
        "-- A preamble that is not a query.\n"
        "-- and more of it\n"
        "\n"
        "-- first_one --\n"
        "-- What it does: $1 user.\n"
        "SELECT 1\n"
        "  FROM t;\n"
        "\n"
        "-- second_2 --\n"
        "-- a comment\n"
        "UPDATE t SET x = 1 WHERE y = $1;\n"
        "-- a trailing comment\n"
    )
    assert parse_queries(text) == {
        "first_one": "SELECT 1\n  FROM t",
        "second_2": "UPDATE t SET x = 1 WHERE y = $1",
    }


def test_parse_queries_rejects_a_duplicate_name() -> None:
    text = "-- same --\nSELECT 1;\n\n-- other --\nSELECT 2;\n\n-- same --\nSELECT 3;\n"
    with pytest.raises(ValueError, match="same"):
        parse_queries(text)


def test_every_query_is_used_and_every_query_used_is_defined() -> None:
    source = (PACKAGE / "store" / "database.py").read_text()
    used = set(re.findall(r"self\._(?:fetchrow|fetch|execute)\(\s*\"([a-z0-9_]+)\"", source))
    # Sanity: the scan finds the calls (including ones wrapped over several lines).
    assert {"reserve", "admit", "finish", "promote", "jobs_claim", "credit_grant"} <= used
    defined = queries()
    assert used - defined.keys() == set()
    assert defined.keys() - used == set(), "a named query nobody runs"
    assert all(sql.strip() and not sql.rstrip().endswith(";") for sql in defined.values())


# -- numbered migrations: frozen once they land ----------------------------------------------


def test_migrations_follow_the_baseline_without_gaps() -> None:
    found = migrations()
    assert found[0].is_baseline, "an empty database starts from the baseline"
    versions = [m.version for m in found]
    assert versions == list(range(found[0].version, found[0].version + len(found)))
    assert all(m.sql.strip() for m in found)


def test_every_landed_migration_is_frozen_by_its_checksum() -> None:
    """SHA256SUMS lists each numbered migration as it landed (``sha256sum -c`` reads it too).
    Editing one fails here before any database refuses to start; a new migration is added to
    the list in the commit that lands it."""
    directory = sql_dir("sql") / "migrations"
    listed = {}
    for line in (directory / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        listed[name] = digest
    files = {p.name: p for p in directory.glob("*.sql")}
    assert sorted(listed) == sorted(files), "every migration file is listed, and only those"
    for name, path in files.items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == listed[name], f"{name} changed"
    assert {m.file_name for m in migrations()} == set(files)


def test_numbered_migrations_define_no_function_trigger_or_view() -> None:
    for migration in migrations():
        assert not CREATE_FUNCTION.search(migration.sql), migration.file_name
        assert not CREATE_TRIGGER.search(migration.sql), migration.file_name
        assert not CREATE_VIEW.search(migration.sql), migration.file_name


# -- repeatables: the database in the present tense ------------------------------------------


def test_every_function_trigger_and_view_is_defined_once_and_re_applies() -> None:
    functions: Counter[str] = Counter()
    triggers: Counter[str] = Counter()
    views: Counter[str] = Counter()
    for repeatable in repeatables():
        for match in CREATE_VIEW.finditer(repeatable.sql):
            assert match.group(1), f"{repeatable.name}: {match.group(2)} is not OR REPLACE"
            views[match.group(2)] += 1
        for match in CREATE_FUNCTION.finditer(repeatable.sql):
            assert match.group(1), f"{repeatable.name}: {match.group(2)} is not OR REPLACE"
            functions[match.group(2)] += 1
        for match in CREATE_TRIGGER.finditer(repeatable.sql):
            assert match.group(1), f"{repeatable.name}: {match.group(2)} is not OR REPLACE"
            triggers[match.group(2)] += 1
    assert {"aq_lock_user_v1", "aq_admit_v3", "aq_finish_v3", "aq_job_changes_v1"} <= set(functions)
    assert [name for name, n in functions.items() if n > 1] == []
    assert [name for name, n in triggers.items() if n > 1] == []
    assert views and [name for name, n in views.items() if n > 1] == []
    assert len(triggers) == 2
    # Functions come before the previous release's entry points, which call them, and both
    # before the triggers.
    names = [r.name for r in repeatables()]
    order = ("functions/", "previous_release/", "triggers/")
    assert names == sorted(names, key=lambda n: ([n.startswith(o) for o in order].index(True), n))


FUNCTION_BODY = re.compile(
    r"^CREATE\s+OR\s+REPLACE\s+FUNCTION\s+([a-z_0-9]+)\s*\(.*?\sAS\s+\$(\w*)\$(.*?)\$\2\$",
    re.MULTILINE | re.IGNORECASE | re.DOTALL,
)
LONGEST_BODY = 80


def test_no_function_body_is_longer_than_a_screen() -> None:
    """Each function decides one thing, readable at once: no body of this release's functions
    and triggers over 80 lines (the previous release's entry points are kept as they shipped)."""
    seen: dict[str, int] = {}
    for repeatable in repeatables():
        if repeatable.name.startswith("previous_release/"):
            continue
        for match in FUNCTION_BODY.finditer(repeatable.sql):
            seen[f"{repeatable.name}: {match.group(1)}"] = match.group(3).count("\n")
    assert len(seen) >= 30, "the scan finds the functions"
    assert "triggers/job_events.sql: aq_job_changes_v1" in seen
    assert {name: n for name, n in seen.items() if n > LONGEST_BODY} == {}


def test_no_sql_outside_the_three_places() -> None:
    """SQL the service runs is in sql/migrations, sql/functions, sql/previous_release, triggers
    or sql/queries.sql; beside them sql/schema.sql, which only describes (nothing runs it)."""
    places = {"migrations", "functions", "previous_release", "queries.sql", "schema.sql"}
    assert {p.name for p in sql_dir("sql").iterdir()} == places
    assert all(p.suffix == ".sql" for p in sql_dir("triggers").iterdir())


def test_user_lock_key_is_spelled_once() -> None:
    hits: list[tuple[str, int]] = []
    for top in ("service", "sql", "triggers"):
        for path in sorted((REPO / top).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            text = path.read_bytes().decode("utf-8", errors="replace")
            for match in re.finditer(re.escape("'analysis_queue:'"), text):
                hits.append((str(path.relative_to(REPO)), match.start()))
    assert [name for name, _ in hits] == ["sql/functions/locks.sql"]

    text = (REPO / "sql" / "functions" / "locks.sql").read_text()
    key = re.search(
        r"CREATE OR REPLACE FUNCTION aq_user_lock_key_v1\(.*?\$\$(.*?)\$\$", text, flags=re.DOTALL
    )
    assert key is not None
    assert key.start(1) < hits[0][1] < key.end(1)
    # The function that takes a user's lock computes the key with it; every other takes it
    # through that one.
    for name in ("aq_lock_user_v1",):
        body = re.search(
            rf"CREATE OR REPLACE FUNCTION {name}\(.*?\$\$(.*?)\$\$", text, flags=re.DOTALL
        )
        assert body is not None and "aq_user_lock_key_v1(p_user_id)" in body.group(1), name


# -- directives and statements: what a no-transaction migration runs ------------------------


def test_directives_are_read_from_the_opening_comment() -> None:
    text = "-- 0013_x: what it does\n-- aq:no-transaction\n\nCREATE INDEX CONCURRENTLY ...;\n"
    assert parse_directives(text) == {NO_TRANSACTION}
    assert parse_directives("-- 0013_x\nALTER TABLE t ADD COLUMN c int;\n") == frozenset()


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("-- aq:no-transactions\nSELECT 1;\n", "unknown directive"),
        ("-- aq:\nSELECT 1;\n", "unknown directive"),
        ("SELECT 1;\n-- aq:no-transaction\nSELECT 2;\n", "opening comment"),
    ],
)
def test_a_misspelled_or_misplaced_directive_is_refused(text: str, error: str) -> None:
    """A typo must not quietly run a CONCURRENTLY migration in a transaction (or the reverse)."""
    with pytest.raises(ValueError, match=error):
        parse_directives(text)


def test_the_migrations_released_before_directives_run_in_a_transaction_as_before() -> None:
    released = [m for m in migrations() if m.version <= 12]
    assert [m.version for m in released] == [11, 12]
    assert not any(m.no_transaction for m in released)


def test_statements_split_at_semicolons_outside_strings_and_comments() -> None:
    sql = (
        "-- header; with a semicolon\n"
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS a ON t (x); -- trailing; comment\n"
        "/* block ; /* nested ; */ still */\n"
        "UPDATE t SET s = 'a;b''c' WHERE d = $$x;y$$ AND e = E'\\';' ;\n"
        'SELECT $tag$ ; $$ ; $tag$, "we;ird", $1\n'
        ";\n"
        "-- only a comment at the end;\n"
    )
    assert split_statements(sql) == [
        "-- header; with a semicolon\nCREATE INDEX CONCURRENTLY IF NOT EXISTS a ON t (x)",
        "-- trailing; comment\n/* block ; /* nested ; */ still */\n"
        "UPDATE t SET s = 'a;b''c' WHERE d = $$x;y$$ AND e = E'\\';'",
        'SELECT $tag$ ; $$ ; $tag$, "we;ird", $1',
    ]


def test_the_baseline_splits_into_its_statements() -> None:
    """Its comments hold semicolons too; each statement still starts with its keyword."""
    baseline = migrations()[0]
    ends = [line for line in baseline.sql.splitlines() if re.search(r"^[^-].*;\s*$", line)]
    keywords = [sql_code(s).split()[0] for s in baseline.statements]
    assert len(keywords) == len(ends)
    assert set(keywords) <= {"CREATE", "INSERT", "ALTER"}, keywords


def test_index_builds_are_found_in_code_only() -> None:
    sql = (
        "-- CREATE INDEX commented ON t (x);\n"
        "SELECT 'CREATE INDEX in_a_string ON t (x)';\n"
        "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS public.u ON ONLY s.t (x);\n"
        'CREATE INDEX "Odd ""name""" ON t (y);\n'
        "create index on t (z);\n"
    )
    assert index_builds(sql) == [
        IndexBuild("public.u", "s.t", unique=True, concurrently=True, if_not_exists=True),
        IndexBuild('"Odd ""name"""', "t", unique=False, concurrently=False, if_not_exists=False),
        IndexBuild(None, "t", unique=False, concurrently=False, if_not_exists=False),
    ]


@pytest.mark.parametrize(
    ("sql", "error"),
    [
        # CONCURRENTLY cannot run in a transaction: said at load, not on the server mid-deploy.
        ("CREATE INDEX CONCURRENTLY IF NOT EXISTS i ON t (x);", "aq:no-transaction"),
        # Runs again from the top after a failure: every build must be re-runnable, and named
        # so that an invalid leftover can be found.
        ("-- aq:no-transaction\nCREATE INDEX CONCURRENTLY i ON t (x);", "IF NOT EXISTS"),
        ("-- aq:no-transaction\nCREATE INDEX CONCURRENTLY ON t (x);", "IF NOT EXISTS <name>"),
        ("-- aq:no-transactoin\nSELECT 1;", "unknown directive"),
    ],
)
def test_loading_refuses_a_migration_the_runner_cannot_run_safely(
    tmp_path: Path, sql: str, error: str
) -> None:
    (tmp_path / "0013_bad.sql").write_text(sql)
    with pytest.raises(ValueError, match=f"0013_bad.sql: .*{re.escape(error)}"):
        load_migrations(tmp_path)


def test_a_directive_does_not_change_how_the_checksum_is_taken(tmp_path: Path) -> None:
    text = "-- 0013_x\n-- aq:no-transaction\nCREATE INDEX CONCURRENTLY IF NOT EXISTS i ON t (x);\n"
    (tmp_path / "0013_x.sql").write_text(text)
    (loaded,) = load_migrations(tmp_path)
    assert loaded.no_transaction
    assert loaded.checksum == hashlib.sha256(text.encode()).hexdigest()
