"""``analysis-queue demo``: the write-up's scenario, end to end, printed as it happens.

A lecturer with five theses clicks "start analysis" five times. Every click is admitted at
once (one pending, four queued); each next analysis starts the moment the previous one lands.
It runs a real service in-process, with the Core simulator, and talks to it over HTTP like any
client. Its jobs live in a database of their own, created for the run on the development server
(or on AQ_DATABASE_URL's server) and dropped after it: a demo beside a running
``analysis-queue dev`` shares that server and nothing else, so neither takes the other's jobs.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from analysis_queue import logs
from analysis_queue.app import build_app, resolve_dsns, start_site
from analysis_queue.config import SIMULATOR, Pooler, Settings
from analysis_queue.http.auth import mint_token
from analysis_queue.http.state import SERVICES
from analysis_queue.store.scratch import scratch_database

POLL_S = 0.05


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
    db = runner.app[SERVICES].db
    await db.grant_credits(user, theses, "demo")
    token = mint_token(
        user,
        settings.secret("jwt_secret"),
        issuer=settings.jwt_issuer or None,
        audience=settings.jwt_audience or None,
    )
    auth = {"Authorization": f"Bearer {token}"}
    started = time.perf_counter()

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - started:6.2f}s] {text}", flush=True)

    try:
        async with aiohttp.ClientSession(base, headers=auth) as http:
            say(f"{user} has {theses} credits and {theses} theses; clicking 'start analysis' ...")
            names: dict[str, str] = {}
            for n in range(1, theses + 1):
                body = {
                    "thesis": {
                        "title": f"Thesis {n}",
                        "document_url": f"https://uni.example/theses/{n}.pdf",
                    },
                    "sources": [f"10.1000/demo.{n}.{k}" for k in range(3)],
                }
                async with http.post("/v1/analyses", json=body) as resp:
                    job: dict[str, Any] = await resp.json()
                names[job["id"]] = f"Thesis {n}"
                pos = f" (position {job['queue_position']})" if job["queue_position"] else ""
                say(f"click {n}: {resp.status} admitted, {job['status']}{pos}")
            async with http.get("/v1/credits") as resp:
                say(f"credits left: {(await resp.json())['balance']}")
            ok = await _watch(http, names, say)
    finally:
        await runner.cleanup()
    return 0 if ok else 1


async def _watch(http: aiohttp.ClientSession, names: dict[str, str], say: Any) -> bool:
    """Print each change until every analysis ended; whether they ran one at a time, in order."""
    seen: dict[str, str] = {}
    started_order: list[str] = []
    deadline = time.monotonic() + 60 + 10 * len(names)
    while time.monotonic() < deadline:
        async with http.get("/v1/analyses") as resp:
            jobs = (await resp.json())["analyses"]
        for job in sorted(jobs, key=lambda j: j["created_at"]):
            if seen.get(job["id"]) != job["status"]:
                seen[job["id"]] = job["status"]
                if job["status"] == "running":
                    started_order.append(job["id"])
                extra = ""
                if job["status"] == "succeeded":
                    extra = f" with {sum((job['verdict_counts'] or {}).values())} verdicts"
                say(f"{names.get(job['id'], job['id'])}: {job['status']}{extra}")
        counts = {s: list(seen.values()).count(s) for s in set(seen.values())}
        if counts.get("succeeded", 0) + counts.get("failed", 0) == len(names):
            in_order = started_order == list(names)  # names is in click order
            say(
                "all analyses finished; they started "
                + ("one at a time, in the order they were clicked." if in_order else "OUT OF ORDER")
            )
            return in_order
        await asyncio.sleep(POLL_S)
    say("timed out waiting for the analyses to finish")
    return False
