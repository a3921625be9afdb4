"""Finds and loads the SQL that lives beside the code: migrations, triggers, named queries.

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


def sql_dir(name: str) -> Path:
    """The directory ``sql`` or ``triggers``, wherever this install keeps it."""
    for candidate in (_PACKAGE_DIR / f"_{name}", _REPOSITORY_DIR / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"SQL directory {name!r} not found beside {_PACKAGE_DIR}")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        """Recorded when applied: an applied migration must never change (add a new one)."""
        return hashlib.sha256(self.sql.encode()).hexdigest()


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
    """Numbered migrations from ``sql/`` and ``triggers/``, one sequence across both."""
    found: dict[int, Migration] = {}
    for directory in (sql_dir("sql"), sql_dir("triggers")):
        for path in sorted(directory.glob("*.sql")):
            match = _MIGRATION_NAME.match(path.name)
            if match is None:
                continue
            version = int(match.group(1))
            if version in found:
                raise ValueError(f"two migrations numbered {version}: {path.name}")
            found[version] = Migration(version, match.group(2), path.read_text())
    return tuple(found[v] for v in sorted(found))
