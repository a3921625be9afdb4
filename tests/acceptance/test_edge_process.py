"""The edge of a real ``serve`` process (uvloop, the production event loop): the connection cap
with its refusal lane, the header timeout, a parser error as a problem, and the start's log
lines that say what the bounds became."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import orjson
import pytest
from analysis_queue.http.auth import mint_token
from procs import SECRETS, Proc, base_env, cli
from rawhttp import Raw, request_head
from support import free_port

pytestmark = pytest.mark.acceptance

CAP = 4  # and a refusal lane of 2
HEADER_TIMEOUT_S = 3.0
AT_ONCE_S = 1.0
LATE_S = 3.0


async def _up(proc: Proc, base: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.alive, proc.text()[-3000:]
        try:
            raw = await Raw.connect(base)
        except OSError:
            await asyncio.sleep(0.1)
            continue
        try:
            await raw.send(request_head("GET", "/readyz"))
            if (await raw.reply()).status == 200:
                return
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            await raw.close()
        await asyncio.sleep(0.1)
    raise AssertionError(f"not ready:\n{proc.text()[-3000:]}")


async def _ask(base: str, head: bytes) -> tuple[int, dict[str, str], bytes]:
    raw = await Raw.connect(base)
    try:
        await raw.send(head)
        reply = await raw.reply(timeout_s=AT_ONCE_S)
        return reply.status, reply.headers, reply.body
    finally:
        await raw.close()


async def test_the_edge_of_a_serving_process(tmp_path: Path, database_url: str) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = base_env(
        tmp_path,
        AQ_DATABASE_URL=database_url,
        AQ_CORE_URL=f"http://127.0.0.1:{free_port()}",  # not called: no job is admitted
        AQ_PORT=str(port),
        AQ_MAX_CONNECTIONS=str(CAP),
        AQ_HEADER_TIMEOUT_S=str(HEADER_TIMEOUT_S),
    )
    proc = Proc("serve", cli("serve"), env, tmp_path / "serve.log")
    idle: list[Raw] = []
    try:
        await _up(proc, base)
        credits = request_head(
            "GET",
            "/v1/credits",
            {"Authorization": f"Bearer {mint_token('u', SECRETS['AQ_JWT_SECRET'])}"},
        )
        assert (await _ask(base, credits))[0] == 200

        # A parser error is a problem here too.
        status, headers, body = await _ask(base, b"GARBAGE\r\n\r\n")
        assert (status, headers["content-type"].split(";")[0]) == (400, "application/problem+json")
        assert orjson.loads(body)["code"] == "malformed_request"

        # Fill the cap with silent sockets; the next connection is past it (accepts are in order).
        idle = [await Raw.connect(base) for _ in range(CAP)]
        opened = time.monotonic()
        status, headers, body = await _ask(base, credits)
        assert (status, orjson.loads(body)["code"]) == (503, "too_many_connections")
        assert headers["retry-after"] == "1"
        status, _, body = await _ask(base, request_head("GET", "/healthz"))
        assert (status, orjson.loads(body)) == (200, {"status": "ok"})
        # The lane full of silent sockets too: closed at accept.
        lane = [await Raw.connect(base) for _ in range(2)]
        late = await Raw.connect(base)
        assert await late.closed_after(AT_ONCE_S) < AT_ONCE_S
        await late.close()
        for raw in lane:
            assert (await raw.reply(timeout_s=1 + LATE_S)).status == 503
            await raw.close()

        # The silent sockets are closed at the header timeout, and the instance serves again.
        for raw in idle:
            await raw.closed_after(HEADER_TIMEOUT_S + LATE_S)
        assert time.monotonic() - opened >= HEADER_TIMEOUT_S - 0.05
        assert (await _ask(base, credits))[0] == 200

        proc.send(signal.SIGTERM)
        assert await proc.wait_exit(30) == 0
    finally:
        for raw in idle:
            await raw.close()
        proc.kill()

    lines = [orjson.loads(line) for line in proc.text().splitlines() if line.startswith("{")]
    by_msg = {line["msg"]: line for line in lines}
    fds = by_msg["file descriptor limit"]
    assert fds["soft"] >= fds["soft_before"] and fds["soft"] > 0
    listening = by_msg["accepting connections"]
    assert (listening["max_connections"], listening["refusal_lane"]) == (CAP, 2)
    assert listening["header_timeout_s"] == HEADER_TIMEOUT_S
    assert by_msg["connections over the cap"]["max_connections"] == CAP
    assert [line for line in lines if line["level"] in ("error", "critical")] == []
    assert "Traceback" not in proc.text()
