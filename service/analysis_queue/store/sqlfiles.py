"""Finds and loads the SQL that lives beside the code: migrations, repeatables, named queries.

- ``sql/migrations/NNNN_name.sql``: numbered migrations (tables, indexes, data), each applied
  once and frozen once it lands; ``NNNN_baseline.sql`` stands in, for an empty database, for
  the history up to its number.
- ``sql/functions/*.sql`` and ``triggers/*.sql``: *repeatable* files, every function, trigger
  function and trigger in the present tense, re-applied whenever their text changes.
- ``sql/queries.sql``: the named queries of ``store/database.py``.

In a checkout (and an editable install) the files are the repository's ``sql/`` and
``triggers/``; a built wheel carries them inside the package as ``analysis_queue/_sql`` and
``analysis_queue/_triggers``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # analysis_queue/
_REPOSITORY_DIR = _PACKAGE_DIR.parents[1]  # a checkout keeps the package in service/
_QUERY_HEADER = re.compile(r"^-- ([a-z][a-z0-9_]*) --$", re.MULTILINE)
_MIGRATION_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_REPEATABLE_NAME = re.compile(r"^[a-z][a-z0-9_]*\.sql$")
BASELINE_NAME = "baseline"


def sql_dir(name: str) -> Path:
    """The directory ``sql`` or ``triggers``, wherever this install keeps it."""
    for candidate in (_PACKAGE_DIR / f"_{name}", _REPOSITORY_DIR / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"SQL directory {name!r} not found beside {_PACKAGE_DIR}")


def _checksum(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Migration:
    """A numbered migration: applied once, in version order, and never edited after."""

    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        """Recorded when applied: an applied migration must never change (add a new one)."""
        return _checksum(self.sql)

    @property
    def is_baseline(self) -> bool:
        """The history up to this version in one file, for an empty database only."""
        return self.name == BASELINE_NAME

    @property
    def file_name(self) -> str:
        return f"{self.version:04d}_{self.name}.sql"


@dataclass(frozen=True)
class Repeatable:
    """A file of functions and triggers, re-applied whenever its text changes."""

    name: str  # "functions/locks.sql", "triggers/job_notify.sql"
    sql: str

    @property
    def checksum(self) -> str:
        return _checksum(self.sql)


def parse_queries(text: str) -> dict[str, str]:
    """Split a named-queries file into ``{name: sql}``."""
    parts = _QUERY_HEADER.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"query {name!r} defined twice")
        lines = [line for line in body.strip().splitlines() if not line.startswith("--")]
        queries[name] = "\n".join(lines).strip().rstrip(";")
    return queries


@cache
def queries() -> dict[str, str]:
    return parse_queries((sql_dir("sql") / "queries.sql").read_text())


@cache
def migrations() -> tuple[Migration, ...]:
    """The numbered migrations of ``sql/migrations``, in version order; at most one baseline,
    which comes first."""
    found: dict[int, Migration] = {}
    for path in sorted((sql_dir("sql") / "migrations").glob("*.sql")):
        match = _MIGRATION_NAME.match(path.name)
        if match is None:
            raise ValueError(f"not a migration file name (NNNN_name.sql): {path.name}")
        version = int(match.group(1))
        if version in found:
            raise ValueError(f"two migrations numbered {version}: {path.name}")
        found[version] = Migration(version, match.group(2), path.read_text())
    ordered = tuple(found[v] for v in sorted(found))
    baselines = [m for m in ordered if m.is_baseline]
    if len(baselines) > 1 or (baselines and baselines[0] is not ordered[0]):
        raise ValueError("a baseline must be the first migration, and there is at most one")
    return ordered


@cache
def repeatables() -> tuple[Repeatable, ...]:
    """The functions (``sql/functions``), then the triggers that call them (``triggers``), each
    directory in file-name order."""
    found: list[Repeatable] = []
    for directory, label in (
        (sql_dir("sql") / "functions", "functions"),
        (sql_dir("triggers"), "triggers"),
    ):
        for path in sorted(directory.glob("*.sql")):
            if _REPEATABLE_NAME.match(path.name) is None:
                raise ValueError(f"not a repeatable file name (name.sql): {label}/{path.name}")
            found.append(Repeatable(f"{label}/{path.name}", path.read_text()))
    return tuple(found)
