"""The edge: how client connections reach the application, and what aiohttp's own server leaves
open there.

The service listens through :class:`EdgeSite`, an aiohttp site whose protocol factory makes an
:class:`EdgeHandler` (aiohttp's ``RequestHandler``) for each connection. What it adds:

- time bounds on what a client sends. A new connection has ``AQ_HEADER_TIMEOUT_S`` to deliver
  its first request head (a timer from accept, stopped by :func:`head_middleware` when the head
  has arrived); a kept-alive one has ``AQ_KEEPALIVE_TIMEOUT_S`` from the end of a response to
  deliver the next head (aiohttp's keep-alive timer, which also runs from accept: a new
  connection gets the shorter of the two). Reading a body is bounded by the routes
  (``AQ_BODY_TIMEOUT_S``, 408); a body left unread after an early answer is drained for at
  most ``LINGER_S`` before the connection closes. aiohttp by itself gives an idle socket an
  hour (3630 s) and a stalled body for ever;
- requests aiohttp's HTTP parser refuses (a malformed request line, a bad header, headers over
  the size limit) are answered with ``application/problem+json`` like every other error, and
  logged as one line instead of a traceback each. A middleware cannot do this: aiohttp answers
  those before routing (aiohttp issue #3287), through ``RequestHandler.handle_error``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from analysis_queue.config import Settings
from analysis_queue.http import problems
from analysis_queue.http.problems import Handler
from analysis_queue.metrics import Metrics

log = logging.getLogger(__name__)

# aiohttp's limits on a request's head, kept explicit: the 431 answer and the docs name them.
MAX_LINE_BYTES = 8190  # the request line
MAX_FIELD_BYTES = 8190  # one header field, name and value
MAX_HEADERS = 128
# After an answer given before the body was read (401, 408, 413), aiohttp reads and drops the
# rest so the client sees the answer rather than a reset; this long at most (aiohttp: 10 s).
LINGER_S = 2.0


@dataclass(frozen=True, slots=True)
class EdgeSettings:
    """What the edge holds a connection to (``AQ_HEADER_TIMEOUT_S``,
    ``AQ_KEEPALIVE_TIMEOUT_S``; the body's bound is the routes')."""

    header_timeout_s: float = 10.0
    keepalive_timeout_s: float = 15.0

    @classmethod
    def from_settings(cls, settings: Settings) -> EdgeSettings:
        return cls(
            header_timeout_s=settings.header_timeout_s,
            keepalive_timeout_s=settings.keepalive_timeout_s,
        )

    def handler_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of aiohttp's ``RequestHandler`` for these settings."""
        return {
            "keepalive_timeout": self.keepalive_timeout_s,
            "lingering_time": LINGER_S,
            "max_line_size": MAX_LINE_BYTES,
            "max_field_size": MAX_FIELD_BYTES,
            "max_headers": MAX_HEADERS,
            "access_log": None,
        }


class EdgeHandler(web.RequestHandler):
    """aiohttp's handler of one connection, with a deadline on its first request head, and its
    parser's refusals answered as problems."""

    def __init__(self, manager: web.Server, edge: Edge, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._edge = edge
        self._edge_head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._edge_head_timer = asyncio.get_running_loop().call_later(
            self._edge.settings.header_timeout_s, self._head_overdue
        )

    def connection_lost(self, exc: BaseException | None) -> None:
        self.head_received()
        super().connection_lost(exc)

    def head_received(self) -> None:
        """A request's head has arrived: the deadline is met (the later ones are aiohttp's
        keep-alive timer's)."""
        if self._edge_head_timer is not None:
            self._edge_head_timer.cancel()
            self._edge_head_timer = None

    def _head_overdue(self) -> None:
        # Counted, not logged: a flood of idle sockets must not become a flood of log lines.
        self._edge_head_timer = None
        self._edge.metrics.http_timeouts.labels("head").inc()
        self.force_close()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        error = problems.parser_error(exc)
        # A client's malformed bytes are not the service's failure: one line, no traceback,
        # and none of the client's bytes (aiohttp's message quotes them).
        log.info(
            "malformed request refused",
            extra={
                "action": "http",
                "code": error.code,
                "reason": type(exc).__name__,
                "peer": request.remote,
            },
        )
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already sent on this connection")
        response = problems.problem(error, request.path)
        response.force_close()
        return response


@web.middleware
async def head_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The first thing every routed request does: tell its connection its head has arrived.
    The application's outermost middleware."""
    protocol = request.protocol
    if isinstance(protocol, EdgeHandler):
        protocol.head_received()
    return await handler(request)


class Edge:
    """The connections of one instance: makes each one's protocol."""

    def __init__(self, settings: EdgeSettings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self._handler_kwargs = settings.handler_kwargs()

    def protocol_factory(self, server: web.Server) -> Any:
        loop = asyncio.get_running_loop()

        def make() -> asyncio.BaseProtocol:
            return EdgeHandler(server, self, loop=loop, **self._handler_kwargs)

        return make


class EdgeSite(web.BaseSite):
    """A TCP site that accepts through :class:`Edge` (``web.TCPSite`` hands every connection to
    aiohttp's ``Server`` directly, with no say in which handler it gets)."""

    def __init__(
        self, runner: web.BaseRunner, edge: Edge, host: str, port: int, *, backlog: int = 128
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._edge = edge
        self._host = host
        self._port = port
        self._tcp: asyncio.Server | None = None

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self.port}"

    @property
    def port(self) -> int:
        """The bound port (the asked one is 0 for any free port)."""
        if self._tcp is not None and self._tcp.sockets:
            return int(self._tcp.sockets[0].getsockname()[1])
        return self._port

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None, "runner.setup() makes the server"
        loop = asyncio.get_running_loop()
        self._tcp = await loop.create_server(
            self._edge.protocol_factory(server), self._host, self._port, backlog=self._backlog
        )
        self._server = self._tcp  # BaseSite.stop() closes it
