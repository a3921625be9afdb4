"""What a client can make the edge hold, and for how long: a socket that says nothing or
dribbles its headers is closed after AQ_HEADER_TIMEOUT_S, an idle kept-alive one after
AQ_KEEPALIVE_TIMEOUT_S, a body that stops halfway is answered 408 after AQ_BODY_TIMEOUT_S, and
past AQ_MAX_CONNECTIONS a connection is refused at once. Driven over bare sockets against a
real instance with short bounds and a small cap."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
from analysis_queue.http.edge import LANE_LINGER_S, LANE_MIN, LANE_READ_S
from rawhttp import Raw, request_head
from support import Harness, Instance, wait_for

SHORT_S = 0.5
# A timer never fires early by more than the clock's resolution; a loaded machine may run it
# late, never seconds late.
EARLY_S = 0.05
LATE_S = 3.0
HEALTHZ = request_head("GET", "/healthz")


async def _metric(h: Harness, instance: Instance, sample: str) -> float:
    async with h.http.get(f"{instance.base_url}/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[1])
    return 0.0


async def test_a_socket_that_sends_nothing_is_closed_after_the_header_timeout(
    harness: Harness,
) -> None:
    instance = await harness.start_instance(header_timeout_s=SHORT_S, keepalive_timeout_s=60)
    raw = await Raw.connect(instance.base_url)
    try:
        elapsed = await raw.closed_after(SHORT_S + LATE_S)
    finally:
        await raw.close()
    assert elapsed >= SHORT_S - EARLY_S
    assert await _metric(harness, instance, 'aq_http_timeouts_total{phase="head"}') == 1


async def test_headers_dribbled_slowly_are_cut_off_at_the_header_timeout(
    harness: Harness,
) -> None:
    """The deadline is for the whole head, not for each byte: a client that keeps sending a
    header line every 50 ms is still closed at the bound."""
    instance = await harness.start_instance(header_timeout_s=SHORT_S, keepalive_timeout_s=60)
    raw = await Raw.connect(instance.base_url)
    sent = 0

    async def dribble() -> None:
        nonlocal sent
        with contextlib.suppress(ConnectionError):
            await raw.send(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")
            while True:
                await asyncio.sleep(0.05)
                await raw.send(f"X-Slow-{sent}: 1\r\n".encode())
                sent += 1

    dribbler = asyncio.create_task(dribble())
    try:
        elapsed = await raw.closed_after(SHORT_S + LATE_S)
    finally:
        dribbler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await dribbler
        await raw.close()
    assert elapsed >= SHORT_S - EARLY_S
    assert sent >= 3  # it was still sending when it was cut off


async def test_an_idle_kept_alive_connection_is_closed_after_the_keepalive_timeout(
    harness: Harness,
) -> None:
    instance = await harness.start_instance(header_timeout_s=60, keepalive_timeout_s=SHORT_S)
    raw = await Raw.connect(instance.base_url)
    try:
        await raw.send(HEALTHZ)
        assert (await raw.reply()).status == 200
        started = time.monotonic()
        await raw.closed_after(SHORT_S + LATE_S)
        elapsed = time.monotonic() - started
    finally:
        await raw.close()
    assert elapsed >= SHORT_S - EARLY_S


async def test_the_header_deadline_is_met_by_the_first_head_only(harness: Harness) -> None:
    """Once a request's head has arrived the header timer is done: a kept-alive connection
    lives by the keep-alive timeout, even when that is the longer one."""
    instance = await harness.start_instance(header_timeout_s=0.3, keepalive_timeout_s=60)
    raw = await Raw.connect(instance.base_url)
    try:
        await raw.send(HEALTHZ)
        assert (await raw.reply()).status == 200
        await asyncio.sleep(0.6)  # twice the header timeout: the point of the test
        await raw.send(HEALTHZ)
        assert (await raw.reply()).status == 200
    finally:
        await raw.close()


async def test_a_body_that_stops_halfway_is_answered_408_and_the_connection_closed(
    harness: Harness,
) -> None:
    h = harness
    instance = await h.start_instance(body_timeout_s=SHORT_S)
    raw = await Raw.connect(instance.base_url)
    head = request_head(
        "POST",
        "/v1/analyses",
        {**h.auth("u"), "Content-Type": "application/json", "Content-Length": "1000"},
    )
    try:
        started = time.monotonic()
        await raw.send(head + b'{"thesis": ')
        reply = await raw.reply(timeout_s=SHORT_S + LATE_S)
        answered = time.monotonic() - started
        await raw.closed_after(LATE_S)  # drained for at most LINGER_S, then closed
    finally:
        await raw.close()
    assert (reply.status, reply.content_type) == (408, "application/problem+json"), reply
    assert reply.json()["code"] == "request_timeout"
    assert reply.headers.get("connection", "").lower() == "close"
    assert answered >= SHORT_S - EARLY_S
    assert await _metric(h, instance, 'aq_http_timeouts_total{phase="body"}') == 1


# -- the connection cap -------------------------------------------------------------------------

CAP = 4  # and a refusal lane of 2 (edge.LANE_MIN)
AT_ONCE_S = 1.0


async def _connected(instance: Instance, n: int) -> None:
    async def counted() -> bool:
        return instance.services.edge.open_connections == n

    await wait_for(counted, timeout_s=5, what=f"{n} connections counted")


async def _timed_get(session: aiohttp.ClientSession, url: str) -> tuple[str, float]:
    started = time.monotonic()
    try:
        async with session.get(url) as r:
            await r.read()
            outcome = str(r.status)
    except aiohttp.ClientConnectionError:
        outcome = "closed"
    return outcome, time.monotonic() - started


async def test_connections_past_the_cap_are_refused_at_once_and_service_resumes(
    harness: Harness,
) -> None:
    h = harness
    # Idle sockets hold their places until the header timeout closes them.
    instance = await h.start_instance(max_connections=CAP, header_timeout_s=5)
    assert (instance.services.edge.settings.lane_slots, LANE_MIN) == (2, 2)
    idle = [await Raw.connect(instance.base_url) for _ in range(CAP)]
    fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
    try:
        await _connected(instance, CAP)

        # Past the cap: a request is answered at once, 503 with Retry-After, as a problem...
        raw = await Raw.connect(instance.base_url)
        started = time.monotonic()
        await raw.send(request_head("GET", "/v1/credits", h.auth("u")))
        refused = await raw.reply(timeout_s=AT_ONCE_S)
        assert time.monotonic() - started < AT_ONCE_S
        await raw.close()
        assert (refused.status, refused.content_type) == (503, "application/problem+json")
        assert refused.json()["code"] == "too_many_connections"
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["connection"] == "close"
        # ...while /healthz is still answered.
        raw = await Raw.connect(instance.base_url)
        await raw.send(HEALTHZ)
        alive = await raw.reply(timeout_s=AT_ONCE_S)
        await raw.close()
        assert (alive.status, alive.json()) == (200, {"status": "ok"})

        # Other clients: each request is answered or refused at once, none waits.
        url = f"{instance.base_url}/healthz"
        outcomes = await asyncio.gather(*(_timed_get(fresh, url) for _ in range(20)))
        assert {outcome for outcome, _ in outcomes} <= {"200", "503", "closed"}, outcomes
        assert max(elapsed for _, elapsed in outcomes) < AT_ONCE_S, outcomes

        # With the lane full of silent sockets too, a new connection is closed at accept.
        lane = [await Raw.connect(instance.base_url) for _ in range(2)]
        late = await Raw.connect(instance.base_url)
        assert await late.closed_after(AT_ONCE_S) < AT_ONCE_S
        await late.close()
        # A silent lane socket is answered 503 when its second is up, and closed.
        for raw in lane:
            assert (await raw.reply(timeout_s=LANE_READ_S + LATE_S)).status == 503
            await raw.closed_after(LANE_LINGER_S + LATE_S)
            await raw.close()

        # The idle sockets time out; the instance serves again.
        for raw in idle:
            await raw.closed_after(5 + LATE_S)
        await _connected(instance, 0)
        async with fresh.get(f"{instance.base_url}/v1/credits", headers=h.auth("u")) as r:
            assert r.status == 200
        assert await _metric(h, instance, 'aq_http_connections_over_cap_total{answer="503"}') >= 3
        assert (
            await _metric(h, instance, 'aq_http_connections_over_cap_total{answer="closed"}') >= 1
        )
        assert (
            await _metric(h, instance, 'aq_http_connections_over_cap_total{answer="healthz"}') >= 1
        )
    finally:
        await fresh.close()
        for raw in idle:
            await raw.close()


async def test_closing_idle_connections_frees_their_places_at_once(harness: Harness) -> None:
    instance = await harness.start_instance(max_connections=CAP, header_timeout_s=60)
    idle = [await Raw.connect(instance.base_url) for _ in range(CAP)]
    await _connected(instance, CAP)
    for raw in idle:
        await raw.close()
    await _connected(instance, 0)
    raw = await Raw.connect(instance.base_url)
    try:
        await raw.send(HEALTHZ)
        assert (await raw.reply()).status == 200
        assert instance.services.edge.open_connections == 1
    finally:
        await raw.close()
