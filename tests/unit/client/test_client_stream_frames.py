"""What the event stream delivers of the frames it reads: each stored event once and in id
order, a gap as a reconnect, a snapshot as the new position, frames of a newer service."""

from __future__ import annotations

import json
from typing import Any, cast

import pytest
from analysis_queue.client import errors
from analysis_queue.client.models import EventKind, JobEvent, PositionEvent, SnapshotEvent
from analysis_queue.client.sse import SseEvent
from analysis_queue.client.stream import EventStream, StreamSettings, _Gap
from analysis_queue.client.transport import Transport

AT = "2030-01-01T00:00:00+00:00"


def _stream(last: int | None = None) -> EventStream:
    return EventStream(cast(Transport, None), last, StreamSettings())


def _job(n: int, kind: str = "admitted") -> SseEvent:
    return SseEvent(kind, json.dumps({"id": n, "kind": kind, "at": AT, "job": None}), str(n))


def _snapshot(n: int) -> SseEvent:
    data = {"id": n, "kind": "snapshot", "at": AT, "analyses": [], "next": None}
    return SseEvent("snapshot", json.dumps(data), str(n))


def _ids(stream: EventStream, frames: list[SseEvent]) -> list[Any]:
    out = []
    for frame in frames:
        event = stream._accept(frame)
        if event is not None:
            out.append((type(event).__name__, event.id))
    return out


def test_a_replay_that_overlaps_delivers_each_event_once() -> None:
    stream = _stream(last=3)
    assert _ids(stream, [_job(2), _job(3), _job(4), _job(4), _job(5)]) == [
        ("JobEvent", 4),
        ("JobEvent", 5),
    ]
    assert stream.last_event_id == 5 and stream.duplicates == 3


def test_an_id_past_the_next_one_is_a_gap() -> None:
    stream = _stream(last=3)
    with pytest.raises(_Gap) as caught:
        _ids(stream, [_job(4), _job(6)])
    assert (caught.value.last, caught.value.got) == (4, 6)
    assert stream.last_event_id == 4  # the reconnect resumes after the last one delivered


def test_a_snapshot_sets_the_position_even_backwards() -> None:
    stream = _stream(last=40)  # say the events were restored from an older backup
    assert _ids(stream, [_snapshot(12), _job(13)]) == [("SnapshotEvent", 12), ("JobEvent", 13)]
    assert stream.last_event_id == 13


def test_position_frames_pass_and_do_not_move_the_position() -> None:
    stream = _stream()
    position = SseEvent(
        "position",
        json.dumps(
            {
                "id": None,
                "kind": "position",
                "at": AT,
                "positions": [{"id": "6d3c3c0e-4a5e-4c1e-9d7e-0f0f0f0f0f0f", "queue_position": 1}],
            }
        ),
        "",
    )
    event = stream._accept(position)
    assert isinstance(event, PositionEvent) and event.positions[0].queue_position == 1
    assert stream.last_event_id is None
    snapshot = stream._accept(_snapshot(0))
    assert isinstance(snapshot, SnapshotEvent) and stream.last_event_id == 0


def test_a_kind_from_a_newer_service_is_delivered_as_a_string() -> None:
    event = _stream(last=0)._accept(_job(1, "archived"))
    assert isinstance(event, JobEvent) and event.kind == "archived"
    known = _stream(last=0)._accept(_job(1, "finished"))
    assert isinstance(known, JobEvent) and known.kind is EventKind.FINISHED


def test_a_malformed_frame_is_a_protocol_error() -> None:
    with pytest.raises(errors.ProtocolError):
        _stream()._accept(SseEvent("admitted", '{"id": "x"}', ""))
