"""One service's HTTP transport: the session, the bearer token (a string, or an async callable
that returns a fresh one), one request with its retries, answers read into models and errors
turned into the client's exceptions (``errors.py``). The clients (``api.py``) and the event
stream (``stream.py``) talk through it.
"""

from __future__ import annotations

import contextlib
import io
import json
import uuid
from collections.abc import Awaitable, Callable, Mapping
from importlib import metadata
from typing import Any, TypeVar

import aiohttp
import pydantic
from multidict import CIMultiDictProxy

from analysis_queue.client.errors import (
    ConnectionFailed,
    ProblemError,
    ProtocolError,
    Unauthorized,
    problem_from_answer,
)
from analysis_queue.client.retries import RetryPolicy, retrying

TokenSource = str | Callable[[], Awaitable[str]]
M = TypeVar("M", bound=pydantic.BaseModel)
T = TypeVar("T")

JSON_TYPES = ("application/json", "application/problem+json")
EVENT_STREAM = "text/event-stream"
LARGE_BODY_BYTES = 1 << 20  # aiohttp's TOO_LARGE_BYTES_BODY
# An idle pooled connection is dropped after this: below the service's AQ_KEEPALIVE_TIMEOUT_S
# (15 s), so that a request is not sent on a connection the service is closing at that moment
# (a POST without a key could not be retried).
KEEPALIVE_S = 10.0
ERROR_BODY_MAX_BYTES = 64 * 1024


def _version() -> str:
    try:
        return metadata.version("analysis-queue")
    except metadata.PackageNotFoundError:  # pragma: no cover - a bare checkout
        return "0"


USER_AGENT = f"analysis-queue-client/{_version()} aiohttp/{aiohttp.__version__}"


def connection_failed(exc: BaseException, action: str) -> ConnectionFailed:
    """An aiohttp or timeout error as the client's: whether the request may have been sent,
    and whether another try can help (a certificate will not change)."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return ConnectionFailed(f"{action}: TLS failed: {exc}", sent=False, transient=False)
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
        return ConnectionFailed(f"{action}: could not connect: {exc}", sent=False)
    if isinstance(exc, TimeoutError):
        return ConnectionFailed(f"{action}: no answer in time", sent=True)
    return ConnectionFailed(f"{action}: {type(exc).__name__}: {exc}", sent=True)


async def error_of(resp: aiohttp.ClientResponse) -> ProblemError:
    """The client's error for a non-2xx answer; of its body (a problem document, or a proxy's
    page) at most ERROR_BODY_MAX_BYTES are read."""
    raw = b""
    while len(raw) < ERROR_BODY_MAX_BYTES:
        chunk = await resp.content.read(ERROR_BODY_MAX_BYTES - len(raw))
        if not chunk:
            break
        raw += chunk
    body: Any = raw.decode("utf-8", errors="replace")
    if resp.content_type in JSON_TYPES:
        with contextlib.suppress(ValueError):
            body = json.loads(raw)
    return problem_from_answer(resp.status, resp.reason, body, resp.headers)


def _data(payload: bytes | None) -> bytes | io.BytesIO | None:
    """A body as aiohttp sends it best: bytes, or a stream past the size at which aiohttp warns
    that bytes could block the loop (bodies that large are refused, but are sent)."""
    if payload is None or len(payload) < LARGE_BODY_BYTES:
        return payload
    return io.BytesIO(payload)


class Transport:
    def __init__(
        self,
        base_url: str,
        token: TokenSource,
        *,
        session: aiohttp.ClientSession | None,
        timeout_s: float,
        retry: RetryPolicy,
    ) -> None:
        if not isinstance(token, str) and not callable(token):
            raise TypeError("token must be a string or an async callable returning one")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retry = retry
        self._token = token
        self._session = session
        self._owns_session = session is None
        self._closed = False

    async def session(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError("the client is closed")
        if self._session is None or self._session.closed:
            if not self._owns_session:
                raise RuntimeError("the aiohttp session given to the client is closed")
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S),
                headers={"User-Agent": USER_AGENT},
            )
        return self._session

    async def close(self) -> None:
        self._closed = True
        session, self._session = self._session, None
        if self._owns_session and session is not None:
            await session.close()

    async def token(self) -> str:
        if isinstance(self._token, str):
            return self._token
        return await self._token()

    def headers(self, token: str, request_id: str, extra: Mapping[str, str]) -> dict[str, str]:
        return {
            "Authorization": f"Bearer {token}",
            "User-Agent": USER_AGENT,
            "X-Request-ID": request_id,
            **extra,
        }

    async def call(
        self,
        method: str,
        path: str,
        model: type[M],
        *,
        action: str,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
        idempotent: bool,
        keyed: bool = False,
    ) -> tuple[M, CIMultiDictProxy[str]]:
        """One call with its retries: the answer read into ``model``, and its headers."""
        request_id = uuid.uuid4().hex  # the same on every try: the service's logs tie them
        tries = retrying(self.retry, idempotent=idempotent, keyed=keyed, action=action)
        async for attempt in tries:
            with attempt:
                return await self._once(
                    method, path, model, action, params, body, dict(headers or {}), request_id
                )
        raise AssertionError("unreachable: tenacity reraises the last error")  # pragma: no cover

    async def with_token(self, send: Callable[[str], Awaitable[T]]) -> T:
        """``send(token)``, and once more with a fresh token after a 401: a callable token
        source is asked again and, if it gives another token, the request goes again with it.
        Every route checks the token before it does anything, so this cannot do anything
        twice."""
        token = await self.token()
        try:
            return await send(token)
        except Unauthorized:
            if isinstance(self._token, str):
                raise
            fresh = await self.token()
            if fresh == token:
                raise
        return await send(fresh)

    async def _once(
        self,
        method: str,
        path: str,
        model: type[M],
        action: str,
        params: Mapping[str, str] | None,
        body: Any,
        headers: dict[str, str],
        request_id: str,
    ) -> tuple[M, CIMultiDictProxy[str]]:
        session = await self.session()
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        # UTF-8 as the service measures it (a string that is no Unicode, a lone surrogate,
        # raises UnicodeEncodeError here, before anything is sent).
        payload = (
            None
            if body is None
            else json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        )
        if payload is not None:
            headers = {"Content-Type": "application/json", **headers}

        async def send(token: str) -> tuple[bytes, CIMultiDictProxy[str]]:
            try:
                async with session.request(
                    method,
                    self.base_url + path,
                    params=params,
                    data=_data(payload),
                    headers=self.headers(token, request_id, headers),
                    timeout=timeout,
                ) as resp:
                    if resp.status >= 300:
                        raise await error_of(resp)
                    return await resp.read(), resp.headers
            except (aiohttp.ClientError, TimeoutError) as exc:
                if isinstance(exc, aiohttp.InvalidURL):
                    raise
                raise connection_failed(exc, action) from exc

        raw, answer = await self.with_token(send)
        try:
            return model.model_validate_json(raw), answer
        except pydantic.ValidationError as exc:
            raise ProtocolError(f"{action}: the answer is not a {model.__name__}: {exc}") from exc
