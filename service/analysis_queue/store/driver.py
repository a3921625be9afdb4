"""The driver's ground rules, in one place: how a connection is set up, and which driver errors
become which domain errors (:func:`wrap_errors`). Every module of ``store`` talks to asyncpg
through these; nothing outside ``store`` imports asyncpg.

Behind a transaction-pooling PgBouncer (``Pooler.TRANSACTION``) a pooled connection is a session
only for one transaction, so it may rely on nothing a session keeps: no startup parameter but
``application_name`` (PgBouncer refuses the others), no named prepared statement (PgBouncer 1.18
does not track them), no server process of its own. Each lock wait is bounded by the SQL
function that waits (``SET lock_timeout`` in its definition), whichever way it was reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import asyncpg
import orjson

from analysis_queue import errors
from analysis_queue.config import Pooler

log = logging.getLogger(__name__)

# The bound of every lock wait. Declared on each SQL function the queries call (`SET
# lock_timeout = '10s'`: the one place it holds through a transaction pooler; a test checks the
# two agree) and sent as a startup parameter on direct connections, where it also bounds the
# plain statements of queries.sql.
LOCK_TIMEOUT_MS = 10_000
IDLE_IN_TRANSACTION_TIMEOUT_MS = 60_000
CONNECT_TIMEOUT_S = 5.0  # a host that drops packets must not hold a start for a minute

# Errors that mean "the database is not there right now": a retry or a 503, never a 500.
_UNAVAILABLE = (
    OSError,
    asyncio.TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    asyncpg.LockNotAvailableError,
    asyncpg.TooManyConnectionsError,
    asyncpg.QueryCanceledError,
)

# The connection died under the statement, or the pool handed out one that had: another
# connection may well succeed at once.
_LOST = (
    ConnectionResetError,
    BrokenPipeError,
    asyncpg.ConnectionDoesNotExistError,
    asyncpg.AdminShutdownError,  # pg_terminate_backend, a restarting server
    asyncpg.InterfaceError,  # "connection is closed"
    asyncpg.InternalClientError,  # "cannot switch to state 12": terminated mid-query
)


@contextlib.contextmanager
def wrap_errors() -> Iterator[None]:
    """Translate driver errors into the service's error hierarchy."""
    try:
        yield
    except asyncpg.PostgresError as exc:
        code = getattr(exc, "sqlstate", None)
        if code == "AQ402":
            raise errors.InsufficientCredits() from exc
        if code == "AQ410":
            raise errors.CoreUnavailable("The admission timed out; try again.") from exc
        if isinstance(exc, _UNAVAILABLE):
            unavailable = errors.DatabaseUnavailable()
            # The server answered with an error (its backend terminated included): it rolled
            # back. A connection that failed under the statement leaves its outcome unknown.
            unavailable.nothing_written = not isinstance(exc, asyncpg.PostgresConnectionError)
            unavailable.connection_lost = isinstance(exc, _LOST)
            raise unavailable from exc
        raise
    except _UNAVAILABLE as exc:
        if isinstance(exc, asyncpg.InternalClientError):
            # Seen after a backend is terminated mid-query, but also what a client-side bug
            # looks like: keep the evidence.
            log.warning("driver internal error", exc_info=exc)
        unavailable = errors.DatabaseUnavailable()
        unavailable.connection_lost = isinstance(exc, _LOST)
        raise unavailable from exc


def _json_default(value: Any) -> str:
    # The driver's own UUID (a job id read back from a row) is a uuid.UUID that orjson does
    # not recognise as one: a batch's items carry ids of both kinds.
    if isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


def _jsonb_encode(value: Any) -> bytes:
    # jsonb's binary format: version 1, then the text
    return b"\x01" + orjson.dumps(value, default=_json_default)


def _jsonb_decode(data: bytes) -> Any:
    return orjson.loads(data[1:])


async def init_connection(conn: asyncpg.Connection[Any]) -> None:
    # Binary codecs: composite results (a function returning an analysis_jobs row) can only
    # be decoded when every field type has a binary codec.
    await conn.set_type_codec(
        "jsonb", encoder=_jsonb_encode, decoder=_jsonb_decode, schema="pg_catalog", format="binary"
    )
    await conn.set_type_codec(
        "json", encoder=orjson.dumps, decoder=orjson.loads, schema="pg_catalog", format="binary"
    )


async def keep_session(_conn: asyncpg.Connection[Any]) -> None:
    """Pool release without the default reset query (``UNLISTEN *``, ``pg_advisory_unlock_all``
    ...): a round trip per release, for session state this service never leaves on pooled
    connections (the lock is transaction-scoped, LISTEN has its own connection). asyncpg still
    rolls back a connection released inside a transaction."""


class StartupParametersRefused(RuntimeError):
    """The server refused a startup parameter: a connection pooler that takes none but
    ``application_name`` (PgBouncer), reached without ``AQ_DATABASE_POOLER=transaction``."""


def startup_refusal(exc: BaseException | None) -> bool:
    """``exc`` is PgBouncer's answer to a startup parameter it does not track (08P01)."""
    return isinstance(exc, asyncpg.ProtocolViolationError) and "startup parameter" in str(exc)


def server_settings(application_name: str, pooler: Pooler = Pooler.NONE) -> dict[str, str]:
    """The startup parameters of a pooled connection."""
    settings = {"application_name": application_name[:63]}
    if pooler is Pooler.NONE:
        # Bounds every lock wait of this session, the plain statements' included (55P03 ->
        # 503); behind a transaction pooler the functions' own SET clauses do it for theirs.
        settings["lock_timeout"] = str(LOCK_TIMEOUT_MS)
        settings["idle_in_transaction_session_timeout"] = str(IDLE_IN_TRANSACTION_TIMEOUT_MS)
    return settings


def statement_cache_size(pooler: Pooler) -> int:
    """asyncpg's prepared statement cache per connection. Off behind a transaction pooler: a
    named statement lives on the server process that prepared it, and the next transaction may
    run on another one (PgBouncer < 1.21). asyncpg then uses the unnamed statement and re-sends
    its Parse with every Bind, in the Sync that executes it: one transaction, one server."""
    return 0 if pooler is Pooler.TRANSACTION else 100  # asyncpg's default


async def through_proxy(conn: asyncpg.Connection[Any]) -> bool:
    """Whether a proxy sits between ``conn`` and PostgreSQL: a pooler hands its clients a
    cancel key of its own, so the server process it names is not the one that answers."""
    return bool(conn.get_server_pid() != await conn.fetchval("SELECT pg_backend_pid()"))
