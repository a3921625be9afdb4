"""The edge: how client connections reach the application, and what aiohttp's own server leaves
open there.

The service listens through :class:`EdgeSite`, an aiohttp site whose protocol factory makes an
:class:`EdgeHandler` (aiohttp's ``RequestHandler``) for each connection. What it adds:

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

from analysis_queue.http import problems

log = logging.getLogger(__name__)

# aiohttp's limits on a request's head, kept explicit: the 431 answer and the docs name them.
MAX_LINE_BYTES = 8190  # the request line
MAX_FIELD_BYTES = 8190  # one header field, name and value
MAX_HEADERS = 128


@dataclass(frozen=True, slots=True)
class EdgeSettings:
    """What the edge holds a connection to."""

    keepalive_timeout_s: float = 75.0

    def handler_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of aiohttp's ``RequestHandler`` for these settings."""
        return {
            "keepalive_timeout": self.keepalive_timeout_s,
            "max_line_size": MAX_LINE_BYTES,
            "max_field_size": MAX_FIELD_BYTES,
            "max_headers": MAX_HEADERS,
            "access_log": None,
        }


class EdgeHandler(web.RequestHandler):
    """aiohttp's handler of one connection, answering its parser's refusals as problems."""

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


class Edge:
    """The connections of one instance: makes each one's protocol."""

    def __init__(self, settings: EdgeSettings) -> None:
        self.settings = settings
        self._handler_kwargs = settings.handler_kwargs()

    def protocol_factory(self, server: web.Server) -> Any:
        loop = asyncio.get_running_loop()

        def make() -> asyncio.BaseProtocol:
            return EdgeHandler(server, loop=loop, **self._handler_kwargs)

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
