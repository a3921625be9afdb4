"""The event hub's pieces: SSE frames, a subscriber's bounded buffer, the read budgets of
catch-up and live delivery, and large encodes off the event loop."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

import orjson
from analysis_queue.loops.hub import (
    ENCODE_INLINE_MAX,
    EventHub,
    Frame,
    HubSettings,
    Subscription,
    encode,
    encoded,
    event_frame,
    position_frames,
    snapshot_frame,
)
from analysis_queue.metrics import Metrics
from analysis_queue.models import (
    EventKind,
    EventPage,
    Job,
    JobEvent,
    JobSummary,
    QueuePosition,
)
from support import make_job


def _job(**overrides: object) -> Job:
    values: dict[str, object] = {
        "user_id": "u",
        "thesis": {"title": "Line one\nline two\r\u2028", "document_url": "https://x.example/t"},
        "sources": ["10.1000/a"],
        "created_at": datetime.now(UTC),
        "queue_position": 2,
    }
    values.update(overrides)
    return make_job(**values)


def _parse(frame: bytes) -> dict[str, str]:
    assert frame.endswith(b"\n\n")
    lines = frame[:-2].split(b"\n")
    assert all(b"\r" not in line for line in lines)
    return {
        k.decode(): v.decode().removeprefix(" ") for k, _, v in (ln.partition(b":") for ln in lines)
    }


def test_event_frame_is_one_sse_event_carrying_the_jobs_summary() -> None:
    job = _job(sources=[f"10.1000/{n}" for n in range(200)])
    frame = event_frame(JobEvent(41, EventKind.ADMITTED, datetime.now(UTC), job.summary()))
    fields = _parse(frame.data)
    assert frame.event_id == 41
    assert (fields["id"], fields["event"]) == ("41", "admitted")
    data = orjson.loads(fields["data"])
    assert data["job"] == orjson.loads(orjson.dumps(job.summary().to_json()))
    assert (data["id"], data["kind"], data["job"]["queue_position"]) == (41, "admitted", 2)
    assert "sources" not in data["job"] and data["job"]["source_count"] == 200
    assert len(frame.data) < 1024, "a summary does not grow with the sources"


def test_position_frames_carry_ids_and_positions_only_in_bounded_frames() -> None:
    moves = [QueuePosition(uuid.uuid4(), n) for n in range(1, 1201)]
    frames = position_frames(moves, per_frame=500)
    assert [f.event_id for f in frames] == [None, None, None]
    payloads = [orjson.loads(_parse(f.data)["data"]) for f in frames]
    assert [len(p["positions"]) for p in payloads] == [500, 500, 200]
    assert payloads[0]["kind"] == "position" and payloads[0]["id"] is None
    assert payloads[2]["positions"][-1] == {"id": str(moves[-1].job_id), "queue_position": 1200}
    assert all(len(f.data) < 500 * 70 for f in frames)
    assert position_frames([]) == []


def test_a_snapshot_frame_carries_summaries_and_the_next_cursor() -> None:
    jobs = [_job(sources=["10.1000/a"] * 100).summary() for _ in range(3)]
    frame = snapshot_frame(9, jobs, "q-next")
    data = orjson.loads(_parse(frame.data)["data"])
    assert frame.event_id == 9
    assert (data["id"], data["kind"], data["next"]) == (9, "snapshot", "q-next")
    assert [j["id"] for j in data["analyses"]] == [str(j.id) for j in jobs]
    assert all("sources" not in j for j in data["analyses"])


def test_a_frame_without_an_id_has_no_id_line() -> None:
    fields = _parse(encode("position", {"id": None}))
    assert "id" not in fields and fields["event"] == "position"


async def test_a_subscription_buffers_up_to_its_limit_then_refuses() -> None:
    sub = Subscription("u", buffer_frames=3)
    frames = [Frame(i, b"x") for i in range(1, 3)]
    assert sub.offer(frames)
    assert sub.offer(frames)  # 2 < 3 buffered: a batch is taken whole
    assert not sub.offer(frames)  # 4 >= 3: the reader is not keeping up
    got = await sub.next(0.1)
    assert got is not None and [f.event_id for f in got] == [1, 2, 1, 2]
    assert await sub.next(0.01) == []  # a heartbeat's turn


async def test_closing_wakes_a_waiting_reader_and_aborts_an_overflowed_one() -> None:
    aborted: list[str] = []
    sub = Subscription("u", buffer_frames=3)
    sub.on_abort = lambda: aborted.append("abort")
    reader = asyncio.create_task(sub.next(10))
    await asyncio.sleep(0)
    sub.close("shutdown")
    assert await asyncio.wait_for(reader, 1) is None
    assert aborted == []  # not writing: it ends its response itself

    stuck = Subscription("u", buffer_frames=3)
    stuck.on_abort = lambda: aborted.append("abort")
    stuck.offer([Frame(1, b"x")])
    stuck.close("overflow")
    assert aborted == ["abort"]
    assert await stuck.next(1) is None
    assert stuck.offer([Frame(2, b"x")])  # ignored once closed


class _Reads:
    """The hub's database reads, each held open until the test lets it go."""

    def __init__(self) -> None:
        self.live: list[str] = []
        self.reads: list[list[str]] = []  # the users of each live read
        self.gate = asyncio.Event()

    async def event_head(self, user_id: str) -> int:
        return 0

    async def events_after(
        self, user_id: str, after_id: int, limit: int, max_bytes: int = 1 << 20
    ) -> EventPage:
        self.live.append(user_id)
        await self.gate.wait()
        return EventPage((), more=False)

    async def events_after_many(
        self, cursors: Mapping[str, int], limit: int, max_bytes: int = 1 << 20
    ) -> dict[str, EventPage]:
        self.reads.append(list(cursors))
        return {u: await self.events_after(u, after, limit) for u, after in cursors.items()}

    async def queue_positions(self, user_id: str) -> list[QueuePosition]:
        return []

    async def list_jobs(
        self, user_id: str, *, before_seq: int | None = None, limit: int = 50
    ) -> list[JobSummary]:
        return []


async def _turns(n: int = 20) -> None:
    """Let every ready task run (no I/O here: a fixed number of loop turns is deterministic)."""
    for _ in range(n):
        await asyncio.sleep(0)


async def test_catch_ups_go_one_at_a_time_per_user_and_never_hold_up_live_delivery() -> None:
    reads = _Reads()
    settings = HubSettings(read_concurrency=1, catchup_concurrency=2)
    hub = EventHub(reads, settings, Metrics())
    subs = {name: await hub.subscribe(user) for name, user in (("a1", "a"), ("a2", "a"))}
    subs["b"] = await hub.subscribe("b")
    subs["c"] = await hub.subscribe("c")
    entered: list[str] = []
    release = {name: asyncio.Event() for name in subs}

    async def catch_up(name: str) -> None:
        async with hub.catching_up(subs[name]):
            entered.append(name)
            await release[name].wait()

    tasks = [asyncio.create_task(catch_up(name)) for name in ("a1", "a2")]
    await _turns()
    assert entered == ["a1"], "a's second stream waits for a's first, with a slot free"
    tasks += [asyncio.create_task(catch_up(name)) for name in ("b", "c")]
    await _turns()
    assert entered == ["a1", "b"], "b takes the free slot; c waits for one"
    hub.notify("d")  # no subscriber: nothing to read
    hub.notify("c")  # live delivery for c reads while both catch-up slots are taken
    await _turns()
    assert reads.live == ["c"]
    release["a1"].set()
    await _turns()
    assert entered == ["a1", "b", "c"]  # c was first in line for a slot
    release["b"].set()
    await _turns()
    assert entered == ["a1", "b", "c", "a2"]  # a's second, once a slot is free
    for event in release.values():
        event.set()
    reads.gate.set()
    await asyncio.gather(*tasks)
    await hub.stop()


async def test_users_woken_during_a_read_are_read_together_next() -> None:
    reads = _Reads()
    hub = EventHub(reads, HubSettings(read_concurrency=1, batch_users=3), Metrics())
    for user in "abcdef":
        await hub.subscribe(user)
    hub.notify("a")
    await _turns()
    assert reads.reads == [["a"]]  # idle: a read of one, at once
    for user in "bcdae":
        hub.notify(user)  # a again, while its read is in flight
    hub.notify("b")  # already waiting: once
    await _turns()
    assert reads.reads == [["a"]], "one read in flight at a time here"
    reads.gate.set()
    await _turns()
    assert reads.reads == [["a"], ["b", "c", "d"], ["a", "e"]]
    await hub.stop()


async def test_a_large_page_is_encoded_off_the_event_loop() -> None:
    loop_thread = threading.get_ident()
    seen: list[int] = []

    def make(items: Sequence[int]) -> list[Frame]:
        seen.append(threading.get_ident())
        return [Frame(i, b"x") for i in items]

    assert len(await encoded(make, range(ENCODE_INLINE_MAX))) == ENCODE_INLINE_MAX
    assert len(await encoded(make, range(ENCODE_INLINE_MAX + 1))) == ENCODE_INLINE_MAX + 1
    assert seen[0] == loop_thread and seen[1] != loop_thread
