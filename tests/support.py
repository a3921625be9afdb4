"""Test support: real service instances in-process, a shared Core simulator, and the service's
own Python client (``analysis_queue.client``) for the calls a test makes along the way."""

from __future__ import annotations

import asyncio
import itertools
import re
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import asyncpg
from aiohttp import web
from analysis_queue.app import build_app, start_site
from analysis_queue.client import NO_RETRIES, AdminClient, AnalysisQueueClient, ProblemError
from analysis_queue.config import Settings
from analysis_queue.dev.core_sim import CoreSimulator
from analysis_queue.http.auth import mint_token
from analysis_queue.http.state import SERVICES, Services
from analysis_queue.models import Job, JobStatus

_JOB_PATH = re.compile(r"/v1/analyses/([0-9a-fA-F-]{36})")
JWT_SECRET = "test-jwt-secret-0123456789abcdef0123"
ADMIN_TOKEN = "test-admin-token"
CALLBACK_SECRET = "test-callback-secret"


def make_job(**overrides: Any) -> Job:
    """A job as the database would return it: queued, first in its queue, unless told otherwise."""
    values: dict[str, Any] = {
        "id": uuid.uuid4(),
        "user_id": "alice",
        "run_id": uuid.uuid4(),
        "core_run_id": "core-1",
        "status": JobStatus.QUEUED,
        "queue_seq": 7,
        "delta_of_job_id": None,
        "deleted_at": None,
        "thesis": {"title": "T", "document_url": "https://uni.example/t.pdf"},
        "sources": ["10.1000/x"],
        "cost": 1,
        "created_at": datetime(2030, 1, 1, tzinfo=UTC),
        "promoted_at": None,
        "started_at": None,
        "finished_at": None,
        "release_attempts": 0,
        "next_release_at": None,
        "error_code": None,
        "error_detail": None,
        "verdicts": None,
        "queue_position": 1,
    }
    values.update(overrides)
    return Job(**values)


def with_database(dsn: str, dbname: str) -> str:
    """``dsn`` with its database replaced, its host kept (a socket directory in the query too)."""
    return urlunsplit(urlsplit(dsn)._replace(path="/" + dbname))


def database_name(dsn: str) -> str:
    return urlsplit(dsn).path.lstrip("/")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def thesis_body(n: int = 1, sources: int = 2) -> dict[str, Any]:
    return {
        "thesis": {"title": f"Thesis {n}", "document_url": f"https://uni.example/t/{n}.pdf"},
        "sources": [f"10.1000/t{n}.{k}" for k in range(sources)],
    }


async def wait_for(
    predicate: Callable[[], Awaitable[bool]], timeout_s: float = 10.0, what: str = "condition"
) -> None:
    """Poll a database predicate until true. Tests of *when* something happens use events."""
    deadline = time.monotonic() + timeout_s
    while True:
        if await predicate():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)


async def wait_until_blocked(
    dsn: str, holder_pid: int, *, count: int = 1, timeout_s: float = 10.0
) -> None:
    """Wait until ``count`` backends are seen waiting for a lock that ``holder_pid`` holds: the
    fact that proves a transaction waits for another, instead of sleeping and assuming it."""

    async def blocked() -> bool:
        n = await fetchval(
            dsn,
            "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
            holder_pid,
        )
        return bool(n >= count)

    await wait_for(blocked, timeout_s=timeout_s, what=f"{count} waiting for backend {holder_pid}")


@dataclass
class Instance:
    runner: web.AppRunner
    base_url: str
    settings: Settings

    @property
    def services(self) -> Services:
        return self.runner.app[SERVICES]

    async def stop(self) -> None:
        await self.runner.cleanup()


@dataclass
class Harness:
    """Service instances in-process on one database (``database_url``, which the test's own
    queries use), reached the ``route``'s way: directly, or through PgBouncer (tests/bouncer.py)."""

    database_url: str
    tmp: Path
    sim: CoreSimulator
    http: aiohttp.ClientSession
    instances: list[Instance] = field(default_factory=list)
    route: Any = None  # a bouncer.Route; None: direct

    async def start_instance(self, **overrides: Any) -> Instance:
        port = free_port()
        values: dict[str, Any] = {
            "database_url": self.database_url,
            **(self.route.settings(self.database_url) if self.route is not None else {}),
            "core_url": self.sim.base_url,
            "core_callback_secret": CALLBACK_SECRET,
            "jwt_secret": JWT_SECRET,
            "admin_token": ADMIN_TOKEN,
            "host": "127.0.0.1",
            "port": port,
            "sweep_interval_s": 0,
            "data_dir": self.tmp,
            "instance_id": f"test-{len(self.instances)}",
            "release_backoff_base_s": 0.05,
            "release_backoff_max_s": 0.2,
        }
        values.update(overrides)
        settings = Settings(**values)
        runner = web.AppRunner(build_app(settings), access_log=None)
        await runner.setup()
        await start_site(runner, "127.0.0.1", port)
        instance = Instance(runner, f"http://127.0.0.1:{port}", settings)
        self.instances.append(instance)
        self.sim.callback_urls.append(f"{instance.base_url}/v1/core/events")
        if instance.services.listener is not None:
            await asyncio.wait_for(instance.services.listener.connected.wait(), 10)
        return instance

    async def stop_instance(self, instance: Instance) -> None:
        url = f"{instance.base_url}/v1/core/events"
        if url in self.sim.callback_urls:
            self.sim.callback_urls.remove(url)
        await instance.stop()
        self.instances.remove(instance)

    def auth(self, user: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {mint_token(user, JWT_SECRET)}"}

    def client(self, user: str, instance: Instance | None = None) -> AnalysisQueueClient:
        """``user``'s client of ``instance`` (the first by default), on the harness's session.
        Without retries: a test sees each answer the service gave."""
        target = instance or self.instances[0]
        return AnalysisQueueClient(
            target.base_url, mint_token(user, JWT_SECRET), session=self.http, retry=NO_RETRIES
        )

    def admin_client(self) -> AdminClient:
        return AdminClient(
            self.instances[0].base_url, ADMIN_TOKEN, session=self.http, retry=NO_RETRIES
        )

    async def grant(self, user: str, amount: int) -> None:
        await self.admin_client().grant_credits(user, amount)

    async def admin(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> tuple[int, Any]:
        """An admin call by hand, for tests of the admin routes' answers themselves."""
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with self.http.request(
            method, f"{self.instances[0].base_url}{path}", json=body, headers=headers
        ) as r:
            return r.status, await r.json(content_type=None)

    async def set_limit(self, user: str, max_running: int | None) -> None:
        await self.admin_client().set_user_limit(user, max_running)

    async def admit(
        self,
        user: str,
        n: int = 1,
        *,
        instance: Instance | None = None,
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """Admit ``body`` (``thesis_body(n)`` by default) through the client: ``(201, the job
        as JSON)``, or ``(status, the problem document)`` when it is refused. With ``headers``
        the request is sent by hand instead, for tests of what the edge makes of them."""
        target = instance or self.instances[0]
        body = body or thesis_body(n)
        if headers is not None:
            async with self.http.post(
                f"{target.base_url}/v1/analyses",
                json=body,
                headers={**self.auth(user), **headers},
            ) as r:
                return r.status, await r.json(content_type=None)
        thesis = body["thesis"]
        try:
            job = await self.client(user, target).start_analysis(
                thesis["title"], thesis["document_url"], body["sources"]
            )
        except ProblemError as exc:
            return exc.status, exc.problem.model_dump(mode="json", exclude_unset=True)
        return 201, job.model_dump(mode="json")

    async def get(self, user: str, path: str) -> tuple[int, Any]:
        """GET ``path`` as ``user``: ``(status, the JSON answer)``. A job and the balance are
        read through the client; anything else (a page and its query, say) by hand, for tests
        of the answer itself."""
        aq = self.client(user)
        job = _JOB_PATH.fullmatch(path)
        try:
            if job is not None:
                return 200, (await aq.get_analysis(job[1])).model_dump(mode="json")
            if path == "/v1/credits":
                return 200, {"balance": await aq.credits()}
        except ProblemError as exc:
            return exc.status, exc.problem.model_dump(mode="json", exclude_unset=True)
        async with self.http.get(
            f"{self.instances[0].base_url}{path}", headers=self.auth(user)
        ) as r:
            return r.status, await r.json(content_type=None)

    async def db(self) -> asyncpg.Connection[Any]:
        return await asyncpg.connect(self.database_url)

    async def close(self) -> None:
        # Core's callbacks first: a connection accepted while an instance stops could escape
        # its shutdown and be left open when the test's loop closes.
        await self.sim.quiesce()
        for instance in list(self.instances):
            await instance.stop()
        self.instances.clear()
        await self.http.close()
        await self.sim.stop()


async def fetch(dsn: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()


async def fetchval(dsn: str, sql: str, *args: Any) -> Any:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(sql, *args)
    finally:
        await conn.close()


async def check_invariants(dsn: str) -> None:
    """What must hold at every moment, read from the database."""
    conn = await asyncpg.connect(dsn)
    try:
        drift = await conn.fetch(
            """SELECT a.user_id, a.balance,
                      coalesce(sum(CASE l.kind WHEN 'grant' THEN l.amount
                                               WHEN 'debit' THEN -l.amount
                                               WHEN 'refund' THEN l.amount END), 0) AS ledger
                 FROM credit_accounts a LEFT JOIN credit_ledger l USING (user_id)
                GROUP BY a.user_id, a.balance
               HAVING a.balance <> coalesce(sum(CASE l.kind WHEN 'grant' THEN l.amount
                                               WHEN 'debit' THEN -l.amount
                                               WHEN 'refund' THEN l.amount END), 0)"""
        )
        assert not drift, f"balance != grants - debits + refunds: {drift}"
        # What clicks in flight hold (aq_reserve_v2) is part of the balance, never more.
        over_held = await conn.fetch(
            """SELECT c.user_id, sum(c.cost) AS held, coalesce(max(a.balance), 0) AS balance
                 FROM core_run_reservations c LEFT JOIN credit_accounts a USING (user_id)
                GROUP BY c.user_id
               HAVING sum(c.cost) > coalesce(max(a.balance), 0)"""
        )
        assert not over_held, f"holds beyond the balance: {over_held}"
        over_limit = await conn.fetch(
            """SELECT user_id, count(*) FROM analysis_jobs
                WHERE status IN ('pending', 'running') AND delta_of_job_id IS NULL
                  AND deleted_at IS NULL
                GROUP BY user_id HAVING count(*) > aq_user_limit_v1(user_id)"""
        )
        assert not over_limit, f"more active first-pass jobs than the user's limit: {over_limit}"
        over_ceiling = await conn.fetchval(
            """SELECT count(*) FROM analysis_jobs WHERE status IN ('pending', 'running')
               HAVING count(*) > (SELECT global_max_running FROM queue_settings)"""
        )
        assert over_ceiling is None, f"{over_ceiling} active jobs over the provider ceiling"
        missing_debit = await conn.fetch(
            """SELECT j.id FROM analysis_jobs j
                WHERE j.cost > 0 AND NOT EXISTS (
                      SELECT 1 FROM credit_ledger l WHERE l.job_id = j.id AND l.kind = 'debit')"""
        )
        assert not missing_debit, f"jobs without a debit: {missing_debit}"
        bad_refund = await conn.fetch(
            """SELECT j.id, j.status, j.started_at FROM analysis_jobs j
                WHERE j.cost > 0
                  AND (j.status = 'failed'
                       OR (j.status = 'cancelled' AND j.started_at IS NULL))
                  AND NOT EXISTS (SELECT 1 FROM credit_ledger l
                                   WHERE l.job_id = j.id AND l.kind = 'refund')"""
        )
        assert not bad_refund, f"failed/cancelled-before-running jobs not refunded: {bad_refund}"
    finally:
        await conn.close()


def max_overlap(intervals: list[tuple[Any, Any]]) -> int:
    """The most intervals [start, end) open at once; ``end`` None means still open."""
    points = []
    for start, end in intervals:
        points.append((start, 1))
        if end is not None:
            points.append((end, -1))
    # At one instant an end frees before a start takes (both are commit-ordered in practice).
    points.sort(key=lambda p: (p[0], p[1]))
    most = now = 0
    for _, step in points:
        now += step
        most = max(most, now)
    return most


async def assert_within_limits(dsn: str) -> dict[str, int]:
    """Over the whole history: each user's first-pass jobs took slots in admission order and
    never more at once than the user's limit; all jobs together never more than the ceiling
    (when one is set). Returns the most seen at once, per user and as ``"*"`` overall."""
    rows = await fetch(
        dsn,
        """SELECT user_id, queue_seq, promoted_at, finished_at, delta_of_job_id IS NULL AS first,
                  aq_user_limit_v1(user_id) AS max_running
             FROM analysis_jobs
            WHERE promoted_at IS NOT NULL
            ORDER BY user_id, queue_seq""",
    )
    ceiling = await fetchval(dsn, "SELECT global_max_running FROM queue_settings")
    seen: dict[str, int] = {}
    by_user: dict[str, list[asyncpg.Record]] = {}
    for row in rows:
        if row["first"]:
            by_user.setdefault(row["user_id"], []).append(row)
    for user, jobs in by_user.items():
        promoted = [j["promoted_at"] for j in jobs]
        assert promoted == sorted(promoted), f"{user}: promoted out of admission order"
        seen[user] = max_overlap([(j["promoted_at"], j["finished_at"]) for j in jobs])
        assert seen[user] <= jobs[0]["max_running"], f"{user}: {seen[user]} at once"
    seen["*"] = max_overlap([(r["promoted_at"], r["finished_at"]) for r in rows])
    if ceiling is not None:
        assert seen["*"] <= ceiling, f"{seen['*']} active at once, ceiling {ceiling}"
    return seen


async def assert_fifo_serial(dsn: str) -> None:
    """Each user's first-pass jobs took the slot in admission order and never overlapped.

    A job holds its user's slot from promotion (``promoted_at``) until it finishes."""
    rows = await fetch(
        dsn,
        """SELECT user_id, queue_seq, promoted_at, finished_at, status
             FROM analysis_jobs
            WHERE delta_of_job_id IS NULL AND promoted_at IS NOT NULL
            ORDER BY user_id, queue_seq""",
    )
    by_user: dict[str, list[asyncpg.Record]] = {}
    for row in rows:
        by_user.setdefault(row["user_id"], []).append(row)
    for user, jobs in by_user.items():
        for prev, nxt in itertools.pairwise(jobs):
            assert prev["finished_at"] is not None, f"{user}: a later job started first"
            assert nxt["promoted_at"] >= prev["finished_at"], f"{user}: overlap or out of order"
