"""When the promoter asks the database to fill slots, and how it folds requests meanwhile.

The database is a stand-in that records each call and answers with the ceiling it is told to
report; what a promotion decides is tested against PostgreSQL in tests/integration. The
follow-up is the real one, bound to a recording dispatcher.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from uuid import UUID

from analysis_queue.loops.promote import PASS_BATCH, WAKE_CONCURRENCY, Promoter
from analysis_queue.metrics import Metrics
from analysis_queue.models import Job, JobStatus, Woken
from analysis_queue.queue.followup import FollowUp, Trigger
from analysis_queue.store.database import Claim
from support import make_job


def _job(user: str = "someone") -> Job:
    return make_job(user_id=user, status=JobStatus.PENDING, queue_position=None)


class RecordingDatabase:
    """Answers promotion calls; ``batches`` are how many jobs successive calls promote."""

    def __init__(self, ceiling: int | None) -> None:
        self.ceiling = ceiling
        self.calls: list[tuple[str, list[str]]] = []
        self.claims: list[Claim | None] = []  # the claim each promotion call was given
        self.gate = asyncio.Event()
        self.gate.set()
        self.batches: list[int] = []
        self.unreleased: list[Job] = []

    def _promoted(self, limit: int) -> list[Job]:
        n = self.batches.pop(0) if self.batches else 0
        return [_job() for _ in range(min(n, limit))]

    async def promote(
        self, user_ids: Sequence[str], limit: int, claim: Claim | None = None
    ) -> tuple[int | None, list[Job]]:
        self.calls.append(("promote", list(user_ids)))
        self.claims.append(claim)
        await self.gate.wait()
        return self.ceiling, self._promoted(limit)

    async def promote_woken(
        self, user_ids: Sequence[str], limit: int, claim: Claim | None = None
    ) -> Woken:
        self.calls.append(("woken", list(user_ids)))
        self.claims.append(claim)
        await self.gate.wait()
        unreleased, self.unreleased = tuple(self.unreleased), []
        return Woken(self.ceiling, tuple(self._promoted(limit)), unreleased)

    async def set_user_limit(self, user_id: str, max_running: int | None) -> list[Job]:
        self.calls.append(("limit", [user_id]))
        return self._promoted(100)


class RecordingDispatcher:
    def __init__(self) -> None:
        self.submitted: list[UUID] = []

    def release(self, job: Job) -> None:
        self.submitted.append(job.id)


def _promoter(db: RecordingDatabase) -> tuple[Promoter, RecordingDispatcher, Metrics]:
    metrics = Metrics()
    followup = FollowUp(metrics)
    promoter = Promoter(db, followup)
    dispatcher = RecordingDispatcher()
    followup.bind(releases=dispatcher, passes=promoter)
    return promoter, dispatcher, metrics


async def _settle(promoter: Promoter) -> None:
    for _ in range(100):
        await asyncio.sleep(0)
    await promoter.stop()


def _promotions(metrics: Metrics, trigger: Trigger) -> float:
    value = metrics.registry.get_sample_value("aq_promotions_total", {"trigger": trigger})
    return value or 0.0


async def test_wake_ups_of_one_turn_go_out_as_one_call_and_later_ones_as_the_next() -> None:
    db = RecordingDatabase(ceiling=None)
    promoter, _, _ = _promoter(db)
    db.gate.clear()
    promoter.wake("b")
    promoter.wake("a")
    promoter.wake("b")
    await asyncio.sleep(0)  # the first call is in flight
    promoter.wake("c")
    promoter.wake("a")
    promoter.wake("c")
    db.gate.set()
    await _settle(promoter)
    assert db.calls == [("woken", ["a", "b"]), ("woken", ["a", "c"])]
    assert promoter.wake_calls == 2


async def test_what_a_wake_up_finds_is_counted_once_and_released() -> None:
    db = RecordingDatabase(ceiling=None)
    db.batches = [2]
    stranded = _job()
    db.unreleased = [stranded]
    promoter, dispatcher, metrics = _promoter(db)
    promoter.wake("a")
    await _settle(promoter)
    assert len(dispatcher.submitted) == 3 and stranded.id in dispatcher.submitted
    assert _promotions(metrics, Trigger.NOTIFY) == 2, "a job found pending is not a promotion"
    assert promoter.promotions == 2


async def test_a_wake_up_that_fills_a_whole_batch_asks_for_a_pass() -> None:
    db = RecordingDatabase(ceiling=40)
    db.batches = [PASS_BATCH, 3]
    promoter, dispatcher, metrics = _promoter(db)
    promoter.wake("a")
    await _settle(promoter)
    assert db.calls == [("woken", ["a"]), ("promote", [])]
    assert promoter.ceiling_on, "learned from the wake-up's answer"
    assert len(dispatcher.submitted) == PASS_BATCH + 3
    assert _promotions(metrics, Trigger.NOTIFY) == PASS_BATCH + 3


async def test_one_pass_at_a_time_and_one_more_for_what_came_meanwhile() -> None:
    db = RecordingDatabase(ceiling=4)
    promoter, _, metrics = _promoter(db)
    promoter.ceiling = 4
    db.gate.clear()
    db.batches = [1, 1]
    promoter.pass_soon(Trigger.ADMIT, "c")
    await asyncio.sleep(0)
    for user in ("b", "a", "b"):  # three requests during the pass: one more, users re-derived
        promoter.pass_soon(Trigger.CANCEL, user)
    promoter.pass_soon(Trigger.CANCEL)
    db.gate.set()
    await _settle(promoter)
    assert db.calls == [("promote", ["c"]), ("promote", ["a", "b"])]
    assert _promotions(metrics, Trigger.ADMIT) == 2


async def test_a_pass_repeats_while_it_fills_whole_batches() -> None:
    db = RecordingDatabase(ceiling=100)
    db.batches = [PASS_BATCH, PASS_BATCH, 3]
    promoter, dispatcher, metrics = _promoter(db)
    promoter.ceiling = 100
    promoter.pass_soon(Trigger.SWEEP)
    await _settle(promoter)
    assert db.calls == [("promote", []), ("promote", []), ("promote", [])]
    assert len(dispatcher.submitted) == 2 * PASS_BATCH + 3
    assert _promotions(metrics, Trigger.SWEEP) == 2 * PASS_BATCH + 3


async def test_a_limit_change_counts_its_promotions_and_asks_for_a_pass_with_the_ceiling_on() -> (
    None
):
    for ceiling, calls in ((None, [("limit", ["u"])]), (3, [("limit", ["u"]), ("promote", [])])):
        db = RecordingDatabase(ceiling=ceiling)
        db.batches = [2]
        promoter, dispatcher, metrics = _promoter(db)
        promoter.ceiling = ceiling
        await promoter.set_user_limit("u", 3)
        await _settle(promoter)
        assert db.calls == calls
        assert len(dispatcher.submitted) == 2
        assert _promotions(metrics, Trigger.LIMIT) == 2


async def test_wake_up_calls_in_flight_are_bounded() -> None:
    db = RecordingDatabase(ceiling=None)
    promoter, _, _ = _promoter(db)
    db.gate.clear()
    for n in range(WAKE_CONCURRENCY + 3):  # one loop turn each: each would be its own call
        promoter.wake(f"user-{n}")
        await asyncio.sleep(0)
    assert len(db.calls) == WAKE_CONCURRENCY
    db.gate.set()
    await _settle(promoter)
    woken = sorted(u for _, users in db.calls for u in users)
    assert woken == sorted(f"user-{n}" for n in range(WAKE_CONCURRENCY + 3))
    assert len(db.calls) == WAKE_CONCURRENCY + 1, "what waited went out together"


async def test_every_promotion_call_carries_the_instances_claim() -> None:
    """What a pass or a wake-up starts is claimed in its own transaction for this instance."""
    db = RecordingDatabase(ceiling=None)
    metrics = Metrics()
    followup = FollowUp(metrics)
    claim = Claim("inst-a", 30.0)
    promoter = Promoter(db, followup, claim=claim)
    followup.bind(releases=RecordingDispatcher(), passes=promoter)
    await promoter.run_pass(Trigger.SWEEP)
    promoter.wake("alice")
    await _settle(promoter)
    assert [name for name, _ in db.calls] == ["promote", "woken"]
    assert db.claims == [claim, claim]
