"""Probes of a hostile or careless client against a real ``serve`` process, scaled to run in a
couple of minutes: what the instance holds stays bounded, and other users keep being served.

The figures each probe measured are printed (``pytest -s``) as well as asserted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from analysis_queue.http.auth import mint_token
from procs import SECRETS, Proc, base_env, cli
from support import free_port, thesis_body, wait_for

pytestmark = pytest.mark.acceptance

MAX_JOB_BYTES = 64 * 1024
RSS_LIMIT_MB = 300


@dataclass
class Service:
    base: str
    sim: str
    proc: Proc
    http: aiohttp.ClientSession

    def auth(self, user: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {mint_token(user, SECRETS['AQ_JWT_SECRET'])}"}

    async def grant(self, user: str, amount: int) -> None:
        headers = {"Authorization": f"Bearer {SECRETS['AQ_ADMIN_TOKEN']}"}
        async with self.http.post(
            f"{self.base}/v1/admin/credits",
            json={"user_id": user, "amount": amount},
            headers=headers,
        ) as r:
            assert r.status == 200, await r.text()

    def rss_mb(self) -> tuple[float, float]:
        """The process's resident set now and at its peak (VmRSS, VmHWM), in MB."""
        fields = {}
        for line in Path(f"/proc/{self.proc.popen.pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            fields[name] = value.strip()
        return (int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024)


async def _ready(http: aiohttp.ClientSession, url: str, proc: Proc) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.alive, proc.text()[-3000:]
        try:
            async with http.get(url) as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"not ready: {url}\n{proc.text()[-3000:]}")


@pytest.fixture
def service_env() -> dict[str, str]:
    """Settings a probe adds to the service's (overridden per test)."""
    return {}


@pytest.fixture
async def service(
    database_url: str, tmp_path: Path, service_env: dict[str, str]
) -> AsyncIterator[Service]:
    port, sim_port = free_port(), free_port()
    sim = Proc(
        "core-sim",
        cli(
            "core-sim",
            "--port",
            str(sim_port),
            "--judge-time",
            "3600",  # runs end when a probe says so (POST /_sim/runs/{id}/finish)
            "--callback-url",
            f"http://127.0.0.1:{port}/v1/core/events",
        ),
        base_env(tmp_path, AQ_LOG_LEVEL="WARNING"),
        tmp_path / "sim.log",
    )
    env = base_env(
        tmp_path,
        AQ_DATABASE_URL=database_url,
        AQ_CORE_URL=f"http://127.0.0.1:{sim_port}",
        AQ_PORT=str(port),
        AQ_LOG_LEVEL="WARNING",
        AQ_SWEEP_INTERVAL_S="0",
        **service_env,
    )
    proc = Proc("serve", cli("serve"), env, tmp_path / "serve.log")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        try:
            await _ready(http, f"http://127.0.0.1:{sim_port}/_sim/stats", sim)
            await _ready(http, f"http://127.0.0.1:{port}/readyz", proc)
            yield Service(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{sim_port}", proc, http)
        finally:
            proc.kill()
            sim.kill()


def _largest_body(n: int) -> dict[str, Any]:
    """An admit body that stores just under the job byte budget: 200 long sources."""
    prefix = f"https://library.example/{n}/"
    per = (MAX_JOB_BYTES - 600) // 200 - 3 - len(prefix) - 4
    return {
        "thesis": {
            "title": f"Thesis {n} " + "x" * 400,
            "document_url": f"https://u.example/{n}.pdf",
        },
        "sources": [f"{prefix}{k:03d}/" + "y" * per for k in range(200)],
    }


async def _admit(s: Service, user: str, count: int, body: Any = _largest_body) -> list[str]:
    ids: list[str] = []
    for n in range(count):
        async with s.http.post(f"{s.base}/v1/analyses", json=body(n), headers=s.auth(user)) as r:
            assert r.status == 201, await r.text()
            ids.append((await r.json())["id"])
    return ids


async def _read_all_pages(s: Service, user: str) -> tuple[int, int]:
    jobs, size, query = 0, 0, "?limit=200"
    while True:
        async with s.http.get(f"{s.base}/v1/analyses{query}", headers=s.auth(user)) as r:
            raw = await r.read()
            body = await r.json()
        jobs, size = jobs + len(body["analyses"]), size + len(raw)
        if body["next"] is None:
            return jobs, size
        query = f"?limit=200&cursor={body['next']}"


async def _read_stream(s: Service, user: str, headers: dict[str, str], until: bytes) -> int:
    """Open a stream, read until ``until`` has been seen, close; the bytes read."""
    size = 0
    async with s.http.get(f"{s.base}/v1/events", headers={**s.auth(user), **headers}) as r:
        assert r.status == 200
        tail = b""
        while True:
            chunk = await asyncio.wait_for(r.content.readany(), 30)
            assert chunk, "the stream ended early"
            size += len(chunk)
            seen = tail + chunk
            if until in seen:
                return size
            tail = seen[-len(until) :]


async def test_a_user_with_300_maximum_size_jobs_lists_snapshots_and_replays_them(
    service: Service,
) -> None:
    s = service
    await s.grant("hoarder", 300)
    ids = await _admit(s, "hoarder", 300)
    rss_before, _ = s.rss_mb()

    listed, list_bytes = await _read_all_pages(s, "hoarder")
    assert listed == 300
    snapshot_bytes = await _read_stream(s, "hoarder", {}, b"event: snapshot")
    # A replay of everything: the 300 admitted events and the first one's start.
    replay_bytes = await _read_stream(s, "hoarder", {"Last-Event-ID": "0"}, b"event: position")
    # And all of it at once, four times over.
    results = await asyncio.gather(
        *(_read_all_pages(s, "hoarder") for _ in range(4)),
        *(_read_stream(s, "hoarder", {"Last-Event-ID": "0"}, b"event: position") for _ in range(4)),
    )
    rss_now, rss_peak = s.rss_mb()
    print(
        f"\n300 jobs of ~{MAX_JOB_BYTES // 1024} KiB: list {list_bytes / 1e6:.2f} MB in "
        f"{-(-300 // 200)} pages, snapshot {snapshot_bytes / 1e6:.2f} MB, replay "
        f"{replay_bytes / 1e6:.2f} MB; RSS {rss_before:.0f} MB before, {rss_now:.0f} MB after, "
        f"peak {rss_peak:.0f} MB"
    )
    assert all(r == (300, list_bytes) for r in results[:4])
    assert rss_peak < RSS_LIMIT_MB, rss_peak
    assert list_bytes < 2_000_000 and replay_bytes < 2_000_000, "summaries, not jobs"
    async with s.http.get(f"{s.base}/v1/analyses/{ids[0]}", headers=s.auth("hoarder")) as r:
        whole = await r.json()
    assert len(whole["sources"]) == 200, "the whole job is one GET away"


async def _finish_running(s: Service, user: str) -> None:
    """Finish the user's running job in Core (the simulator judges forever otherwise)."""
    async with s.http.get(f"{s.sim}/_sim/runs") as r:
        runs = await r.json()
    judging = [run for run in runs if run["state"] == "judging" and run["user_id"] == user]
    assert len(judging) == 1, judging
    async with s.http.post(f"{s.sim}/_sim/runs/{judging[0]['id']}/finish") as r:
        assert r.status == 200, await r.text()


async def test_an_idle_stream_of_a_long_queue_receives_little_per_promotion(
    service: Service,
) -> None:
    s = service
    await s.grant("lecturer", 200)
    ids = await _admit(s, "lecturer", 200)
    received = 0
    promoted: set[str] = set()
    async with s.http.get(f"{s.base}/v1/events", headers=s.auth("lecturer")) as stream:
        assert stream.status == 200
        buffered = b""
        while b"event: snapshot" not in buffered:
            buffered += await asyncio.wait_for(stream.content.readany(), 30)
        started = time.monotonic()

        async def running() -> set[str]:
            async with s.http.get(
                f"{s.base}/v1/analyses?limit=200", headers=s.auth("lecturer")
            ) as r:
                return {j["id"] for j in (await r.json())["analyses"] if j["status"] == "running"}

        async def next_started() -> bool:
            return bool(await running() - promoted - {ids[0]})

        for _ in range(20):
            await _finish_running(s, "lecturer")
            await wait_for(next_started, what="the next job to start")
            promoted.update(await running())
        # Everything the 20 promotions sent has arrived once the last start is on the stream.
        while True:
            try:
                chunk = await asyncio.wait_for(stream.content.readany(), 1.0)
            except TimeoutError:
                break
            received += len(chunk)
            if not chunk:
                break
        took = time.monotonic() - started
    print(
        f"\nidle stream, 200 queued jobs: {received / 1e6:.3f} MB for 20 promotions in {took:.1f} s"
    )
    assert received < 1_000_000, received
    assert received > 20 * 200, "it did receive the promotions"


def _p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


async def test_with_a_table_locked_admits_fail_fast_and_readiness_answers(
    service: Service, database_url: str
) -> None:
    """The defaults: a query waits at most 5 s for a pooled connection (a new one included)
    and 10 s for its statement (the functions' own lock_timeout is 10 s too). 100 clicks while
    a migration-like lock is held on the jobs table for up to 20 s."""
    s = service
    users = [f"clicker-{n}" for n in range(50)]
    for user in users:
        await s.grant(user, 2)
    import asyncpg

    blocker = await asyncpg.connect(database_url)
    answers: list[tuple[int, str | None, float]] = []

    async def click(user: str, n: int) -> None:
        started = time.monotonic()
        async with s.http.post(
            f"{s.base}/v1/analyses", json=thesis_body(n), headers=s.auth(user)
        ) as r:
            await r.read()
            answers.append((r.status, r.headers.get("Retry-After"), time.monotonic() - started))

    try:
        await blocker.execute("BEGIN; LOCK TABLE analysis_jobs IN ACCESS EXCLUSIVE MODE")
        held_at = time.monotonic()
        clicks = asyncio.gather(*(click(u, n) for u in users for n in range(2)))
        ready: list[tuple[int, float]] = []
        # Its own client: the clicks hold the shared session's hundred connections.
        async with aiohttp.ClientSession() as probe:
            while not clicks.done():
                started = time.monotonic()
                async with probe.get(f"{s.base}/readyz") as r:
                    ready.append((r.status, time.monotonic() - started))
                await asyncio.sleep(0.2)
        await clicks
        assert time.monotonic() - held_at < 20, "every click was answered while the lock held"
    finally:
        await blocker.execute("ROLLBACK")
        await blocker.close()
    statuses = sorted({status for status, _, _ in answers})
    slowest = max(took for _, _, took in answers)
    print(
        f"\n100 clicks behind a table lock: statuses {statuses}, slowest {slowest:.2f} s; "
        f"/readyz {len(ready)} times, slowest {max(t for _, t in ready):.3f} s"
    )
    assert statuses == [503] and all(retry == "1" for _, retry, _ in answers)
    assert slowest < 5 + 10 + 3, "the acquire and statement bounds, and Core's answer"
    assert all(status == 200 and took < 2 for status, took in ready), ready
    async with s.http.post(
        f"{s.base}/v1/analyses", json=_largest_body(0), headers=s.auth(users[0])
    ) as r:
        assert r.status == 201, "and admits go on once the lock is gone"


@pytest.mark.parametrize("service_env", [{"AQ_MAX_CONNECTIONS": "60", "AQ_HEADER_TIMEOUT_S": "30"}])
async def test_stream_and_connection_caps_while_another_user_is_served(
    service: Service,
) -> None:
    s = service
    await s.grant("neighbour", 1)
    latencies: list[float] = []
    stop = asyncio.Event()

    async def neighbour() -> None:  # another user, on a connection of their own, all along
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as own:
            while not stop.is_set():
                started = time.monotonic()
                async with own.get(f"{s.base}/v1/credits", headers=s.auth("neighbour")) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                latencies.append(time.monotonic() - started)
                await asyncio.sleep(0.01)

    served = asyncio.create_task(neighbour())
    streams: list[aiohttp.ClientResponse] = []
    sockets: list[asyncio.StreamWriter] = []
    try:
        for _ in range(20):
            streams.append(await s.http.get(f"{s.base}/v1/events", headers=s.auth("hoarder")))
        assert [r.status for r in streams] == [200] * 20
        async with s.http.get(f"{s.base}/v1/events", headers=s.auth("hoarder")) as refused:
            assert refused.status == 429 and refused.headers["Retry-After"].isdigit()
            assert (await refused.json())["code"] == "too_many_streams"
        # Idle sockets that never send a request: as many as the cap allows, and one more.
        host, port = s.base.removeprefix("http://").split(":")

        async def idle(count: int) -> None:
            for _ in range(count):
                _, writer = await asyncio.open_connection(host, int(port))
                sockets.append(writer)

        async def connections() -> int:  # as the instance counts them (this one's included)
            async with s.http.get(f"{s.base}/metrics") as r:
                text = await r.text()
            line = next(ln for ln in text.splitlines() if ln.startswith("aq_http_connections "))
            return int(float(line.split()[1]))

        while await connections() < 60:
            await idle(1)
        async with aiohttp.ClientSession() as fresh:
            async with fresh.get(f"{s.base}/v1/credits", headers=s.auth("neighbour")) as r:
                over_cap = r.status
                assert r.headers.get("Retry-After") == "1"
            async with fresh.get(f"{s.base}/healthz") as r:
                health = r.status
        # Far past the cap (and its small refusal lane): refused at once, never left hanging.
        await idle(60)
        refused_in: list[float] = []
        for _ in range(10):
            started = time.monotonic()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as fresh:
                try:
                    async with fresh.get(f"{s.base}/v1/credits") as r:
                        assert r.status == 503
                except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                    pass  # closed at accept
            refused_in.append(time.monotonic() - started)
        await asyncio.sleep(1.0)  # the neighbour keeps asking meanwhile
    finally:
        stop.set()
        await served
        for stream in streams:
            stream.close()
        for writer in sockets:
            writer.close()
    p99 = _p99(latencies)
    print(
        f"\n20 streams + 1 refused (429), idle sockets up to a cap of 60: a new request "
        f"{over_cap}, /healthz {health}; 60 more: refused within {max(refused_in):.3f} s; the "
        f"neighbour: {len(latencies)} requests, p99 {p99 * 1000:.1f} ms"
    )
    assert (over_cap, health) == (503, 200)
    assert max(refused_in) < 2.5, refused_in
    assert p99 < 0.25, p99
