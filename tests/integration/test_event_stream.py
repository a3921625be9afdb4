"""GET /v1/events against real instances: order, replay, fan-out across instances, isolation,
back-pressure, clean-up and shutdown; and the event log's ids in the database."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import asyncpg
import orjson
import pytest
from analysis_queue.http.auth import mint_token
from analysis_queue.models import AdmitRequest, ReserveRequest
from analysis_queue.store.database import Database
from support import JWT_SECRET, Harness, Instance, fetch, fetchval, thesis_body, wait_for

WAIT_S = 10.0
SSE_READ_BUFSIZE = 1024 * 1024  # lines (events) up to 2 MiB


# -- a small SSE client ---------------------------------------------------------------------


@dataclasses.dataclass
class Sse:
    id: int | None
    type: str
    data: dict[str, Any]

    @property
    def job_id(self) -> str | None:
        job = self.data.get("job")
        return job["id"] if job else None

    @property
    def positions(self) -> dict[str, int]:
        """A position frame's moves: job id -> its queue position."""
        return {m["id"]: m["queue_position"] for m in self.data.get("positions", [])}


class SseClient:
    """Reads one stream in the background; tests wait on what arrived."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response
        self.events: list[Sse] = []
        self.comments = 0
        self.ended = asyncio.Event()
        self._arrived = asyncio.Condition()
        self._task = asyncio.create_task(self._read())

    @classmethod
    async def open(
        cls,
        h: Harness,
        instance: Instance,
        user: str,
        *,
        last_event_id: int | None = None,
        query_token: bool = False,
    ) -> SseClient:
        headers: dict[str, str] = {}
        params: dict[str, str] = {}
        if query_token:
            params["access_token"] = mint_token(user, JWT_SECRET)
        else:
            headers.update(h.auth(user))
        if last_event_id is not None:
            headers["Last-Event-ID"] = str(last_event_id)
        # An event carrying a big job is one long `data:` line; the client's line limit is
        # twice its read buffer, whose default changed across aiohttp releases: say it.
        response = await h.http.get(
            f"{instance.base_url}/v1/events",
            headers=headers,
            params=params,
            read_bufsize=SSE_READ_BUFSIZE,
        )
        assert response.status == 200, await response.text()
        assert response.headers["Content-Type"].startswith("text/event-stream")
        return cls(response)

    async def _read(self) -> None:
        fields: dict[str, str] = {}
        data: list[str] = []
        try:
            while True:
                raw = await self.response.content.readline()
                if not raw:
                    return
                line = raw.decode().rstrip("\n")
                if line == "":
                    if data:
                        event = Sse(
                            int(fields["id"]) if "id" in fields else None,
                            fields.get("event", "message"),
                            orjson.loads("\n".join(data)),
                        )
                        async with self._arrived:
                            self.events.append(event)
                            self._arrived.notify_all()
                    fields, data = {}, []
                elif line.startswith(":"):
                    self.comments += 1
                else:
                    name, _, value = line.partition(":")
                    value = value.removeprefix(" ")
                    if name == "data":
                        data.append(value)
                    else:
                        fields[name] = value
        except (aiohttp.ClientError, ConnectionError):
            return
        finally:
            self.ended.set()
            async with self._arrived:
                self._arrived.notify_all()

    async def until(
        self, predicate: Callable[[list[Sse]], bool], timeout_s: float = WAIT_S, what: str = ""
    ) -> list[Sse]:
        async def satisfied() -> None:
            async with self._arrived:
                await self._arrived.wait_for(lambda: predicate(self.events) or self.ended.is_set())

        try:
            await asyncio.wait_for(satisfied(), timeout_s)
        except TimeoutError:
            pass
        assert predicate(self.events), f"timed out waiting for {what}: {self.summary()}"
        return self.events

    def stored(self) -> list[Sse]:
        """Events with an id, snapshots aside."""
        return [e for e in self.events if e.id is not None and e.type != "snapshot"]

    def summary(self) -> list[tuple[int | None, str, str | None]]:
        return [(e.id, e.type, e.job_id) for e in self.events]

    async def close(self) -> None:
        self.response.close()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


@contextlib.asynccontextmanager
async def stream(
    h: Harness, instance: Instance, user: str, **kwargs: Any
) -> AsyncIterator[SseClient]:
    client = await SseClient.open(h, instance, user, **kwargs)
    try:
        yield client
    finally:
        await client.close()


def kinds_of(events: list[Sse], job_id: str) -> list[str]:
    return [e.type for e in events if e.job_id == job_id and e.type != "position"]


def has(kind: str, job_id: str) -> Callable[[list[Sse]], bool]:
    return lambda events: any(e.type == kind and e.job_id == job_id for e in events)


async def core_run(h: Harness, job_id: str) -> str:
    return str(
        await fetchval(
            h.database_url, "SELECT core_run_id FROM analysis_jobs WHERE id = $1::uuid", job_id
        )
    )


async def finish_in_core(h: Harness, job_id: str) -> None:
    async with h.http.post(f"{h.sim.base_url}/_sim/runs/{await core_run(h, job_id)}/finish") as r:
        assert r.status == 200, await r.text()


async def admitted(h: Harness, user: str, n: int, **kwargs: Any) -> dict[str, Any]:
    status, body = await h.admit(user, n, **kwargs)
    assert status == 201, body
    return body


def subscribers(instance: Instance) -> float | None:
    registry = instance.services.metrics.registry
    return registry.get_sample_value("aq_event_subscribers")


# -- order ----------------------------------------------------------------------------------


async def test_events_arrive_in_order_with_increasing_ids(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = 60  # runs finish when the test says so
    inst = await h.start_instance()
    await h.grant("u", 5)
    async with stream(h, inst, "u") as s:
        (snapshot,) = await s.until(lambda ev: len(ev) >= 1, what="the snapshot")
        assert (snapshot.type, snapshot.id, snapshot.data["analyses"]) == ("snapshot", 0, [])

        a = await admitted(h, "u", 1)
        await s.until(has("started", a["id"]), what="a started")
        b = await admitted(h, "u", 2)
        c = await admitted(h, "u", 3)
        await s.until(has("admitted", c["id"]), what="c admitted")
        await finish_in_core(h, a["id"])
        await s.until(has("started", b["id"]), what="b started")
        await finish_in_core(h, b["id"])
        await s.until(has("started", c["id"]), what="c started")
        events = await s.until(
            lambda ev: sum(e.type == "position" for e in ev) >= 1, what="a position change"
        )

    stored = s.stored()
    assert [e.id for e in stored] == list(range(1, len(stored) + 1))  # dense, increasing
    assert [(e.type, e.job_id) for e in stored] == [
        ("admitted", a["id"]),
        ("started", a["id"]),
        ("admitted", b["id"]),
        ("admitted", c["id"]),
        ("finished", a["id"]),
        ("promoted", b["id"]),
        ("started", b["id"]),
        ("finished", b["id"]),
        ("promoted", c["id"]),
        ("started", c["id"]),
    ]
    for event in stored:
        assert event.data["id"] == event.id and event.data["kind"] == event.type
        assert set(event.data["job"]) >= {"id", "status", "queue_position", "thesis"}
        assert "sources" not in event.data["job"] and "verdicts" not in event.data["job"]
    # c moved from 2nd to 1st in the queue when b was promoted: a position frame without an id.
    moves = [e for e in events if e.type == "position"]
    assert moves[0].id is None and moves[0].positions == {c["id"]: 1}
    finished_a = next(e for e in stored if e.type == "finished")
    assert finished_a.data["job"]["status"] == "succeeded"
    assert sum(finished_a.data["job"]["verdict_counts"].values()) == 2
    b_admitted = next(e for e in stored if e.type == "admitted" and e.job_id == b["id"])
    assert b_admitted.data["at"] < finished_a.data["at"]


async def test_delete_of_a_queued_job_is_a_deleted_event_and_moves_the_rest(
    harness: Harness,
) -> None:
    h = harness
    h.sim.judge_time_s = 60
    inst = await h.start_instance()
    await h.grant("u", 3)
    await admitted(h, "u", 1)
    b = await admitted(h, "u", 2)
    c = await admitted(h, "u", 3)
    async with stream(h, inst, "u") as s:
        await s.until(lambda ev: len(ev) >= 1, what="the snapshot")
        async with h.http.delete(
            f"{inst.base_url}/v1/analyses/{b['id']}", headers=h.auth("u")
        ) as r:
            assert r.status == 200
        events = await s.until(
            lambda ev: has("deleted", b["id"])(ev) and any(e.type == "position" for e in ev),
            what="the delete and c's move",
        )
    deleted = next(e for e in events if e.type == "deleted")
    assert deleted.data["job"]["status"] == "cancelled"
    (move,) = [e for e in events if e.type == "position"]
    assert move.positions == {c["id"]: 1}, "a, not queued, is not in it"


async def test_cancel_of_a_queued_job_is_a_cancelled_event_and_the_job_stays(
    harness: Harness,
) -> None:
    h = harness
    h.sim.judge_time_s = 60
    inst = await h.start_instance()
    await h.grant("u", 3)
    await admitted(h, "u", 1)
    b = await admitted(h, "u", 2)
    c = await admitted(h, "u", 3)
    async with stream(h, inst, "u") as s:
        await s.until(lambda ev: len(ev) >= 1, what="the snapshot")
        async with h.http.post(
            f"{inst.base_url}/v1/analyses/{b['id']}/cancel", headers=h.auth("u")
        ) as r:
            assert r.status == 200, await r.text()
        events = await s.until(
            lambda ev: has("cancelled", b["id"])(ev) and any(e.type == "position" for e in ev),
            what="the cancel and c's move",
        )
    assert kinds_of(events, b["id"]) == ["cancelled"], "a cancel is no delete"
    (cancelled,) = [e for e in events if e.type == "cancelled"]
    assert cancelled.data["job"]["status"] == "cancelled"
    assert cancelled.data["job"]["error"]["code"] == "cancelled_by_user"
    (move,) = [e for e in events if e.type == "position"]
    assert move.positions == {c["id"]: 1}, "a, not queued, is not in it"

    # A new stream's snapshot still lists it, cancelled.
    async with stream(h, inst, "u") as fresh:
        (snapshot,) = await fresh.until(lambda ev: len(ev) >= 1, what="the snapshot")
    assert snapshot.type == "snapshot"
    listed = {j["id"]: j["status"] for j in snapshot.data["analyses"]}
    assert listed[b["id"]] == "cancelled" and listed[c["id"]] == "queued"


async def _head(h: Harness, user: str) -> int:
    value = await fetchval(
        h.database_url, "SELECT last_id FROM job_event_counters WHERE user_id = $1", user
    )
    return int(value or 0)


async def _head_above(h: Harness, user: str, event_id: int) -> bool:
    return await _head(h, user) > event_id


async def _delete_one(h: Harness, user: str) -> None:
    """Soft-delete one of the user's finished jobs: one new event, ``deleted``."""
    job_id = await fetchval(
        h.database_url,
        "SELECT id FROM analysis_jobs WHERE user_id = $1 AND status = 'succeeded'"
        " AND deleted_at IS NULL LIMIT 1",
        user,
    )
    async with h.http.delete(
        f"{h.instances[0].base_url}/v1/analyses/{job_id}", headers=h.auth(user)
    ) as r:
        assert r.status == 200, await r.text()


# -- replay ---------------------------------------------------------------------------------


async def test_reconnect_with_last_event_id_misses_nothing_and_duplicates_nothing(
    harness: Harness,
) -> None:
    h = harness
    h.sim.judge_time_s = 0.05  # slower than the admits: a queue builds up
    inst = await h.start_instance()
    await h.grant("u", 100)
    stop = asyncio.Event()

    async def writer() -> None:  # changes keep committing through the disconnect and replay
        for n in range(100):
            if stop.is_set():
                return
            await admitted(h, "u", n)
            await asyncio.sleep(0.01)

    writing = asyncio.create_task(writer())
    try:
        first = await SseClient.open(h, inst, "u")
        await first.until(lambda ev: len(first.stored()) >= 10, what="ten events")
        await first.close()
        last = first.stored()[-1].id
        assert last is not None
        # Events committed while disconnected, for the replay to send.
        await wait_for(lambda: _head_above(h, "u", last + 3), what="events while disconnected")

        async with stream(h, inst, "u", last_event_id=last) as second:
            # And events committed after the stream went live, for the live feed to send.
            at_connect = await _head(h, "u")
            await second.until(
                lambda ev: any(e.id is not None and e.id > at_connect + 3 for e in ev),
                what="live events after the replay",
            )
            stop.set()
            await writing

            async def drained() -> bool:
                rows = await fetch(h.database_url, "SELECT status FROM analysis_jobs")
                return all(r["status"] == "succeeded" for r in rows)

            await wait_for(drained, timeout_s=30, what="the queue to drain")
            head = int(
                await fetchval(
                    h.database_url, "SELECT last_id FROM job_event_counters WHERE user_id = 'u'"
                )
            )
            await second.until(
                lambda ev: any(e.id == head for e in ev), what=f"every event up to {head}"
            )
            # A duplicate of an earlier event would come before any later one: make one (a
            # delete, event head + 1) and wait for it.
            await _delete_one(h, "u")
            await second.until(
                lambda ev: any(e.id == head + 1 for e in ev), what="the marker event"
            )
    finally:
        stop.set()
        await writing

    ids = [e.id for e in second.events if e.id is not None]
    assert all(e.type != "snapshot" for e in second.events)
    assert ids == list(range(last + 1, head + 2)), "missed or duplicated events"
    # The first stream began with a snapshot of whatever had committed when it opened (the
    # writer may already have admitted a few): from there on, every id once.
    snapshot = first.events[0]
    assert snapshot.type == "snapshot" and snapshot.id is not None
    seen = [e.id for e in first.stored()] + ids
    assert seen == list(range(snapshot.id + 1, head + 2))
    assert len(second.events) > len(ids)  # the queued jobs' positions after the replay


async def test_last_event_id_older_than_kept_or_unknown_gets_a_snapshot(
    harness: Harness,
) -> None:
    h = harness
    h.sim.judge_time_s = 0.01
    inst = await h.start_instance()
    await h.grant("u", 3)
    for n in range(3):
        await admitted(h, "u", n)

    async def all_done() -> bool:
        rows = await fetch(h.database_url, "SELECT status FROM analysis_jobs")
        return all(r["status"] == "succeeded" for r in rows)

    await wait_for(all_done, what="the jobs to finish")
    head = int(await fetchval(h.database_url, "SELECT last_id FROM job_event_counters"))
    # Admitted, promoted (all but the first), finished; started too, unless Core's callback beat
    # the running mark (a fast judge on a loaded machine). Every id is a stored event.
    assert head >= 3 + 2 + 3
    assert head == await fetchval(h.database_url, "SELECT count(*) FROM job_events")

    async with stream(h, inst, "u", last_event_id=head - 2) as s:  # kept: a replay
        await s.until(lambda ev: len(ev) >= 2, what="the replay")
        assert [e.id for e in s.events] == [head - 1, head]

    async with stream(h, inst, "u", last_event_id=head + 5) as s:  # not one of ours
        (snap,) = await s.until(lambda ev: len(ev) >= 1, what="a snapshot")
        assert (snap.type, snap.id, len(snap.data["analyses"])) == ("snapshot", head, 3)

    sweeper = inst.services.sweeper
    sweeper.settings = dataclasses.replace(sweeper.settings, event_retention_s=0)
    report = await sweeper.run_once()
    assert report.events_pruned == head
    async with stream(h, inst, "u", last_event_id=2) as s:  # pruned: a snapshot
        (snap,) = await s.until(lambda ev: len(ev) >= 1, what="a snapshot")
        assert (snap.type, snap.id) == ("snapshot", head)
        assert {j["status"] for j in snap.data["analyses"]} == {"succeeded"}
    async with stream(h, inst, "u", last_event_id=head) as s:  # up to date: nothing to send
        status, _ = await h.admit("u", 9)  # no credits left: refused, so no event either
        assert status == 402
        # Anything the stream would send before the next event comes before it: make one.
        await _delete_one(h, "u")
        await s.until(lambda ev: len(ev) >= 1, what="the marker event")
    assert [(e.type, e.id) for e in s.events] == [("deleted", head + 1)]


# -- across instances, isolation, auth ------------------------------------------------------


async def test_event_committed_through_one_instance_reaches_a_subscriber_on_another(
    harness: Harness,
) -> None:
    h = harness
    h.sim.judge_time_s = 60
    a_inst = await h.start_instance()
    b_inst = await h.start_instance()
    await h.grant("u", 1)
    async with stream(h, b_inst, "u") as s:
        await s.until(lambda ev: len(ev) >= 1, what="the snapshot")
        job = await admitted(h, "u", 1, instance=a_inst)
        events = await s.until(has("admitted", job["id"]), what="the admit made through A")
    assert events[1].id == 1
    assert b_inst.services.events.batches >= 1


async def test_a_subscriber_sees_only_its_own_users_events(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = 0.1
    inst = await h.start_instance()
    await h.grant("alice", 1)
    await h.grant("bob", 5)
    async with stream(h, inst, "alice", query_token=True) as alice:
        for n in range(5):
            await admitted(h, "bob", n)
        mine = await admitted(h, "alice", 1)
        await alice.until(has("finished", mine["id"]), what="alice's job finished")
        async with stream(h, inst, "alice", last_event_id=0) as replay:
            await replay.until(has("finished", mine["id"]), what="alice's replay")

    for s in (alice, replay):
        jobs = {e.job_id for e in s.events if e.job_id is not None}
        assert jobs == {mine["id"]}, s.summary()
    assert [e.id for e in alice.stored()] == [1, 2, 3]  # alice's own numbering


@pytest.mark.parametrize(
    ("headers", "params"),
    [
        ({}, {}),
        ({"Authorization": "Bearer nonsense"}, {}),
        ({}, {"access_token": "nonsense"}),
        ({}, {"access_token": mint_token("u", "another-secret-0123456789abcdef0123")}),
    ],
)
async def test_stream_without_valid_credentials_is_401(
    harness: Harness, headers: dict[str, str], params: dict[str, str]
) -> None:
    inst = await harness.start_instance()
    async with harness.http.get(f"{inst.base_url}/v1/events", headers=headers, params=params) as r:
        assert r.status == 401
        assert r.headers["Content-Type"].startswith("application/problem+json")
        assert "WWW-Authenticate" in r.headers
    # The query token is for the event stream only.
    token = mint_token("u", JWT_SECRET)
    async with harness.http.get(f"{inst.base_url}/v1/credits", params={"access_token": token}) as r:
        assert r.status == 401


async def test_the_query_token_never_reaches_a_log_line(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    h = harness
    caplog.set_level(logging.DEBUG)
    inst = await h.start_instance()
    token = mint_token("u", JWT_SECRET)
    async with stream(h, inst, "u", query_token=True) as s:
        await s.until(lambda ev: len(ev) >= 1, what="the snapshot")
    bad = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    async with h.http.get(f"{inst.base_url}/v1/events", params={"access_token": bad}) as r:
        assert r.status == 401
    await h.stop_instance(inst)
    assert any(r.__dict__.get("action") == "events_open" for r in caplog.records)
    signature = token.rsplit(".", 1)[1]
    for record in caplog.records:
        text = record.getMessage() + repr(record.__dict__)
        assert signature not in text and bad.rsplit(".", 1)[1] not in text, record


# -- back-pressure, clean-up, shutdown ------------------------------------------------------


async def _stuck_client(instance: Instance, user: str) -> socket.socket:
    """Subscribes, reads the response head, then never reads again (a tiny receive window)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    port = int(instance.base_url.rsplit(":", 1)[1])
    await loop.sock_connect(sock, ("127.0.0.1", port))
    token = mint_token(user, JWT_SECRET)
    request = (
        f"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {token}\r\nAccept: text/event-stream\r\n\r\n"
    )
    await loop.sock_sendall(sock, request.encode())
    head = await asyncio.wait_for(loop.sock_recv(sock, 200), WAIT_S)
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def _big_thesis(n: int) -> dict[str, Any]:
    """An admit body whose summary (what a frame carries) is as large as the edge allows,
    ~9 kB: frames that fill the stuck client's socket buffers (a few MB on loopback) and then
    its buffer in the hub within a few dozen jobs."""
    body = thesis_body(n)
    body["thesis"] = {
        "title": f"{n} " + "\u20ac" * 490,  # three bytes each in UTF-8
        "document_url": f"https://uni.example/{n}/" + "\U0001d518" * 1900 + ".pdf",  # four
    }
    return body


async def test_a_stuck_subscriber_is_dropped_without_slowing_others_or_promotion(
    harness: Harness,
) -> None:
    h = harness
    h.sim.judge_time_s = 0.01
    inst = await h.start_instance()
    hub = inst.services.events
    hub.settings = dataclasses.replace(hub.settings, buffer_frames=16, write_timeout_s=30)
    jobs = 150
    await h.grant("u", jobs)
    stuck = await _stuck_client(inst, "u")
    try:
        async with stream(h, inst, "u") as good:
            await good.until(lambda ev: len(ev) >= 1, what="the snapshot")
            assert hub.subscribers == 2 and subscribers(inst) == 2
            started = time.monotonic()
            ids = [(await admitted(h, "u", n, body=_big_thesis(n)))["id"] for n in range(jobs)]

            async def drained() -> bool:
                rows = await fetch(h.database_url, "SELECT status FROM analysis_jobs")
                return all(r["status"] == "succeeded" for r in rows)

            await wait_for(drained, timeout_s=30, what="every job to run")
            drained_in_s = time.monotonic() - started
            await good.until(has("finished", ids[-1]), timeout_s=5, what="the last finish")
            caught_up_in_s = time.monotonic() - started - drained_in_s

            assert hub.dropped == 1, "the stuck subscriber was not dropped"
            assert hub.subscribers == 1 and subscribers(inst) == 1
            assert not good.ended.is_set()
            # Nothing waited for the stuck one: no write timeout (30 s) was sat out.
            assert drained_in_s < 15 and caught_up_in_s < 3, (drained_in_s, caught_up_in_s)
            head = int(await fetchval(h.database_url, "SELECT last_id FROM job_event_counters"))
            assert [e.id for e in good.stored()] == list(range(1, head + 1))
    finally:
        stuck.close()


async def test_disconnected_subscribers_are_cleaned_up(harness: Harness) -> None:
    h = harness
    inst = await h.start_instance()
    hub = inst.services.events
    hub.settings = dataclasses.replace(hub.settings, heartbeat_s=0.1)
    clients = [await SseClient.open(h, inst, f"u{n % 2}") for n in range(4)]
    for c in clients:
        await c.until(lambda ev: len(ev) >= 1, what="the snapshot")
    assert hub.subscribers == 4 and subscribers(inst) == 4
    for c in clients:
        await c.close()

    async def gone() -> bool:
        return hub.subscribers == 0

    await wait_for(gone, timeout_s=5, what="the hub to forget closed streams")
    assert subscribers(inst) == 0


async def test_shutdown_with_open_streams_is_quick(harness: Harness) -> None:
    h = harness
    inst = await h.start_instance()
    clients = [await SseClient.open(h, inst, f"u{n}") for n in range(3)]
    for c in clients:
        await c.until(lambda ev: len(ev) >= 1, what="the snapshot")
    stuck = await _stuck_client(inst, "u0")
    try:
        started = time.monotonic()
        await h.stop_instance(inst)
        took = time.monotonic() - started
    finally:
        stuck.close()
    assert took < 3, f"shutdown took {took:.1f}s"
    for c in clients:
        await asyncio.wait_for(c.ended.wait(), WAIT_S)
        await c.close()


# -- the event log in the database ----------------------------------------------------------


async def test_a_users_event_ids_follow_commit_order(database_url: str) -> None:
    """A transaction holding the user's counter row makes the next event-writer wait; a
    rolled-back event leaves no gap."""
    db = await Database.connect(database_url, min_size=1, max_size=4)
    holder = await asyncpg.connect(database_url)
    try:
        first, second = uuid.uuid4(), uuid.uuid4()
        for job_id in (first, second):
            await holder.execute(
                """INSERT INTO analysis_jobs
                          (id, user_id, run_id, status, thesis, sources, cost, waiting_for)
                   VALUES ($1, 'u', $2, 'queued', '{}'::jsonb, '[]'::jsonb, 0,
                           'your_previous_analysis')""",
                job_id,
                uuid.uuid4(),
            )
        assert await db.event_head("u") == 2

        tx = holder.transaction()
        await tx.start()
        # Event 3, not committed: the counter row stays locked until this ends.
        await holder.execute(
            """UPDATE analysis_jobs SET status = 'pending', user_slot = 1, waiting_for = NULL
                WHERE id = $1""",
            first,
        )
        other = asyncio.create_task(
            db.finish(job_id=second, status="cancelled", from_statuses=("queued",))
        )

        async def waiting() -> bool:
            n = await holder.fetchval(
                """SELECT count(*) FROM pg_stat_activity
                    WHERE datname = current_database() AND wait_event_type = 'Lock'"""
            )
            return bool(n >= 1)

        await wait_for(waiting, timeout_s=WAIT_S, what="the second writer to wait")
        assert not other.done()
        await tx.rollback()  # event 3 never happened: the waiting writer takes id 3
        result = await other
        assert result is not None and result.changed
        events = (await db.events_after("u", 0, 10)).events
        assert [(e.event_id, e.kind, e.job and e.job.id) for e in events] == [
            (1, "admitted", first),
            (2, "admitted", second),
            (3, "cancelled", second),
            (4, "promoted", first),  # the tail promotion, in the same transaction
        ]
        stamps = [e.created_at for e in events]
        assert stamps == sorted(stamps)
    finally:
        await holder.close()
        await db.close()


async def test_concurrent_writers_get_dense_ids_per_user(database_url: str) -> None:
    db = await Database.connect(database_url, min_size=1, max_size=20)
    try:
        for user in ("a", "b"):
            await db.grant_credits(user, 100)

        async def admit(user: str) -> None:
            run_id, job_id = uuid.uuid4(), uuid.uuid4()
            reservation = await db.reserve(
                ReserveRequest(
                    user_id=user,
                    run_id=run_id,
                    job_id=job_id,
                    cost=1,
                    thesis={"title": "t", "document_url": "https://x.example/t.pdf"},
                    sources=["10.1000/x"],
                    idempotency_key=None,
                    request_hash=None,
                )
            )
            assert reservation.outcome == "reserved"
            await db.admit(
                AdmitRequest(
                    job_id=job_id,
                    user_id=user,
                    run_id=run_id,
                    core_run_id=f"core-{job_id}",
                    thesis={"title": "t", "document_url": "https://x.example/t.pdf"},
                    sources=["10.1000/x"],
                    cost=1,
                    delta_of=None,
                    idempotency_key=None,
                    request_hash=None,
                )
            )

        await asyncio.gather(*(admit("a" if n % 3 else "b") for n in range(40)))
        for user in ("a", "b"):
            events = (await db.events_after(user, 0, 100)).events
            ids = [e.event_id for e in events]
            assert ids == list(range(1, len(ids) + 1))
            assert {e.kind for e in events} == {"admitted"}
            stamps = [e.created_at for e in events]
            assert stamps == sorted(stamps)
            assert await db.event_head(user) == len(ids)
        assert (
            len((await db.events_after("a", 0, 100)).events)
            + len((await db.events_after("b", 0, 100)).events)
            == 40
        )
    finally:
        await db.close()
