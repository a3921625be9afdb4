"""The provider ceiling under stress, with real processes.

Two ``serve`` instances with ``AQ_GLOBAL_MAX_RUNNING=5`` share the test's database and one
``core-sim`` process. Thirty users (ten of them on plans of 2 or 3 analyses at once, set through
the admin API) click at random on whichever instance is up; some cancel what they just admitted;
the simulator's judging time changes every few seconds and it finishes some runs early (a few
of them failed). Mid-load one instance is SIGKILLed and started again a few seconds later, then
the other one.

While that runs, a sampler reads the database every 50 ms (one statement, so one consistent
snapshot): never more than 5 jobs pending or running, never a user with more active first-pass
jobs than their limit. Afterwards every job must finish, and the test checks: every admit
answered 201 is a row (no lost job); the invariants and the whole history (per-user limit,
FIFO within each user, the ceiling, from promoted_at/finished_at); the simulator never had more
than 5 runs judging at once; PostgreSQL counted no deadlock and no instance logged one; some jobs
waited for provider capacity and a good number succeeded.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import orjson
import pytest
from analysis_queue.http.auth import mint_token
from procs import SECRETS, SERVICE_ENV, Node, Proc, base_env, cli
from support import assert_within_limits, check_invariants, fetch, fetchval, free_port, thesis_body

pytestmark = [pytest.mark.acceptance, pytest.mark.slow]

CEILING = 5
USERS = [f"stress-user-{i:02d}" for i in range(30)]
LIMITS = {u: 2 for u in USERS[:6]} | {u: 3 for u in USERS[6:10]}
GRANT = 100_000

LOAD_S = 22.0
ADMITTERS = 10  # concurrent clicking loops
ADMIT_PAUSE_S = (0.05, 0.3)  # between one loop's clicks
# The loops hold off while this many jobs are queued, so that the queue drains in bounded time
# after the load; below it the ceiling is the bottleneck, and jobs wait for provider capacity.
MAX_QUEUED = 60
CANCEL_SHARE = 0.15  # of admitted jobs, cancelled (DELETE) 0-1.5s later
# Every so often a user cancels one of their *running* jobs: its slot must not free before Core
# stopped judging it, or the job promoted into the slot judges beside it (Core over the ceiling).
CANCEL_RUNNING_EVERY_S = 0.1
FINISH_EARLY_EVERY_S = 0.25  # the simulator ends one judging run early this often
FAILED_SHARE = 0.1  # of the runs ended early, ended as failed
JUDGE_TIMES_S = (0.05, 0.1, 0.2, 0.3)
JUDGE_CHANGE_EVERY_S = 2.0
# (seconds into the load, instance, seconds down): SIGKILL, then start it again.
KILLS = ((5.0, "a", 3.0), (13.0, "b", 3.0))
CLICKS_AT_KILL = 10  # sent to the instance 20 ms before its SIGKILL, so some are cut off
# Plan customers' bursts: the other users pause until the queue is empty, then two users with a
# limit of 3 click five times each at once, judged slowly. The ceiling fills with their jobs
# alone, so one of them runs 3 at once (5 slots, at most 3 each): their limits are exercised.
BURSTS_AT_S = (10.0, 19.0)
BURST_USERS = 2
BURST_CLICKS = 5
BURST_JUDGE_S = 0.3
BURST_HOLD_S = 1.5
QUIET_WAIT_S = 5.0

SAMPLE_EVERY_S = 0.05
REQUEST_TIMEOUT_S = 12.0
ADMIT_GIVE_UP_S = 15.0  # an admit retried on the other instance (same Idempotency-Key) this long
DRAIN_TIMEOUT_S = 60.0
MIN_SUCCEEDED = 100
# An instance that is down or shutting down; Core unreachable for a moment.
TOLERATED_503 = {"database_unavailable", "shutting_down", "core_unavailable"}

SAMPLE_SQL = """
WITH open AS (
    SELECT user_id, status, waiting_for, delta_of_job_id
      FROM analysis_jobs
     WHERE status IN ('queued', 'pending', 'running'))
SELECT (SELECT count(*) FROM open WHERE status <> 'queued') AS active,
       (SELECT count(*) FROM open WHERE status = 'queued') AS queued,
       (SELECT count(*) FROM open WHERE waiting_for = 'provider_capacity') AS ready,
       (SELECT coalesce(jsonb_object_agg(u.user_id, u.n), '{}')
          FROM (SELECT user_id, count(*) AS n FROM open
                 WHERE status <> 'queued' AND delta_of_job_id IS NULL
                 GROUP BY user_id) u) AS per_user,
       (SELECT coalesce(jsonb_agg(jsonb_build_object('user', o.user_id, 'active', o.n,
                                                     'limit', o.lim)), '[]')
          FROM (SELECT user_id, count(*) AS n, aq_user_limit_v1(user_id) AS lim FROM open
                 WHERE status <> 'queued' AND delta_of_job_id IS NULL
                 GROUP BY user_id
                HAVING count(*) > aq_user_limit_v1(user_id)) o) AS over_limit
"""

DEADLOCKS_SQL = "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"

OPEN_SQL = """
SELECT id, user_id, status, waiting_for, core_run_id, claimed_by, claim_expires_at,
       release_attempts, error_code, promoted_at
  FROM analysis_jobs
 WHERE status IN ('queued', 'pending', 'running')
 ORDER BY queue_seq
"""

TOTALS_SQL = """
SELECT count(*) AS jobs,
       count(*) FILTER (WHERE status = 'succeeded') AS succeeded,
       count(*) FILTER (WHERE status = 'failed') AS failed,
       count(*) FILTER (WHERE status = 'cancelled') AS cancelled,
       count(*) FILTER (WHERE status = 'cancelled' AND promoted_at IS NOT NULL)
           AS cancelled_active,
       count(*) FILTER (WHERE promoted_at IS NOT NULL) AS promoted,
       count(*) FILTER (WHERE release_attempts > 1) AS released_twice
  FROM analysis_jobs
"""


@dataclass
class Samples:
    """What the sampler saw in the database while the load ran."""

    n: int = 0
    max_active: int = 0
    max_queued: int = 0
    max_ready: int = 0
    with_ready: int = 0  # samples with a job waiting for provider capacity
    at_ceiling: int = 0  # samples with the ceiling full
    max_per_user: dict[str, int] = field(default_factory=dict)
    over_ceiling: list[str] = field(default_factory=list)
    over_limit: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def add(self, row: asyncpg.Record, at: float) -> None:
        self.n += 1
        active, queued, ready = int(row["active"]), int(row["queued"]), int(row["ready"])
        self.max_active = max(self.max_active, active)
        self.max_queued = max(self.max_queued, queued)
        self.max_ready = max(self.max_ready, ready)
        self.with_ready += ready > 0
        self.at_ceiling += active >= CEILING
        for user, n in orjson.loads(row["per_user"]).items():
            self.max_per_user[user] = max(self.max_per_user.get(user, 0), int(n))
        if active > CEILING:
            self.over_ceiling.append(f"t={at:.2f}s: {active} pending/running")
        for over in orjson.loads(row["over_limit"]):
            self.over_limit.append(
                f"t={at:.2f}s: {over['user']} {over['active']} active, limit {over['limit']}"
            )


class Stress:
    """The processes, the clicking users and the checks."""

    def __init__(self, dsn: str, tmp: Path, http: aiohttp.ClientSession) -> None:
        self.dsn = dsn
        self.tmp = tmp
        self.http = http
        self.nodes = [Node("a", free_port()), Node("b", free_port())]
        self.sim_port = free_port()
        self.procs: list[Proc] = []
        self.auth = {
            u: {"Authorization": f"Bearer {mint_token(u, SECRETS['AQ_JWT_SECRET'])}"} for u in USERS
        }
        self.admin = {"Authorization": f"Bearer {SECRETS['AQ_ADMIN_TOKEN']}"}
        self.admitted: dict[str, str] = {}  # job id -> user, every id answered 201
        self.cancelling: set[str] = set()
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.unexpected: list[str] = []
        self.events: list[str] = []  # what the chaos did, when
        self.samples = Samples()
        self.queued = 0  # as last sampled: the clicking loops hold off above MAX_QUEUED
        self.active = 0  # as last sampled
        self.quiet = asyncio.Event()  # set during a burst: only the burst's users click
        self.stop = asyncio.Event()
        self.started = time.monotonic()
        self._n = 0
        self._inflight: set[asyncio.Task[Any]] = set()  # cancels, clicks at a kill

    @property
    def sim_url(self) -> str:
        return f"http://127.0.0.1:{self.sim_port}"

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.live]

    def at(self) -> float:
        return time.monotonic() - self.started

    # -- processes ---------------------------------------------------------------------------

    async def start(self) -> None:
        callbacks = [a for n in self.nodes for a in ("--callback-url", f"{n.base}/v1/core/events")]
        args = cli("core-sim", "--port", str(self.sim_port), "--judge-time", "0.1", *callbacks)
        sim = Proc("core-sim", args, base_env(self.tmp), self.tmp / "core-sim.log")
        self.procs.append(sim)
        await self._ready(self.sim_url + "/_sim/stats", sim)
        for node in self.nodes:
            await self.start_node(node)

    async def start_node(self, node: Node) -> None:
        node.starts += 1
        name = f"{node.name}{node.starts}"
        env = base_env(
            self.tmp,
            **SERVICE_ENV,
            AQ_DATABASE_URL=self.dsn,
            AQ_CORE_URL=self.sim_url,
            AQ_PORT=str(node.port),
            AQ_INSTANCE_ID=f"stress-{name}",
            AQ_GLOBAL_MAX_RUNNING=str(CEILING),
        )
        node.proc = Proc(f"serve-{name}", cli("serve"), env, self.tmp / f"serve-{name}.log")
        self.procs.append(node.proc)
        await self._ready(node.base + "/readyz", node.proc)
        node.live = True

    async def _ready(self, url: str, proc: Proc) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert proc.alive, f"{proc.name} exited:\n{proc.text()[-3000:]}"
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with self.http.get(url, timeout=aiohttp.ClientTimeout(total=3)) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
        raise AssertionError(f"{proc.name} not ready in 30s:\n{proc.text()[-3000:]}")

    async def kill_and_restart(self, name: str, down_s: float) -> None:
        node = self.node(name)
        assert node.proc is not None
        pid = node.proc.popen.pid
        for _ in range(CLICKS_AT_KILL):
            self._n += 1
            self._spawn(self.admit(random.choice(USERS), self._n, first=node))
        await asyncio.sleep(0.02)
        node.live = False
        node.proc.send(signal.SIGKILL)
        code = await node.proc.wait_exit(5)
        assert code == -signal.SIGKILL, f"{node.name} did not die of SIGKILL: {code}"
        self.events.append(f"t={self.at():.1f}s SIGKILL {name} (pid {pid})")
        await asyncio.sleep(down_s)
        await self.start_node(node)
        assert node.proc is not None
        self.events.append(f"t={self.at():.1f}s {name} up again (pid {node.proc.popen.pid})")

    def kill_all(self) -> None:
        for proc in self.procs:
            proc.kill()

    def serve_logs(self) -> list[Proc]:
        return [p for p in self.procs if p.name.startswith("serve-")]

    def logs(self, *needles: str) -> str:
        return "\nlog excerpts:\n" + "\n".join(p.excerpt(*needles) for p in self.serve_logs())

    # -- setup -------------------------------------------------------------------------------

    async def setup_users(self) -> None:
        base = self.nodes[0].base
        for user in USERS:
            async with self.http.post(
                f"{base}/v1/admin/credits",
                json={"user_id": user, "amount": GRANT},
                headers=self.admin,
            ) as r:
                assert r.status == 200, await r.text()
        for user, limit in LIMITS.items():
            async with self.http.put(
                f"{base}/v1/admin/users/{user}/limit",
                json={"max_running": limit},
                headers=self.admin,
            ) as r:
                assert r.status == 200, await r.text()
        rows = await fetch(
            self.dsn, "SELECT u, aq_user_limit_v1(u) AS lim FROM unnest($1::text[]) u", USERS
        )
        assert {r["u"]: r["lim"] for r in rows} == {u: LIMITS.get(u, 1) for u in USERS}
        ceiling = await fetchval(self.dsn, "SELECT global_max_running FROM queue_settings")
        assert ceiling == CEILING, f"the database's ceiling is {ceiling}"

    # -- simulator ---------------------------------------------------------------------------

    async def sim_get(self, path: str) -> Any:
        async with self.http.get(self.sim_url + path) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    async def sim_post(self, path: str, body: dict[str, Any] | None = None) -> int:
        async with self.http.post(self.sim_url + path, json=body) as r:
            await r.read()
            return r.status

    # -- the load ----------------------------------------------------------------------------

    async def clicker(self) -> None:
        while not self.stop.is_set():
            await asyncio.sleep(random.uniform(*ADMIT_PAUSE_S))
            if self.queued >= MAX_QUEUED or self.quiet.is_set() or not self.live():
                continue
            self._n += 1
            job_id = await self.admit(random.choice(USERS), self._n)
            if job_id is not None and random.random() < CANCEL_SHARE:
                self._spawn(self.cancel_later(job_id))

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def admit(self, user: str, n: int, first: Node | None = None) -> str | None:
        """One click (on ``first`` if given); on a dead instance, the same click
        (Idempotency-Key) on the other one."""
        headers = {**self.auth[user], "Idempotency-Key": f"stress-{n}"}
        deadline = time.monotonic() + ADMIT_GIVE_UP_S
        while time.monotonic() < deadline:
            nodes = self.live()
            if first is None and not nodes:
                await asyncio.sleep(0.1)
                continue
            node, first = first or random.choice(nodes), None
            status, body = await self.call("POST", node, "/v1/analyses", headers, thesis_body(n))
            code = body.get("code") if isinstance(body, dict) else None
            if status == 201:
                assert isinstance(body, dict)
                self.admitted[str(body["id"])] = user
                self.outcomes["admit 201"] += 1
                return str(body["id"])
            if self._retry(f"admit@{node.name}", status, code):
                await asyncio.sleep(0.2)
                continue
            self.unexpected.append(f"admit on {node.name}: {status} {body}")
            return None
        self.outcomes["admit given up"] += 1
        return None

    def _retry(self, what: str, status: int | str, code: str | None) -> bool:
        """Count an answer that says "try again" (and retry it); False for any other."""
        if isinstance(status, str):
            self.outcomes[f"{what} {status}"] += 1
            return True
        if (status == 503 and code in TOLERATED_503) or code == "idempotency_in_progress":
            self.outcomes[f"{what} {status} {code}"] += 1
            return True
        return False

    async def cancel_later(self, job_id: str, delay_s: float | None = None) -> None:
        if job_id in self.cancelling:
            return  # a user cancels a job once
        self.cancelling.add(job_id)
        await asyncio.sleep(random.uniform(0, 1.5) if delay_s is None else delay_s)
        user, retried = self.admitted[job_id], False
        deadline = time.monotonic() + ADMIT_GIVE_UP_S
        while time.monotonic() < deadline:
            nodes = self.live()
            if not nodes:
                await asyncio.sleep(0.1)
                continue
            node = random.choice(nodes)
            path = f"/v1/analyses/{job_id}"
            status, body = await self.call("DELETE", node, path, self.auth[user])
            code = body.get("code") if isinstance(body, dict) else None
            if status == 200 or (status == 404 and retried):  # an earlier try went through
                self.outcomes[f"delete {status}"] += 1
                return
            if self._retry(f"delete@{node.name}", status, code):
                retried = True
                await asyncio.sleep(0.2)
                continue
            self.unexpected.append(f"delete {job_id} on {node.name}: {status} {body}")
            return
        self.outcomes["delete given up"] += 1

    async def call(
        self, method: str, node: Node, path: str, headers: dict[str, str], body: Any = None
    ) -> tuple[int | str, Any]:
        """Status and JSON body, or the name of the connection error in place of a status."""
        started = time.monotonic()
        try:
            async with self.http.request(
                method,
                node.base + path,
                json=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
            ) as r:
                return r.status, await r.json(content_type=None)
        except TimeoutError:
            took = time.monotonic() - started
            self.unexpected.append(f"{method} {path} on {node.name}: no answer in {took:.1f}s")
            return "Timeout", None
        except (aiohttp.ClientError, ValueError) as exc:
            return type(exc).__name__, None

    async def provider(self) -> None:
        """Change the judging time now and then; end a judging run early now and then."""
        next_change = 0.0
        while not self.stop.is_set():
            if self.quiet.is_set():  # a burst sets its own judging time
                await asyncio.sleep(FINISH_EARLY_EVERY_S)
                continue
            if time.monotonic() >= next_change:
                judge = random.choice(JUDGE_TIMES_S)
                assert await self.sim_post("/_sim/faults", {"judge_time_s": judge}) == 200
                self.outcomes[f"judge_time {judge}s"] += 1
                next_change = time.monotonic() + JUDGE_CHANGE_EVERY_S
            judging = [r["id"] for r in await self.sim_get("/_sim/runs") if r["state"] == "judging"]
            if judging:
                state = "failed" if random.random() < FAILED_SHARE else "completed"
                finish = {"state": state, "error": "stress_test"}
                status = await self.sim_post(f"/_sim/runs/{random.choice(judging)}/finish", finish)
                # 409: it finished on its own (or was cancelled) meanwhile.
                self.outcomes[f"sim finish {state} {status}"] += 1
            await asyncio.sleep(FINISH_EARLY_EVERY_S)

    async def running_canceller(self) -> None:
        """Cancel a running job now and then, as its user would."""
        while not self.stop.is_set():
            await asyncio.sleep(CANCEL_RUNNING_EVERY_S)
            if self.quiet.is_set():
                continue
            rows = await fetch(
                self.dsn,
                """SELECT id FROM analysis_jobs WHERE status = 'running'
                    ORDER BY random() LIMIT 1""",
            )
            if rows and str(rows[0]["id"]) in self.admitted:
                self._spawn(self.cancel_later(str(rows[0]["id"]), delay_s=0.0))
                self.outcomes["cancel running"] += 1

    async def sampler(self) -> None:
        conn = await asyncpg.connect(self.dsn)
        try:
            while not self.stop.is_set():
                try:
                    row = await conn.fetchrow(SAMPLE_SQL)
                except asyncpg.PostgresError as exc:
                    self.samples.errors.append(f"t={self.at():.2f}s: {exc!r}")
                else:
                    assert row is not None
                    self.samples.add(row, self.at())
                    self.queued, self.active = int(row["queued"]), int(row["active"])
                await asyncio.sleep(SAMPLE_EVERY_S)
        finally:
            await conn.close()

    async def chaos(self) -> None:
        for at, name, down_s in KILLS:
            await asyncio.sleep(max(0.0, at - self.at()))
            await self.kill_and_restart(name, down_s)

    async def bursts(self) -> None:
        for at in BURSTS_AT_S:
            await asyncio.sleep(max(0.0, at - self.at()))
            await self.burst()

    async def burst(self) -> None:
        self.quiet.set()
        try:
            paused = self.at()
            deadline = time.monotonic() + QUIET_WAIT_S
            while (self.queued or self.active) and time.monotonic() < deadline:
                await asyncio.sleep(SAMPLE_EVERY_S)
            idle = not (self.queued or self.active)
            assert await self.sim_post("/_sim/faults", {"judge_time_s": BURST_JUDGE_S}) == 200
            users = random.sample(sorted(u for u, n in LIMITS.items() if n == 3), BURST_USERS)
            clicks = []
            for user in users:
                for _ in range(BURST_CLICKS):
                    self._n += 1
                    clicks.append(self.admit(user, self._n))
            started = self.at()
            await asyncio.gather(*clicks)
            self.events.append(
                f"t={started:.1f}s burst {users} x{BURST_CLICKS} "
                f"({'on an idle queue' if idle else 'queue NOT idle'} after "
                f"{started - paused:.1f}s quiet)"
            )
            await asyncio.sleep(BURST_HOLD_S)
        finally:
            self.quiet.clear()

    async def run_load(self) -> None:
        self.started = time.monotonic()
        self.stop.clear()
        background: list[Callable[[], Awaitable[None]]] = [
            self.sampler,
            self.provider,
            self.running_canceller,
        ]
        tasks = [asyncio.create_task(f()) for f in background]
        tasks += [asyncio.create_task(self.clicker()) for _ in range(ADMITTERS)]
        chaos = [asyncio.create_task(self.chaos()), asyncio.create_task(self.bursts())]
        try:
            await asyncio.sleep(LOAD_S)
            await asyncio.gather(*chaos)  # both instances are up again, the bursts done
        finally:
            self.stop.set()
            for task in chaos:
                task.cancel()
            results = await asyncio.gather(*tasks, *chaos, return_exceptions=True)
            if self._inflight:
                await asyncio.wait(set(self._inflight), timeout=ADMIT_GIVE_UP_S + 5)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                raise result

    # -- after the load ----------------------------------------------------------------------

    async def drain(self) -> float:
        """Wait until no job is queued, pending or running; seconds it took."""
        started = time.monotonic()
        while True:
            open_jobs = await fetch(self.dsn, OPEN_SQL)
            if not open_jobs:
                return time.monotonic() - started
            if time.monotonic() - started > DRAIN_TIMEOUT_S:
                runs = {r["id"]: r["state"] for r in await self.sim_get("/_sim/runs")}
                shown = [
                    {**dict(j), "core_state": runs.get(j["core_run_id"])} for j in open_jobs[:8]
                ]
                ids = [str(j["id"]) for j in open_jobs[:3]]
                raise AssertionError(
                    f"{len(open_jobs)} jobs still open {DRAIN_TIMEOUT_S}s after the load "
                    f"stopped: {shown}" + self.logs() + self.logs(*ids)
                )
            await asyncio.sleep(0.25)

    async def sim_idle(self) -> dict[str, int]:
        """The simulator's statistic once nothing judges any more (bounded wait)."""
        deadline = time.monotonic() + 10
        while True:
            stats: dict[str, int] = await self.sim_get("/_sim/stats")
            if stats["judging"] == 0 or time.monotonic() > deadline:
                return stats
            await asyncio.sleep(0.1)

    def log_lines(self, *needles: str) -> list[str]:
        return [
            f"[{p.name}] {line[:400]}"
            for p in self.procs
            for line in p.text().splitlines()
            if any(n in line for n in needles)
        ]


async def deadlocks(dsn: str) -> int:
    # Backends flush their statistics within about a second of going idle.
    await asyncio.sleep(1.2)
    return int(await fetchval(dsn, DEADLOCKS_SQL))


@pytest.fixture
async def stress(database_url: str, tmp_path: Path) -> AsyncIterator[Stress]:
    async with aiohttp.ClientSession() as http:
        s = Stress(database_url, tmp_path, http)
        try:
            yield s
        finally:
            s.stop.set()  # whatever happened: no process outlives the test
            s.kill_all()


@pytest.mark.timeout(180)
async def test_ceiling_holds_under_stress_with_instances_killed(stress: Stress) -> None:
    s = stress
    began = time.monotonic()
    deadlocks_before = await deadlocks(s.dsn)
    await s.start()
    await s.setup_users()
    print(
        f"\n[setup] core-sim :{s.sim_port}, instances a :{s.node('a').port} and "
        f"b :{s.node('b').port}, ceiling {CEILING}, {len(USERS)} users ({len(LIMITS)} with "
        f"limits 2-3); logs in {s.tmp}",
        flush=True,
    )

    await s.run_load()
    assert not s.unexpected, (
        "answers other than 201/200, a tolerated 503 or a connection error (first 10 of "
        f"{len(s.unexpected)}): {s.unexpected[:10]}" + s.logs()
    )
    drained_s = await s.drain()

    # While it ran: the sampler's view of the database.
    smp = s.samples
    assert not smp.errors, f"the sampler's queries failed: {smp.errors[:5]}"
    assert smp.n > LOAD_S / SAMPLE_EVERY_S / 3, f"only {smp.n} samples"
    assert not smp.over_ceiling, f"over the ceiling: {smp.over_ceiling[:10]}"
    assert not smp.over_limit, f"users over their limit: {smp.over_limit[:10]}"
    assert smp.with_ready > 0, "no job ever waited for provider capacity: no stress on the ceiling"

    # No lost job: every 201 is a row, and none is left open (drain).
    ids = list(s.admitted)
    found = await fetchval(
        s.dsn, "SELECT count(*) FROM analysis_jobs WHERE id = ANY ($1::uuid[])", ids
    )
    assert found == len(ids), f"{len(ids) - found} jobs answered 201 are not in the database"

    # The whole history: per-user limits, FIFO within each user, the ceiling; the ledger.
    await check_invariants(s.dsn)
    seen = await assert_within_limits(s.dsn)

    # What the provider saw.
    stats = await s.sim_idle()
    assert stats["judging"] == 0, f"runs still judging with every job finished: {stats}"
    assert stats["max_judging"] <= CEILING, (
        f"Core had {stats['max_judging']} runs judging at once, ceiling {CEILING}"
    )

    # Deadlocks: none counted by PostgreSQL, none logged.
    deadlocks_after = await deadlocks(s.dsn)
    logged = s.log_lines("40P01", "deadlock detected")
    assert deadlocks_after == deadlocks_before, (
        f"pg_stat_database.deadlocks went {deadlocks_before} -> {deadlocks_after}; logged: "
        f"{logged[:5]}"
    )
    assert not logged, "deadlocks logged:\n" + "\n".join(logged[:10])

    # The plan limits were exercised: a user with a limit of 3 ran 3 at once (the bursts).
    at_limit = sorted(u for u, n in LIMITS.items() if seen.get(u, 0) == n)
    assert any(LIMITS[u] == 3 for u in at_limit), (
        f"no user with a limit of 3 ever ran 3 at once: {[(u, seen.get(u)) for u in LIMITS]}"
    )

    totals = (await fetch(s.dsn, TOTALS_SQL))[0]
    assert totals["succeeded"] > MIN_SUCCEEDED, f"only {totals['succeeded']} jobs succeeded"
    errors = s.log_lines('"level":"error"', '"level":"critical"')
    limited_peaks = collections.Counter(seen.get(u, 0) for u in LIMITS)
    outcomes = ", ".join(f"{k} x{v}" for k, v in sorted(s.outcomes.items()))
    print(
        f"\n[chaos] {'; '.join(s.events)}\n"
        f"[load] {LOAD_S:.0f}s, {len(s.admitted)} admitted (201); answers: {outcomes}\n"
        f"[database] {totals['jobs']} jobs: {totals['succeeded']} succeeded, "
        f"{totals['failed']} failed, {totals['cancelled']} cancelled "
        f"({totals['cancelled_active']} after promotion), {totals['released_twice']} claimed "
        f"more than once; drained {drained_s:.1f}s after the load\n"
        f"[samples] {smp.n}: max active {smp.max_active} (ceiling {CEILING}, full in "
        f"{smp.at_ceiling}), max queued {smp.max_queued}, waiting for provider capacity in "
        f"{smp.with_ready} (max {smp.max_ready}); per-user limit never exceeded\n"
        f"[history] most at once overall {seen['*']}; users with a limit of 2-3 peaked at "
        f"{dict(sorted(limited_peaks.items()))} (peak: users); at their limit: {at_limit}\n"
        f"[provider] sim max_judging {stats['max_judging']}; deadlocks "
        f"{deadlocks_before} -> {deadlocks_after}; error log lines {len(errors)}\n"
        f"[summary] jobs {totals['jobs']}, succeeded {totals['succeeded']}, cancelled "
        f"{totals['cancelled']}, max active seen {smp.max_active}, sim max_judging "
        f"{stats['max_judging']}, deadlocks {deadlocks_after - deadlocks_before}, "
        f"took {time.monotonic() - began:.0f}s",
        flush=True,
    )
    if errors:
        print("[error lines]\n  " + "\n  ".join(errors[:10]), flush=True)
