"""An applied migration is frozen: a changed one stops the start instead of diverging."""

from __future__ import annotations

import asyncpg
import pytest
from analysis_queue.store.database import Database
from analysis_queue.store.migrate import MigrationChanged, apply_migrations
from analysis_queue.store.sqlfiles import migrations

LATEST = migrations()[-1].version


async def test_changed_migration_refuses_to_start(database_url: str) -> None:
    db = await Database.connect(database_url, min_size=1, max_size=1)
    try:
        assert await db.pending_migrations() == []
        conn = await asyncpg.connect(database_url)
        try:
            await conn.execute(
                "UPDATE aq_schema_migrations SET checksum = 'edited' WHERE version = $1",
                LATEST,
            )
        finally:
            await conn.close()
        assert await db.pending_migrations() == [LATEST]
        with pytest.raises(MigrationChanged):
            await apply_migrations(database_url)
    finally:
        await db.close()
