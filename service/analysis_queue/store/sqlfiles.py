"""Finds and loads the SQL that lives beside the code: migrations, repeatables, named queries.

- ``sql/migrations/NNNN_name.sql``: numbered migrations (tables, indexes, data), each applied
  once and frozen once it lands; ``NNNN_baseline.sql`` stands in, for an empty database, for
  the history up to its number. A migration's opening comment may hold directives, one a line:
  ``-- aq:no-transaction`` runs it outside a transaction, one statement at a time (for
  ``CREATE INDEX CONCURRENTLY``; docs/operations.md, "Online migrations").
- ``sql/functions/*.sql``, ``sql/previous_release/*.sql`` and ``triggers/*.sql``: *repeatable*
  files, every function, trigger function and trigger in the present tense, re-applied
  whenever their text changes.
- ``sql/queries.sql``: the named queries of ``store/database.py``.

In a checkout (and an editable install) the files are the repository's ``sql/`` and
``triggers/``; a built wheel carries them inside the package as ``analysis_queue/_sql`` and
``analysis_queue/_triggers``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # analysis_queue/
_REPOSITORY_DIR = _PACKAGE_DIR.parents[1]  # a checkout keeps the package in service/
_QUERY_HEADER = re.compile(r"^-- ([a-z][a-z0-9_]*) --$", re.MULTILINE)
_MIGRATION_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_REPEATABLE_NAME = re.compile(r"^[a-z][a-z0-9_]*\.sql$")
BASELINE_NAME = "baseline"
NO_TRANSACTION = "no-transaction"
_DIRECTIVES = frozenset({NO_TRANSACTION})
_DIRECTIVE = re.compile(r"^--\s*aq:(\S*)\s*$")
_NAME = r'(?:"(?:[^"]|"")+"|[A-Za-z_][\w$]*)'
_INDEX_BUILD = re.compile(
    rf"\bCREATE\s+(?P<unique>UNIQUE\s+)?INDEX\s+(?P<concurrently>CONCURRENTLY\s+)?"
    rf"(?P<if_not_exists>IF\s+NOT\s+EXISTS\s+)?(?:(?P<name>{_NAME}(?:\.{_NAME})?)\s+)?"
    rf"ON\s+(?:ONLY\s+)?(?P<table>{_NAME}(?:\.{_NAME})?)",
    re.IGNORECASE,
)
_CONCURRENTLY = re.compile(r"\bCONCURRENTLY\b", re.IGNORECASE)


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

    @property
    def directives(self) -> frozenset[str]:
        """The ``-- aq:`` lines of the opening comment (ValueError for one it does not know)."""
        return parse_directives(self.sql)

    @property
    def no_transaction(self) -> bool:
        """Run outside a transaction, one statement at a time (``-- aq:no-transaction``)."""
        return NO_TRANSACTION in self.directives

    @property
    def statements(self) -> list[str]:
        return split_statements(self.sql)


@dataclass(frozen=True)
class Repeatable:
    """A file of functions and triggers, re-applied whenever its text changes."""

    name: str  # "functions/locks.sql", "triggers/job_notify.sql"
    sql: str

    @property
    def checksum(self) -> str:
        return _checksum(self.sql)


def parse_directives(text: str) -> frozenset[str]:
    """The ``-- aq:name`` lines of a migration's opening comment (the lines before its first
    statement). One it does not know, or one after the first statement, is a ValueError: a
    misspelled ``no-transaction`` must not quietly run the file in a transaction."""
    found: set[str] = set()
    in_header = True
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped and not stripped.startswith("--"):
            in_header = False
        match = _DIRECTIVE.match(stripped)
        if match is None:
            continue
        if not in_header:
            raise ValueError(f"line {number}: an aq: directive belongs in the opening comment")
        if match.group(1) not in _DIRECTIVES:
            known = ", ".join(sorted(_DIRECTIVES))
            raise ValueError(f"line {number}: unknown directive {stripped!r} (known: {known})")
        found.add(match.group(1))
    return frozenset(found)


def _scan(sql: str) -> Iterator[tuple[str, str]]:
    """SQL text as ``(kind, text)`` pieces, kind ``code``, ``string`` (quoted, dollar-quoted,
    or a quoted identifier) or ``comment``: just enough lexing to find where statements end and
    which keywords are SQL, not a parser."""
    i, start = 0, 0
    while i < len(sql):
        token = _token_at(sql, i)
        if token is None:
            i += 1
            continue
        kind, end = token
        if start < i:
            yield "code", sql[start:i]
        yield kind, sql[i:end]
        i = start = end
    if start < len(sql):
        yield "code", sql[start:]


def _token_at(sql: str, i: int) -> tuple[str, int] | None:
    """The comment or string that starts at ``i`` (its kind and end), or None."""
    if sql.startswith("--", i):
        newline = sql.find("\n", i)
        return "comment", len(sql) if newline < 0 else newline
    if sql.startswith("/*", i):
        return "comment", _block_comment_end(sql, i)
    if sql[i] in "'\"":
        # E'...' takes backslash escapes; standard strings (the default) do not.
        escapes = sql[i] == "'" and i > 0 and sql[i - 1] in "eE" and not _ident_at(sql, i - 2)
        return "string", _quoted_end(sql, i, escapes)
    if sql[i] == "$" and not _ident_at(sql, i - 1):
        tag = re.match(r"\$(?:[A-Za-z_][A-Za-z0-9_]*)?\$", sql[i:])
        if tag is not None:  # not $1, a parameter
            close = sql.find(tag.group(0), i + len(tag.group(0)))
            return "string", len(sql) if close < 0 else close + len(tag.group(0))
    return None


def _block_comment_end(sql: str, i: int) -> int:
    depth, j = 1, i + 2  # block comments nest in PostgreSQL
    while j < len(sql) and depth:
        if sql.startswith("/*", j):
            depth, j = depth + 1, j + 2
        elif sql.startswith("*/", j):
            depth, j = depth - 1, j + 2
        else:
            j += 1
    return j


def _quoted_end(sql: str, i: int, escapes: bool) -> int:
    quote, j = sql[i], i + 1
    while j < len(sql):
        if escapes and sql[j] == "\\":
            j += 2
        elif sql.startswith(quote * 2, j):
            j += 2
        elif sql[j] == quote:
            return j + 1
        else:
            j += 1
    return len(sql)


def _ident_at(sql: str, i: int) -> bool:
    return i >= 0 and (sql[i].isalnum() or sql[i] in "_$")


def split_statements(sql: str) -> list[str]:
    """The statements of a file, each with the comments before it, without the ``;``. A file
    sent whole is one implicit transaction in PostgreSQL, where ``CREATE INDEX CONCURRENTLY``
    is refused: a no-transaction migration runs these one at a time."""
    statements: list[str] = []
    current: list[str] = []
    has_code = False
    for kind, text in _scan(sql):
        if kind != "code":
            current.append(text)
            has_code = has_code or kind == "string"
            continue
        *ended, rest = text.split(";")
        for piece in ended:
            current.append(piece)
            if has_code or piece.strip():
                statements.append("".join(current).strip())
            current, has_code = [], False
        current.append(rest)
        has_code = has_code or bool(rest.strip())
    if has_code:
        statements.append("".join(current).strip())
    return statements


def sql_code(sql: str) -> str:
    """The SQL without its comments, and with every string literal emptied: what keyword checks
    read, so that a comment or a string that mentions ``CONCURRENTLY`` does not count."""
    parts = []
    for kind, text in _scan(sql):
        if kind == "code" or (kind == "string" and text.startswith('"')):
            parts.append(text)
        else:
            parts.append(" " if kind == "comment" else "''")
    return "".join(parts)


@dataclass(frozen=True)
class IndexBuild:
    """A ``CREATE INDEX`` statement, as far as the migration runner and its rules need it."""

    name: str | None  # as written (maybe quoted or schema-qualified); None: PostgreSQL names it
    table: str
    unique: bool
    concurrently: bool
    if_not_exists: bool


def index_builds(sql: str) -> list[IndexBuild]:
    """Every ``CREATE INDEX`` in the SQL, comments and strings aside."""
    return [
        IndexBuild(
            name=m.group("name"),
            table=m.group("table"),
            unique=bool(m.group("unique")),
            concurrently=bool(m.group("concurrently")),
            if_not_exists=bool(m.group("if_not_exists")),
        )
        for m in _INDEX_BUILD.finditer(sql_code(sql))
    ]


def check_migration(migration: Migration) -> None:
    """What the runner relies on, checked when the files are loaded (ValueError naming the file).

    A no-transaction migration runs again from its first statement after a failure, so every
    index it builds says ``IF NOT EXISTS`` and has a name (by which the runner finds and drops
    the invalid index a failed ``CONCURRENTLY`` build leaves behind). ``CONCURRENTLY`` in a
    migration that runs in a transaction would fail on the server; it fails here first."""
    where = migration.file_name
    try:
        no_transaction = migration.no_transaction
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    code = sql_code(migration.sql)
    if not no_transaction:
        if _CONCURRENTLY.search(code):
            raise ValueError(
                f"{where}: CONCURRENTLY cannot run inside a transaction; "
                "add '-- aq:no-transaction' to its opening comment"
            )
        return
    for build in index_builds(migration.sql):
        if build.name is None or not build.if_not_exists:
            raise ValueError(
                f"{where}: a no-transaction migration runs again after a failure: write "
                f"CREATE INDEX CONCURRENTLY IF NOT EXISTS <name> ON {build.table} ..."
            )


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
    return load_migrations(sql_dir("sql") / "migrations")


def load_migrations(directory: Path) -> tuple[Migration, ...]:
    """The numbered migrations of a directory, in version order, each checked
    (:func:`check_migration`); at most one baseline, which comes first. The service's are
    :func:`migrations`; tests load sets of their own through the same code."""
    found: dict[int, Migration] = {}
    for path in sorted(directory.glob("*.sql")):
        match = _MIGRATION_NAME.match(path.name)
        if match is None:
            raise ValueError(f"not a migration file name (NNNN_name.sql): {path.name}")
        version = int(match.group(1))
        if version in found:
            raise ValueError(f"two migrations numbered {version}: {path.name}")
        found[version] = Migration(version, match.group(2), path.read_text())
        check_migration(found[version])
    ordered = tuple(found[v] for v in sorted(found))
    baselines = [m for m in ordered if m.is_baseline]
    if len(baselines) > 1 or (baselines and baselines[0] is not ordered[0]):
        raise ValueError("a baseline must be the first migration, and there is at most one")
    return ordered


@cache
def repeatables() -> tuple[Repeatable, ...]:
    """The functions (``sql/functions``), then the previous release's entry points, which call
    them (``sql/previous_release``), then the triggers (``triggers``), each directory in
    file-name order."""
    found: list[Repeatable] = []
    for directory, label in (
        (sql_dir("sql") / "functions", "functions"),
        (sql_dir("sql") / "previous_release", "previous_release"),
        (sql_dir("triggers"), "triggers"),
    ):
        for path in sorted(directory.glob("*.sql")):
            if _REPEATABLE_NAME.match(path.name) is None:
                raise ValueError(f"not a repeatable file name (name.sql): {label}/{path.name}")
            found.append(Repeatable(f"{label}/{path.name}", path.read_text()))
    return tuple(found)
