"""The driver's ground rules per pooler: what a pooled connection sends at startup, whether it
caches statements, and which refusal means "this is a pooler" (against a real PgBouncer:
tests/integration/test_pgbouncer.py)."""

from __future__ import annotations

import asyncpg
from analysis_queue.config import Pooler
from analysis_queue.store.driver import (
    LOCK_TIMEOUT_MS,
    server_settings,
    startup_refusal,
    statement_cache_size,
)


def test_directly_the_session_carries_the_bounds() -> None:
    assert server_settings("analysis-queue a") == {
        "application_name": "analysis-queue a",
        "lock_timeout": str(LOCK_TIMEOUT_MS),
        "idle_in_transaction_session_timeout": "60000",
    }
    assert statement_cache_size(Pooler.NONE) > 0


def test_behind_a_transaction_pooler_only_what_it_tracks() -> None:
    name = "analysis-queue " + "x" * 80
    assert server_settings(name, Pooler.TRANSACTION) == {"application_name": name[:63]}
    assert statement_cache_size(Pooler.TRANSACTION) == 0


def test_pgbouncers_refusal_of_a_startup_parameter_is_recognised() -> None:
    refused = asyncpg.ProtocolViolationError("unsupported startup parameter: lock_timeout")
    assert startup_refusal(refused)
    assert not startup_refusal(asyncpg.ProtocolViolationError("server conn crashed?"))
    assert not startup_refusal(OSError("connection refused"))
    assert not startup_refusal(None)
