"""Writes ``sql/schema.sql`` (``make schema``): a scratch database migrated from nothing and
rendered by ``store/schema.py``.

    python -m analysis_queue.dev.schema_file [DSN]

DSN is a server to make the scratch database on (``AQ_TEST_DATABASE_URL`` when omitted, else
the embedded server)."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import asyncpg

from analysis_queue.dev.embedded import start_embedded
from analysis_queue.dev.scratch import scratch_database
from analysis_queue.store.migrate import apply_migrations
from analysis_queue.store.schema import render, schema_file


async def render_fresh(server_dsn: str) -> str:
    """Migrate a scratch database on ``server_dsn``'s server from nothing and render it."""
    async with scratch_database(server_dsn, "aq_schema") as dsn:
        await apply_migrations(dsn)
        conn: asyncpg.Connection[Any] = await asyncpg.connect(dsn)
        try:
            return await render(conn)
        finally:
            await conn.close()


def main(argv: list[str]) -> int:
    dsn = argv[1] if len(argv) > 1 else os.environ.get("AQ_TEST_DATABASE_URL")
    with tempfile.TemporaryDirectory(prefix="aq-schema-") as tmp:
        if not dsn:
            dsn = start_embedded(Path(tmp), keep=False)
        text = asyncio.run(render_fresh(dsn))
    schema_file().write_text(text)
    print(f"wrote {schema_file()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
