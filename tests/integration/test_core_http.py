"""CoreClient against a real CoreSimulator over HTTP: create, release, cancel, callbacks, faults."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import ClientSession, web
from analysis_queue.core.client import CoreClient, CoreRun, verify_callback
from analysis_queue.dev.core_sim import VERDICTS, CoreSimulator, verdict_for
from analysis_queue.errors import (
    CoreRunGone,
    CoreUnavailable,
    InvalidSource,
    ProviderBudgetExhausted,
    UnparseableThesis,
)

SECRET = "test-callback-secret"
WAIT_S = 5.0
FAST_JUDGE_S = 0.05
# Long enough that a run released in a test stays "judging" until the test finishes it.
SLOW_JUDGE_S = 30.0
THESIS = {"title": "On simulators", "document_url": "https://uni.example/thesis.PDF"}
SOURCES = [
    "10.1234/abc.def",
    "doi:10.55555/x-1",
    "https://doi.org/10.1000/182",
    "https://a.example/p",
]


@dataclass(frozen=True)
class Callback:
    headers: dict[str, str]
    body: bytes

    def verified(self, secret: str = SECRET) -> bool:
        return verify_callback(
            secret,
            self.headers.get("X-Core-Timestamp"),
            self.headers.get("X-Core-Signature"),
            self.body,
            now=time.time(),
        )

    def run(self) -> CoreRun:
        return CoreRun.from_json(orjson.loads(self.body))


@dataclass
class Receiver:
    url: str = ""
    status: int = 204
    calls: asyncio.Queue[Callback] = field(default_factory=asyncio.Queue)

    async def next(self) -> Callback:
        return await asyncio.wait_for(self.calls.get(), WAIT_S)


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    rec = Receiver()

    async def handle(request: web.Request) -> web.Response:
        await rec.calls.put(Callback(dict(request.headers), await request.read()))
        return web.Response(status=rec.status)

    app = web.Application()
    app.router.add_post("/v1/core/events", handle)
    runner, base = await _serve(app)
    rec.url = base + "/v1/core/events"
    yield rec
    await runner.cleanup()


@pytest.fixture
async def sim(receiver: Receiver) -> AsyncIterator[CoreSimulator]:
    simulator = CoreSimulator(
        callback_urls=[receiver.url], callback_secret=SECRET, judge_time_s=FAST_JUDGE_S
    )
    await simulator.start()
    yield simulator
    await simulator.stop()
    await simulator.stop()


@pytest.fixture
async def client(sim: CoreSimulator) -> AsyncIterator[CoreClient]:
    core = CoreClient(sim.base_url, timeout_s=WAIT_S)
    await core.start()
    await core.start()
    yield core
    await core.close()
    await core.close()


@pytest.fixture
async def http() -> AsyncIterator[ClientSession]:
    async with ClientSession() as session:
        yield session


async def _create(client: CoreClient, run_id: str = "run-1", **overrides: Any) -> CoreRun:
    thesis = overrides.pop("thesis", THESIS)
    sources = overrides.pop("sources", SOURCES)
    return await client.create_held(run_id, "user-1", thesis, sources)


# --- create ----------------------------------------------------------------------------------


async def test_create_held_is_idempotent_on_run_id(client: CoreClient, sim: CoreSimulator) -> None:
    first = await _create(client)
    again = await _create(client)

    assert first.state == "held" and first.id.startswith("core-")
    assert again == first
    snapshot = sim.runs_snapshot()
    assert [(r["id"], r["run_id"], r["user_id"], r["state"]) for r in snapshot] == [
        (first.id, "run-1", "user-1", "held")
    ]
    fetched = await client.get_run(first.id)
    assert fetched is not None and fetched.state == "held" and not fetched.finished


@pytest.mark.parametrize(
    "bad_source",
    ["10.12/abc", "10.12345/", "doi:10.1234/has space", "ftp://files.example/a", "http:///nohost"],
)
async def test_bad_source_is_invalid_source(client: CoreClient, bad_source: str) -> None:
    with pytest.raises(InvalidSource) as refused:
        await _create(client, sources=[*SOURCES, bad_source])
    assert repr(bad_source) in refused.value.detail


async def test_empty_sources_is_invalid_source(client: CoreClient) -> None:
    with pytest.raises(InvalidSource):
        await _create(client, sources=[])


@pytest.mark.parametrize(
    "thesis",
    [
        {"title": "T", "document_url": "https://uni.example/thesis.exe"},
        {"title": "T", "document_url": "file:///home/me/thesis.pdf"},
        {"title": "T", "document_url": "https:///thesis.pdf"},
        {"title": "", "document_url": "https://uni.example/thesis.pdf"},
        {"title": "x" * 501, "document_url": "https://uni.example/thesis.pdf"},
    ],
)
async def test_bad_thesis_is_unparseable(client: CoreClient, thesis: dict[str, str]) -> None:
    with pytest.raises(UnparseableThesis) as refused:
        await _create(client, thesis=thesis)
    assert refused.value.detail.startswith("thesis")


async def test_budget_exhausted_refuses_new_runs_only(
    client: CoreClient, sim: CoreSimulator
) -> None:
    sim.faults.budget_runs = 1
    first = await _create(client, "run-1")

    with pytest.raises(ProviderBudgetExhausted):
        await _create(client, "run-2")
    assert (await _create(client, "run-1")).id == first.id


async def test_create_fault_5xx_is_core_unavailable(client: CoreClient, sim: CoreSimulator) -> None:
    sim.faults.create_status = 503
    with pytest.raises(CoreUnavailable):
        await _create(client)


@pytest.mark.parametrize(
    "body",
    [b"not json", b"[]", b'{"run_id": "r", "user_id": "u", "thesis": {}, "sources": []}'],
)
async def test_malformed_create_body_is_400(
    sim: CoreSimulator, http: ClientSession, body: bytes
) -> None:
    async with http.post(sim.base_url + "/v1/runs", data=body) as response:
        assert response.status == 400


async def test_create_without_hold_judges_at_once(
    sim: CoreSimulator, http: ClientSession, receiver: Receiver
) -> None:
    body = {"run_id": "r", "user_id": "u", "thesis": THESIS, "sources": SOURCES, "hold": False}
    async with http.post(sim.base_url + "/v1/runs", data=orjson.dumps(body)) as response:
        assert response.status == 201
        assert (await response.json())["state"] == "judging"
    assert (await receiver.next()).run().state == "completed"


# --- release, judging, callbacks -------------------------------------------------------------


async def test_release_judges_and_calls_back_signed(
    client: CoreClient, sim: CoreSimulator, receiver: Receiver
) -> None:
    sim.judge_time_s = SLOW_JUDGE_S
    run = await _create(client)
    await client.release(run.id)
    await client.release(run.id)  # idempotent while judging
    judging = await client.get_run(run.id)
    assert judging is not None and judging.state == "judging"

    sim.judge_time_s = FAST_JUDGE_S
    other = await _create(client, "run-2")
    await client.release(other.id)
    callback = await receiver.next()

    assert callback.verified()
    assert not callback.verified("another-secret")
    done = callback.run()
    assert done.id == other.id and done.state == "completed" and done.error is None
    assert [v.source for v in done.verdicts] == SOURCES
    assert all(v.verdict == verdict_for(v.source) in VERDICTS for v in done.verdicts)
    assert await client.get_run(other.id) == done
    with pytest.raises(CoreRunGone):
        await client.release(other.id)  # completed runs are not held


async def test_release_of_cancelled_run_is_gone(client: CoreClient) -> None:
    run = await _create(client)
    await client.cancel(run.id)
    await client.cancel(run.id)

    with pytest.raises(CoreRunGone):
        await client.release(run.id)
    cancelled = await client.get_run(run.id)
    assert cancelled is not None and cancelled.state == "cancelled" and cancelled.finished


async def test_cancel_stops_judging_without_callback(
    client: CoreClient, sim: CoreSimulator, receiver: Receiver
) -> None:
    sim.judge_time_s = SLOW_JUDGE_S
    run = await _create(client, "run-1")
    await client.release(run.id)
    await client.cancel(run.id)

    sim.judge_time_s = FAST_JUDGE_S
    other = await _create(client, "run-2")
    await client.release(other.id)
    assert (await receiver.next()).run().id == other.id
    assert receiver.calls.empty()
    assert [r["state"] for r in sim.runs_snapshot()] == ["cancelled", "completed"]


async def test_unknown_run(client: CoreClient) -> None:
    assert await client.get_run("core-nope") is None
    await client.cancel("core-nope")
    with pytest.raises(CoreRunGone):
        await client.release("core-nope")


async def test_release_fault_5xx_is_core_unavailable(
    client: CoreClient, sim: CoreSimulator
) -> None:
    run = await _create(client)
    sim.faults.release_status = 503
    with pytest.raises(CoreUnavailable):
        await client.release(run.id)
    sim.faults.release_status = None
    await client.release(run.id)


async def test_offline_is_unavailable_and_online_keeps_state(
    client: CoreClient, sim: CoreSimulator
) -> None:
    run = await _create(client)
    url = sim.base_url
    await sim.go_offline()

    with pytest.raises(CoreUnavailable) as refused:
        await client.get_run(run.id)
    assert "connection failed" in refused.value.detail
    with pytest.raises(CoreUnavailable):
        await _create(client, "run-2")

    await sim.go_online()
    assert sim.base_url == url
    assert await client.get_run(run.id) == run
    await client.release(run.id)


async def test_dropped_callbacks_are_not_sent(
    client: CoreClient, sim: CoreSimulator, receiver: Receiver, http: ClientSession
) -> None:
    sim.judge_time_s = SLOW_JUDGE_S
    sim.faults.drop_callbacks = True
    dropped = await _create(client, "run-1")
    await client.release(dropped.id)
    async with http.post(f"{sim.base_url}/_sim/runs/{dropped.id}/finish") as response:
        assert response.status == 200

    sim.faults.drop_callbacks = False
    sent = await _create(client, "run-2")
    await client.release(sent.id)
    async with http.post(f"{sim.base_url}/_sim/runs/{sent.id}/finish") as response:
        assert response.status == 200

    assert (await receiver.next()).run().id == sent.id
    assert receiver.calls.empty()
    finished = await client.get_run(dropped.id)
    assert finished is not None and finished.state == "completed"


async def test_duplicate_callbacks_are_sent_twice(
    client: CoreClient, sim: CoreSimulator, receiver: Receiver
) -> None:
    sim.faults.duplicate_callbacks = True
    run = await _create(client)
    await client.release(run.id)

    first, second = await receiver.next(), await receiver.next()
    assert first.verified() and second.verified()
    assert first.run() == second.run()
    assert first.run().id == run.id


async def test_failing_runs_call_back_failed(
    client: CoreClient, sim: CoreSimulator, receiver: Receiver
) -> None:
    sim.faults.fail_runs = True
    run = await _create(client)
    await client.release(run.id)

    failed = (await receiver.next()).run()
    assert (failed.state, failed.error, failed.verdicts) == ("failed", "provider_error", [])
    assert failed.finished


async def test_callback_tries_the_next_url_then_retries(
    client: CoreClient, sim: CoreSimulator, receiver: Receiver
) -> None:
    sim.callback_urls = ["http://127.0.0.1:1/v1/core/events", receiver.url]
    first = await _create(client, "run-1")
    await client.release(first.id)
    assert (await receiver.next()).run().id == first.id

    # A refusing receiver gets the same callback again in the next round.
    sim.callback_urls = [receiver.url]
    receiver.status = 503
    second = await _create(client, "run-2")
    await client.release(second.id)
    refused = await receiver.next()
    receiver.status = 204
    retried = await receiver.next()
    assert refused.run() == retried.run() and retried.run().id == second.id


async def test_control_api(
    client: CoreClient, sim: CoreSimulator, receiver: Receiver, http: ClientSession
) -> None:
    faults = {"fail_runs": True, "judge_time_s": SLOW_JUDGE_S}
    async with http.post(sim.base_url + "/_sim/faults", data=orjson.dumps(faults)) as response:
        assert response.status == 200
        assert (await response.json())["fail_runs"] is True
    assert sim.faults.fail_runs and sim.judge_time_s == SLOW_JUDGE_S
    for bad in ({"fail_runs": "yes"}, {"create_status": True}, {"no_such_fault": 1}):
        async with http.post(sim.base_url + "/_sim/faults", data=orjson.dumps(bad)) as response:
            assert response.status == 400

    run = await _create(client)
    await client.release(run.id)
    finish = {"state": "failed", "error": "document_unreadable"}
    url = f"{sim.base_url}/_sim/runs/{run.id}/finish"
    async with http.post(url, data=orjson.dumps(finish)) as response:
        assert response.status == 200
    assert (await receiver.next()).run().error == "document_unreadable"
    async with http.post(url) as response:
        assert response.status == 409

    async with http.get(sim.base_url + "/_sim/runs") as response:
        runs = await response.json()
    assert [(r["id"], r["state"]) for r in runs] == [(run.id, "failed")]


async def test_stats_count_runs_judging_at_once(
    client: CoreClient, sim: CoreSimulator, receiver: Receiver, http: ClientSession
) -> None:
    async def stats() -> dict[str, int]:
        async with http.get(sim.base_url + "/_sim/stats") as response:
            assert response.status == 200
            return dict(await response.json())

    sim.judge_time_s = SLOW_JUDGE_S
    runs = [await _create(client, f"run-{i}") for i in range(3)]
    assert await stats() == {"judging": 0, "max_judging": 0}  # held is not judging
    for run in runs:
        await client.release(run.id)
    await client.release(runs[0].id)  # a repeated release is the same run judging
    assert await stats() == {"judging": 3, "max_judging": 3}

    await client.cancel(runs[0].id)
    async with http.post(f"{sim.base_url}/_sim/runs/{runs[1].id}/finish") as response:
        assert response.status == 200
    assert (await receiver.next()).run().id == runs[1].id
    assert await stats() == {"judging": 1, "max_judging": 3}

    sim.judge_time_s = FAST_JUDGE_S
    fast = await _create(client, "run-fast")
    await client.release(fast.id)
    assert (await receiver.next()).run().id == fast.id  # judged to the end on its own
    assert await stats() == {"judging": 1, "max_judging": 3}
    assert sim.stats() == await stats()


# --- signatures ------------------------------------------------------------------------------
