"""Admissions and completions as group commits: the clicks (and Core's reports) that arrive
together share one transaction and one notifying commit, and each is still decided for itself,
in arrival order, by the one function of its decision; a lone click is a batch of one."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from analysis_queue.models import (
    AdmitRequest,
    BatchOutcome,
    CompletionRequest,
    JobStatus,
    ReservationOutcome,
    ReserveRequest,
)
from analysis_queue.store.database import Claim, Database
from support import Harness, check_invariants, fetch, fetchval, wait_for, wait_until_blocked

THESIS = {"title": "Batched", "document_url": "https://uni.example/batched.pdf"}


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    d = await Database.connect(database_url, min_size=1, max_size=4)
    try:
        yield d
    finally:
        await d.close()


def _reserve(user: str, cost: int = 1, key: str | None = None) -> ReserveRequest:
    return ReserveRequest(
        user_id=user,
        run_id=uuid.uuid4(),
        job_id=uuid.uuid4(),
        cost=cost,
        thesis=THESIS,
        sources=["10.1000/x"],
        idempotency_key=key,
        request_hash="h" if key else None,
    )


def _admit(r: ReserveRequest) -> AdmitRequest:
    return AdmitRequest(
        job_id=r.job_id,
        user_id=r.user_id,
        run_id=r.run_id,
        core_run_id=f"core-{r.job_id}",
        thesis=r.thesis,
        sources=r.sources,
        cost=r.cost,
        delta_of=None,
        idempotency_key=r.idempotency_key,
        request_hash=r.request_hash,
    )


async def _reserved(db: Database, requests: list[ReserveRequest]) -> None:
    reservations = await db.reserve_many(requests)
    assert [reservations[r].outcome for r in requests] == [ReservationOutcome.RESERVED] * len(
        requests
    )


async def test_each_click_of_a_batch_is_decided_for_itself_in_arrival_order(
    db: Database, database_url: str
) -> None:
    await db.grant_credits("alice", 2)
    await db.grant_credits("bob", 1)
    clicks = [_reserve("alice"), _reserve("bob"), _reserve("alice"), _reserve("carol")]
    reservations = await db.reserve_many(clicks)
    outcomes = [reservations[c].outcome for c in clicks]
    assert outcomes == ["reserved", "reserved", "reserved", "insufficient_credits"]

    admitted = await db.admit_many([_admit(c) for c in clicks[:3]])
    results = [admitted[a] for a in admitted]
    assert [r.outcome for r in results] == [BatchOutcome.DONE] * 3
    jobs = {a.user_id + str(n): admitted[a].result.job for n, a in enumerate(admitted)}
    # Alice's second click saw her first: queued behind it, first in her queue.
    assert [(j.status, j.queue_position) for j in jobs.values()] == [
        (JobStatus.PENDING, None),
        (JobStatus.PENDING, None),
        (JobStatus.QUEUED, 1),
    ]
    seqs = await fetch(
        database_url, "SELECT user_id, queue_seq FROM analysis_jobs ORDER BY queue_seq"
    )
    assert [r["user_id"] for r in seqs] == ["alice", "bob", "alice"], "arrival order"
    assert await db.balance("alice") == 0 and await db.balance("bob") == 0
    await check_invariants(database_url)


async def test_a_batch_fills_slots_and_counts_positions_as_click_by_click(
    db: Database, database_url: str
) -> None:
    """The admits of a batch are written together, but each click still sees the ones before
    it: a user with two slots gets both, in order, and the next click queues behind the job
    that already waited; every click's events come in admission order, with dense ids."""
    await db.grant_credits("alice", 5)
    await db.grant_credits("bob", 5)
    await db.set_user_limit("alice", 2)
    earlier = _reserve("bob")
    await _reserved(db, [earlier])
    await db.admit_many([_admit(earlier)])  # bob's slot is taken before the batch
    clicks = [_reserve("alice"), _reserve("bob"), _reserve("alice"), _reserve("bob")]
    clicks.append(_reserve("alice"))
    await _reserved(db, clicks)
    admitted = await db.admit_many([_admit(c) for c in clicks])
    jobs = [admitted[a].result.job for a in admitted]
    assert [(j.user_id, j.status, j.queue_position) for j in jobs] == [
        ("alice", JobStatus.PENDING, None),
        ("bob", JobStatus.QUEUED, 1),
        ("alice", JobStatus.PENDING, None),
        ("bob", JobStatus.QUEUED, 2),
        ("alice", JobStatus.QUEUED, 1),
    ]
    slots = await fetch(
        database_url,
        "SELECT user_slot FROM analysis_jobs WHERE user_id = 'alice' ORDER BY queue_seq",
    )
    assert [r["user_slot"] for r in slots] == [1, 2, None]
    events = await fetch(
        database_url,
        """SELECT e.user_id, e.event_id, e.kind, j.queue_seq FROM job_events e
             JOIN analysis_jobs j ON j.id = e.job_id ORDER BY e.user_id, e.event_id""",
    )
    for user, count in (("alice", 3), ("bob", 3)):
        mine = [e for e in events if e["user_id"] == user]
        assert [e["event_id"] for e in mine] == list(range(1, count + 1))
        assert {e["kind"] for e in mine} == {"admitted"}
        assert [e["queue_seq"] for e in mine] == sorted(e["queue_seq"] for e in mine)
    assert await db.balance("alice") == 2 and await db.balance("bob") == 2
    await check_invariants(database_url)


async def test_a_refusal_in_a_batch_rolls_back_nothing_of_its_neighbours(
    db: Database, database_url: str
) -> None:
    await db.grant_credits("alice", 1)
    await db.grant_credits("bob", 1)
    first, second, neighbour = _reserve("alice"), _reserve("alice"), _reserve("bob")
    await _reserved(db, [first, neighbour])
    # A reservation of the previous release's, which held nothing: both of alice's fit her
    # balance when they were made.
    await fetchval(
        database_url,
        "INSERT INTO core_run_reservations (run_id, job_id, user_id, thesis, sources)"
        " VALUES ($1, $2, 'alice', '{}', '[]') RETURNING 1",
        second.run_id,
        second.job_id,
    )
    gone = _reserve("dave")  # its reservation was reclaimed by the sweep meanwhile
    admitted = await db.admit_many([_admit(first), _admit(second), _admit(gone), _admit(neighbour)])
    assert [admitted[a].outcome for a in admitted] == [
        BatchOutcome.DONE,
        BatchOutcome.INSUFFICIENT_CREDITS,  # the first spent her only credit
        BatchOutcome.RESERVATION_GONE,
        BatchOutcome.DONE,
    ]
    assert await fetchval(database_url, "SELECT count(*) FROM analysis_jobs") == 2
    # The refused click's reservation is still there, for its caller to release.
    assert await fetchval(
        database_url, "SELECT count(*) FROM core_run_reservations WHERE run_id = $1", second.run_id
    )
    await check_invariants(database_url)


async def test_an_admit_sent_again_after_it_committed_answers_with_its_jobs(
    db: Database, database_url: str
) -> None:
    """The connection died under a batch of admits after its commit, so it is sent again
    (SAFE_TO_REPEAT): every click is answered with the job it made, where it stands now, and
    nothing is admitted, debited or placed twice."""
    await db.grant_credits("alice", 3)
    await db.grant_credits("bob", 1)
    clicks = [_reserve("alice"), _reserve("bob"), _reserve("alice"), _reserve("alice")]
    await _reserved(db, clicks)
    requests = [_admit(c) for c in clicks]
    first = await db.admit_many(requests)
    again = await db.admit_many(requests)
    assert [again[r].outcome for r in requests] == [BatchOutcome.DONE] * 4
    made = [first[r].result.job for r in requests]
    answered = [again[r].result.job for r in requests]
    assert [j.id for j in answered] == [j.id for j in made]
    assert [(j.status, j.queue_position) for j in answered] == [
        (JobStatus.PENDING, None),
        (JobStatus.PENDING, None),
        (JobStatus.QUEUED, 1),
        (JobStatus.QUEUED, 2),
    ]
    assert all(again[r].result.promoted == () for r in requests)
    assert await fetchval(database_url, "SELECT count(*) FROM analysis_jobs") == 4
    assert (
        await fetchval(database_url, "SELECT count(*) FROM credit_ledger WHERE kind = 'debit'") == 4
    )
    assert await db.balance("alice") == 0 and await db.balance("bob") == 0
    # A click whose reservation the sweep reclaimed, and that made no job, is still refused.
    gone = _admit(_reserve("alice"))
    assert (await db.admit_many([gone]))[gone].outcome is BatchOutcome.RESERVATION_GONE
    await check_invariants(database_url)


async def test_concurrent_clicks_see_each_others_holds_and_a_released_hold_frees_its_credit(
    db: Database, database_url: str
) -> None:
    """A user with 2 credits clicks three times in one batch, then once more: the holds of
    the reservations still in flight count, so only two reach Core; releasing one (Core
    refused it) frees its credit for the next click, once."""
    await db.grant_credits("alice", 2)
    clicks = [_reserve("alice"), _reserve("alice"), _reserve("alice")]
    reservations = await db.reserve_many(clicks)
    assert [reservations[c].outcome for c in clicks] == [
        ReservationOutcome.RESERVED,
        ReservationOutcome.RESERVED,
        ReservationOutcome.INSUFFICIENT_CREDITS,
    ]
    assert reservations[clicks[2]].balance == 0, "nothing left to hold"
    assert await db.credits("alice") == (2, 2), "the balance, both of it held"
    assert (await db.reserve(_reserve("alice"))).outcome is ReservationOutcome.INSUFFICIENT_CREDITS
    await db.release_reservation(clicks[1].run_id)  # Core refused the second
    again = _reserve("alice")
    assert (await db.reserve(again)).outcome is ReservationOutcome.RESERVED
    # The hold becomes the debit: the balance moves once, at the admit.
    assert await db.balance("alice") == 2
    admitted = await db.admit_many([_admit(clicks[0]), _admit(again)])
    assert [admitted[a].outcome for a in admitted] == [BatchOutcome.DONE] * 2
    assert await db.credits("alice") == (0, 0)
    assert await fetchval(database_url, "SELECT count(*) FROM core_run_reservations") == 0
    await check_invariants(database_url)


async def test_a_failed_admit_keeps_its_key_taken_and_gives_its_credit_back(
    db: Database, database_url: str
) -> None:
    """A user with 1 credit: a click whose admit failed (database away) keeps its reservation,
    so its retry is told the key is in progress and Core is not asked again, but its hold is
    released, so a new click can be paid; a click Core did not answer gives its key and its
    credit back, its reservation left to the sweep."""
    await db.grant_credits("bea", 1)
    failed = _reserve("bea", key="bea-1")
    await _reserved(db, [failed])
    assert (await db.reserve(_reserve("bea"))).outcome is ReservationOutcome.INSUFFICIENT_CREDITS
    await db.release_hold(failed.run_id)
    retry = dataclasses.replace(failed, run_id=uuid.uuid4(), job_id=uuid.uuid4())
    assert (await db.reserve(retry)).outcome is ReservationOutcome.IN_PROGRESS
    unanswered = _reserve("bea", key="bea-2")
    await _reserved(db, [unanswered])
    await db.orphan_reservation(unanswered.run_id)
    assert (await db.reserve(dataclasses.replace(unanswered, run_id=uuid.uuid4()))).outcome is (
        ReservationOutcome.RESERVED
    ), "the key and the credit free for the retry"
    held = await fetch(
        database_url,
        "SELECT run_id, cost FROM core_run_reservations WHERE user_id = 'bea' ORDER BY created_at",
    )
    assert [(r["run_id"], r["cost"]) for r in held][:2] == [
        (failed.run_id, 0),
        (unanswered.run_id, 0),
    ], "both left to the sweep, holding nothing"
    assert sum(r["cost"] for r in held) == 1, "the retry holds the one credit"
    await check_invariants(database_url)


async def test_the_sweep_releases_the_hold_of_a_stale_reservation_exactly_once(
    db: Database, database_url: str
) -> None:
    """An admit that died left its reservation holding the user's only credit: the sweep's
    take releases it, and the reservation it puts back (Core could not be told to cancel)
    holds nothing, so the credit is not released twice while the sweep keeps trying."""
    await db.grant_credits("cai", 1)
    stale = _reserve("cai")
    await _reserved(db, [stale])
    assert await db.credits("cai") == (1, 1)
    taken = await db.take_stale_reservations(0, 10)
    assert [r.run_id for r in taken] == [stale.run_id]
    assert await db.credits("cai") == (1, 0), "the hold released with the reservation"
    paid = _reserve("cai")
    await _reserved(db, [paid])  # the freed credit pays the next click
    await db.put_back_reservation(taken[0])
    assert await db.credits("cai") == (1, 1), "the one credit held once, by the new click"
    assert (await db.reserve(_reserve("cai"))).outcome is ReservationOutcome.INSUFFICIENT_CREDITS
    again = await db.take_stale_reservations(0, 10)
    assert {r.run_id for r in again} == {stale.run_id, paid.run_id}
    assert await db.credits("cai") == (1, 0)
    await check_invariants(database_url)


async def test_a_reservation_sent_again_is_answered_again_and_holds_nothing_more(
    db: Database, database_url: str
) -> None:
    """A batch of reservations repeated (its connection died after the commit, before the
    answer): each click reserved the first time is answered reserved again, by its run id,
    keyed or not, and holds its credit once; a click refused the first time is refused again."""
    await db.grant_credits("cy", 2)
    clicks = [_reserve("cy", key="cy-1"), _reserve("cy"), _reserve("cy")]
    first = await db.reserve_many(clicks)
    again = await db.reserve_many(clicks)
    expected = [
        ReservationOutcome.RESERVED,
        ReservationOutcome.RESERVED,
        ReservationOutcome.INSUFFICIENT_CREDITS,
    ]
    assert [first[c].outcome for c in clicks] == expected
    assert [again[c].outcome for c in clicks] == expected
    assert await db.credits("cy") == (2, 2)
    assert await fetchval(database_url, "SELECT count(*) FROM core_run_reservations") == 2
    await check_invariants(database_url)


async def test_a_batch_waits_for_a_busy_users_lock_and_then_decides_every_click(
    db: Database, database_url: str
) -> None:
    """A click whose user's lock another transaction holds is decided in its batch: the batch
    waits for that lock (sorted, bounded by the function's lock_timeout), then decides every
    click in arrival order, the keyed one's reservation included."""
    for user in ("alice", "bob"):
        await db.grant_credits(user, 5)
    clicks = [_reserve("alice"), _reserve("bob"), _reserve("alice", key="k1")]
    holder = await asyncpg.connect(database_url)
    try:
        await holder.execute("BEGIN; SELECT aq_lock_user_v1('alice')")
        reserving = asyncio.create_task(db.reserve_many(clicks))
        await wait_until_blocked(database_url, holder.get_server_pid())
        assert not reserving.done()
        await holder.execute("ROLLBACK")
        reservations = await asyncio.wait_for(reserving, 10)
        assert [reservations[c].outcome for c in clicks] == [ReservationOutcome.RESERVED] * 3
        await holder.execute("BEGIN; SELECT aq_lock_user_v1('alice')")
        admitting = asyncio.create_task(db.admit_many([_admit(c) for c in clicks]))
        await wait_until_blocked(database_url, holder.get_server_pid())
        await holder.execute("ROLLBACK")
        admitted = await asyncio.wait_for(admitting, 10)
    finally:
        await holder.close()
    jobs = [admitted[a].result.job for a in admitted]
    assert [(j.user_id, j.status, j.queue_position) for j in jobs] == [
        ("alice", JobStatus.PENDING, None),
        ("bob", JobStatus.PENDING, None),
        ("alice", JobStatus.QUEUED, 1),
    ]
    await check_invariants(database_url)


async def _users_locked_by(dsn: str, pid: int) -> set[str]:
    rows = await fetch(
        dsn,
        """SELECT u FROM unnest(ARRAY['alice', 'bob', 'carol']) u
            WHERE EXISTS (SELECT 1 FROM pg_locks l
                           WHERE l.pid = $1 AND l.locktype = 'advisory' AND l.granted
                             AND ((l.classid::bigint << 32) | l.objid::bigint)
                                 = aq_user_lock_key_v1(u))""",
        pid,
    )
    return {r["u"] for r in rows}


async def test_a_batch_takes_its_users_locks_in_sorted_order(database_url: str) -> None:
    """aq_lock_users_v1: a batch's users' locks are taken in sorted order, each waited for: the
    batch holds alice's while it waits for bob's, and takes carol's only after bob's."""
    holder = await asyncpg.connect(database_url)
    batch = await asyncpg.connect(database_url)
    try:
        await holder.execute("BEGIN; SELECT aq_lock_user_v1('bob')")
        await batch.execute("BEGIN")
        locking = asyncio.create_task(
            batch.execute("SELECT aq_lock_users_v1(ARRAY['carol', 'bob', 'alice', 'bob'])")
        )
        await wait_until_blocked(database_url, holder.get_server_pid())
        assert await _users_locked_by(database_url, batch.get_server_pid()) == {"alice"}
        await holder.execute("ROLLBACK")
        await asyncio.wait_for(locking, 10)
        assert await _users_locked_by(database_url, batch.get_server_pid()) == {
            "alice",
            "bob",
            "carol",
        }
        await batch.execute("ROLLBACK")
    finally:
        await holder.close()
        await batch.close()


async def test_completions_of_a_batch_each_fill_the_slot_they_free(
    db: Database, database_url: str
) -> None:
    for user in ("alice", "bob"):
        await db.grant_credits(user, 2)
    clicks = [_reserve("alice"), _reserve("bob"), _reserve("alice"), _reserve("bob")]
    await _reserved(db, clicks)
    admitted = await db.admit_many([_admit(c) for c in clicks], Claim("inst-a", 60))
    running = [a for a in admitted if admitted[a].result.job.status is JobStatus.PENDING]
    # What the admits started is claimed, in their transaction, for the instance releasing it.
    assert {admitted[a].result.job.claimed_by for a in running} == {"inst-a"}
    assert len(running) == 2
    done = [
        CompletionRequest(
            core_run_id=a.core_run_id,
            status=JobStatus.SUCCEEDED,
            from_statuses=(JobStatus.PENDING, JobStatus.RUNNING),
            error_code=None,
            error_detail=None,
            verdicts=[{"source": "10.1000/x", "verdict": "supported"}],
            ran=True,
        )
        for a in running
    ]
    unknown = CompletionRequest(
        core_run_id="core-unknown",
        status=JobStatus.SUCCEEDED,
        from_statuses=(JobStatus.PENDING,),
        error_code=None,
        error_detail=None,
        verdicts=None,
        ran=True,
    )
    again = dataclasses.replace(done[0])  # Core reports the same run twice in one batch
    finished = await db.finish_many([*done, unknown, again], Claim("inst-b", 60))
    duplicate = finished[again]
    assert duplicate is not None and not duplicate.changed, "a report changes a job once"
    assert finished[unknown] is None
    for report in done:
        outcome = finished[report]
        assert outcome is not None and outcome.changed
        assert [(j.status, j.claimed_by) for j in outcome.promoted] == [
            (JobStatus.PENDING, "inst-b")
        ]
    statuses = await fetch(
        database_url, "SELECT status, count(*) AS n FROM analysis_jobs GROUP BY status"
    )
    assert {r["status"]: r["n"] for r in statuses} == {"succeeded": 2, "pending": 2}
    await check_invariants(database_url)


def _ended(core_run_id: str, status: JobStatus = JobStatus.SUCCEEDED) -> CompletionRequest:
    return CompletionRequest(
        core_run_id=core_run_id,
        status=status,
        from_statuses=(JobStatus.PENDING, JobStatus.RUNNING),
        error_code=None if status is JobStatus.SUCCEEDED else "core_failed",
        error_detail=None,
        verdicts=None,
        ran=True,
    )


async def test_completions_of_a_batch_are_written_together_as_report_by_report(
    db: Database, database_url: str
) -> None:
    """A batch ends its jobs and fills the slots they free all at once, with the result of
    finishing them one by one: a user with two slots gets both refilled, in queue order; and a
    report about a job that the batch's own fill starts (Core ended its held run early) still
    ends it, refunded, and frees its slot for the next job."""
    await db.grant_credits("alice", 5)
    await db.grant_credits("bob", 5)
    await db.set_user_limit("alice", 2)
    a_clicks = [_reserve("alice") for _ in range(4)]
    b_clicks = [_reserve("bob") for _ in range(3)]
    await _reserved(db, [*a_clicks, *b_clicks])
    await db.admit_many([_admit(c) for c in (*a_clicks, *b_clicks)])
    a1, a2, a3, a4 = (_admit(c) for c in a_clicks)
    b1, b2, b3 = (_admit(c) for c in b_clicks)
    reports = [
        _ended(a1.core_run_id),
        _ended(b1.core_run_id),
        _ended(b2.core_run_id, JobStatus.FAILED),  # queued until b1's slot is filled
        _ended(a2.core_run_id),
    ]
    finished = await db.finish_many(reports, Claim("inst-a", 60))
    results = [finished[r] for r in reports]
    assert all(r is not None for r in results)
    assert [(r.job.status, r.changed) for r in results if r] == [
        (JobStatus.SUCCEEDED, True),
        (JobStatus.SUCCEEDED, True),
        (JobStatus.FAILED, True),
        (JobStatus.SUCCEEDED, True),
    ]
    promoted = [[j.id for j in r.promoted] for r in results if r]
    # Alice's two freed slots go with her first report; bob's b2 started and ended, b3 next.
    assert promoted == [[a3.job_id, a4.job_id], [b2.job_id], [b3.job_id], []]
    assert results[2] is not None and results[2].refunded
    rows = await fetch(
        database_url,
        "SELECT id, status, user_slot, claimed_by FROM analysis_jobs ORDER BY queue_seq",
    )
    state = {r["id"]: (r["status"], r["user_slot"]) for r in rows}
    assert state[a3.job_id] == ("pending", 1) and state[a4.job_id] == ("pending", 2)
    assert state[b2.job_id] == ("failed", 1) and state[b3.job_id] == ("pending", 1)
    assert {r["claimed_by"] for r in rows if r["status"] == "pending"} == {"inst-a"}
    assert await db.balance("bob") == 5 - 3 + 1
    events = await fetch(
        database_url, "SELECT user_id, event_id FROM job_events ORDER BY user_id, event_id"
    )
    for user in ("alice", "bob"):
        ids = [e["event_id"] for e in events if e["user_id"] == user]
        assert ids == list(range(1, len(ids) + 1)), "dense ids"
    await check_invariants(database_url)


# -- through the service ---------------------------------------------------------------------


def _statements(inst: Any, what: str) -> tuple[float, float]:
    registry = inst.services.metrics.registry
    return (
        registry.get_sample_value("aq_group_commit_statements_total", {"what": what}) or 0.0,
        registry.get_sample_value("aq_group_commit_jobs_total", {"what": what}) or 0.0,
    )


async def test_clicks_that_arrive_together_share_statements_and_get_their_own_answers(
    harness: Harness,
) -> None:
    h = harness
    h.sim.judge_time_s = 600
    inst = await h.start_instance()
    users = [f"user-{n}" for n in range(40)]
    for user in users:
        await h.grant(user, 1)
    answers = await asyncio.gather(*(h.admit(u, 1) for u in users), h.admit("broke", 1))
    assert [status for status, _ in answers] == [201] * 40 + [402]
    assert all(body["status"] == "pending" for _, body in answers[:40])
    assert len({body["id"] for _, body in answers[:40]}) == 40
    admit_statements, admit_jobs = _statements(inst, "admit")
    reserve_statements, reserve_jobs = _statements(inst, "reserve")
    assert (admit_jobs, reserve_jobs) == (40, 41)
    assert admit_statements < 40 and reserve_statements < 41, "they shared statements"

    async def all_running() -> bool:
        return _statements(inst, "running")[1] == 40

    await wait_for(all_running, what="the 40 releases")
    # Each was claimed by the admit that started it: no claim statement of its own.
    assert _statements(inst, "claim") == (0.0, 0.0)
    await check_invariants(h.database_url)


async def test_a_click_whose_user_is_busy_waits_and_its_neighbours_do_not(
    harness: Harness,
) -> None:
    h = harness
    h.sim.judge_time_s = 600
    await h.start_instance()
    await h.grant("alice", 1)
    await h.grant("bob", 1)
    holder = await h.db()
    try:
        await holder.execute("BEGIN; SELECT aq_lock_user_v1('alice')")
        alice = asyncio.create_task(h.admit("alice", 1))
        bob = await asyncio.wait_for(h.admit("bob", 1), 10)  # never waits for alice's lock
        assert bob[0] == 201
        # Alice's click waits for her lock in its batch; bob's went out beside it.
        await wait_until_blocked(h.database_url, holder.get_server_pid())
        assert not alice.done()
    finally:
        await holder.execute("ROLLBACK")
        await holder.close()
    status, body = await asyncio.wait_for(alice, 10)
    assert (status, body["status"]) == (201, "pending")
    await check_invariants(h.database_url)
