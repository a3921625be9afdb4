"""``analysis-queue demo``: the write-up's scenario, end to end, printed as it happens.

A lecturer with five theses clicks "start analysis" five times. Every click is admitted at
once (one pending, four queued); each next analysis starts the moment the previous one lands.
It runs a real service in-process, with the Core simulator, and talks to it over HTTP with the
Python client (``analysis_queue.client``) like any user: it clicks, then follows the event
stream. Its jobs live in a database of their own, created for the run on the development server
(or on AQ_DATABASE_URL's server) and dropped after it: a demo beside a running
``analysis-queue dev`` shares that server and nothing else, so neither takes the other's jobs.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
import uuid
from typing import Any
from uuid import UUID

from aiohttp import web

from analysis_queue import logs
from analysis_queue.app import build_app, resolve_dsns, start_site
from analysis_queue.client import (
    AdminClient,
    AnalysisQueueClient,
    AnalysisStatus,
    EventStream,
    JobEvent,
)
from analysis_queue.config import SIMULATOR, Pooler, Settings
from analysis_queue.dev.scratch import scratch_database
from analysis_queue.http.auth import mint_token

WATCH_S = 60  # how long the demo waits for its analyses: this, and per analysis ...
WATCH_PER_JOB_S = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def run_demo(settings: Settings, *, theses: int = 5, judge_time_s: float = 1.0) -> int:
    """Replay the scenario; ``settings`` as ``dev`` takes them (stand-ins for what is unset)."""
    logs.configure("WARNING")
    settings = settings.for_development()
    # On the server itself: a pooler in front of it may not know the new database.
    async with scratch_database((await resolve_dsns(settings)).direct, "aq_demo") as dsn:
        port = _free_port()
        demo_settings = settings.model_copy(
            update={
                "database_url": dsn,
                "direct_database_url": None,
                "database_pooler": Pooler.NONE,
                "core_url": SIMULATOR,  # the demo's own, whatever Core the environment names
                "port": port,
                "sim_judge_time_s": judge_time_s,
                "instance_id": f"demo-{uuid.uuid4().hex[:6]}",
            }
        )
        return await _replay(demo_settings, theses)


async def _replay(settings: Settings, theses: int) -> int:
    port = settings.port
    runner = web.AppRunner(build_app(settings), access_log=None)
    await runner.setup()
    await start_site(runner, "127.0.0.1", port)
    base = f"http://127.0.0.1:{port}"
    user = f"lecturer-{uuid.uuid4().hex[:6]}"
    token = mint_token(
        user,
        settings.secret("jwt_secret"),
        issuer=settings.jwt_issuer or None,
        audience=settings.jwt_audience or None,
    )
    started = time.perf_counter()

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - started:6.2f}s] {text}", flush=True)

    try:
        async with AdminClient(base, settings.secret("admin_token")) as admin:
            await admin.grant_credits(user, theses, note="demo")
        async with AnalysisQueueClient(base, token) as aq, aq.events() as stream:
            await anext(stream)  # the snapshot: from here on the stream has every change
            say(f"{user} has {theses} credits and {theses} theses; clicking 'start analysis' ...")
            names: dict[UUID, str] = {}
            for n in range(1, theses + 1):
                job = await aq.start_analysis(
                    f"Thesis {n}",
                    f"https://uni.example/theses/{n}.pdf",
                    [f"10.1000/demo.{n}.{k}" for k in range(3)],
                )
                names[job.id] = f"Thesis {n}"
                pos = f" (position {job.queue_position})" if job.queue_position else ""
                say(f"click {n}: admitted, {job.status}{pos}")
            say(f"credits left: {await aq.credits()}")
            ok = await _watch(aq, stream, names, say)
    finally:
        await runner.cleanup()
    return 0 if ok else 1


async def _watch(
    aq: AnalysisQueueClient, stream: EventStream, names: dict[UUID, str], say: Any
) -> bool:
    """Print each change the event stream brings until every analysis ended; whether they ran
    one at a time, in the order they were clicked."""
    seen: dict[UUID, AnalysisStatus] = {}
    try:
        async with asyncio.timeout(WATCH_S + WATCH_PER_JOB_S * len(names)):
            async for event in stream:
                job = event.job if isinstance(event, JobEvent) else None
                if job is None or job.id not in names or seen.get(job.id) == job.status:
                    continue
                seen[job.id] = job.status
                extra = ""
                if job.status is AnalysisStatus.SUCCEEDED:
                    extra = f" with {sum((job.verdict_counts or {}).values())} verdicts"
                say(f"{names[job.id]}: {job.status}{extra}")
                if len([s for s in seen.values() if s.terminal]) == len(names):
                    break
    except TimeoutError:
        say("timed out waiting for the analyses to finish")
        return False
    jobs = [await aq.get_analysis(job_id) for job_id in names]  # in click order
    serial = all(
        nxt.started_at is not None
        and prev.finished_at is not None
        and nxt.started_at >= prev.finished_at
        for prev, nxt in itertools.pairwise(jobs)
    )
    say(
        "all analyses finished; they started "
        + ("one at a time, in the order they were clicked." if serial else "OUT OF ORDER")
    )
    return serial
