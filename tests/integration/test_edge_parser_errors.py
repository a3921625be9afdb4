"""Requests aiohttp's HTTP parser refuses before any route runs, sent over a bare socket: each is
answered with application/problem+json like every other error, the connection is closed, and
the refusal is logged as one line without a traceback."""

from __future__ import annotations

import logging

import pytest
from rawhttp import Raw
from support import ADMIN_TOKEN, Harness

PROBLEM_JSON = "application/problem+json"
OVER_LIMIT = 9000  # aiohttp's limits on the request line and on a header field are 8190 bytes


def _head(*lines: str | bytes) -> bytes:
    raw = [line if isinstance(line, bytes) else line.encode("latin-1") for line in lines]
    return b"\r\n".join(raw) + b"\r\n\r\n"


CASES = {
    "garbage": (b"GARBAGE\r\n\r\n", 400, "malformed_request"),
    "bad_version": (_head("GET /healthz HTTP/9.x", "Host: t"), 400, "malformed_request"),
    "space_in_header_name": (
        _head("GET /healthz HTTP/1.1", "Host: t", "Bad Header: x"),
        400,
        "malformed_request",
    ),
    "nul_in_header_value": (
        _head("GET /healthz HTTP/1.1", "Host: t", b"X-Nul: a\x00b"),
        400,
        "malformed_request",
    ),
    "two_content_lengths": (
        _head("POST /v1/credits HTTP/1.1", "Host: t", "Content-Length: 1", "Content-Length: 2"),
        400,
        "malformed_request",
    ),
    "long_header": (
        _head("GET /healthz HTTP/1.1", "Host: t", "X-Big: " + "a" * OVER_LIMIT),
        431,
        "headers_too_large",
    ),
    "long_authorization": (
        _head("GET /v1/credits HTTP/1.1", "Host: t", "Authorization: Bearer " + "a" * OVER_LIMIT),
        431,
        "headers_too_large",
    ),
    "long_url": (
        _head(f"GET /healthz?{'a' * OVER_LIMIT} HTTP/1.1", "Host: t"),
        431,
        "headers_too_large",
    ),
    "too_many_headers": (
        _head("GET /healthz HTTP/1.1", "Host: t", *(f"X-H{n}: {n}" for n in range(200))),
        431,
        "headers_too_large",
    ),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
async def test_a_request_the_parser_refuses_is_a_problem_and_one_log_line(
    harness: Harness, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    data, status, code = CASES[case]
    instance = await harness.start_instance()
    caplog.set_level(logging.INFO)
    caplog.clear()
    raw = await Raw.connect(instance.base_url)
    try:
        await raw.send(data)
        reply = await raw.reply()
        await raw.closed_after(5)  # the parser cannot find the next request: the end
    finally:
        await raw.close()

    assert (reply.status, reply.content_type) == (status, PROBLEM_JSON), reply
    body = reply.json()
    assert (body["status"], body["code"]) == (status, code)
    assert body["type"].endswith("/" + code)
    assert "aaaa" not in reply.body.decode()  # nothing of the client's bytes comes back

    refusals = [r for r in caplog.records if r.getMessage() == "malformed request refused"]
    assert len(refusals) == 1, caplog.text
    assert getattr(refusals[0], "code", None) == code
    assert all(r.exc_info is None for r in caplog.records), caplog.text
    assert "Traceback" not in caplog.text
    assert "aaaa" not in caplog.text


async def test_well_formed_requests_on_the_same_instance_are_unaffected(harness: Harness) -> None:
    instance = await harness.start_instance()
    long_but_legal = "k" * 8000  # under the limit: an Idempotency-Key's own rule answers it
    async with harness.http.get(
        f"{instance.base_url}/v1/admin/capacity",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}", "X-Padding": long_but_legal},
    ) as r:
        assert r.status == 200
