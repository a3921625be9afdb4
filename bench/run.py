"""Benchmarks: how close the queue comes to what PostgreSQL on this machine can do.

    make bench            (or: .venv/bin/python bench/run.py [--quick] [--only admit,drain,...])

Starts what it needs: PostgreSQL (AQ_BENCH_DATABASE_URL / AQ_TEST_DATABASE_URL server, else the
embedded one), the service and the Core simulator as real processes (zero judging time), and a
fresh database per scenario. Prints a table and writes bench/results.json. Times are reported as
ratios measured in the same run: the machine is shared and noisy. Not a test.

Admits go through the Python client (``analysis_queue.client``) without retries, so each is one
request, timed and counted as answered; like every admit of that client, each carries an
Idempotency-Key.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import asyncpg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from analysis_queue.client import NO_RETRIES, AnalysisQueueClient, ProblemError  # noqa: E402
from analysis_queue.core.client import CoreClient  # noqa: E402
from analysis_queue.http.auth import mint_token  # noqa: E402
from analysis_queue.loops.dispatch import Dispatcher, DispatchSettings  # noqa: E402
from analysis_queue.loops.promote import Promoter  # noqa: E402
from analysis_queue.loops.sweep import Sweeper, SweepSettings  # noqa: E402
from analysis_queue.metrics import Metrics  # noqa: E402
from analysis_queue.models import (  # noqa: E402
    AdmitRequest,
    JobStatus,
    ReserveRequest,
)
from analysis_queue.queue.finish import Finisher  # noqa: E402
from analysis_queue.queue.followup import FollowUp  # noqa: E402
from analysis_queue.store.database import Claim, Database  # noqa: E402
from analysis_queue.store.listen import JOBS_CHANNEL  # noqa: E402
from analysis_queue.store.migrate import apply_migrations  # noqa: E402

SECRETS = {
    "AQ_JWT_SECRET": "bench-jwt-secret-0123456789abcdef0123",
    "AQ_ADMIN_TOKEN": "bench-admin",
    "AQ_CORE_CALLBACK_SECRET": "bench-callback",
}
CONCURRENCY = 64
POOL_SIZE = 20  # the service's database pool in these runs (--pool-size)


# -- infrastructure -----------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def with_db(dsn: str, name: str) -> str:
    return urlunsplit(urlsplit(dsn)._replace(path="/" + name))


def server_dsn(tmp: Path) -> str:
    dsn = os.environ.get("AQ_BENCH_DATABASE_URL") or os.environ.get("AQ_TEST_DATABASE_URL")
    if dsn:
        return dsn
    from analysis_queue.dev.embedded import start_embedded

    return start_embedded(tmp / "pg", keep=False)


@asynccontextmanager
async def fresh_database(server: str) -> AsyncIterator[str]:
    name = f"aq_bench_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(server)
    await conn.execute(f"CREATE DATABASE {name}")
    await conn.close()
    dsn = with_db(server, name)
    await apply_migrations(dsn)
    try:
        yield dsn
    finally:
        conn = await asyncpg.connect(server)
        await conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await conn.close()


@asynccontextmanager
async def _database(server: str, on: str | None) -> AsyncIterator[str]:
    """``on`` when given (a database a benchmark loaded), else a fresh one."""
    if on is not None:
        yield on
        return
    async with fresh_database(server) as dsn:
        yield dsn


class Proc:
    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._f = log.open("wb")
        self.p = subprocess.Popen(args, env=env, stdout=self._f, stderr=subprocess.STDOUT)

    def cpu_s(self) -> float:
        import psutil

        t = psutil.Process(self.p.pid).cpu_times()
        return float(t.user + t.system)

    def peak_rss_mb(self) -> float:
        for line in Path(f"/proc/{self.p.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self._f.close()


def _env(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AQ_")}
    env.update(SECRETS)
    env.update(values)
    return env


@asynccontextmanager
async def running_stack(
    dsn: str, tmp: Path, http: aiohttp.ClientSession, *, instances: int = 1, **service_env: str
) -> AsyncIterator[tuple[str, str, Proc]]:
    """A Core simulator process and ``instances`` service processes on ``dsn``. Yields the
    first instance's URL, the simulator's and the first instance's process; with more than one,
    ``svc.bases`` and ``svc.peers`` name them all (the simulator calls back the first)."""
    ports, sim_port = [free_port() for _ in range(instances)], free_port()
    port = ports[0]
    cli = [sys.executable, "-m", "analysis_queue.cli"]
    sim = Proc(
        [
            *cli,
            "core-sim",
            "--port",
            str(sim_port),
            "--judge-time",
            service_env.pop("JUDGE", "0"),
            "--callback-url",
            f"http://127.0.0.1:{port}/v1/core/events",
        ],
        _env(AQ_LOG_LEVEL="WARNING"),
        tmp / f"sim-{sim_port}.log",
    )
    procs: list[Proc] = []
    for p in ports:
        env = _env(
            AQ_DATABASE_URL=dsn,
            AQ_CORE_URL=f"http://127.0.0.1:{sim_port}",
            AQ_PORT=str(p),
            AQ_DATA_DIR=str(tmp),
            AQ_LOG_LEVEL="WARNING",
            AQ_POOL_MAX_SIZE=str(POOL_SIZE),
            **{f"AQ_{k}": v for k, v in service_env.items()},
        )
        procs.append(Proc([*cli, "serve"], env, tmp / f"svc-{p}.log"))
    svc = procs[0]
    bases = [f"http://127.0.0.1:{p}" for p in ports]
    base, sim_base = bases[0], f"http://127.0.0.1:{sim_port}"
    try:
        await _wait_http(http, f"{sim_base}/_sim/runs")
        for b in bases:
            await _wait_http(http, f"{b}/readyz")
        svc.sim = sim  # type: ignore[attr-defined]
        svc.bases = bases  # type: ignore[attr-defined]
        svc.peers = procs  # type: ignore[attr-defined]
        yield base, sim_base, svc
    finally:
        for proc in procs:
            proc.stop()
        sim.stop()


async def _wait_http(http: aiohttp.ClientSession, url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with http.get(url) as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} never became ready")


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


async def grant_all(dsn: str, users: list[str], amount: int) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.executemany(
            "SELECT aq_credit_grant_v1($1, $2, 'bench')", [(u, amount) for u in users]
        )
    finally:
        await conn.close()


async def closed_loop(
    duration_s: float, concurrency: int, op: Callable[[int], Awaitable[None]]
) -> tuple[int, list[float], float]:
    """``concurrency`` workers call ``op`` back to back for ``duration_s``."""
    latencies: list[float] = []
    stop_at = time.perf_counter() + duration_s
    started = time.perf_counter()

    async def worker(w: int) -> None:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            await op(w)
            latencies.append(time.perf_counter() - t0)

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return len(latencies), latencies, time.perf_counter() - started


# -- 1. admit ceiling ---------------------------------------------------------------------------

RAW_ADMIT = [
    "SELECT pg_advisory_xact_lock(hashtextextended('analysis_queue:' || $1, 0))",
    """UPDATE credit_accounts SET balance = balance - 1 WHERE user_id = $1 AND balance >= 1""",
    """INSERT INTO analysis_jobs (id, user_id, run_id, core_run_id, status, thesis, sources, cost,
                                  user_slot, waiting_for)
       SELECT $2, $1, $3, $4, d.status, $5::jsonb, $6::jsonb, 1,
              CASE WHEN d.status = 'pending' THEN 1 END,
              CASE WHEN d.status = 'queued' THEN 'your_previous_analysis' END
         FROM (SELECT CASE WHEN EXISTS (
                  SELECT 1 FROM analysis_jobs b WHERE b.user_id = $1 AND b.delta_of_job_id IS NULL
                     AND b.status IN ('queued', 'pending', 'running'))
              THEN 'queued' ELSE 'pending' END AS status) d""",
    "INSERT INTO credit_ledger (user_id, job_id, kind, amount) VALUES ($1, $2, 'debit', 1)",
]


def max_overlap(intervals: list[tuple[Any, Any]]) -> int:
    """The most intervals [start, end) open at once (an end frees before a start takes)."""
    points = sorted(
        [(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals if end]
    )
    most = now = 0
    for _, step in points:
        now += step
        most = max(most, now)
    return most


def _body(n: int) -> dict[str, Any]:
    return {
        "thesis": {"title": f"Thesis {n}", "document_url": f"https://uni.example/t/{n}.pdf"},
        "sources": [f"10.1000/b{n}.{k}" for k in range(3)],
    }


def user_client(base: str, http: aiohttp.ClientSession, user: str) -> AnalysisQueueClient:
    """``user``'s client on the bench's session, without retries."""
    token = mint_token(user, SECRETS["AQ_JWT_SECRET"])
    return AnalysisQueueClient(base, token, session=http, retry=NO_RETRIES)


async def admit(aq: AnalysisQueueClient, n: int) -> None:
    """One admit of ``_body(n)``; a refusal raises ``ProblemError``."""
    body = _body(n)
    await aq.start_analysis(
        body["thesis"]["title"], body["thesis"]["document_url"], body["sources"]
    )


async def raw_ceiling(dsn: str, users: list[str], duration_s: float) -> dict[str, Any]:
    pool = await asyncpg.create_pool(dsn, min_size=CONCURRENCY, max_size=CONCURRENCY)
    thesis = json.dumps(_body(0)["thesis"])
    sources = json.dumps(_body(0)["sources"])

    async def op(_w: int) -> None:
        user = random.choice(users)
        job = uuid.uuid4()
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute(RAW_ADMIT[0], user)
            await conn.execute(RAW_ADMIT[1], user)
            await conn.execute(RAW_ADMIT[2], user, job, uuid.uuid4(), f"raw-{job}", thesis, sources)
            await conn.execute(RAW_ADMIT[3], user, job)

    n, lat, wall = await closed_loop(duration_s, CONCURRENCY, op)
    await pool.close()
    return {"rate": n / wall, "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3, "n": n}


async def http_admits(
    base: str, http: aiohttp.ClientSession, users: list[str], duration_s: float
) -> dict[str, Any]:
    clients = {u: user_client(base, http, u) for u in users}
    errors = 0

    async def op(w: int) -> None:
        nonlocal errors
        try:
            await admit(clients[random.choice(users)], w)
        except ProblemError:
            errors += 1

    n, lat, wall = await closed_loop(duration_s, CONCURRENCY, op)
    return {
        "rate": n / wall,
        "p50_ms": pct(lat, 50) * 1e3,
        "p99_ms": pct(lat, 99) * 1e3,
        "n": n,
        "errors": errors,
    }


async def bench_admit(
    server: str, tmp: Path, http: aiohttp.ClientSession, duration_s: float
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, users in (("1000_users", [f"u{i}" for i in range(1000)]), ("one_user", ["solo"])):
        async with fresh_database(server) as dsn:
            await grant_all(dsn, users, 10**9)
            raw = await raw_ceiling(dsn, users, duration_s)
        async with fresh_database(server) as dsn:
            await grant_all(dsn, users, 10**9)
            async with running_stack(dsn, tmp, http) as (base, _sim, svc):
                svc_result = await http_admits(base, http, users, duration_s)
                svc_result["peak_rss_mb"] = svc.peak_rss_mb()
        out[label] = {
            "service": svc_result,
            "raw_sql": raw,
            "ratio": svc_result["rate"] / raw["rate"],
        }
    return out


# -- 2. promotion latency -----------------------------------------------------------------------


async def _promotion_gaps(dsn: str) -> list[tuple[int, float]]:
    """Each promotion's gap (completion committed -> next job running), with its rank among its
    user's promotions (1 = the user's first)."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            """SELECT extract(epoch FROM nxt.started_at - prev.finished_at) AS gap,
                      row_number() OVER (PARTITION BY prev.user_id ORDER BY prev.queue_seq) AS k
                 FROM analysis_jobs prev
                 JOIN LATERAL (SELECT * FROM analysis_jobs n
                                WHERE n.user_id = prev.user_id AND n.queue_seq > prev.queue_seq
                                ORDER BY n.queue_seq LIMIT 1) nxt ON true
                WHERE prev.finished_at IS NOT NULL AND nxt.started_at IS NOT NULL"""
        )
        return [(int(r["k"]), float(r["gap"])) for r in rows]
    finally:
        await conn.close()


async def _admit_chain(
    base: str, http: aiohttp.ClientSession, users: list[str], per_user: int
) -> None:
    """Each user's jobs in order, the users side by side (as a busy service would see them, so
    its pool is open and warm when the measurement starts)."""

    async def one_user(u: str) -> None:
        aq = user_client(base, http, u)
        for n in range(per_user):
            await admit(aq, n)

    await asyncio.gather(*(one_user(u) for u in users))


async def _wait_all_terminal(
    dsn: str, total: int, timeout_s: float, users: list[str] | None = None
) -> float:
    """Until ``total`` jobs are terminal (of ``users`` only, beside a loaded history)."""
    conn = await asyncpg.connect(dsn)
    started = time.perf_counter()
    try:
        while time.perf_counter() - started < timeout_s:
            if users is None:
                done = await conn.fetchval(
                    "SELECT count(*) FROM analysis_jobs"
                    " WHERE status IN ('succeeded','failed','cancelled')"
                )
            else:  # through the users' index: a count of the whole history would load it
                done = await conn.fetchval(
                    "SELECT count(*) FROM analysis_jobs WHERE user_id = ANY($1::text[])"
                    " AND deleted_at IS NULL AND status IN ('succeeded','failed','cancelled')",
                    users,
                )
            if done >= total:
                return time.perf_counter() - started
            await asyncio.sleep(0.05)
        raise RuntimeError(f"only {done}/{total} finished in {timeout_s}s")
    finally:
        await conn.close()


async def promotion_by_callback(
    server: str,
    tmp: Path,
    http: aiohttp.ClientSession,
    promotions: int,
    ceiling: int = 0,
    chains: int = 10,
    *,
    during_admits: bool = False,
) -> dict[str, Any]:
    """The production path: Core's callback finishes a job, whose transaction promotes the next
    (with a ceiling: when the user's next job is the fairest, else a pass woken by NOTIFY).
    ``chains`` users side by side, Core judging in 2 ms: ten keep the machine saturated, one
    shows the path's own latency.

    Each chain's first run is held in Core until every job is admitted, then all of them end at
    once: the promotions are measured on a warm service that does nothing else, and the first
    round is a burst of ``chains`` simultaneous completions. ``during_admits`` is the older
    variant: the first runs judge 0.3 s from their admission, so the first tenth or so of each
    chain's promotions happen while the load generator is still admitting the chains."""
    users = [f"p{i}" for i in range(chains)]
    per_user = promotions // len(users) + 1
    env = {"JUDGE": "0.3" if during_admits else "3600", "GLOBAL_MAX_RUNNING": str(ceiling)}
    async with fresh_database(server) as dsn:
        await grant_all(dsn, users, 10**6)
        async with running_stack(dsn, tmp, http, **env) as (base, _sim, _svc):
            await _admit_chain(base, http, users, per_user)
            async with http.post(f"{_sim}/_sim/faults", json={"judge_time_s": 0.002}) as r:
                assert r.status == 200
            if not during_admits:
                async with http.get(f"{_sim}/_sim/runs") as r:
                    held = [run["id"] for run in await r.json() if run["state"] == "judging"]
                assert len(held) == len(users), held  # each chain's first, and nothing else

                async def finish(run_id: str) -> None:
                    async with http.post(f"{_sim}/_sim/runs/{run_id}/finish", json={}) as r:
                        assert r.status == 200, await r.text()

                await asyncio.gather(*(finish(run_id) for run_id in held))
            await _wait_all_terminal(dsn, len(users) * per_user, 120)
            async with http.get(f"{_sim}/_sim/runs") as r:
                runs = await r.json()
        out = _latency_summary(await _promotion_gaps(dsn))
        out["core_clock"] = _latency_summary(await _release_gaps(dsn, runs))
        return out


async def _rows(dsn: str, sql: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(sql))
    finally:
        await conn.close()


async def _release_gaps(dsn: str, runs: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """The issue's own measure, on Core's clock alone: from Core ending a run (and sending its
    callback) to Core receiving the release of the same user's next run; ranked as above."""
    by_core_id = {r["id"]: r for r in runs}
    rows = await _rows(
        dsn, "SELECT user_id, core_run_id FROM analysis_jobs ORDER BY user_id, queue_seq"
    )
    gaps: list[tuple[int, float]] = []
    previous: dict[str, Any] = {}
    rank: dict[str, int] = {}
    for row in rows:
        run, prev = by_core_id.get(row["core_run_id"]), previous.get(row["user_id"])
        if prev is not None and run is not None and prev["finished_at"] and run["released_at"]:
            rank[row["user_id"]] = rank.get(row["user_id"], 0) + 1
            gaps.append((rank[row["user_id"]], run["released_at"] - prev["finished_at"]))
        previous[row["user_id"]] = run
    return gaps


async def promotion_external(
    server: str,
    tmp: Path,
    http: aiohttp.ClientSession,
    promotions: int,
    *,
    listen: bool,
    ceiling: int = 0,
) -> dict[str, Any]:
    """A completion committed by someone else (no tail call): NOTIFY, or only the sweep."""
    users = [f"x{i}" for i in range(10)]
    per_user = promotions // len(users) + 1
    env = {"JUDGE": "3600", "GLOBAL_MAX_RUNNING": str(ceiling)}
    if not listen:
        env.update(LISTEN_ENABLED="false", SWEEP_INTERVAL_S="0.25")
    async with fresh_database(server) as dsn:
        await grant_all(dsn, users, 10**6)
        async with running_stack(dsn, tmp, http, **env) as (base, _sim, _svc):
            await _admit_chain(base, http, users, per_user)
            conn = await asyncpg.connect(dsn)
            running: dict[str, asyncio.Event] = {u: asyncio.Event() for u in users}

            def on_notify(_c: Any, _p: int, _ch: str, payload: str) -> None:
                # One notification per transaction, naming its users: a changed user re-checks
                # whether its next job runs.
                # (A per-row notification of an older version names one user: A/B runs.)
                note = json.loads(payload)
                for user in note.get("u", {}) or [note.get("user_id")]:
                    if user in running:
                        running[user].set()

            await conn.add_listener(JOBS_CHANNEL, on_notify)
            finisher = await asyncpg.connect(dsn)
            lock = asyncio.Lock()

            async def chain(user: str) -> None:
                for _ in range(per_user - 1):
                    while True:
                        running[user].clear()  # before the check: a later "running" stays set
                        if await finisher_running(user):
                            break
                        await asyncio.wait_for(running[user].wait(), 30)
                    async with lock:
                        await finisher.execute(
                            """UPDATE analysis_jobs SET status = 'succeeded',
                                      finished_at = clock_timestamp()
                                WHERE user_id = $1 AND status = 'running'""",
                            user,
                        )

            async def finisher_running(user: str) -> bool:
                async with lock:
                    return bool(
                        await finisher.fetchval(
                            "SELECT count(*) FROM analysis_jobs WHERE user_id=$1 AND status='running'",
                            user,
                        )
                    )

            await asyncio.gather(*(chain(u) for u in users))
            await conn.close()
            await finisher.close()
        return _latency_summary(await _promotion_gaps(dsn))


def _latency_summary(ranked: list[tuple[int, float]]) -> dict[str, Any]:
    """p50/p99/max of all promotions, and of all but each user's first: the first round ends
    every user's first run at once, a burst the steady state does not see; it is counted in the
    first figures, and kept apart in the second."""

    def summary(gaps: list[float]) -> dict[str, Any]:
        ms = [g * 1e3 for g in gaps]
        return {
            "n": len(ms),
            "p50_ms": pct(ms, 50),
            "p99_ms": pct(ms, 99),
            "max_ms": max(ms) if ms else float("nan"),
        }

    out = summary([g for _k, g in ranked])
    out["steady"] = summary([g for k, g in ranked if k > 1])
    return out


# -- 3. drain -----------------------------------------------------------------------------------


async def admit_round_robin(
    clients: dict[tuple[str, int], AnalysisQueueClient],
    users: list[str],
    per_user: int,
    instances: int,
) -> None:
    """Each user's ``per_user`` clicks, round after round over all users, by CONCURRENCY
    workers; click k goes to instance k mod ``instances`` (a user's clicks reach either)."""
    work = [(u, n) for n in range(per_user) for u in users]
    cursor = 0

    async def worker() -> None:
        nonlocal cursor
        while cursor < len(work):
            u, n = work[cursor]
            cursor += 1
            await admit(clients[u, cursor % instances], n)

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


async def bench_drain(
    server: str,
    tmp: Path,
    http: aiohttp.ClientSession,
    users_n: int,
    per_user: int,
    ceiling: int = 0,
    instances: int = 2,
    on: str | None = None,
    user_prefix: str = "d",
) -> dict[str, Any]:
    """``users_n`` users admit ``per_user`` jobs each over HTTP, spread across ``instances``
    service processes (a user's clicks go to either), Core instant: the time until every job
    succeeded. In a fresh database, or ``on`` one (a loaded history): only its users' jobs
    are counted."""
    users = [f"{user_prefix}{i}" for i in range(users_n)]
    total = users_n * per_user
    async with _database(server, on) as dsn:
        await grant_all(dsn, users, per_user)
        env = {"GLOBAL_MAX_RUNNING": str(ceiling)}
        async with running_stack(dsn, tmp, http, instances=instances, **env) as (
            _base,
            _sim,
            svc,
        ):
            bases = svc.bases  # type: ignore[attr-defined]
            procs: list[Proc] = svc.peers  # type: ignore[attr-defined]
            clients = {
                (u, b): user_client(base, http, u) for u in users for b, base in enumerate(bases)
            }
            import psutil

            # Tables that grow from empty are analyzed as they grow (as autovacuum would); a
            # loaded history is analyzed already, and 5,000 rows more would not make autovacuum
            # analyze it again.
            analyzer = asyncio.create_task(
                analyzing(
                    dsn,
                    ("core_run_reservations",)
                    if on is not None
                    else (
                        "analysis_jobs",
                        "job_events",
                        "job_event_counters",
                        "credit_accounts",
                        "credit_ledger",
                        "core_run_reservations",
                    ),
                )
            )
            await asyncio.sleep(0.2)  # its first ANALYZE is in before the clock starts

            def service_cpu_s() -> float:
                return sum(p.cpu_s() for p in procs)

            cpu0 = (service_cpu_s(), svc.sim.cpu_s(), psutil.cpu_times(), time.process_time())
            started = time.perf_counter()
            await admit_round_robin(clients, users, per_user, len(bases))
            admitted_s = time.perf_counter() - started
            # What admission left to run: the tail after it is this backlog at the ceiling.
            conn = await asyncpg.connect(dsn)
            try:  # the drain's users' jobs, through their index (beside a loaded history)
                backlog = await conn.fetchval(
                    "SELECT count(*) FROM analysis_jobs WHERE user_id = ANY($1::text[])"
                    " AND deleted_at IS NULL AND status IN ('queued', 'pending', 'running')",
                    users,
                )
            finally:
                await conn.close()
            await _wait_all_terminal(dsn, total, 600, users)
            wall = time.perf_counter() - started
            analyzer.cancel()
            await asyncio.gather(analyzer, return_exceptions=True)
            rss = max(p.peak_rss_mb() for p in procs)
            batching: dict[str, dict[str, float]] = {}
            for base in bases:
                for what, counts in (await _group_commits(http, base)).items():
                    mine = batching.setdefault(what, {})
                    for k, v in counts.items():
                        mine[k] = mine.get(k, 0) + v
            # Every instance hears every notification: one instance's count is the commits'.
            notifications = await _metric(http, bases[0], "aq_notifications_total")
            sys_now = psutil.cpu_times()
            busy = (sys_now.user + sys_now.system) - (cpu0[2].user + cpu0[2].system)
            cpu = {
                "service": (service_cpu_s() - cpu0[0]) / wall,
                "simulator": (svc.sim.cpu_s() - cpu0[1]) / wall,
                "load_generator": (time.process_time() - cpu0[3]) / wall,
                "machine": busy / wall,
            }
        conn = await asyncpg.connect(dsn)
        try:
            succeeded = await conn.fetchval(
                "SELECT count(*) FROM analysis_jobs WHERE status='succeeded'"
                " AND user_id = ANY($1::text[])",
                users,
            )
            rows = await conn.fetch(
                "SELECT promoted_at, finished_at FROM analysis_jobs WHERE promoted_at IS NOT NULL"
                " AND user_id = ANY($1::text[])",
                users,
            )
            overall = max_overlap([(r["promoted_at"], r["finished_at"]) for r in rows])
            # Max concurrency per user: the most [promoted_at, finished_at) intervals that overlap.
            overlap = await conn.fetchval(
                """SELECT coalesce(max(c), 0) FROM (
                       SELECT count(*) AS c FROM analysis_jobs a JOIN analysis_jobs b
                         ON a.user_id = b.user_id AND b.promoted_at <= a.promoted_at
                        AND b.finished_at > a.promoted_at
                        AND a.delta_of_job_id IS NULL AND b.delta_of_job_id IS NULL
                      WHERE a.user_id = ANY($1::text[])
                      GROUP BY a.id) s""",
                users,
            )
        finally:
            await conn.close()
    return {
        "instances": instances,
        "ceiling": ceiling or None,
        "jobs": total,
        "succeeded": succeeded,
        "admitted_in_s": admitted_s,
        "open_when_admitted": backlog,
        "drained_in_s": wall,
        "jobs_per_s": total / wall,
        "max_concurrency_per_user": overlap,
        "max_active_overall": overall,
        "peak_rss_mb": rss,
        "cpu_cores_used": cpu,
        "group_commits": batching,
        # One notification per notifying commit, and the service's one instance hears them all.
        "notifying_commits_per_job": notifications / total,
    }


async def _metric(http: aiohttp.ClientSession, base: str, name: str) -> float:
    async with http.get(f"{base}/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.split("{", 1)[0].split(" ", 1)[0] == name
    )


async def _buckets(http: aiohttp.ClientSession, bases: list[str], name: str) -> dict[float, float]:
    """A histogram's cumulative buckets (upper bound -> count), summed over instances."""
    out: dict[float, float] = {}
    for base in bases:
        async with http.get(f"{base}/metrics") as r:
            text = await r.text()
        for line in text.splitlines():
            if line.startswith(name + "_bucket{"):
                le = line.split('le="', 1)[1].split('"', 1)[0]
                bound = float("inf") if le == "+Inf" else float(le)
                out[bound] = out.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _share_over(before: dict[float, float], after: dict[float, float]) -> dict[str, float]:
    """Of the observations between two scrapes, the share above each bucket bound."""
    total = after.get(float("inf"), 0.0) - before.get(float("inf"), 0.0)
    return {
        f"over_{int(b * 1000)}ms": (total - (after[b] - before.get(b, 0.0))) / total
        for b in sorted(after)
        if b != float("inf") and b >= 0.05 and total
    }


async def _group_commits(http: aiohttp.ClientSession, base: str) -> dict[str, dict[str, float]]:
    """The dispatcher's group commits, from the service's /metrics: jobs and statements."""
    async with http.get(f"{base}/metrics") as r:
        text = await r.text()
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        for metric, key in (
            ("aq_group_commit_jobs_total", "jobs"),
            ("aq_group_commit_statements_total", "statements"),
        ):
            if line.startswith(metric + "{"):
                what = line.split('what="', 1)[1].split('"', 1)[0]
                out.setdefault(what, {})[key] = float(line.rsplit(" ", 1)[1])
        if line.startswith("aq_group_commit_alone_total{"):  # left to a transaction alone
            what = line.split('what="', 1)[1].split('"', 1)[0]
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out.setdefault(what, {})[f"alone_{reason}"] = float(line.rsplit(" ", 1)[1])
    return out


# Triggers switched off to see what they cost (an experiment, never the product).
# The change trigger writes the event log and the wake-up list (without it the NOTIFY at
# commit has nothing to send); the NOTIFY's own deferred triggers, apart.
WITHOUT_JOB_CHANGES = ("analysis_jobs_changes_insert_v1", "analysis_jobs_changes_update_v1")
WITHOUT_NOTIFY = ("analysis_jobs_notify_insert_v4", "analysis_jobs_notify_update_v4")
ANALYZE_EVERY_S = 1.0  # what autovacuum would do for tables that grow from empty
PEER_VENV = ROOT / "bench" / ".venv-peer"


async def analyzing(dsn: str, tables: tuple[str, ...]) -> None:
    """ANALYZE the tables before the clock starts, then every second, until cancelled: this
    server runs with autovacuum off, and plans made for empty tables would measure nothing.
    Both the service and its peer get it."""
    conn = await asyncpg.connect(dsn)
    try:
        while True:
            for table in tables:
                await conn.execute(f"ANALYZE {table}")
            await asyncio.sleep(ANALYZE_EVERY_S)
    finally:
        await conn.close()


def _peer_python() -> Path:
    """The peer's own virtual environment, made on first use from bench/peer-requirements.txt."""
    python = PEER_VENV / "bin" / "python"
    stamp = PEER_VENV / ".installed"
    requirements = ROOT / "bench" / "peer-requirements.txt"
    if not stamp.exists() or stamp.read_text() != requirements.read_text():
        subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", "-r", str(requirements)], check=True
        )
        stamp.write_text(requirements.read_text())
    return python


async def bench_peer_drain(
    server: str, users_n: int, per_user: int, worker_concurrency: int
) -> dict[str, Any]:
    """procrastinate's per-key lock drain (bench/peer_procrastinate.py) on a fresh database of
    the same server, with as many concurrent clients as the service's drain."""
    python = await asyncio.to_thread(_peer_python)
    async with fresh_database(server) as dsn:
        proc = await asyncio.create_subprocess_exec(
            str(python),
            str(ROOT / "bench" / "peer_procrastinate.py"),
            dsn,
            str(users_n),
            str(per_user),
            str(CONCURRENCY),
            str(worker_concurrency),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the peer failed: {err.decode()[-2000:]}")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


async def raw_drain(
    server: str, users_n: int, per_user: int, without: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The drain's database work alone: per job, the statements the service sends (reserve,
    admit, claim, running, finish with its tail promotion), through the same queue functions,
    with their triggers and NOTIFYs and one LISTEN connection, but no HTTP and no Python
    service. ``CONCURRENCY`` workers each drain whole users. Its rate bounds any drain on this
    machine."""
    users = [f"r{i}" for i in range(users_n)]
    thesis, sources = _body(0)["thesis"], _body(0)["sources"]
    async with fresh_database(server) as dsn:
        await grant_all(dsn, users, per_user)
        listener = await asyncpg.connect(dsn)
        for trigger in without:
            await listener.execute(f"ALTER TABLE analysis_jobs DISABLE TRIGGER {trigger}")
        heard = 0

        def on_notify(_c: Any, _p: int, _ch: str, _payload: str) -> None:
            nonlocal heard
            heard += 1

        await listener.add_listener(JOBS_CHANNEL, on_notify)
        db = await Database.connect(dsn, min_size=CONCURRENCY, max_size=CONCURRENCY)
        todo = list(users)
        started = time.perf_counter()

        async def job_done(job_id: uuid.UUID) -> uuid.UUID | None:
            await db.claim([job_id], "raw", 60.0)
            await db.mark_running([job_id], "raw")
            done = await db.finish(
                job_id=job_id, status=JobStatus.SUCCEEDED, from_statuses=ACTIVE, ran=True
            )
            assert done is not None
            # every job the finish promoted (one at most here)
            return done.promoted[0].id if done.promoted else None

        async def worker() -> None:
            while todo:
                user = todo.pop()
                first = None
                for _ in range(per_user):
                    click = ReserveRequest(
                        user, uuid.uuid4(), uuid.uuid4(), 1, thesis, sources, None, None
                    )
                    await db.reserve(click)
                    admission = await db.admit(
                        AdmitRequest(
                            click.job_id,
                            user,
                            click.run_id,
                            f"raw-{click.run_id}",
                            thesis,
                            sources,
                            1,
                            None,
                            None,
                            None,
                        )
                    )
                    if admission.job.status is JobStatus.PENDING:
                        first = click.job_id
                nxt = first
                while nxt is not None:
                    nxt = await job_done(nxt)

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        wall = time.perf_counter() - started
        await db.close()
        await listener.close()
        conn = await asyncpg.connect(dsn)
        try:
            succeeded = await conn.fetchval(
                "SELECT count(*) FROM analysis_jobs WHERE status = 'succeeded'"
            )
        finally:
            await conn.close()
    total = users_n * per_user
    assert succeeded == total, f"{succeeded}/{total} succeeded"
    return {"jobs": total, "seconds": wall, "jobs_per_s": total / wall, "notifications": heard}


ACTIVE = (JobStatus.PENDING, JobStatus.RUNNING)


# -- 4. sweep cost vs history -------------------------------------------------------------------


def bench_sweeper(db: Database, core: CoreClient) -> Sweeper:
    """A sweeper wired as the service wires one, for passes timed in-process."""
    metrics = Metrics()
    followup = FollowUp(metrics)
    finisher = Finisher(db, core, followup, metrics)
    dispatcher = Dispatcher(db, core, DispatchSettings(instance_id="bench"), finisher, metrics)
    promoter = Promoter(db, followup)
    followup.bind(releases=dispatcher, passes=promoter)
    settings = SweepSettings(running_quiet_s=3600)
    return Sweeper(db, core, dispatcher, promoter, finisher, settings, metrics)


async def bench_sweep(server: str, histories: list[int], users_n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for history in histories:
        async with fresh_database(server) as dsn:
            conn = await asyncpg.connect(dsn)
            try:
                # Each user: one running job and one queued behind it (nothing to promote),
                # plus `history` finished jobs spread over the users.
                await conn.execute(
                    """INSERT INTO analysis_jobs (id, user_id, run_id, core_run_id, status, thesis,
                                                  sources, cost, promoted_at, started_at,
                                                  user_slot)
                       SELECT gen_random_uuid(), 'u' || g, gen_random_uuid(), 'r-run-' || g,
                              'running', '{}', '[]', 0, now(), now(), 1
                         FROM generate_series(1, $1) g""",
                    users_n,
                )
                await conn.execute(
                    """INSERT INTO analysis_jobs (id, user_id, run_id, core_run_id, status, thesis,
                                                  sources, cost, waiting_for)
                       SELECT gen_random_uuid(), 'u' || g, gen_random_uuid(), 'r-q-' || g,
                              'queued', '{}', '[]', 0, 'your_previous_analysis'
                         FROM generate_series(1, $1) g""",
                    users_n,
                )
                await conn.execute(
                    """INSERT INTO analysis_jobs (id, user_id, run_id, core_run_id, status, thesis,
                                                  sources, cost, promoted_at, started_at,
                                                  finished_at, verdicts)
                       SELECT gen_random_uuid(), 'u' || (g % $2), gen_random_uuid(), 'r-h-' || g,
                              'succeeded', '{"title": "t"}', '["10.1/x"]', 0, now(), now(), now(),
                              '[{"source": "10.1/x", "verdict": "supported"}]'
                         FROM generate_series(1, $1) g""",
                    history,
                    users_n,
                )
                await conn.execute("VACUUM ANALYZE analysis_jobs")
                plans = {}
                from analysis_queue.store.sqlfiles import queries

                q = queries()
                for name, args in (
                    ("sweep_users_to_promote", (1000,)),
                    ("sweep_pending_due", (1000,)),
                    ("sweep_running_quiet", (3600.0, 1000)),
                    ("reservation_take_stale", (120.0, 1000)),
                    ("job_event_prune", (7 * 86400.0, 1000)),
                ):
                    rows = await conn.fetch("EXPLAIN " + q[name], *args)
                    plans[name] = [r[0] for r in rows]
            finally:
                await conn.close()
            db = await Database.connect(dsn)
            core = CoreClient("http://127.0.0.1:9")  # never called: nothing is due
            await core.start()
            sweeper = bench_sweeper(db, core)
            times = []
            for _ in range(7):
                report = await sweeper.run_once()
                times.append(report.duration_s)
            await core.close()
            await db.close()
            out[str(history)] = {"median_ms": statistics.median(times) * 1e3, "plans": plans}
    keys = [str(h) for h in histories]
    out["ratio"] = out[keys[-1]]["median_ms"] / out[keys[0]]["median_ms"]
    return out


# -- history: the same operations beside a small and a year-sized history (#26) ----------------

HISTORY_DEPTH = 200  # finished jobs per user with a history: 10M rows over 50,000 users
EVENTS_KEPT_DAYS = 7  # the sweep prunes events older than this (SweepSettings.event_retention_s)
HISTORY_REPS = 60  # users measured per operation


async def load_history(dsn: str, rows: int) -> dict[str, float]:
    """``rows`` finished jobs over a year, ``HISTORY_DEPTH`` per user, with what they leave
    behind: a debit each and a grant per user in the ledger, balances that match it, the
    events of the last week (the rest pruned, as the sweep does) and their counters. Written
    set-based with the triggers off (their rows are written here instead), the secondary
    indexes dropped during the load and built again after it, then VACUUM ANALYZE: a table in
    its steady state, as autovacuum keeps it."""
    users = max(1, rows // HISTORY_DEPTH)
    conn = await asyncpg.connect(dsn)
    started = time.perf_counter()
    try:
        await conn.execute("SET maintenance_work_mem = '1GB'")
        indexes = await conn.fetch(
            """SELECT i.indexname, i.indexdef FROM pg_indexes i
                WHERE i.schemaname = 'public' AND i.tablename IN ('analysis_jobs', 'credit_ledger',
                      'job_events')
                  AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conname = i.indexname)"""
        )
        for ix in indexes:
            await conn.execute(f"DROP INDEX {ix['indexname']}")
        await conn.execute("SET session_replication_role = replica")
        await conn.execute(
            """INSERT INTO credit_accounts (user_id, balance)
               SELECT 'h' || u, 1000 FROM generate_series(1, $1) u""",
            users,
        )
        await conn.execute(
            """INSERT INTO analysis_jobs (id, user_id, run_id, core_run_id, status, queue_seq,
                                          thesis, sources, cost, created_at, promoted_at,
                                          started_at, finished_at, updated_at, verdicts)
               SELECT gen_random_uuid(), 'h' || (1 + g % $2), gen_random_uuid(), 'h-' || g,
                      'succeeded', g,
                      jsonb_build_object('title', 'Thesis ' || g,
                                         'document_url', 'https://uni.example/t/' || g || '.pdf'),
                      '["10.1000/a.1", "10.1000/a.2"]'::jsonb, 1,
                      t, t + interval '1 second', t + interval '2 seconds',
                      t + interval '90 seconds', t + interval '90 seconds',
                      '[{"source": "10.1000/a.1", "verdict": "supported"},
                        {"source": "10.1000/a.2", "verdict": "contradicted"}]'::jsonb
                 FROM generate_series(1, $1) g,
                      LATERAL (SELECT now() - interval '1 hour'
                                      - (1 - g::float8 / $1) * interval '365 days' AS t) x""",
            rows,
            users,
        )
        await conn.execute("SELECT setval('analysis_jobs_queue_seq', $1)", rows)
        await conn.execute(
            """INSERT INTO credit_ledger (user_id, job_id, kind, amount, created_at)
               SELECT user_id, id, 'debit', cost, created_at FROM analysis_jobs"""
        )
        await conn.execute(
            """INSERT INTO credit_ledger (user_id, kind, amount, note, created_at)
               SELECT user_id, 'grant', sum(cost) + 1000, 'history', min(created_at)
                 FROM analysis_jobs GROUP BY user_id"""
        )
        await conn.execute(
            """INSERT INTO job_events (user_id, event_id, job_id, kind, created_at)
               SELECT j.user_id,
                      row_number() OVER (PARTITION BY j.user_id ORDER BY j.queue_seq, k.n),
                      j.id, k.kind, j.created_at + k.n * interval '1 second'
                 FROM analysis_jobs j,
                      (VALUES (1, 'admitted'), (2, 'promoted'), (3, 'started'),
                              (4, 'finished')) k(n, kind)
                WHERE j.created_at > now() - $1 * interval '1 day'""",
            EVENTS_KEPT_DAYS,
        )
        await conn.execute(
            """INSERT INTO job_event_counters (user_id, last_id)
               SELECT user_id, max(event_id) FROM job_events GROUP BY user_id"""
        )
        await conn.execute("RESET session_replication_role")
        loaded = time.perf_counter()
        for ix in indexes:
            await conn.execute(ix["indexdef"])
        indexed = time.perf_counter()
        await conn.execute("VACUUM ANALYZE")
        sizes = await conn.fetchrow(
            """SELECT pg_total_relation_size('analysis_jobs') AS jobs,
                      pg_total_relation_size('credit_ledger') AS ledger,
                      pg_total_relation_size('job_events') AS events,
                      (SELECT count(*) FROM job_events) AS event_rows"""
        )
    finally:
        await conn.close()
    return {
        "rows": rows,
        "users": users,
        "insert_s": loaded - started,
        "index_s": indexed - loaded,
        "total_s": time.perf_counter() - started,
        "jobs_mb": sizes["jobs"] / 2**20,
        "ledger_mb": sizes["ledger"] / 2**20,
        "events_mb": sizes["events"] / 2**20,
        "event_rows": sizes["event_rows"],
    }


async def _timed(op: Callable[[], Awaitable[Any]]) -> float:
    t0 = time.perf_counter()
    await op()
    return (time.perf_counter() - t0) * 1e3


async def history_ops(dsn: str, rows: int) -> dict[str, Any]:
    """Each operation's database work, for ``HISTORY_REPS`` users with a full history, median
    and p95 in ms: an admit (reservation and admit; Core's call aside), a promotion (the
    completion that promotes the user's next job, and that job's running mark), the first and
    a deep page of the user's list, an event stream's snapshot, and a sweep pass."""
    with_history = max(1, rows // HISTORY_DEPTH)
    reps = min(HISTORY_REPS, with_history)
    users = [f"h{1 + n * with_history // reps}" for n in range(reps)]  # distinct, spread out
    db = await Database.connect(dsn, min_size=2, max_size=4)
    claim = Claim("bench", 60)
    thesis = {"title": "Thesis", "document_url": "https://uni.example/t.pdf"}
    sources = ["10.1000/b.1", "10.1000/b.2"]
    out: dict[str, list[float]] = {
        k: [] for k in ("admit", "promotion", "first_page", "deep_page", "snapshot", "sweep_pass")
    }

    async def click(user: str) -> tuple[Any, str]:
        job, run = uuid.uuid4(), uuid.uuid4()
        await db.reserve(ReserveRequest(user, run, job, 1, thesis, sources, None, None))
        core = f"b-{run}"
        admitted = await db.admit(
            AdmitRequest(job, user, run, core, thesis, sources, 1, None, None, None), claim
        )
        return admitted.job, core

    try:
        first: dict[str, tuple[Any, str]] = {}
        for user in users:
            t0 = time.perf_counter()
            first[user] = await click(user)
            out["admit"].append((time.perf_counter() - t0) * 1e3)
        for user in users:
            await click(user)  # queued behind the first
            job, core = first[user]
            await db.mark_running([job.id], "bench")

            async def promotion(core: str = core) -> None:
                done = await db.finish(
                    core_run_id=core,
                    status=JobStatus.SUCCEEDED,
                    from_statuses=(JobStatus.PENDING, JobStatus.RUNNING),
                    verdicts=[],
                    ran=True,
                    claim=claim,
                )
                assert done is not None and done.promoted, "the finish promoted nothing"
                await db.mark_running([p.id for p in done.promoted], "bench")

            out["promotion"].append(await _timed(promotion))
        for user in users:
            page = await db.list_jobs(user, limit=150)
            deep = page[-1].queue_seq
            out["first_page"].append(await _timed(lambda u=user: db.list_jobs(u, limit=50)))
            out["deep_page"].append(
                await _timed(lambda u=user, d=deep: db.list_jobs(u, before_seq=d, limit=50))
            )

            async def snapshot(u: str = user) -> None:
                await db.event_head(u)
                await db.list_jobs(u, limit=201)

            out["snapshot"].append(await _timed(snapshot))
        core_client = CoreClient("http://127.0.0.1:9")  # never called: nothing is due
        await core_client.start()
        sweeper = bench_sweeper(db, core_client)
        for _ in range(7):
            out["sweep_pass"].append((await sweeper.run_once()).duration_s * 1e3)
        await core_client.close()
        # The ledger still balances to every account (the identity the tests check).
        t0 = time.perf_counter()
        drift = await db.pool.fetchval(
            """SELECT count(*) FROM (
                   SELECT a.user_id FROM credit_accounts a LEFT JOIN credit_ledger l USING (user_id)
                    GROUP BY a.user_id, a.balance
                   HAVING a.balance <> coalesce(sum(CASE l.kind WHEN 'grant' THEN l.amount
                                                   WHEN 'debit' THEN -l.amount
                                                   WHEN 'refund' THEN l.amount END), 0)) d"""
        )
        ledger_check_s = time.perf_counter() - t0
    finally:
        await db.close()
    summary: dict[str, Any] = {
        k: {"median_ms": statistics.median(v), "p95_ms": pct(v, 95)} for k, v in out.items()
    }
    summary["ledger_drift_accounts"] = drift
    summary["ledger_check_s"] = ledger_check_s
    return summary


async def bench_history(
    server: str, tmp: Path, http: aiohttp.ClientSession, sizes: list[int], drain_users: int
) -> dict[str, Any]:
    """The operations and the drain beside each history size, in one run; ratios large/small."""
    out: dict[str, Any] = {}
    for rows in sizes:
        async with fresh_database(server) as dsn:
            load = await load_history(dsn, rows)
            print(
                f"  history {rows:,} rows ({load['users']:,} users): loaded in "
                f"{load['total_s']:.0f} s ({load['index_s']:.0f} s of it indexes); "
                f"jobs {load['jobs_mb']:.0f} MB, ledger {load['ledger_mb']:.0f} MB, events "
                f"{load['event_rows']:,} rows",
                flush=True,
            )
            ops = await history_ops(dsn, rows)
            drain = await bench_drain(server, tmp, http, drain_users, 5, on=dsn)
            out[str(rows)] = {"load": load, "ops": ops, "drain": drain}
    small, large = (out[str(n)] for n in (sizes[0], sizes[-1]))
    out["ratio_large_to_small"] = {
        **{
            k: large["ops"][k]["median_ms"] / small["ops"][k]["median_ms"]
            for k in small["ops"]
            if isinstance(small["ops"][k], dict)
        },
        "drain_jobs_per_s": large["drain"]["jobs_per_s"] / small["drain"]["jobs_per_s"],
    }
    return out


def print_history(r: dict[str, Any]) -> None:
    sizes = [k for k in r if k.isdigit()]
    small, large = r[sizes[0]], r[sizes[-1]]
    print(f"\nhistory: {int(sizes[0]):,} vs {int(sizes[-1]):,} finished jobs (median ms)")
    for op, ratio in r["ratio_large_to_small"].items():
        if op == "drain_jobs_per_s":
            print(
                f"  {'drain 1000x5 jobs/s':<22} {small['drain']['jobs_per_s']:>9.0f} "
                f"{large['drain']['jobs_per_s']:>9.0f}   x{ratio:.2f}"
            )
        else:
            print(
                f"  {op:<22} {small['ops'][op]['median_ms']:>9.2f} "
                f"{large['ops'][op]['median_ms']:>9.2f}   x{ratio:.2f}"
            )
    print(
        f"  ledger balances every account: {large['ops']['ledger_drift_accounts'] == 0} "
        f"(checked in {large['ops']['ledger_check_s']:.1f} s)"
    )


# -- fan-out: thousands of open dashboards during a drain (#26) ---------------------------------


async def _probe(
    http: aiohttp.ClientSession, bases: list[str], token: str, stop: asyncio.Event
) -> list[float]:
    """Another user's first page (``GET /v1/analyses``) every 20 ms, on the instances in turn,
    until ``stop``: its latencies in seconds."""
    latencies: list[float] = []
    n = 0
    while not stop.is_set():
        t0 = time.perf_counter()
        async with http.get(
            f"{bases[n % len(bases)]}/v1/analyses", headers={"Authorization": f"Bearer {token}"}
        ) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"probe: {r.status}")
        latencies.append(time.perf_counter() - t0)
        n += 1
        await asyncio.sleep(0.02)
    return latencies


async def _probed_drain(
    dsn: str, http: aiohttp.ClientSession, bases: list[str], users: list[str], probe_token: str
) -> dict[str, Any]:
    """``users`` admit FANOUT_JOBS each across ``bases``, Core instant, while ``_probe`` reads:
    the time until all succeeded, and the probe's latencies meanwhile."""
    clients = {(u, b): user_client(base, http, u) for u in users for b, base in enumerate(bases)}
    stop = asyncio.Event()
    probe = asyncio.create_task(_probe(http, bases, probe_token, stop))
    started = time.perf_counter()
    await admit_round_robin(clients, users, FANOUT_JOBS, len(bases))
    await _wait_all_terminal(dsn, len(users) * FANOUT_JOBS, 600, users)
    wall = time.perf_counter() - started
    stop.set()
    latencies = await probe
    return {
        "jobs": len(users) * FANOUT_JOBS,
        "drained_in_s": wall,
        "jobs_per_s": len(users) * FANOUT_JOBS / wall,
        "other_user_list_ms": {
            "n": len(latencies),
            "p50": pct(latencies, 50) * 1000,
            "p99": pct(latencies, 99) * 1000,
        },
    }


FANOUT_JOBS = 5  # per user, in each drain
FANOUT_PACED_PER_S = 100  # after the drain, a click per user at this rate
FANOUT_IDLE_CLICKS = 50  # then, one at a time


async def _paced_clicks(
    http: aiohttp.ClientSession, bases: list[str], users: list[str], per_s: float
) -> None:
    """One click per user, ``per_s`` a second on a fixed schedule (not one after another)."""
    start = time.perf_counter()

    async def click(n: int, user: str) -> None:
        await asyncio.sleep(max(0.0, start + n / per_s - time.perf_counter()))
        await admit(user_client(bases[n % len(bases)], http, user), FANOUT_JOBS)

    await asyncio.gather(*(click(n, u) for n, u in enumerate(users)))


def _rss_mb(proc: Proc) -> float:
    import psutil

    return float(psutil.Process(proc.p.pid).memory_info().rss) / 2**20


async def bench_fanout(
    server: str, tmp: Path, http: aiohttp.ClientSession, users_n: int, tabs: int
) -> dict[str, Any]:
    """Two instances; a drain of ``users_n`` x FANOUT_JOBS with no stream open, then
    ``users_n`` other users open ``tabs`` streams each (spread over both instances, in a
    process of their own: bench/fanout_reader.py) and drain as many. Measures how fast each
    change reaches every tab of its user, the memory an idle stream costs each instance, and
    whether the drain and another user's reads stay as fast with the streams open."""
    import psutil

    quiet = [f"q{i}" for i in range(users_n)]
    watched = [f"w{i}" for i in range(users_n)]
    async with fresh_database(server) as dsn:
        await grant_all(dsn, [*quiet, "probe"], FANOUT_JOBS)
        await grant_all(dsn, watched, FANOUT_JOBS + 2)  # the paced click and the idle one
        async with running_stack(dsn, tmp, http, instances=2) as (base, _sim, svc):
            bases: list[str] = svc.bases  # type: ignore[attr-defined]
            procs: list[Proc] = svc.peers  # type: ignore[attr-defined]
            analyzer = asyncio.create_task(
                analyzing(dsn, ("analysis_jobs", "job_events", "job_event_counters"))
            )
            prober = user_client(base, http, "probe")
            for n in range(FANOUT_JOBS):  # a list of the probe's own to read
                await admit(prober, n)
            await _wait_all_terminal(dsn, FANOUT_JOBS, 60, ["probe"])
            probe_token = mint_token("probe", SECRETS["AQ_JWT_SECRET"])
            xacts = (
                "SELECT xact_commit + xact_rollback FROM pg_stat_database"
                " WHERE datname = current_database()"
            )
            conn = await asyncpg.connect(dsn)
            try:
                xacts0 = await conn.fetchval(xacts)
                without = await _probed_drain(dsn, http, bases, quiet, probe_token)
                await asyncio.sleep(1)  # the instances' statistics are flushed
                without["transactions_per_job"] = (await conn.fetchval(xacts) - xacts0) / without[
                    "jobs"
                ]
            finally:
                await conn.close()
            rss_before = [_rss_mb(p) for p in procs]
            reader = await asyncio.create_subprocess_exec(
                sys.executable,
                str(ROOT / "bench" / "fanout_reader.py"),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            assert reader.stdin is not None and reader.stdout is not None
            spec = {"bases": bases, "users": watched, "tabs": tabs}
            reader.stdin.write(json.dumps({**spec, "secret": SECRETS["AQ_JWT_SECRET"]}).encode())
            reader.stdin.write(b"\n")
            t0 = time.perf_counter()
            ready = (await reader.stdout.readline()).decode().split()
            if not ready or ready[0] != "ready":
                raise RuntimeError(f"fanout reader: {ready}")
            opened_s = time.perf_counter() - t0
            await asyncio.sleep(2)  # idle: what the streams hold once their snapshots went
            rss_idle = [_rss_mb(p) for p in procs]
            subscribers = [await _metric(http, b, "aq_event_subscribers") for b in bases]
            reader_cpu0 = psutil.Process(reader.pid).cpu_times()
            service_cpu0 = sum(p.cpu_s() for p in procs)
            machine0 = psutil.cpu_times()
            scans = "SELECT idx_scan FROM pg_stat_user_tables WHERE relname = 'job_events'"
            conn = await asyncpg.connect(dsn)
            try:
                scans0 = await conn.fetchval(scans)
                xacts0 = await conn.fetchval(xacts)
                lag0 = await _buckets(http, bases, "aq_notification_lag_seconds")
                t_drain = time.perf_counter()
                streamed = await _probed_drain(dsn, http, bases, watched, probe_token)
                drain_s = time.perf_counter() - t_drain
                reader_cpu = psutil.Process(reader.pid).cpu_times()
                service_cpu = (sum(p.cpu_s() for p in procs) - service_cpu0) / drain_s
                machine = psutil.cpu_times()
                # How late the NOTIFYs themselves arrived at the listeners (change -> listener).
                notify_lag = _share_over(
                    lag0, await _buckets(http, bases, "aq_notification_lag_seconds")
                )
                await asyncio.sleep(1)  # the drain's last reads are in the statistics
                # One scan per user each time an instance reads its events: reads per event.
                drain_events = await conn.fetchval(
                    "SELECT count(*) FROM job_events WHERE user_id = ANY($1::text[])", watched
                )
                event_reads = await conn.fetchval(scans) - scans0
                streamed["transactions_per_job"] = (await conn.fetchval(xacts) - xacts0) / streamed[
                    "jobs"
                ]
                # Then the same streams under a steady, lighter load: one click per user, paced.
                paced_from = time.time()
                await _paced_clicks(http, bases, watched, FANOUT_PACED_PER_S)
                await _wait_all_terminal(dsn, len(watched) * (FANOUT_JOBS + 1), 60, watched)
                # And on a quiet machine: one click now and then, each a burst of events.
                await asyncio.sleep(1)
                idle_from = time.time()
                for n, user in enumerate(watched[:FANOUT_IDLE_CLICKS]):
                    await admit(user_client(bases[n % 2], http, user), FANOUT_JOBS + 1)
                    await asyncio.sleep(0.2)
                await _wait_all_terminal(
                    dsn, len(watched) * (FANOUT_JOBS + 1) + FANOUT_IDLE_CLICKS, 60, watched
                )
                events = await conn.fetchval(
                    "SELECT count(*) FROM job_events WHERE user_id = ANY($1::text[])", watched
                )
            finally:
                await conn.close()
            reader.stdin.write(f"stop {events} {paced_from} {idle_from}\n".encode())
            delivered = json.loads(await reader.stdout.readline())
            await reader.wait()
            machine_cpu = (
                machine.user + machine.system - machine0.user - machine0.system
            ) / drain_s
            rss_peak = [p.peak_rss_mb() for p in procs]
            analyzer.cancel()
            await asyncio.gather(analyzer, return_exceptions=True)
    streams = users_n * tabs
    return {
        "users": users_n,
        "tabs": tabs,
        "streams": streams,
        "streams_opened_in_s": opened_s,
        "subscribers_per_instance": subscribers,
        "rss_mb_per_instance": {"before": rss_before, "idle": rss_idle, "peak": rss_peak},
        "kb_per_idle_stream": (sum(rss_idle) - sum(rss_before)) * 1024 / streams,
        "drain_without_streams": without,
        "drain_with_streams": streamed,
        "delivery": delivered,
        "job_events_scans_per_event": event_reads / max(drain_events, 1),
        "notifications_late_during_drain": notify_lag,
        "cpu_cores_during_drain": {
            "service": service_cpu,
            "reader": (reader_cpu.user + reader_cpu.system - reader_cpu0.user - reader_cpu0.system)
            / drain_s,
            "machine": machine_cpu,
        },
    }


def print_fanout(r: dict[str, Any]) -> None:
    d = r["delivery"]
    print(
        f"\nFan-out: {r['streams']:,} streams ({r['users']} users x {r['tabs']} tabs, 2 instances)"
    )
    print(
        f"  opened in {r['streams_opened_in_s']:.1f} s; subscribers {r['subscribers_per_instance']};"
        f" {r['kb_per_idle_stream']:.1f} KB per idle stream"
        f" (RSS MB before {r['rss_mb_per_instance']['before']}, idle"
        f" {r['rss_mb_per_instance']['idle']})"
    )
    print(
        f"  change -> every tab: p50 {d['every_tab_ms']['p50']:.0f} ms, p99"
        f" {d['every_tab_ms']['p99']:.0f} ms, max {d['every_tab_ms']['max']:.0f} ms;"
        f" {d['reached_every_tab'] + d['paced']['reached_every_tab'] + d['idle']['reached_every_tab']:,}"
        f"/{d['expected_events']:,}"
        " events reached every tab"
    )
    p = d["paced"]["every_tab_ms"]
    print(
        f"  the same under {FANOUT_PACED_PER_S} clicks/s ({d['paced']['events']} events):"
        f" p50 {p['p50']:.0f} ms, p99 {p['p99']:.0f} ms, max {p['max']:.0f} ms"
    )
    i = d["idle"]["every_tab_ms"]
    print(
        f"  the same on a quiet machine ({d['idle']['events']} events of single clicks):"
        f" p50 {i['p50']:.0f} ms, p99 {i['p99']:.0f} ms, max {i['max']:.0f} ms"
    )
    lag = d.get("reader_lag_ms")
    if lag:
        print(
            "  the reader's own loop late by, p99: "
            + ", ".join(f"{k} {v['p99']:.0f} ms" for k, v in lag.items())
        )
    late = r.get("notifications_late_during_drain")
    if late:
        print(
            "  NOTIFYs that reached a listener later than, during the drain: "
            + ", ".join(f"{k[5:]} {v:.1%}" for k, v in late.items())
        )
    cpu = r["cpu_cores_during_drain"]
    print(
        f"  cores busy during the drain: service {cpu['service']:.2f}, reader"
        f" {cpu['reader']:.2f}, machine {cpu['machine']:.2f}"
    )
    for label, k in (("without streams", "drain_without_streams"), ("with", "drain_with_streams")):
        x = r[k]
        print(
            f"  drain {label}: {x['jobs_per_s']:.0f} jobs/s,"
            f" {x.get('transactions_per_job', 0):.2f} transactions per job; another user's list p50"
            f" {x['other_user_list_ms']['p50']:.1f} ms, p99 {x['other_user_list_ms']['p99']:.1f} ms"
        )


# -- main ---------------------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> dict[str, Any]:
    only = (
        set(args.only.split(","))
        if args.only
        else {"admit", "promotion", "drain", "sweep", "history", "fanout"}
    )
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "service_pool_size": POOL_SIZE,
        }
    }
    with tempfile.TemporaryDirectory(prefix="aq-bench-") as tmp_s:
        tmp = Path(tmp_s)
        server = server_dsn(tmp)
        conn = await asyncpg.connect(server)
        results["machine"]["postgres"] = await conn.fetchval("SHOW server_version")
        await conn.close()
        timeout = aiohttp.ClientTimeout(total=60)
        connector = aiohttp.TCPConnector(limit=CONCURRENCY * 2)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            if "admit" in only:
                results["admit"] = await bench_admit(server, tmp, http, args.duration)
                print_admit(results["admit"])
            if "promotion" in only:
                n = 200 if args.quick else 1000
                results["promotion"] = {
                    "callback_tail": await promotion_by_callback(server, tmp, http, n),
                    "callback_during_admits": await promotion_by_callback(
                        server, tmp, http, n, during_admits=True
                    ),
                    "callback_one_chain": await promotion_by_callback(
                        server, tmp, http, n // 2, chains=1
                    ),
                    "notify": await promotion_external(server, tmp, http, n, listen=True),
                    "sweep_only_0.25s": await promotion_external(
                        server, tmp, http, min(n, 200), listen=False
                    ),
                    "callback_ceiling_40": await promotion_by_callback(
                        server, tmp, http, n, ceiling=40
                    ),
                    "notify_ceiling_40": await promotion_external(
                        server, tmp, http, n, listen=True, ceiling=40
                    ),
                }
                print_promotion(results["promotion"])
            if "drain_service" in only:  # the service's drains alone (A/B runs of two versions)
                users = 200 if args.quick else 1000
                results["drain"] = await bench_drain(server, tmp, http, users, 5)
                print_drain(results["drain"])
                results["drain_ceiling_40"] = await bench_drain(
                    server, tmp, http, users, 5, ceiling=40
                )
                print_drain(results["drain_ceiling_40"], "with the provider ceiling at 40")
                print_ceiling_ratio(results["drain_ceiling_40"], results["drain"])
            if "drain" in only:
                users = 200 if args.quick else 1000
                results["drain_raw_sql"] = {
                    "as_is": await raw_drain(server, users, 5),
                    "without_job_changes": await raw_drain(server, users, 5, WITHOUT_JOB_CHANGES),
                    "without_job_changes_and_notify": await raw_drain(
                        server, users, 5, WITHOUT_JOB_CHANGES + WITHOUT_NOTIFY
                    ),
                }
                print_raw_drain(results["drain_raw_sql"])
                results["drain"] = await bench_drain(server, tmp, http, users, 5)
                print_drain(results["drain"])
                peers = [await bench_peer_drain(server, users, 5, c) for c in (16, 64)]
                best = max(peers, key=lambda p: p["jobs_per_s"])
                results["drain_peer_procrastinate"] = {**best, "tried": peers}  # a copy: no cycle
                print_peer_drain(results["drain_peer_procrastinate"], results["drain"])
                results["drain_ceiling_40"] = await bench_drain(
                    server, tmp, http, users, 5, ceiling=40
                )
                print_drain(results["drain_ceiling_40"], "with the provider ceiling at 40")
                print_ceiling_ratio(results["drain_ceiling_40"], results["drain"])
                print_peer_drain(results["drain_peer_procrastinate"], results["drain_ceiling_40"])
            if "history" in only:
                rows = args.history_rows or (100_000 if args.quick else 10_000_000)
                results["history"] = await bench_history(
                    server, tmp, http, [10_000, rows], 200 if args.quick else 1000
                )
                print_history(results["history"])
            if "fanout" in only:
                users = 200 if args.quick else 1000
                results["fanout"] = await bench_fanout(server, tmp, http, users, 5)
                print_fanout(results["fanout"])
            if "sweep" in only:
                big = 100_000 if args.quick else 1_000_000
                results["sweep"] = await bench_sweep(server, [1000, big], 10_000)
                print_sweep(results["sweep"])
    return results


def print_admit(r: dict[str, Any]) -> None:
    print("\n1. Admit (64 concurrent clients)")
    print(
        f"   {'':12} {'service/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'raw SQL/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'ratio':>6} {'RSS MB':>7}"
    )
    for label, v in r.items():
        s, raw = v["service"], v["raw_sql"]
        print(
            f"   {label:12} {s['rate']:10.0f} {s['p50_ms']:8.1f} {s['p99_ms']:8.1f} "
            f"{raw['rate']:10.0f} {raw['p50_ms']:8.1f} {raw['p99_ms']:8.1f} {v['ratio']:6.2f} {s['peak_rss_mb']:7.0f}"
        )


def print_promotion(r: dict[str, Any]) -> None:
    print("\n2. Promotion latency: completion commit -> next job running (the database's clock)")
    print("   and, for Core's callbacks, callback sent -> next release received (Core's clock)")
    rows = [(label, v) for label, v in r.items()]
    rows += [(f"{label} (Core)", v["core_clock"]) for label, v in r.items() if "core_clock" in v]
    for label, v in rows:
        s = v.get("steady", {})
        print(
            f"   {label:26} n={v['n']:5d}  p50 {v['p50_ms']:6.1f}  p99 {v['p99_ms']:6.1f}  max {v['max_ms']:6.1f} ms"
            + (
                f"  | without each user's first: p50 {s['p50_ms']:6.1f}  p99 {s['p99_ms']:6.1f} ms"
                if s
                else ""
            )
        )


def print_drain(r: dict[str, Any], label: str = "") -> None:
    print(f"\n3. Drain {label}, {r['instances']} instance(s)")
    print(
        f"   {r['jobs']} jobs: admitted in {r['admitted_in_s']:.1f}s ({r['open_when_admitted']} open), "
        f"all succeeded in {r['drained_in_s']:.1f}s "
        f"= {r['jobs_per_s']:.0f} jobs/s; max concurrency per user {r['max_concurrency_per_user']}, "
        f"overall {r['max_active_overall']}; "
        f"peak RSS {r['peak_rss_mb']:.0f} MB"
    )
    print(
        "   CPU (cores busy): " + ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_cores_used"].items())
    )
    print(f"   notifying commits per admitted job: {r['notifying_commits_per_job']:.2f}")
    gc = r.get("group_commits", {})
    print(
        "   group commits: "
        + ", ".join(
            f"{what} {v.get('jobs', 0):.0f} jobs in {v.get('statements', 0):.0f} statements"
            + (f" ({alone:.0f} then alone)" if (alone := v.get("alone_busy", 0)) else "")
            for what, v in sorted(gc.items())
        )
    )


def print_ceiling_ratio(on: dict[str, Any], off: dict[str, Any]) -> None:
    print(
        f"   the ceiling at 40 / off: {on['jobs_per_s'] / off['jobs_per_s']:.2f} "
        f"({on['jobs_per_s']:.0f} / {off['jobs_per_s']:.0f} jobs/s)"
    )


def print_peer_drain(peer: dict[str, Any], ours: dict[str, Any]) -> None:
    tried = ", ".join(f"{p['worker_concurrency']}: {p['jobs_per_s']:.0f}" for p in peer["tried"])
    print(
        f"\n3. Drain, the peer: procrastinate {peer['procrastinate']} with lock=<user>, "
        f"{peer['jobs']} jobs in {peer['drained_in_s']:.1f}s = {peer['jobs_per_s']:.0f} jobs/s "
        f"(worker concurrency {tried} jobs/s); max concurrency per lock "
        f"{peer['max_concurrency_per_lock']}; the service / the peer: "
        f"{ours['jobs_per_s'] / peer['jobs_per_s']:.2f}"
    )


def print_raw_drain(r: dict[str, Any]) -> None:
    print("\n3. Drain, database work only (the same statements, no HTTP, no service)")
    for label, v in r.items():
        print(
            f"   {label:30} {v['jobs']} jobs in {v['seconds']:.1f}s = {v['jobs_per_s']:.0f} jobs/s"
        )


def print_sweep(r: dict[str, Any]) -> None:
    print("\n4. Sweep pass, 10,000 users with a queued job")
    for k, v in r.items():
        if k != "ratio":
            print(f"   history {int(k):>9,}: {v['median_ms']:7.1f} ms")
    print(f"   ratio: {r['ratio']:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument(
        "--only",
        default="",
        help="comma list: admit,promotion,drain,drain_service,sweep,history,fanout",
    )
    parser.add_argument(
        "--history-rows", type=int, default=0, help="the large history (default 10,000,000)"
    )
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per admit run")
    parser.add_argument(
        "--pool-size", type=int, default=POOL_SIZE, help="the service's database pool size"
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results.json"))
    ns = parser.parse_args()
    POOL_SIZE = ns.pool_size
    res = asyncio.run(main(ns))
    Path(ns.out).write_text(json.dumps(res, indent=2, default=str))
    print(f"\nwritten: {ns.out}")
