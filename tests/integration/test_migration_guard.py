"""An applied migration is frozen: a changed one stops the start instead of diverging."""

from __future__ import annotations

import asyncpg
import pytest
from analysis_queue.store.database import Database, MigrationChanged, apply_migrations


async def test_changed_migration_refuses_to_start(database_url: str) -> None:
    db = await Database.connect(database_url, min_size=1, max_size=1)
    try:
        assert await db.pending_migrations() == []
        conn = await asyncpg.connect(database_url)
        try:
            await conn.execute(
                "UPDATE aq_schema_migrations SET checksum = 'edited' WHERE version = 2"
            )
        finally:
            await conn.close()
        assert await db.pending_migrations() == [2]
        with pytest.raises(MigrationChanged):
            await apply_migrations(database_url)
    finally:
        await db.close()
