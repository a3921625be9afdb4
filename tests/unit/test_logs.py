"""Log lines carry the request id of the request they were written for."""

from __future__ import annotations

import io
import logging

import orjson
from analysis_queue.logs import JsonFormatter, RedactTokens, RequestIdFilter, request_id_var


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
