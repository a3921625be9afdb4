"""The Python client (``analysis_queue.client``) against live instances: each method, each
error class, retries that never admit twice, pagination past 200 jobs, the event stream across
the ends of streams, and ``wait_for``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import pytest
from analysis_queue.client import (
    NO_RETRIES,
    AdminClient,
    AnalysisQueueClient,
    AnalysisStatus,
    Conflict,
    ConnectionFailed,
    Event,
    EventStream,
    IdempotencyInProgress,
    IdempotencyKeyReused,
    InsufficientCredits,
    InvalidBody,
    InvalidParameter,
    InvalidSource,
    JobEvent,
    JobTooLarge,
    NotFound,
    PayloadTooLarge,
    PositionEvent,
    ProtocolError,
    ProviderBudgetExhausted,
    RetryPolicy,
    ServiceUnavailable,
    SnapshotEvent,
    StreamSettings,
    TooManyStreams,
    Unauthorized,
    UnparseableThesis,
    WaitReason,
)
from analysis_queue.http.auth import mint_token
from analysis_queue.queue.admit import request_hash
from support import ADMIN_TOKEN, JWT_SECRET, Harness, fetch, fetchval, wait_for

WAIT_S = 15.0
DOC = "https://uni.example/t.pdf"
FAST_RETRIES = RetryPolicy(attempts=8, within_s=20, backoff_base_s=0.1, backoff_max_s=0.5)


def token(user: str) -> str:
    return mint_token(user, JWT_SECRET)


def sources(n: int, k: int = 2) -> list[str]:
    return [f"10.1000/c{n}.{i}" for i in range(k)]


async def start(aq: AnalysisQueueClient, n: int, **kwargs: Any) -> Any:
    return await aq.start_analysis(f"Thesis {n}", DOC, sources(n), **kwargs)


@pytest.fixture
async def h(harness: Harness) -> Harness:
    await harness.start_instance()
    return harness


def client(h: Harness, user: str, **kwargs: Any) -> AnalysisQueueClient:
    return AnalysisQueueClient(h.instances[0].base_url, token(user), **kwargs)


def admin(h: Harness, **kwargs: Any) -> AdminClient:
    return AdminClient(h.instances[0].base_url, ADMIN_TOKEN, **kwargs)


async def set_faults(h: Harness, **faults: Any) -> None:
    async with h.http.post(f"{h.sim.base_url}/_sim/faults", json=faults) as r:
        assert r.status == 200, await r.text()


async def collect(stream: EventStream, into: list[Event]) -> None:
    async for event in stream:
        into.append(event)


async def stop(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    async def check() -> bool:
        return predicate()

    await wait_for(check, timeout_s, what)


class Retries(logging.Handler):
    """The client's "retrying" log lines, by the code of the answer that was retried, and its
    event streams' reconnects, by their reason."""

    def __init__(self) -> None:
        super().__init__()
        self.codes: list[str | None] = []
        self.reconnects: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() == "retrying":
            self.codes.append(getattr(record, "code", None))
        elif record.getMessage() == "event stream reconnecting":
            self.reconnects.append(str(getattr(record, "reason", "")))

    async def seen(self, code: str | None, times: int = 1) -> None:
        await until(lambda: self.codes.count(code) >= times, f"{times} retries after {code}")


@pytest.fixture
def retries() -> Iterator[Retries]:
    handler = Retries()
    logger = logging.getLogger("analysis_queue.client")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# -- each method --------------------------------------------------------------------------------


async def test_a_user_admits_reads_lists_rechecks_and_cancels(h: Harness) -> None:
    async with admin(h) as adm, client(h, "alice") as aq:
        assert await adm.grant_credits("alice", 3, note="client test") == 3
        assert await aq.credits() == 3

        first = await start(aq, 1)
        assert first.status is AnalysisStatus.PENDING
        assert first.thesis.title == "Thesis 1" and first.sources == sources(1)
        second = await start(aq, 2)
        assert second.status is AnalysisStatus.QUEUED and second.queue_position == 1
        assert second.waiting_for is WaitReason.YOUR_PREVIOUS_ANALYSIS
        assert await aq.credits() == 1

        again = await aq.get_analysis(second.id)
        assert again.id == second.id and again.sources == sources(2)

        listed = [j.id async for j in aq.list_analyses()]
        assert listed == [second.id, first.id]  # newest first

        cancelled = await aq.cancel_analysis(second.id)
        assert cancelled is not None and cancelled.status is AnalysisStatus.CANCELLED
        again_cancelled = await aq.cancel_analysis(second.id)  # answered as it is
        assert again_cancelled is not None and again_cancelled.status is AnalysisStatus.CANCELLED
        assert await aq.credits() == 2  # a job that never ran is refunded, once
        assert [j.id async for j in aq.list_analyses()] == [second.id, first.id]  # still listed
        deleted = await aq.delete_analysis(second.id)
        assert deleted is not None and deleted.status is AnalysisStatus.CANCELLED
        assert await aq.delete_analysis(second.id) is None  # gone: nothing left to delete
        assert await aq.cancel_analysis(second.id) is None
        assert [j.id async for j in aq.list_analyses()] == [first.id]
        assert await aq.credits() == 2

        done = await aq.wait_for(first.id, timeout_s=WAIT_S)
        assert done.status is AnalysisStatus.SUCCEEDED
        assert done.verdicts is not None and len(done.verdicts) == 2
        assert done.verdict_counts is not None and sum(done.verdict_counts.values()) == 2
        with pytest.raises(Conflict):
            await aq.cancel_analysis(first.id)  # it succeeded: nothing to cancel

        delta = await aq.start_recheck(first.id, ["10.1000/new.1"])
        assert delta.delta_of == first.id and delta.sources == ["10.1000/new.1"]
        assert (await aq.wait_for(delta.id, timeout_s=WAIT_S)).status is AnalysisStatus.SUCCEEDED


async def test_the_admin_grants_sets_limits_and_reads_capacity(h: Harness) -> None:
    async with admin(h) as adm:
        assert await adm.grant_credits("bob", 5) == 5
        assert await adm.grant_credits("bob", 2) == 7
        limit = await adm.set_user_limit("bob", 3)
        assert (limit.user_id, limit.max_running, limit.default) == ("bob", 3, False)
        assert (await adm.user_limit("bob")).max_running == 3
        reset = await adm.set_user_limit("bob", None)
        assert (reset.max_running, reset.default) == (1, True)
        capacity = await adm.capacity()
        assert capacity.global_max_running is None and capacity.slots_in_use == 0


async def test_a_token_source_is_asked_again_after_a_401(h: Harness) -> None:
    handed: list[str] = []
    tokens = iter([mint_token("carol", "not-the-secret-0123456789abcdef0123"), token("carol")])

    async def source() -> str:
        handed.append(next(tokens, token("carol")))
        return handed[-1]

    async with client(h, "carol") as aq_static:
        assert await aq_static.credits() == 0
    async with AnalysisQueueClient(h.instances[0].base_url, source) as aq:
        assert await aq.credits() == 0  # the first token was refused, the second one worked
        assert len(handed) == 2
    async with AnalysisQueueClient(h.instances[0].base_url, "garbage") as bad:
        with pytest.raises(Unauthorized) as caught:
            await bad.credits()
        assert caught.value.status == 401 and caught.value.code == "unauthorized"


# -- each error class ---------------------------------------------------------------------------


async def test_each_refusal_raises_its_class(h: Harness) -> None:
    async with admin(h) as adm, client(h, "dave", retry=NO_RETRIES) as aq:
        with pytest.raises(InsufficientCredits) as broke:
            await start(aq, 1)
        assert broke.value.status == 402 and "balance is 0" in broke.value.detail
        await adm.grant_credits("dave", 10)

        with pytest.raises(InvalidBody) as invalid:
            await aq.start_analysis("T", "not a url", sources(1))
        assert [e.field for e in invalid.value.errors] == ["thesis.document_url"]
        with pytest.raises(InvalidSource):
            await aq.start_analysis("T", DOC, ["10.9999/does-not-resolve"])
        with pytest.raises(UnparseableThesis):
            await aq.start_analysis("T", "https://uni.example/t.exe", sources(1))
        wide = [f"https://l.example/{i}/{'y' * 400}" for i in range(200)]
        with pytest.raises(JobTooLarge) as big:
            await aq.start_analysis("T", DOC, wide)
        assert big.value.limit_bytes == 64 * 1024 and (big.value.size_bytes or 0) > 64 * 1024
        with pytest.raises(PayloadTooLarge):
            await aq.start_analysis("T", DOC, [f"https://l.example/{'z' * 1990}"] * 600)

        h.sim.faults.budget_runs = 0
        with pytest.raises(ProviderBudgetExhausted) as budget:
            await start(aq, 2)
        assert budget.value.status == 429
        h.sim.faults.budget_runs = None

        h.sim.faults.create_status = 503
        with pytest.raises(ServiceUnavailable) as down:
            await start(aq, 3)
        assert (down.value.code, down.value.retry_after_s) == ("core_unavailable", 2.0)
        h.sim.faults.create_status = None

        h.sim.judge_time_s = 60.0  # job 4 is not done when its re-check is refused, however slow
        job = await start(aq, 4, idempotency_key="dave-4")
        with pytest.raises(IdempotencyKeyReused):
            await start(aq, 5, idempotency_key="dave-4")
        with pytest.raises(Conflict):
            await aq.start_recheck(job.id, sources(6))  # only a succeeded job can be re-checked
        with pytest.raises(NotFound):
            await aq.get_analysis(uuid.uuid4())
        with pytest.raises(NotFound):
            await aq.get_analysis("../credits")  # quoted into one segment: no other route
        with pytest.raises(InvalidParameter) as bad_page:
            await aq.list_page(limit=500)
        assert bad_page.value.errors[0].field == "limit"
        with pytest.raises(InvalidParameter):
            await aq.list_page(cursor="not-a-cursor")
        assert await aq.credits() == 9  # every refusal left the balance alone
    async with client(h, "eve") as other:
        with pytest.raises(NotFound):
            await other.get_analysis(job.id)  # another user's job is nobody's
        assert await other.cancel_analysis(job.id) is None
        assert await other.delete_analysis(job.id) is None


async def test_idempotency_in_progress_is_retried_until_the_first_admit_ends(
    h: Harness, retries: Retries
) -> None:
    """A key whose first request is still being admitted (here: its reservation, as an admit
    that waits for Core leaves it) answers 409 idempotency_in_progress. Without retries that is
    raised; with them the client asks again until the first request ended."""
    user, key = "frank", "frank-1"
    thesis = {"title": "Thesis 1", "document_url": DOC}
    async with admin(h) as adm:
        await adm.grant_credits(user, 1)
    conn = await h.db()
    try:
        await conn.execute(
            """INSERT INTO core_run_reservations
                   (run_id, job_id, user_id, thesis, sources, idempotency_key, request_hash)
               VALUES ($1, $2, $3, $4::jsonb, $5::jsonb, $6, $7)""",
            uuid.uuid4(),
            uuid.uuid4(),
            user,
            json.dumps(thesis),
            json.dumps(sources(1)),
            key,
            request_hash({"thesis": thesis, "sources": sources(1)}),
        )
        async with client(h, user, retry=NO_RETRIES) as once:
            with pytest.raises(IdempotencyInProgress):
                await start(once, 1, idempotency_key=key)
        async with client(h, user, retry=FAST_RETRIES) as aq:
            admitting = asyncio.create_task(start(aq, 1, idempotency_key=key))
            await retries.seen("idempotency_in_progress", 2)  # tries find it in progress ...
            assert not admitting.done()
            await conn.execute("DELETE FROM core_run_reservations WHERE idempotency_key = $1", key)
            job = await asyncio.wait_for(admitting, WAIT_S)  # ... then the key is free
        assert job.status is AnalysisStatus.PENDING
    finally:
        await conn.close()


async def test_an_unreachable_service_and_a_broken_one(h: Harness) -> None:
    from aiohttp import web
    from support import free_port

    closed = f"http://127.0.0.1:{free_port()}"
    async with AnalysisQueueClient(closed, "t", retry=FAST_RETRIES) as nowhere:
        with pytest.raises(ConnectionFailed) as caught:
            await nowhere.credits()
        assert caught.value.sent is False

    async def garbage(_request: web.Request) -> web.Response:
        return web.Response(text="<html>hello</html>", content_type="text/html")

    async def gateway(_request: web.Request) -> web.Response:
        return web.Response(status=502, text="<html>bad gateway</html>", content_type="text/html")

    app = web.Application()
    app.router.add_get("/v1/credits", garbage)
    app.router.add_get("/v1/analyses/{id}", gateway)
    app.router.add_get("/v1/events", garbage)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with AnalysisQueueClient(f"http://127.0.0.1:{port}", "t", retry=FAST_RETRIES) as aq:
            with pytest.raises(ProtocolError):
                await aq.credits()
            with pytest.raises(ServiceUnavailable) as gw:
                await aq.get_analysis(uuid.uuid4())
            assert gw.value.code == "http_502" and "bad gateway" in gw.value.detail
            with pytest.raises(ProtocolError):
                async with aq.events() as stream:
                    await anext(stream)
    finally:
        await runner.cleanup()


# -- retries that never admit twice -------------------------------------------------------------


async def _admitted_with_key(h: Harness, user: str, key: str) -> list[Any]:
    return await fetch(
        h.database_url,
        "SELECT id, status FROM analysis_jobs WHERE user_id = $1 AND idempotency_key = $2",
        user,
        key,
    )


async def _ledger(h: Harness, user: str) -> tuple[int, int]:
    rows = await fetch(
        h.database_url,
        """SELECT (SELECT balance FROM credit_accounts WHERE user_id = $1) AS balance,
                  (SELECT count(*) FROM credit_ledger WHERE user_id = $1 AND kind = 'debit')
                      AS debits""",
        user,
    )
    return int(rows[0]["balance"]), int(rows[0]["debits"])


async def test_a_retry_after_core_was_unavailable_admits_once(h: Harness, retries: Retries) -> None:
    """Core refuses the create with a 503: the service answers 503 core_unavailable with
    Retry-After (the held run may or may not exist: the sweep cancels it); the client waits at
    least that long and tries again with the same Idempotency-Key."""
    async with admin(h) as adm:
        await adm.grant_credits("gina", 5)
    h.sim.faults.create_status = 503
    async with client(h, "gina", retry=FAST_RETRIES) as aq:
        admitting = asyncio.create_task(start(aq, 1, idempotency_key="gina-1"))
        await retries.seen("core_unavailable")
        h.sim.faults.create_status = None
        job = await asyncio.wait_for(admitting, WAIT_S)
    assert [r["id"] for r in await _admitted_with_key(h, "gina", "gina-1")] == [job.id]
    assert await _ledger(h, "gina") == (4, 1)


async def test_a_retry_with_the_key_the_client_made_admits_once(
    h: Harness, retries: Retries
) -> None:
    """Without an Idempotency-Key of the caller's, the client makes one per call and sends the
    same one on every try: Core's outage answers 503 twice, and one job is admitted, once."""
    async with admin(h) as adm:
        await adm.grant_credits("gus", 5)
    h.sim.faults.create_status = 503
    async with client(h, "gus", retry=FAST_RETRIES) as aq:
        admitting = asyncio.create_task(start(aq, 1))
        await retries.seen("core_unavailable", times=2)
        h.sim.faults.create_status = None
        job = await asyncio.wait_for(admitting, WAIT_S)
    rows = await fetch(
        h.database_url,
        "SELECT id, idempotency_key FROM analysis_jobs WHERE user_id = 'gus'",
    )
    assert [r["id"] for r in rows] == [job.id] and rows[0]["idempotency_key"]
    assert await _ledger(h, "gus") == (4, 1)


async def test_a_retry_after_the_database_timed_out_mid_admit_admits_once(
    harness: Harness, retries: Retries
) -> None:
    """The worst place for the database to fail: Core holds the run, and the admit's
    transaction cannot finish (a lock it needs is held past the statement timeout). The answer
    is 503 database_unavailable; the reservation stays, so the retry with the same key is
    told 409 idempotency_in_progress until the sweep has reclaimed it (cancelling the held
    run); then the retry admits, once."""
    h = harness
    await h.start_instance(
        db_statement_timeout_s=0.5, sweep_interval_s=0.5, reservation_stale_s=3.0
    )
    async with admin(h) as adm:
        await adm.grant_credits("hal", 5)
    blocker = await h.db()
    try:
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute("LOCK TABLE credit_ledger IN ACCESS EXCLUSIVE MODE")
        policy = RetryPolicy(attempts=30, within_s=30, backoff_base_s=0.2, backoff_max_s=1)
        async with client(h, "hal", retry=policy) as aq:
            admitting = asyncio.create_task(start(aq, 1, idempotency_key="hal-1"))
            await retries.seen("database_unavailable")
            await tx.rollback()
            job = await asyncio.wait_for(admitting, 30)
    finally:
        await blocker.close()
    assert "idempotency_in_progress" in retries.codes  # the key stayed taken for a while
    assert [r["id"] for r in await _admitted_with_key(h, "hal", "hal-1")] == [job.id]
    assert await _ledger(h, "hal") == (4, 1)

    def runs(state: str | None = None) -> list[dict[str, Any]]:
        hal = [r for r in h.sim.runs_snapshot() if r["user_id"] == "hal"]
        return [r for r in hal if state is None or r["state"] == state]

    # Core saw two creates: the first try's run, cancelled by the sweep, and the job's.
    await until(lambda: len(runs("cancelled")) == 1, "the first try's held run cancelled")
    assert len(runs()) == 2
    assert [r["run_id"] for r in runs() if r["state"] != "cancelled"] == [str(job.run_id)]


async def test_a_lost_answer_is_replayed_not_admitted_again(h: Harness, retries: Retries) -> None:
    """The first try's answer does not come in time (its admit waits on the global lock, which
    the test holds, after Core made the run), so the client gives up on it and asks again with
    the same key: in progress while the first admit waits, then, once it committed, the same
    job replayed."""
    async with admin(h) as adm:
        await adm.grant_credits("ivy", 5)
    blocker = await h.db()
    try:
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute("SELECT aq_lock_global_v1()")
        async with client(h, "ivy", retry=FAST_RETRIES, timeout_s=0.5) as aq:
            admitting = asyncio.create_task(start(aq, 1, idempotency_key="ivy-1"))
            await retries.seen("idempotency_in_progress")  # the first try timed out before
            await tx.rollback()
            job = await asyncio.wait_for(admitting, WAIT_S)
    finally:
        await blocker.close()
    assert retries.codes[0] is None  # the timed-out try: no answer, no code
    assert [r["id"] for r in await _admitted_with_key(h, "ivy", "ivy-1")] == [job.id]
    assert await _ledger(h, "ivy") == (4, 1)
    assert len([r for r in h.sim.runs_snapshot() if r["user_id"] == "ivy"]) == 1


# -- pagination ---------------------------------------------------------------------------------


async def test_listing_pages_through_more_than_200_jobs(h: Harness) -> None:
    jobs = 450
    async with admin(h) as adm, client(h, "jo") as aq:
        await adm.grant_credits("jo", jobs + 50)
        gate = asyncio.Semaphore(16)

        async def one(n: int) -> uuid.UUID:
            async with gate:
                return (await start(aq, n)).id

        admitted = await asyncio.gather(*(one(n) for n in range(jobs)))
        listed = [j async for j in aq.list_analyses()]
        assert len(listed) == jobs and {j.id for j in listed} == set(admitted)
        times = [j.created_at for j in listed]
        assert times == sorted(times, reverse=True)  # newest first, across pages

        # Jobs admitted while a listing pages sort before its first page: each job that existed
        # when it began comes exactly once, none twice.
        seen: list[uuid.UUID] = []
        async for job in aq.list_analyses(page_size=50):
            seen.append(job.id)
            if len(seen) % 50 == 1:
                await start(aq, 10_000 + len(seen))
        assert len(seen) == len(set(seen)) == jobs
        assert set(seen) == set(admitted)


# -- the event stream ---------------------------------------------------------------------------


async def test_the_stream_delivers_every_event_once_across_its_ends(harness: Harness) -> None:
    """Streams that end every second (AQ_EVENT_STREAM_MAX_S): the client reconnects with
    Last-Event-ID each time, and what it delivers is every stored event once, in id order."""
    h = harness
    h.sim.judge_time_s = 0.3  # long enough for a queue, and so for position frames
    await h.start_instance(event_stream_max_s=1.0)
    async with admin(h) as adm, client(h, "kim") as aq:
        await adm.grant_credits("kim", 100)
        got: list[Event] = []
        async with aq.events() as stream:
            reader = asyncio.create_task(collect(stream, got))
            await until(lambda: bool(got), "the snapshot")
            h.sim.judge_time_s = 60.0  # one queue whatever the machine's speed:
            running, ahead, behind = [await start(aq, 100 + k) for k in range(3)]
            assert behind.queue_position == 2
            await aq.delete_analysis(ahead.id)  # the job behind moves up: a position frame
            # Wait for it before the job behind starts: read in one batch with that start, the
            # deletion would leave no queued job to have moved.
            await until(lambda: any(isinstance(e, PositionEvent) for e in got), "a position")
            h.sim.judge_time_s = 0.3
            await aq.cancel_analysis(running.id)  # and starts
            n = 0
            while stream.connects < 3 or n < 12:  # jobs come and go across three streams
                assert n < 100, "the stream does not reconnect"
                job = await start(aq, n)
                if n % 3 == 1:
                    await aq.delete_analysis(job.id)
                elif n % 6 == 2:
                    with contextlib.suppress(Conflict):  # unless it succeeded meanwhile
                        await aq.cancel_analysis(job.id)
                await asyncio.sleep(0.15)
                n += 1

            async def settled() -> bool:
                return not await fetchval(
                    h.database_url,
                    "SELECT count(*) FROM analysis_jobs WHERE status IN ('queued', 'pending', "
                    "'running')",
                )

            await wait_for(settled, 20, "every job ended")
            head = await fetchval(
                h.database_url, "SELECT last_id FROM job_event_counters WHERE user_id = 'kim'"
            )
            await until(lambda: stream.last_event_id == head, f"event {head} delivered", 20)
            await stop(reader)
        assert isinstance(got[0], SnapshotEvent) and got[0].id == 0
        ids = [e.id for e in got if isinstance(e, JobEvent)]
        assert ids == list(range(1, head + 1))
        assert any(isinstance(e, PositionEvent) for e in got)
        kinds = {e.kind for e in got if isinstance(e, JobEvent)}
        assert {"admitted", "promoted", "started", "finished", "cancelled", "deleted"} <= kinds


async def test_a_stream_resumes_after_the_id_another_process_kept(h: Harness) -> None:
    """``events(last_event_id=N)`` in a new client (another process, say) delivers what came
    after N and nothing before it, with no snapshot."""
    async with admin(h) as adm, client(h, "lou") as aq:
        await adm.grant_credits("lou", 5)
        h.sim.judge_time_s = 60.0
        for n in range(3):
            await start(aq, n)
        async with aq.events() as stream:
            first = await anext(aiter(stream))
            assert isinstance(first, SnapshotEvent)
            kept = stream.last_event_id
        assert kept is not None and kept >= 3  # 3 admitted at least
        await start(aq, 3)
        await start(aq, 4)
    head = int(
        await fetchval(
            h.database_url, "SELECT last_id FROM job_event_counters WHERE user_id = 'lou'"
        )
    )
    async with client(h, "lou") as later, later.events(last_event_id=kept) as stream:
        got: list[Event] = []
        reader = asyncio.create_task(collect(stream, got))
        await until(lambda: (stream.last_event_id or 0) >= head, f"event {head} delivered")
        await stop(reader)
        last = stream.last_event_id
    assert last is not None and not any(isinstance(e, SnapshotEvent) for e in got)
    assert [e.id for e in got if isinstance(e, JobEvent)] == list(range(kept + 1, last + 1))
    assert {e.kind for e in got if isinstance(e, JobEvent)} >= {"admitted"}


async def test_a_session_the_caller_gave_stays_open(h: Harness) -> None:
    async with aiohttp.ClientSession() as session:
        async with AnalysisQueueClient(
            h.instances[0].base_url, token("max"), session=session
        ) as aq:
            assert await aq.credits() == 0
        assert not session.closed  # the caller's, closed by the caller
        async with AdminClient(h.instances[0].base_url, ADMIN_TOKEN, session=session) as adm:
            assert await adm.grant_credits("max", 1) == 1
        assert not session.closed
        async with session.get(f"{h.instances[0].base_url}/healthz") as r:
            assert r.status == 200


async def test_a_stream_past_the_users_cap_waits_for_a_free_one(
    harness: Harness, retries: Retries
) -> None:
    """429 too_many_streams (with Retry-After) is retried by the stream: it opens once another
    closes. With ``give_up_after_s`` it is raised instead."""
    h = harness
    await h.start_instance(event_streams_per_user=1)
    async with client(h, "lee") as aq:
        first = aq.events()
        assert isinstance(await anext(first), SnapshotEvent)
        impatient = AnalysisQueueClient(
            h.instances[0].base_url, token("lee"), stream=StreamSettings(give_up_after_s=1)
        )
        async with impatient, impatient.events() as refused:
            with pytest.raises(TooManyStreams) as caught:
                await anext(refused)
        assert caught.value.retry_after_s == 5
        second = aq.events()
        opening = asyncio.create_task(anext(second))
        await until(lambda: "TooManyStreams" in retries.reconnects, "a refusal")
        assert not opening.done()
        await first.aclose()
        # The service frees the slot once it notices the client left, at its next write: an
        # event now, instead of the 15-second keepalive.
        async with admin(h) as adm:
            await adm.grant_credits("lee", 1)
        await start(aq, 1)
        assert isinstance(await asyncio.wait_for(opening, 45), SnapshotEvent)
        await second.aclose()


# -- wait_for -----------------------------------------------------------------------------------


def subscribers(h: Harness) -> float:
    value = h.instances[0].services.metrics.registry.get_sample_value("aq_event_subscribers")
    return float(value or 0)


async def test_many_waits_share_one_stream(h: Harness) -> None:
    """Thirty waits at once, more than the 20 streams a user may open: one stream serves all."""
    async with admin(h) as adm, client(h, "max") as aq:
        await adm.grant_credits("max", 30)
        await adm.set_user_limit("max", 5)
        jobs = [await start(aq, n) for n in range(30)]
        most = 0.0

        async def watch() -> None:
            nonlocal most
            while True:
                most = max(most, subscribers(h))
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        done = await asyncio.gather(*(aq.wait_for(j.id, timeout_s=60) for j in jobs))
        await stop(watcher)
        assert [d.status for d in done] == [AnalysisStatus.SUCCEEDED] * 30
        assert all(d.verdicts for d in done)
        assert most == 1
        assert aq._waits._task is None  # the last wait closed the stream


async def test_wait_for_a_job_already_done_missing_deleted_or_too_slow(h: Harness) -> None:
    async with admin(h) as adm, client(h, "ned") as aq:
        await adm.grant_credits("ned", 5)
        first = await start(aq, 1)
        done = await aq.wait_for(first.id, timeout_s=WAIT_S)
        again = await aq.wait_for(first.id, timeout_s=WAIT_S)  # already terminal: at once
        assert again == done

        with pytest.raises(NotFound):
            await aq.wait_for(uuid.uuid4(), timeout_s=WAIT_S)

        h.sim.judge_time_s = 60.0
        slow = await start(aq, 2)
        queued = await start(aq, 3)
        with pytest.raises(TimeoutError):
            await aq.wait_for(slow.id, timeout_s=0.5)

        waiting = asyncio.create_task(aq.wait_for(queued.id, timeout_s=WAIT_S))
        await until(lambda: aq._waits._positioned, "the wait's stream has its snapshot")
        assert await aq.cancel_analysis(queued.id) is not None
        assert (await waiting).status is AnalysisStatus.CANCELLED  # cancelled, still listed

        gone = await start(aq, 4)
        waiting = asyncio.create_task(aq.wait_for(gone.id, timeout_s=WAIT_S))
        await until(lambda: aq._waits._positioned, "the wait's stream has its snapshot")
        assert await aq.delete_analysis(gone.id) is not None
        with pytest.raises(NotFound):  # cancelled, and deleted with it
            await waiting
