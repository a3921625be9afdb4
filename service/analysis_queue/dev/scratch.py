"""A throwaway database on a server: the demo's own, so that it can share the development server
with a running ``analysis-queue dev`` without taking (or giving) a single job."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from analysis_queue.store.driver import CONNECT_TIMEOUT_S, wrap_errors


def with_database(dsn: str, name: str) -> str:
    """The same server and credentials, another database."""
    return urlunsplit(urlsplit(dsn)._replace(path="/" + name))


async def _admin(dsn: str, sql: str) -> None:
    with wrap_errors():
        conn: asyncpg.Connection[Any] = await asyncpg.connect(dsn, timeout=CONNECT_TIMEOUT_S)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()


@contextlib.asynccontextmanager
async def scratch_database(dsn: str, prefix: str) -> AsyncIterator[str]:
    """Create an empty database ``<prefix>_<random>`` next to ``dsn``'s, yield its DSN, and drop
    it (with whatever is still connected to it) on the way out."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    await _admin(dsn, f'CREATE DATABASE "{name}"')
    try:
        yield with_database(dsn, name)
    finally:
        await _admin(dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
