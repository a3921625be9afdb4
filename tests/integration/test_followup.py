"""The follow-up of every committed decision: each promotion is counted exactly once, whichever
path made it (an admit, a completion's tail, a cancel, a change of limit, a notification, a
sweep, a pass), across instances."""

from __future__ import annotations

import asyncio
import random

import pytest
from support import Harness, Instance, check_invariants, fetch, fetchval, wait_for

USERS = [f"mix-{i}" for i in range(6)]
JOBS_PER_USER = 6


def _metric_sum(instances: list[Instance], name: str) -> dict[str, float]:
    """Per label value, summed over the instances: ``{trigger: count}``."""
    totals: dict[str, float] = {}
    for instance in instances:
        for family in instance.services.metrics.registry.collect():
            for sample in family.samples:
                if sample.name == name:
                    label = next(iter(sample.labels.values()))
                    totals[label] = totals.get(label, 0.0) + sample.value
    return totals


async def _open_jobs(h: Harness) -> int:
    return int(
        await fetchval(
            h.database_url,
            "SELECT count(*) FROM analysis_jobs WHERE status IN ('queued','pending','running')",
        )
    )


@pytest.mark.parametrize("ceiling", [0, 3], ids=["ceiling-off", "ceiling-3"])
async def test_every_promotion_is_counted_once_after_a_mixed_run(
    harness: Harness, ceiling: int
) -> None:
    h = harness
    rng = random.Random(1234 + ceiling)
    h.sim.judge_time_s = 0.05
    settings = {
        "global_max_running": ceiling,
        "sweep_interval_s": 0.3,
        "running_quiet_s": 0.2,
    }
    a = await h.start_instance(**settings)
    b = await h.start_instance(**settings)
    for user in USERS:
        await h.grant(user, JOBS_PER_USER)

    admitted: list[tuple[str, str]] = []

    async def clicks(user: str) -> None:
        for n in range(JOBS_PER_USER):
            status, job = await h.admit(user, n, instance=rng.choice((a, b)))
            assert status == 201, job
            admitted.append((user, job["id"]))
            await asyncio.sleep(rng.uniform(0, 0.05))

    async def meddle() -> None:
        for step in range(12):
            await asyncio.sleep(rng.uniform(0.02, 0.1))
            if step == 3:
                h.sim.faults.drop_callbacks = True  # completions now come from the sweep
            if step == 7:
                h.sim.faults.drop_callbacks = False
            if step % 4 == 1:
                await h.set_limit(rng.choice(USERS), rng.choice((2, 3, None)))
            elif admitted:
                user, job_id = rng.choice(admitted)
                async with h.http.delete(
                    f"{rng.choice((a, b)).base_url}/v1/analyses/{job_id}", headers=h.auth(user)
                ) as r:
                    assert r.status in (200, 404, 503), await r.text()

    await asyncio.gather(*(clicks(u) for u in USERS), meddle())
    for user in USERS:
        await h.set_limit(user, None)
    await wait_for(lambda: _no_open_jobs(h), timeout_s=60, what="every job to end")

    promoted_in_db = await fetchval(
        h.database_url, "SELECT count(*) FROM job_events WHERE kind = 'promoted'"
    )
    counted = _metric_sum([a, b], "aq_promotions_total")
    assert sum(counted.values()) == promoted_in_db, counted
    assert promoted_in_db > 0, counted
    if not ceiling:
        assert counted.get("tail", 0) > 0, counted  # completions fill the slot they free

    # Refunds are counted once too, by reason, as the ledger has them.
    refunds = await fetch(
        h.database_url,
        """SELECT j.error_code, count(*) AS n FROM credit_ledger l
             JOIN analysis_jobs j ON j.id = l.job_id
            WHERE l.kind = 'refund' GROUP BY 1""",
    )
    assert _metric_sum([a, b], "aq_refunds_total") == {r["error_code"]: r["n"] for r in refunds}
    await check_invariants(h.database_url)


async def _no_open_jobs(h: Harness) -> bool:
    return await _open_jobs(h) == 0
