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
  those before routing (aiohttp issue #3287), through ``RequestHandler.handle_error``;
- a cap on open connections, ``AQ_MAX_CONNECTIONS``, kept below the file-descriptor limit
  (:func:`raise_fd_limit` raises the soft limit toward the hard one at start). Past the cap a
  connection goes to a small *refusal lane*: it has ``LANE_READ_S`` to send its request line,
  and is answered ``503 too_many_connections`` with ``Retry-After`` (or ``200`` for
  ``GET /healthz``: the process is alive, and is shedding load as it should) and closed. Past
  the lane too, it is closed at accept. A 503 rather than a bare close because a client, a
  proxy or a load balancer reads a 503 with Retry-After as "busy, come back or go elsewhere",
  and a reset as a crash to retry at once; the lane is small and each of its connections
  lives two seconds at most, so answering costs little more than closing.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, cast

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from analysis_queue import errors
from analysis_queue.config import Settings
from analysis_queue.core.client import CORE_CONNECTIONS_MAX
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

# The default cap's ceiling, whatever the descriptors allow: an idle connection costs some
# 20 KB (17,565 streams took 310 MB), so 10,000 of them about 200 MB.
MAX_CONNECTIONS_CEILING = 10_000
# Descriptors the process needs besides client connections, the pool, the LISTEN connection
# and Core's: the listening socket, the event loop's, stdio, log files, the odd file.
FD_RESERVE = 64
# With no hard limit (macOS), the soft one is raised to this (Linux's default fs.nr_open).
FD_TARGET_WHEN_UNLIMITED = 1 << 20
# The refusal lane: a sixteenth of the cap, within these bounds.
LANE_MIN, LANE_MAX = 2, 64
LANE_READ_S = 1.0  # time a lane connection has to send its request line
LANE_LINGER_S = 1.0  # after the answer, time for the client to read it and close
LANE_PEEK_BYTES = 1024
OVER_CAP_LOG_INTERVAL_S = 10.0  # one warning per interval, with the count, not one per refusal


@dataclass(frozen=True, slots=True)
class FdLimit:
    """RLIMIT_NOFILE of the process: the soft limit now and before it was raised."""

    soft: int
    hard: int | None  # None: unlimited
    before: int


def raise_fd_limit() -> FdLimit:
    """Raise the soft RLIMIT_NOFILE toward the hard one (it is the soft one that runs out), as
    far as the system allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    before = soft
    target = FD_TARGET_WHEN_UNLIMITED if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # macOS refuses more than its OPEN_MAX
            pass
    return FdLimit(soft, None if hard == resource.RLIM_INFINITY else hard, before)


def fd_soft_limit() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return FD_TARGET_WHEN_UNLIMITED if soft == resource.RLIM_INFINITY else soft


def fds_besides_clients(settings: Settings) -> int:
    """Descriptors the instance needs for what is not a client connection."""
    return settings.pool_max_size + 1 + CORE_CONNECTIONS_MAX + FD_RESERVE


def _lane_for(connections: int) -> int:
    return max(LANE_MIN, min(LANE_MAX, connections // 16))


@dataclass(frozen=True, slots=True)
class EdgeSettings:
    """What the edge holds a connection to (``AQ_HEADER_TIMEOUT_S``,
    ``AQ_KEEPALIVE_TIMEOUT_S``; the body's bound is the routes') and how many it holds
    (``AQ_MAX_CONNECTIONS``, and the refusal lane beyond it)."""

    header_timeout_s: float = 10.0
    keepalive_timeout_s: float = 15.0
    max_connections: int = MAX_CONNECTIONS_CEILING
    lane_slots: int = LANE_MAX
    fd_soft_limit: int = 0  # what the cap was computed from, for the start's log line
    fds_besides_clients: int = 0

    @classmethod
    def from_settings(cls, settings: Settings, fd_soft: int | None = None) -> EdgeSettings:
        """The settings' bounds; the default cap from the soft descriptor limit ``fd_soft``
        (the process's now by default): what it leaves after everything else the instance
        holds and the refusal lane, at most ``MAX_CONNECTIONS_CEILING``."""
        soft = fd_soft_limit() if fd_soft is None else fd_soft
        besides = fds_besides_clients(settings)
        if settings.max_connections is not None:
            cap = settings.max_connections
            lane = _lane_for(cap)
        else:
            room = max(0, soft - besides)
            lane = _lane_for(room)
            cap = max(1, min(MAX_CONNECTIONS_CEILING, room - lane))
        return cls(
            header_timeout_s=settings.header_timeout_s,
            keepalive_timeout_s=settings.keepalive_timeout_s,
            max_connections=cap,
            lane_slots=lane,
            fd_soft_limit=soft,
            fds_besides_clients=besides,
        )

    @property
    def fits_fd_limit(self) -> bool:
        needed = self.max_connections + self.lane_slots + self.fds_besides_clients
        return needed <= self.fd_soft_limit

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
        self._edge.closed(self)
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


def _raw_response(status: int, content_type: str, body: bytes, headers: dict[str, str]) -> bytes:
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}"]
    head += [f"{name}: {value}" for name, value in headers.items()]
    head += [f"Content-Type: {content_type}", f"Content-Length: {len(body)}", "Connection: close"]
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body


_HEALTHZ_LINES = (b"GET /healthz ", b"GET /healthz?")
_HEALTHZ_OK = _raw_response(200, "application/json", orjson.dumps({"status": "ok"}), {})
_TOO_MANY = errors.TooManyConnections()
_TOO_MANY_CONNECTIONS = _raw_response(
    problems.status_of(_TOO_MANY),
    "application/problem+json",
    orjson.dumps(problems.problem_document(_TOO_MANY, "/")),
    problems.headers_of(_TOO_MANY),
)


class Edge:
    """The connections of one instance: counts them, and makes each one's protocol: an
    :class:`EdgeHandler` under the cap, a place in the refusal lane past it, and past the lane a
    protocol that closes the connection at once."""

    def __init__(self, settings: EdgeSettings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self._handler_kwargs = settings.handler_kwargs()
        # Weak: a protocol made but never connected (the accept failed) does not hold a place.
        self._open: weakref.WeakSet[EdgeHandler] = weakref.WeakSet()
        self._lane: weakref.WeakSet[_LaneConnection] = weakref.WeakSet()
        self._over_cap_unlogged = 0
        self._over_cap_logged_at = -OVER_CAP_LOG_INTERVAL_S

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def protocol_factory(self, server: web.Server) -> Callable[[], asyncio.BaseProtocol]:
        loop = asyncio.get_running_loop()
        cap = self.settings.max_connections

        def make() -> asyncio.BaseProtocol:
            # Counted when made, not when connected: asyncio accepts a burst of connections
            # before the first of them is connected, and each must see the others.
            if len(self._open) < cap:
                handler = EdgeHandler(server, self, loop=loop, **self._handler_kwargs)
                self._open.add(handler)
                return handler
            return self._over_cap()

        return make

    def closed(self, handler: EdgeHandler) -> None:
        self._open.discard(handler)

    def close_lane(self) -> None:
        for connection in list(self._lane):
            connection.abort()

    def _over_cap(self) -> asyncio.BaseProtocol:
        self._log_over_cap()
        if len(self._lane) < self.settings.lane_slots:
            connection = _LaneConnection(self)
            self._lane.add(connection)
            return connection
        self.metrics.http_over_cap.labels("closed").inc()
        return _CloseAtAccept()

    def _lane_closed(self, connection: _LaneConnection) -> None:
        self._lane.discard(connection)

    def _log_over_cap(self) -> None:
        self._over_cap_unlogged += 1
        now = time.monotonic()
        if now - self._over_cap_logged_at < OVER_CAP_LOG_INTERVAL_S:
            return
        log.warning(
            "connections over the cap",
            extra={
                "action": "http",
                "max_connections": self.settings.max_connections,
                "over_cap": self._over_cap_unlogged,  # since the last line like this one
            },
        )
        self._over_cap_unlogged = 0
        self._over_cap_logged_at = now


class _LaneConnection(asyncio.Protocol):
    """A connection past the cap: read its request line for up to ``LANE_READ_S``, answer
    ``/healthz`` or 503, half-close, and close when the client has read it (or after
    ``LANE_LINGER_S``). Closing with the request unread could reset the connection before
    the client reads the answer; the half-close lets it read first."""

    def __init__(self, edge: Edge) -> None:
        self._edge = edge
        self._transport: asyncio.Transport | None = None
        self._head = b""
        self._timer: asyncio.TimerHandle | None = None
        self._answered = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport; uvloop's are not asyncio.Transport subclasses (aiohttp casts too).
        self._transport = cast(asyncio.Transport, transport)
        self._timer = asyncio.get_running_loop().call_later(LANE_READ_S, self._answer)

    def data_received(self, data: bytes) -> None:
        if self._answered:
            return  # what follows the request line is dropped
        self._head += data[: LANE_PEEK_BYTES - len(self._head)]
        if b"\n" in self._head or len(self._head) >= LANE_PEEK_BYTES:
            self._answer()

    def eof_received(self) -> bool:
        self._answer()
        return False  # the transport closes once the answer is written

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._transport = None
        self._edge._lane_closed(self)

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def _answer(self) -> None:
        transport = self._transport
        if self._answered or transport is None:
            return
        self._answered = True
        if self._timer is not None:
            self._timer.cancel()
        healthz = self._head.startswith(_HEALTHZ_LINES)
        self._edge.metrics.http_over_cap.labels("healthz" if healthz else "503").inc()
        transport.write(_HEALTHZ_OK if healthz else _TOO_MANY_CONNECTIONS)
        if transport.can_write_eof():
            transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(LANE_LINGER_S, transport.close)


class _CloseAtAccept(asyncio.Protocol):
    """Past the cap and the lane: the cheapest refusal, a close before a byte is read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


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
        edge = self._edge.settings
        extra = {
            "action": "listen",
            "address": self.name,
            "max_connections": edge.max_connections,
            "refusal_lane": edge.lane_slots,
            "fd_soft_limit": edge.fd_soft_limit,
            "header_timeout_s": edge.header_timeout_s,
            "keepalive_timeout_s": edge.keepalive_timeout_s,
        }
        log.info("accepting connections", extra=extra)
        if not edge.fits_fd_limit:
            log.warning(
                "AQ_MAX_CONNECTIONS leaves too few file descriptors: past them, accepts fail "
                "and /healthz with them",
                extra={**extra, "fds_besides_clients": edge.fds_besides_clients},
            )

    async def stop(self) -> None:
        await super().stop()
        self._edge.close_lane()
