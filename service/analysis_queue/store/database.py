"""The pool and every query of the queue: the one place that runs SQL for the service.

It returns frozen dataclasses from ``models`` and turns driver errors into domain errors
(``driver.wrap_errors``). Migrations are ``migrate.py``, the LISTEN connection ``listen.py``;
both use ``direct_dsn``, which may differ from the pool's when the pool goes through a
transaction pooler (``driver`` says what that changes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit
from uuid import UUID

import asyncpg

from analysis_queue import errors, tracing
from analysis_queue.config import Pooler
from analysis_queue.models import (
    Admission,
    AdmitRequest,
    Batched,
    BatchOutcome,
    Capacity,
    CompletionRequest,
    EventKind,
    EventPage,
    Finish,
    Job,
    JobEvent,
    JobStatus,
    JobSummary,
    QueuePosition,
    Reservation,
    ReservationOutcome,
    ReserveRequest,
    StaleReservation,
    UserLimit,
    Woken,
)
from analysis_queue.store import migrate
from analysis_queue.store.driver import (
    CONNECT_TIMEOUT_S,
    StartupParametersRefused,
    init_connection,
    keep_session,
    server_settings,
    startup_refusal,
    statement_cache_size,
    wrap_errors,
)
from analysis_queue.store.sqlfiles import queries

log = logging.getLogger(__name__)

# The named queries (sql/queries.sql) that may be sent again when the connection died under
# them, their outcome unknown: reads, and writes whose repetition changes nothing (a
# reservation is answered again by its run id; a hold released, a key freed, once; an admit
# that did commit finds its reservations gone and its jobs made, and answers 'repeated').
SAFE_TO_REPEAT = frozenset(
    {
        "reserve",
        "admit",
        "reservation_release_hold",
        "reservation_orphan",
        "capacity",
        "user_limit_get",
        "credit_balance",
        "job_open_counts",
        "job_get",
        "job_list_page",
        "job_for_recheck",
        "job_event_head",
        "job_event_pages",
        "job_queue_positions",
        "sweep_users_to_promote",
        "sweep_pending_due",
        "sweep_running_quiet",
    }
)


@dataclass(frozen=True, slots=True)
class Timeouts:
    """How long a query may wait, in seconds: for a pooled connection (``acquire_s``), for its
    statement, lock waits included (``statement_s``: the driver cancels it past that), and the
    readiness probe, on its own connection (``probe_s``). Past any of them the caller gets
    ``DatabaseUnavailable``: a 503 with Retry-After, never a request that hangs."""

    acquire_s: float = 5.0
    statement_s: float = 10.0
    probe_s: float = 1.0


DEFAULT_TIMEOUTS = Timeouts()


@dataclass(frozen=True, slots=True)
class Claim:
    """Who claims the jobs a batch starts, and for how long (the dispatcher's claim lease)."""

    instance_id: str
    lease_s: float


def _job_or_none(row: Any) -> Job | None:
    if row is None or row["id"] is None:
        return None
    return Job.from_row(row)


async def _learn_row_types(conn: asyncpg.Connection[Any]) -> None:
    """Have the driver learn the job row type and its array at connect: it asks the server about
    a composite type the first time a result carries it, a round trip that would otherwise land
    on some request's critical path once per connection. Skipped before the schema exists.

    Run, not ``prepare()``d: a prepare ends without a Sync, which holds a transaction pooler's
    server connection for this client until its next query; and before asyncpg 0.31 it names
    the statement even with the cache off."""
    try:
        await conn.fetchrow("SELECT NULL::analysis_jobs AS job, NULL::analysis_jobs[] AS jobs")
    except asyncpg.UndefinedObjectError:
        pass


class _WarmedUp(Exception):
    """Rolls the warm-up's transaction back."""


async def _warm_up(conn: asyncpg.Connection[Any]) -> None:
    """Walk a new connection through one job's path in a transaction rolled back
    (``aq_warm_up_v1``, sql/functions/warm.sql): its backend compiles the queue's functions
    and plans their statements now, not on some user's first admit or promotion. Best effort:
    before the schema exists, or if the database refuses, the connection is used cold."""
    try:
        async with conn.transaction():
            await conn.execute("SELECT aq_warm_up_v1()")
            raise _WarmedUp
    except _WarmedUp:
        pass
    except asyncpg.PostgresError as exc:
        log.debug("warm-up skipped", extra={"action": "warm_up", "reason": str(exc)})


def admission_of(batched: Batched[Admission]) -> Admission:
    """One click's answer from a batch of admits, its refusals raised: no credit left (a hold
    the previous release did not make), or a reservation the sweep reclaimed meanwhile."""
    if batched.outcome is BatchOutcome.INSUFFICIENT_CREDITS:
        raise errors.InsufficientCredits()
    if batched.outcome is BatchOutcome.RESERVATION_GONE:
        raise errors.CoreUnavailable("The admission timed out; try again.")
    assert batched.result is not None
    return batched.result


def _jobs(rows: Any) -> tuple[Job, ...]:
    """An array of analysis_jobs rows (a composite array) as jobs."""
    return tuple(Job.from_row(r) for r in rows or ())


def _span_attributes(dsn: str) -> dict[str, str | int | bool]:
    """What every statement's span says of the database (OpenTelemetry's names)."""
    parts = urlsplit(dsn)
    found: dict[str, str | int | bool] = {"db.system.name": "postgresql"}
    if parts.path.strip("/"):
        found["db.namespace"] = parts.path.strip("/")
    if parts.hostname:
        found["server.address"] = parts.hostname
    return found


class Database:
    """A pool and the queue's queries. ``await Database.connect(dsn)``; ``await db.close()``."""

    def __init__(
        self,
        pool: asyncpg.Pool[Any],
        dsn: str,
        application_name: str,
        backend_pids: set[int] | None = None,
        *,
        direct_dsn: str | None = None,
        pooler: Pooler = Pooler.NONE,
    ) -> None:
        self.pool = pool
        self.dsn = dsn
        self.direct_dsn = direct_dsn or dsn  # LISTEN and migrations: a session of their own
        self.pooler = pooler
        self.application_name = application_name
        # The server processes of this pool's open connections: a notification sent by one of
        # them is a change this process committed (and followed up) itself. Always empty behind
        # a transaction pooler, where a connection has no server process of its own: every
        # notification then counts as another's (a wake-up's read too many, never one missed).
        self.backend_pids = backend_pids if backend_pids is not None else set()
        self._q = queries()
        self.timeouts = DEFAULT_TIMEOUTS
        self._probe: asyncpg.Connection[Any] | None = None
        self._probing = asyncio.Lock()
        self._closed = False
        self._span_attributes = _span_attributes(dsn)

    @classmethod
    async def connect(
        cls,
        dsn: str,
        *,
        direct_dsn: str | None = None,
        pooler: Pooler = Pooler.NONE,
        min_size: int = 2,
        max_size: int = 10,
        application_name: str = "analysis-queue",
        timeouts: Timeouts = DEFAULT_TIMEOUTS,
    ) -> Database:
        """Open the pool on ``dsn``. Raises ``StartupParametersRefused`` when ``dsn`` is a
        pooler that ``pooler`` does not say (no retry helps), ``DatabaseUnavailable`` when the
        server does not answer."""
        pids: set[int] = set()

        async def init(conn: asyncpg.Connection[Any]) -> None:
            await init_connection(conn)
            await _learn_row_types(conn)
            await _warm_up(conn)
            if pooler is Pooler.NONE:
                pid = conn.get_server_pid()
                pids.add(pid)
                conn.add_termination_listener(lambda _conn: pids.discard(pid))

        try:
            with wrap_errors():
                pool = await asyncpg.create_pool(
                    dsn,
                    min_size=min_size,
                    max_size=max_size,
                    init=init,
                    reset=keep_session,
                    server_settings=server_settings(application_name, pooler),
                    statement_cache_size=statement_cache_size(pooler),
                    command_timeout=timeouts.statement_s,
                    timeout=CONNECT_TIMEOUT_S,
                    max_inactive_connection_lifetime=300,
                )
        except errors.DatabaseUnavailable as exc:
            if startup_refusal(exc.__cause__):
                raise StartupParametersRefused(str(exc.__cause__)) from exc.__cause__
            raise
        db = cls(pool, dsn, application_name, pids, direct_dsn=direct_dsn, pooler=pooler)
        db.timeouts = timeouts
        return db

    async def close(self) -> None:
        self._closed = True
        # A readiness probe in flight may be opening its connection: wait for it (bounded by
        # the probe's timeout), so that the connection it opens is closed here too.
        async with self._probing:
            probe, self._probe = self._probe, None
        if probe is not None:
            probe.terminate()
        try:
            await asyncio.wait_for(self.pool.close(), timeout=5)
        except Exception:  # close() timed out: do not wait for stuck connections
            self.pool.terminate()

    # -- plumbing -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[asyncpg.pool.PoolConnectionProxy[Any]]:
        """A pooled connection within the acquire bound: past it ``DatabaseUnavailable``, a
        503 with Retry-After, instead of a request that queues for the pool without end.

        A connection a lost-connection error came out of is terminated before it goes back:
        its server may have said FATAL before its socket closed, and asyncpg's pool, last in
        first out, would hand that connection straight to the statement's second try."""
        with wrap_errors():
            async with self.pool.acquire(timeout=self.timeouts.acquire_s) as conn:
                try:
                    yield conn
                except errors.DatabaseUnavailable as exc:
                    if exc.connection_lost:
                        conn.terminate()
                    raise

    async def _fetchrow(self, name: str, *args: Any) -> Any:
        rows = await self._fetch(name, *args)
        return rows[0] if rows else None

    async def _fetch(self, name: str, *args: Any) -> list[Any]:
        return list(await self._send(name, lambda conn: conn.fetch(self._q[name], *args)))

    async def _execute(self, name: str, *args: Any) -> str:
        return str(await self._send(name, lambda conn: conn.execute(self._q[name], *args)))

    async def _send(
        self,
        name: str,
        statement: Callable[[asyncpg.pool.PoolConnectionProxy[Any]], Awaitable[Any]],
    ) -> Any:
        """Query ``name`` on a pooled connection. One whose connection died under it is sent
        once more, on another connection, when it is in ``SAFE_TO_REPEAT``: a terminated backend
        then costs no request."""
        # Traced, one span a statement, named by its query (the decisions: reserve, admit,
        # finish, claim, running, promote, ...).
        with tracing.span(name, kind="client", attributes=self._span_attributes) as span:
            for attempt in (1, 2):
                try:
                    async with self._connection() as conn:
                        with wrap_errors():
                            return await statement(conn)
                except errors.DatabaseUnavailable as exc:
                    if attempt == 2 or not exc.connection_lost or name not in SAFE_TO_REPEAT:
                        tracing.set_error(span, type(exc).__name__)
                        raise
                    log.info("connection lost under a statement; once more", extra={"query": name})
        raise AssertionError("unreachable")

    async def ping(self) -> None:
        """Whether the database answers, on a connection of its own: readiness must not wait
        behind requests for the pool (nor fail because they hold it all). Bounded by
        ``timeouts.probe_s``; a probe that fails drops its connection and the next one opens a
        new one."""
        async with self._probing:
            if self._closed:
                raise errors.DatabaseUnavailable("closed")
            try:
                async with asyncio.timeout(self.timeouts.probe_s):
                    with wrap_errors():
                        if self._probe is None or self._probe.is_closed():
                            self._probe = await asyncpg.connect(
                                self.dsn,
                                server_settings={
                                    "application_name": f"{self.application_name}-probe"[:63]
                                },
                                statement_cache_size=0,
                            )
                        await self._probe.fetchval("SELECT 1")
            except (errors.DatabaseUnavailable, TimeoutError) as exc:
                probe, self._probe = self._probe, None
                if probe is not None:
                    probe.terminate()
                raise errors.DatabaseUnavailable() from exc

    # -- admission ---------------------------------------------------------------------------

    async def reserve(self, request: ReserveRequest) -> Reservation:
        """One click's reservation: a batch of one (``reserve_many``)."""
        return (await self.reserve_many([request]))[request]

    async def reserve_many(
        self, requests: Sequence[ReserveRequest]
    ) -> dict[ReserveRequest, Reservation]:
        """The reservations of a group commit, in one transaction (``aq_reserve_v2``): each
        click's key resolved and its cost held, in order."""
        items = [
            {
                "item": n,
                "user_id": r.user_id,
                "run_id": r.run_id,
                "job_id": r.job_id,
                "cost": r.cost,
                "thesis": r.thesis,
                "sources": r.sources,
                "idempotency_key": r.idempotency_key,
                "request_hash": r.request_hash,
            }
            for n, r in enumerate(requests)
        ]
        return {
            requests[row["item"]]: Reservation(
                ReservationOutcome(row["outcome"]), row["job_id"], row["balance"]
            )
            for row in await self._fetch("reserve", items)
        }

    async def admit(self, request: AdmitRequest, claim: Claim | None = None) -> Admission:
        """One click's admit: a batch of one (``admit_many``); its refusals raised."""
        return admission_of((await self.admit_many([request], claim))[request])

    async def admit_many(
        self, requests: Sequence[AdmitRequest], claim: Claim | None = None
    ) -> dict[AdmitRequest, Batched[Admission]]:
        """The admits of a group commit, in one transaction and one notifying commit
        (``aq_admit_v3``), each decided in order: DONE with its admission,
        INSUFFICIENT_CREDITS or RESERVATION_GONE. The jobs they start come back claimed for
        ``claim``'s instance. Sent again after its connection died, a batch that had
        committed answers each click DONE with the job it made ('repeated'); what it had
        promoted for others is left to the sweep, their claims lapsing."""
        items = [
            {
                "item": n,
                "job_id": r.job_id,
                "user_id": r.user_id,
                "run_id": r.run_id,
                "core_run_id": r.core_run_id,
                "thesis": r.thesis,
                "sources": r.sources,
                "cost": r.cost,
                "delta_of": r.delta_of,
                "idempotency_key": r.idempotency_key,
                "request_hash": r.request_hash,
            }
            for n, r in enumerate(requests)
        ]
        out: dict[AdmitRequest, Batched[Admission]] = {}
        instance, lease_s = (claim.instance_id, claim.lease_s) if claim else (None, None)
        for row in await self._fetch("admit", items, instance, lease_s):
            request = requests[row["item"]]
            if row["outcome"] == "admitted":
                admission = Admission(
                    Job.from_row(row), _jobs(row["promoted"]), bool(row["asks_pass"])
                )
                out[request] = Batched(BatchOutcome.DONE, admission)
            elif row["outcome"] == "repeated":
                out[request] = Batched(BatchOutcome.DONE, Admission(Job.from_row(row), (), False))
            else:
                out[request] = Batched(BatchOutcome(row["outcome"]))
        return out

    async def release_reservation(self, run_id: UUID) -> bool:
        """Drop a reservation (and its hold); whether it was still there."""
        return await self._fetchrow("reservation_release", run_id) is not None

    async def release_hold(self, run_id: UUID) -> None:
        """Release the credit a reservation holds, keeping the reservation for the sweep."""
        await self._execute("reservation_release_hold", run_id)

    async def orphan_reservation(self, run_id: UUID) -> None:
        """Leave a reservation to the sweep, holding nothing, and free its Idempotency-Key for
        a retry."""
        await self._execute("reservation_orphan", run_id)

    async def take_stale_reservations(self, age_s: float, limit: int) -> list[StaleReservation]:
        rows = await self._fetch("reservation_take_stale", age_s, limit)
        return [
            StaleReservation(
                r["run_id"], r["job_id"], r["user_id"], r["core_run_id"], r["thesis"], r["sources"]
            )
            for r in rows
        ]

    async def put_back_reservation(self, r: StaleReservation) -> None:
        await self._execute(
            "reservation_put_back",
            r.run_id,
            r.job_id,
            r.user_id,
            r.core_run_id,
            r.thesis,
            r.sources,
        )

    # -- promotion and completion ------------------------------------------------------------

    async def promote(
        self, user_ids: Sequence[str], limit: int, claim: Claim | None = None
    ) -> tuple[int | None, list[Job]]:
        """Fill free slots: the users' own (ceiling off), or the fairest after re-deriving the
        users' waits (ceiling on: a pass). Returns the ceiling in force and the jobs promoted,
        claimed for ``claim``'s instance in the same transaction."""
        instance, lease_s = (claim.instance_id, claim.lease_s) if claim else (None, None)
        try:
            rows = await self._fetch("promote", list(user_ids), limit, instance, lease_s)
        except asyncpg.UniqueViolationError:
            # A slot index refused a second holder: a writer that does not take the locks (a
            # manual fix) won. The index kept the invariant; the next pass sees the truth.
            log.warning("promotion lost to a slot index", extra={"users": list(user_ids)[:10]})
            return None, []
        ceiling = rows[0]["ceiling"] if rows else None
        return ceiling, [Job.from_row(r) for r in rows if r["id"] is not None]

    async def promote_woken(
        self, user_ids: Sequence[str], limit: int, claim: Claim | None = None
    ) -> Woken:
        """A notification woke these users: fill what it left free (a read without locks when
        there is nothing to fill; what it promotes is claimed for ``claim``'s instance), and
        name their pending jobs nobody is releasing."""
        instance, lease_s = (claim.instance_id, claim.lease_s) if claim else (None, None)
        try:
            rows = await self._fetch("promote_woken", list(user_ids), limit, instance, lease_s)
        except asyncpg.UniqueViolationError:
            log.warning("promotion lost to a slot index", extra={"users": list(user_ids)[:10]})
            return Woken(None, (), ())
        ceiling = rows[0]["ceiling"] if rows else None
        jobs = [(r["promoted"], Job.from_row(r)) for r in rows if r["id"] is not None]
        return Woken(
            ceiling,
            tuple(job for promoted, job in jobs if promoted),
            tuple(job for promoted, job in jobs if not promoted),
        )

    # -- capacity ----------------------------------------------------------------------------

    async def set_ceiling(self, ceiling: int | None) -> None:
        """Set the global ceiling (None: off); waits for queue decisions made under the old."""
        await self._fetchrow("ceiling_set", ceiling)

    async def capacity(self) -> Capacity:
        row = await self._fetchrow("capacity")
        return Capacity(
            ceiling=row["ceiling"],
            active=int(row["active"]),
            jobs_waiting=int(row["jobs_waiting"]),
            users_waiting=int(row["users_waiting"]),
        )

    async def set_user_limit(self, user_id: str, max_running: int | None) -> list[Job]:
        """Set a user's concurrency (None: the default); returns the jobs it promoted."""
        return [Job.from_row(r) for r in await self._fetch("user_limit_set", user_id, max_running)]

    async def user_limit(self, user_id: str) -> UserLimit:
        row = await self._fetchrow("user_limit_get", user_id)
        return UserLimit(
            user_id=user_id,
            max_running=int(row["max_running"]),
            custom=bool(row["custom"]),
            active=int(row["active"]),
            queued=int(row["queued"]),
        )

    async def finish(
        self,
        *,
        job_id: UUID | None = None,
        core_run_id: str | None = None,
        user_id: str | None = None,
        status: JobStatus | None,
        from_statuses: Sequence[JobStatus] = (),
        delete: bool = False,
        error_code: str | None = None,
        error_detail: str | None = None,
        verdicts: list[dict[str, Any]] | None = None,
        ran: bool = False,
        claim: Claim | None = None,
    ) -> Finish | None:
        """End one job (by id or Core run id; ``user_id`` scopes it to that user): a batch of
        one of ``aq_finish_v3``. ``status`` None only soft-deletes; the move happens only from
        a status in ``from_statuses``. None: no such job."""
        item = {
            "item": 0,
            "job_id": job_id,
            "core_run_id": core_run_id,
            "user_id": user_id,
            "status": status,
            "from": list(from_statuses),
            "delete": delete,
            "error_code": error_code,
            "error_detail": error_detail,
            "verdicts": verdicts,
            "ran": ran,
        }
        rows = await self._finish_items([item], claim)
        return rows[0]

    async def finish_many(
        self, requests: Sequence[CompletionRequest], claim: Claim | None = None
    ) -> dict[CompletionRequest, Finish | None]:
        """Core's completions of a group commit, in one transaction and one notifying commit
        (``aq_finish_v3``), each finished in order, with the fill of what they free: a request
        maps to its finish, or None when no job has its run. The jobs they promote come back
        claimed for ``claim``'s instance."""
        items = [
            {
                "item": n,
                "core_run_id": r.core_run_id,
                "status": r.status,
                "from": list(r.from_statuses),
                "error_code": r.error_code,
                "error_detail": r.error_detail,
                "verdicts": r.verdicts,
                "ran": r.ran,
            }
            for n, r in enumerate(requests)
        ]
        finishes = await self._finish_items(items, claim)
        return {r: finishes[n] for n, r in enumerate(requests)}

    async def _finish_items(
        self, items: list[dict[str, Any]], claim: Claim | None
    ) -> list[Finish | None]:
        instance, lease_s = (claim.instance_id, claim.lease_s) if claim else (None, None)
        out: list[Finish | None] = [None] * len(items)
        for row in await self._fetch("finish", items, instance, lease_s):
            job = _job_or_none(row["job"])
            if row["outcome"] == "finished" and job is not None:
                out[row["item"]] = Finish(
                    job,
                    JobStatus(row["old_status"]),
                    row["changed"],
                    row["refunded"],
                    _jobs(row["promoted"]),
                    bool(row["asks_pass"]),
                )
        return out

    # -- dispatch ----------------------------------------------------------------------------

    async def claim(
        self, job_ids: Sequence[UUID], instance_id: str, lease_s: float
    ) -> dict[UUID, Job]:
        """Claim these pending jobs for release; returns the ones claimed, by id."""
        rows = await self._fetch("jobs_claim", sorted(set(job_ids)), instance_id, lease_s)
        return {job.id: job for job in map(Job.from_row, rows)}

    async def mark_running(self, job_ids: Sequence[UUID], instance_id: str) -> set[UUID]:
        """Core released these claimed jobs: the ones still pending for ``instance_id``, now
        running (a job that moved on meanwhile is left out)."""
        rows = await self._fetch("jobs_mark_running", sorted(set(job_ids)), instance_id)
        return {row["job_id"] for row in rows}

    async def schedule_release_retry(
        self, job_id: UUID, instance_id: str, at: datetime, detail: str
    ) -> None:
        await self._execute("job_release_retry", job_id, instance_id, at, detail)

    async def mark_polled(self, job_ids: Sequence[UUID]) -> None:
        await self._execute("job_mark_polled", list(job_ids))

    # -- sweep -------------------------------------------------------------------------------

    async def users_to_promote(self, limit: int) -> list[str]:
        return [r["user_id"] for r in await self._fetch("sweep_users_to_promote", limit)]

    async def pending_due(self, limit: int) -> list[UUID]:
        return [r["id"] for r in await self._fetch("sweep_pending_due", limit)]

    async def running_quiet(self, quiet_s: float, limit: int) -> list[tuple[UUID, str]]:
        rows = await self._fetch("sweep_running_quiet", quiet_s, limit)
        return [(r["id"], r["core_run_id"]) for r in rows]

    # -- reads -------------------------------------------------------------------------------

    async def open_job_counts(self) -> dict[str, int]:
        return {r["status"]: int(r["n"]) for r in await self._fetch("job_open_counts")}

    def pool_counts(self) -> tuple[int, int]:
        """(connections, idle connections) of the pool."""
        return self.pool.get_size(), self.pool.get_idle_size()

    async def get_job(self, job_id: UUID, user_id: str) -> Job | None:
        return _job_or_none(await self._fetchrow("job_get", job_id, user_id))

    async def list_jobs(
        self, user_id: str, *, before_seq: int | None = None, limit: int = 50
    ) -> list[JobSummary]:
        """A page of the user's jobs, newest first: those admitted before ``before_seq`` (a
        job's ``queue_seq``; None: from the newest)."""
        rows = await self._fetch("job_list_page", user_id, before_seq, limit)
        return [JobSummary.from_row(r) for r in rows]

    async def job_for_recheck(self, job_id: UUID, user_id: str) -> dict[str, Any] | None:
        row = await self._fetchrow("job_for_recheck", job_id, user_id)
        return dict(row) if row is not None else None

    # -- the event log -----------------------------------------------------------------------

    async def event_head(self, user_id: str) -> int:
        """The id of the user's latest committed event; 0 if there is none."""
        row = await self._fetchrow("job_event_head", user_id)
        return int(row["last_id"])

    async def events_after(
        self, user_id: str, after_id: int, limit: int, max_bytes: int = 1 << 20
    ) -> EventPage:
        """The user's events after ``after_id``, oldest first: at most ``limit`` of them and
        about ``max_bytes`` of job summaries, but always at least one if there is one."""
        return (await self.events_after_many({user_id: after_id}, limit, max_bytes))[user_id]

    async def events_after_many(
        self, cursors: Mapping[str, int], limit: int, max_bytes: int = 1 << 20
    ) -> dict[str, EventPage]:
        """``events_after`` for each user of ``cursors`` (user -> after this id), in one
        statement: a page for every user, empty where nothing came after, with the user's
        queue as that statement saw it."""
        users = list(cursors)
        rows = await self._fetch(
            "job_event_pages", users, [cursors[u] for u in users], limit, max_bytes
        )
        found: dict[str, list[Any]] = {u: [] for u in users}
        for r in rows:
            found[r["feed_user_id"]].append(r)
        return {
            user: EventPage(
                tuple(
                    JobEvent(
                        r["event_id"],
                        EventKind(r["kind"]),
                        r["event_at"],
                        JobSummary.from_row(r) if r["id"] is not None else None,
                    )
                    for r in mine
                ),
                more=bool(mine) and bool(mine[0]["more"]),
                queued=tuple(mine[0]["queued_ids"]) if mine else (),
            )
            for user, mine in found.items()
        }

    async def queue_positions(self, user_id: str) -> list[QueuePosition]:
        """Where each of the user's queued jobs stands, in queue order."""
        rows = await self._fetch("job_queue_positions", [user_id])
        return [QueuePosition(r["id"], r["queue_position"]) for r in rows]

    async def prune_events(self, retention_s: float, limit: int) -> int:
        row = await self._fetchrow("job_event_prune", retention_s, limit)
        return int(row["deleted"])

    # -- credits -----------------------------------------------------------------------------

    async def grant_credits(self, user_id: str, amount: int, note: str | None = None) -> int:
        row = await self._fetchrow("credit_grant", user_id, amount, note)
        return int(row["balance"])

    async def balance(self, user_id: str) -> int:
        return (await self.credits(user_id))[0]

    async def credits(self, user_id: str) -> tuple[int, int]:
        """(balance, held): the balance, and what of it clicks in flight hold until their admit
        debits it or their reservation goes."""
        row = await self._fetchrow("credit_balance", user_id)
        return int(row["balance"]), int(row["held"])

    # -- schema ------------------------------------------------------------------------------

    async def pending_migrations(self) -> list[int]:
        """Versions this code has that the database lacks, or applied with other text."""
        with wrap_errors():
            return await migrate.pending(self.pool)
