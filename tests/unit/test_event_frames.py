"""The event stream's pieces without a database: frames, buffers, ids, the URL scrubber."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from pathlib import Path
from uuid import uuid4

import orjson
import pytest
from aiohttp.test_utils import make_mocked_request
from analysis_queue.http.events import _last_event_id
from analysis_queue.logs import HumanFormatter, JsonFormatter, RedactTokens, redact
from analysis_queue.loops.hub import Frame, Subscription, encode, event_frame
from analysis_queue.models import Job, JobEvent

STATIC = Path(__file__).resolve().parents[2] / "service" / "analysis_queue" / "http" / "static"


def _job(**overrides: object) -> Job:
    now = datetime.now(UTC)
    values: dict[str, object] = {
        "id": uuid4(),
        "user_id": "u",
        "run_id": uuid4(),
        "core_run_id": "core-1",
        "status": "queued",
        "queue_seq": 7,
        "delta_of_job_id": None,
        "deleted_at": None,
        "thesis": {"title": "Line one\nline two\r\u2028", "document_url": "https://x.example/t"},
        "sources": ["10.1000/a"],
        "cost": 1,
        "created_at": now,
        "promoted_at": None,
        "started_at": None,
        "finished_at": None,
        "release_attempts": 0,
        "next_release_at": None,
        "error_code": None,
        "error_detail": None,
        "verdicts": None,
        "queue_position": 2,
    }
    values.update(overrides)
    return Job(**values)  # type: ignore[arg-type]


def _parse(frame: bytes) -> dict[str, str]:
    assert frame.endswith(b"\n\n")
    lines = frame[:-2].split(b"\n")
    assert all(b"\r" not in line for line in lines)
    return {
        k.decode(): v.decode().removeprefix(" ") for k, _, v in (ln.partition(b":") for ln in lines)
    }


def test_event_frame_is_one_sse_event_carrying_the_job_as_the_rest_api_shows_it() -> None:
    job = _job()
    frame = event_frame(JobEvent(41, "admitted", datetime.now(UTC), job))
    fields = _parse(frame.data)
    assert frame.event_id == 41
    assert (fields["id"], fields["event"]) == ("41", "admitted")
    data = orjson.loads(fields["data"])
    assert data["job"] == orjson.loads(orjson.dumps(job.to_json()))
    assert (data["id"], data["kind"], data["job"]["queue_position"]) == (41, "admitted", 2)


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


@pytest.mark.parametrize(
    ("header", "query", "expected"),
    [
        (None, None, None),
        ("17", None, 17),
        (" 17 ", None, 17),
        (None, "5", 5),
        ("0", None, 0),
        ("-1", None, None),
        ("1e3", None, None),
        ("abc", None, None),
        (str(2**63), None, None),
        ("٣", None, None),  # a decimal digit that is not ASCII
    ],
)
def test_last_event_id_is_a_non_negative_integer_or_nothing(
    header: str | None, query: str | None, expected: int | None
) -> None:
    path = "/v1/events" + (f"?last_event_id={query}" if query is not None else "")
    headers = {"Last-Event-ID": header} if header is not None else {}
    assert _last_event_id(make_mocked_request("GET", path, headers=headers)) == expected


def test_logged_access_tokens_are_redacted() -> None:
    url = "http://h:1/v1/events?last_event_id=3&access_token=eyJ.secret.sig"
    assert redact(url) == "http://h:1/v1/events?last_event_id=3&access_token=[redacted]"
    assert redact("GET /v1/events?access_token=a.b.c HTTP/1.1") == (
        "GET /v1/events?access_token=[redacted] HTTP/1.1"
    )
    record = logging.makeLogRecord(
        {"msg": "%s %s", "args": ("GET", url), "levelname": "INFO", "url": url, "n": 1}
    )
    assert RedactTokens().filter(record)
    for formatter in (JsonFormatter(), HumanFormatter()):
        line = formatter.format(record)
        assert "secret" not in line and "eyJ" not in line, line
        assert "last_event_id=3" in line


def test_the_dashboard_is_static_and_uses_no_inline_script() -> None:
    html = (STATIC / "index.html").read_text()
    assert '<script src="/static/app.js" defer></script>' in html
    assert html.count("<script") == 1 and "style=" not in html
    script = (STATIC / "app.js").read_text()
    assert "setInterval" not in script and "innerHTML" not in script
    assert "new EventSource(" in script
