"""A backend terminated under a request (pg_terminate_backend, a failover) costs no request
whose statement is safe to repeat: the statement is sent once more on another connection
(store/database.py, SAFE_TO_REPEAT)."""

from __future__ import annotations

import asyncio
from collections import Counter

import asyncpg
from support import Harness


async def test_backends_terminated_under_reads_and_reservations_cost_no_request(
    harness: Harness,
) -> None:
    """Readers page their jobs and read their credits while, twelve times, a statement of the
    instance's pool is terminated as it runs: no answer is a 5xx, and statements were really
    cut under requests."""
    h = harness
    instance = await h.start_instance()
    app_name = instance.services.db.application_name
    users = [f"reader-{n}" for n in range(8)]
    for user in users:
        await h.grant(user, 5)
        assert (await h.admit(user, 1))[0] == 201
    statuses: Counter[int] = Counter()
    stop = asyncio.Event()

    async def reader(user: str) -> None:
        paths = ["/v1/credits", "/v1/analyses", "/v1/analyses?limit=1"]
        n = 0
        while not stop.is_set():
            path = paths[n % len(paths)]
            n += 1
            async with h.http.get(f"{instance.base_url}{path}", headers=h.auth(user)) as r:
                await r.read()
                statuses[r.status] += 1

    killer_conn = await asyncpg.connect(h.database_url)
    terminated = 0
    try:
        readers = [asyncio.create_task(reader(u)) for u in users for _ in range(3)]
        # One backend at a time, well apart: a request's second try lands between two.
        for _ in range(12):
            await asyncio.sleep(0.4)
            for _ in range(500):  # until one statement is caught running (about a second)
                cut = await killer_conn.fetchval(
                    """SELECT count(pg_terminate_backend(pid)) FROM (
                           SELECT pid FROM pg_stat_activity
                            WHERE datname = current_database() AND application_name = $1
                              AND state = 'active' AND pid <> pg_backend_pid()
                            LIMIT 1) s""",
                    app_name,
                )
                if cut:
                    terminated += cut
                    break
        stop.set()
        await asyncio.gather(*readers)
    finally:
        stop.set()
        await killer_conn.close()
    assert terminated >= 8, f"only {terminated} statements were cut: the test proved nothing"
    assert sum(statuses.values()) > 100
    assert set(statuses) == {200}, (statuses, terminated)
