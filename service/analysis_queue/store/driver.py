"""The driver's ground rules, in one place: how a connection is set up, and which driver errors
become which domain errors (:func:`wrap_errors`). Every module of ``store`` talks to asyncpg
through these; nothing outside ``store`` imports asyncpg.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import asyncpg
import orjson

from analysis_queue import errors

log = logging.getLogger(__name__)

LOCK_TIMEOUT_MS = 10_000
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
            raise errors.DatabaseUnavailable() from exc
        raise
    except _UNAVAILABLE as exc:
        if isinstance(exc, asyncpg.InternalClientError):
            # Seen after a backend is terminated mid-query, but also what a client-side bug
            # looks like: keep the evidence.
            log.warning("driver internal error", exc_info=exc)
        raise errors.DatabaseUnavailable() from exc


def _jsonb_encode(value: Any) -> bytes:
    return b"\x01" + orjson.dumps(value)  # jsonb's binary format: version 1, then the text


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


def server_settings(application_name: str) -> dict[str, str]:
    return {
        "application_name": application_name[:63],
        # Bounds every lock wait, the advisory user lock included (55P03 -> 503).
        "lock_timeout": str(LOCK_TIMEOUT_MS),
        "idle_in_transaction_session_timeout": "60000",
    }
