"""What a migration run does to a database with a given history (the plan, without a database;
tests/integration/test_migrations.py runs it on PostgreSQL)."""

from __future__ import annotations

import pytest
from analysis_queue.store.migrate import (
    Applied,
    DatabaseTooOld,
    MigrationChanged,
    plan,
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
