"""The SSE parser: line endings, chunk boundaries, fields, comments and bounds."""

from __future__ import annotations

import pytest
from analysis_queue.client.errors import ProtocolError
from analysis_queue.client.sse import SseEvent, SseParser

STREAM = (
    b"retry: 2000\n\n"
    b'id: 7\nevent: promoted\ndata: {"id":7}\n\n'
    b": keepalive\n\n"
    b'event: position\ndata: {"id":null}\n\n'
)


def test_a_stream_parses_into_its_events_with_the_last_id_carried_over() -> None:
    parser = SseParser()
    events = parser.feed(STREAM)
    assert events == [
        SseEvent("promoted", '{"id":7}', "7"),
        SseEvent("position", '{"id":null}', "7"),  # no id of its own: the last one
    ]
    assert parser.retry_ms == 2000


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 64])
def test_any_chunking_gives_the_same_events(size: int) -> None:
    whole = SseParser().feed(STREAM)
    parser = SseParser()
    events = [e for i in range(0, len(STREAM), size) for e in parser.feed(STREAM[i : i + size])]
    assert events == whole


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_every_line_ending_and_a_crlf_split_across_chunks(newline: bytes) -> None:
    raw = STREAM.replace(b"\n", newline)
    parser = SseParser()
    events = [e for i in range(len(raw)) for e in parser.feed(raw[i : i + 1])]
    assert [e.event for e in events] == ["promoted", "position"]


def test_data_lines_join_and_the_default_type_is_message() -> None:
    parser = SseParser()
    assert parser.feed(b"\xef\xbb\xbfdata: a\ndata:b\ndata\n\n") == [
        SseEvent("message", "a\nb\n", "")
    ]


def test_frames_without_data_dispatch_nothing_and_bad_fields_are_ignored() -> None:
    parser = SseParser()
    assert parser.feed(b"event: x\nid: 3\n\nretry: soon\nid: a\0b\nfoo: bar\n\n") == []
    assert parser.last_event_id == "3" and parser.retry_ms is None


def test_a_line_or_an_event_past_the_bound_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        SseParser(max_bytes=100).feed(b"data: " + b"x" * 200)
    parser = SseParser(max_bytes=100)
    with pytest.raises(ProtocolError):
        for _ in range(20):
            parser.feed(b"data: " + b"x" * 10 + b"\n")


def test_a_megabyte_of_frames_in_one_chunk_parses_in_linear_time() -> None:
    frame = b'id: 1\nevent: admitted\ndata: {"id":1,"job":"' + b"x" * 200 + b'"}\n\n'
    events = SseParser().feed(frame * 5000)
    assert len(events) == 5000
