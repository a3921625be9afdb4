"""Log lines carry the request id of the request they were written for, and never a token."""

from __future__ import annotations

import io
import logging

import orjson
from analysis_queue.logs import (
    HumanFormatter,
    JsonFormatter,
    RedactTokens,
    RequestIdFilter,
    redact,
    request_id_var,
)


def test_request_id_and_redaction_reach_the_json_line() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestIdFilter())
    handler.addFilter(RedactTokens())
    log = logging.getLogger("test-logs")
    log.addHandler(handler)
    log.propagate = False
    try:
        token = request_id_var.set("req-123")
        try:
            log.warning("GET /v1/events?access_token=abc.def", extra={"job_id": "j1"})
        finally:
            request_id_var.reset(token)
        log.warning("outside a request")
    finally:
        log.removeHandler(handler)
    first, second = (orjson.loads(line) for line in stream.getvalue().splitlines())
    assert first["request_id"] == "req-123"
    assert first["job_id"] == "j1"
    assert "abc.def" not in first["msg"]
    assert "request_id" not in second


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
