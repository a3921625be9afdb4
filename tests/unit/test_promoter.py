"""When the promoter asks the database to fill slots, and how it folds requests meanwhile.

The database is a stand-in that records each call and answers with the ceiling it is told to
report; what a promotion decides is tested against PostgreSQL in tests/integration.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, cast
from uuid import UUID

from analysis_queue.metrics import Metrics
from analysis_queue.models import Job
from analysis_queue.queue.dispatch import Dispatcher
from analysis_queue.queue.promote import PASS_BATCH, Promoter
from analysis_queue.store.database import Database


class RecordingDatabase:
    def __init__(self, ceiling: int | None) -> None:
        self.ceiling = ceiling
        self.calls: list[list[str]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.batches: list[int] = []  # jobs to "promote" on successive calls

    async def promote(self, user_ids: Sequence[str], limit: int) -> tuple[int | None, list[Job]]:
        self.calls.append(list(user_ids))
        await self.gate.wait()
        n = self.batches.pop(0) if self.batches else 0
        return self.ceiling, [cast(Job, _FakeJob()) for _ in range(min(n, limit))]


class _FakeJob:
    id = UUID(int=1)
    user_id = "someone"


class RecordingDispatcher:
    def __init__(self) -> None:
        self.metrics = Metrics()
        self.submitted: list[UUID] = []

    def submit(self, job_id: UUID, *, hint: bool = False) -> None:
        self.submitted.append(job_id)


def _promoter(db: RecordingDatabase) -> tuple[Promoter, RecordingDispatcher]:
    dispatcher = RecordingDispatcher()
    promoter = Promoter(cast(Database, db), cast(Dispatcher, cast(Any, dispatcher)))
    return promoter, dispatcher


async def _settle(promoter: Promoter) -> None:
    for _ in range(100):
        await asyncio.sleep(0)
    await promoter.stop()


async def test_ceiling_off_promotes_each_freed_user_and_folds_repeats() -> None:
    db = RecordingDatabase(ceiling=None)
    promoter, _ = _promoter(db)
    db.gate.clear()
    promoter.slot_freed("a")
    promoter.slot_freed("b")
    await asyncio.sleep(0)
    promoter.slot_freed("a")  # while a's call is in flight: one more call for a, not two
    promoter.slot_freed("a")
    db.gate.set()
    await _settle(promoter)
    assert sorted(map(tuple, db.calls)) == [("a",), ("a",), ("b",)]


async def test_ceiling_on_runs_one_pass_at_a_time_and_one_more_for_what_came_meanwhile() -> None:
    db = RecordingDatabase(ceiling=4)
    promoter, _ = _promoter(db)
    promoter.ceiling = 4
    db.gate.clear()
    promoter.slot_freed("c")
    await asyncio.sleep(0)
    for user in ("b", "a", "b"):  # three frees during the pass: one more pass, users re-derived
        promoter.slot_freed(user)
    promoter.pass_soon()
    db.gate.set()
    await _settle(promoter)
    assert db.calls == [["c"], ["a", "b"]]


async def test_a_pass_repeats_while_it_fills_whole_batches() -> None:
    db = RecordingDatabase(ceiling=100)
    db.batches = [PASS_BATCH, PASS_BATCH, 3]
    promoter, dispatcher = _promoter(db)
    promoter.ceiling = 100
    promoter.pass_soon()
    await _settle(promoter)
    assert db.calls == [[], [], []]
    assert len(dispatcher.submitted) == 2 * PASS_BATCH + 3


async def test_a_user_promotion_that_learns_the_ceiling_is_on_turns_into_a_pass() -> None:
    db = RecordingDatabase(ceiling=2)  # the promoter still believes it is off
    promoter, _ = _promoter(db)
    db.gate.clear()
    promoter.slot_freed("a")
    await asyncio.sleep(0)
    promoter.slot_freed("a")  # folded into a re-run, which now sees the ceiling
    db.gate.set()
    await _settle(promoter)
    assert promoter.ceiling_on
    assert db.calls == [["a"], ["a"]]  # the user's call, then a pass re-deriving the user
