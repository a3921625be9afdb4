"""The SQL beside the code: named queries, frozen migrations, the database in the present tense."""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from pathlib import Path

import pytest
from analysis_queue.store.sqlfiles import (
    migrations,
    parse_queries,
    queries,
    repeatables,
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
CREATE_VIEW = re.compile(r"^CREATE\s+(OR\s+REPLACE\s+)?VIEW\s+", re.MULTILINE | re.IGNORECASE)


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


def test_every_function_and_trigger_is_defined_once_and_re_applies() -> None:
    functions: Counter[str] = Counter()
    triggers: Counter[str] = Counter()
    for repeatable in repeatables():
        for match in CREATE_FUNCTION.finditer(repeatable.sql):
            assert match.group(1), f"{repeatable.name}: {match.group(2)} is not OR REPLACE"
            functions[match.group(2)] += 1
        for match in CREATE_TRIGGER.finditer(repeatable.sql):
            assert match.group(1), f"{repeatable.name}: {match.group(2)} is not OR REPLACE"
            triggers[match.group(2)] += 1
    assert {"aq_lock_user_v1", "aq_admit_v2", "aq_finish_v2", "aq_job_event_v2"} <= set(functions)
    assert [name for name, n in functions.items() if n > 1] == []
    assert [name for name, n in triggers.items() if n > 1] == []
    assert len(triggers) == 4
    # Functions come before the triggers that call them.
    names = [r.name for r in repeatables()]
    assert names == sorted(names, key=lambda n: (not n.startswith("functions/"), n))


def test_no_sql_outside_the_three_places() -> None:
    """SQL the service runs is in sql/migrations, sql/functions, triggers or sql/queries.sql."""
    places = {"migrations", "functions", "queries.sql"}
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
    function = re.search(
        r"CREATE OR REPLACE FUNCTION aq_lock_user_v1\(.*?\$\$(.*?)\$\$", text, flags=re.DOTALL
    )
    assert function is not None
    assert "'analysis_queue:'" in function.group(1)
    assert function.start(1) < hits[0][1] < function.end(1)
