"""Talk to Core, the upstream analysis engine, over HTTP, and sign/verify its callbacks."""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any
from urllib.parse import quote

import aiohttp
import orjson
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from analysis_queue import tracing
from analysis_queue.errors import (
    CoreRunGone,
    CoreUnavailable,
    InvalidSource,
    ProviderBudgetExhausted,
    UnparseableThesis,
)

log = logging.getLogger(__name__)

SIGNATURE_PREFIX = "sha256="
SIGNATURE_LEN = len(SIGNATURE_PREFIX) + 64  # hex of a SHA-256 digest, as hexdigest() writes it
HEX_DIGITS = frozenset("0123456789abcdef")
TIMESTAMP_MAX_DIGITS = 12  # Unix seconds; 10 digits until the year 2286
CALLBACK_WINDOW_S = 300.0
CORE_TIMEOUT_S = 10.0
CORE_CONNECTIONS_MAX = 100
# Core's refusal details reach end users; a misbehaving Core must not flood them.
REFUSAL_DETAIL_MAX_CHARS = 500


class RunState(StrEnum):
    """The states of a Core run this service acts on (Core may report others: they are kept as
    strings and mean "not finished")."""

    HELD = "held"
    JUDGING = "judging"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


FINISHED_STATES = frozenset({RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED})
# Transient by definition, so they must never be read as "the run is gone".
TRANSIENT_4XX = frozenset({408, 429})


def sign_callback(secret: str, timestamp: int, body: bytes) -> str:
    """Return the ``X-Core-Signature`` value of ``body`` sent at ``timestamp``."""
    message = str(timestamp).encode("ascii") + b"." + body
    digest = hmac.new(secret.encode("utf-8"), message, hashlib.sha256).hexdigest()
    return SIGNATURE_PREFIX + digest


def callback_timestamp(
    secret: str,
    timestamp_header: str | None,
    signature_header: str | None,
    *,
    now: float,
    window_s: float = CALLBACK_WINDOW_S,
) -> int | None:
    """The timestamp of a callback whose headers could verify: a secret is configured, the
    timestamp is digits within ``window_s`` of ``now``, the signature is ``sha256=`` and 64
    hex digits. None otherwise. It needs no body, so a forged or stale callback is refused
    before its body is read."""
    # An empty secret would let anyone forge callbacks, so it verifies nothing.
    if not secret or timestamp_header is None or signature_header is None:
        return None
    # int() alone would also accept " 12", "+12" and "1_2"; Core only ever sends digits. The
    # length bound keeps int() away from an 8 KiB header (ValueError past 4300 digits).
    if not (
        0 < len(timestamp_header) <= TIMESTAMP_MAX_DIGITS
        and timestamp_header.isascii()
        and timestamp_header.isdigit()
    ):
        return None
    timestamp = int(timestamp_header)
    if abs(now - timestamp) > window_s:
        return None
    digest = signature_header.removeprefix(SIGNATURE_PREFIX)
    if len(signature_header) != SIGNATURE_LEN or not HEX_DIGITS.issuperset(digest):
        return None
    return timestamp


def signature_matches(secret: str, timestamp: int, signature_header: str, body: bytes) -> bool:
    """The HMAC comparison, in constant time, once :func:`callback_timestamp` passed."""
    expected = sign_callback(secret, timestamp, body)
    return hmac.compare_digest(expected.encode("utf-8"), signature_header.encode("utf-8"))


def verify_callback(
    secret: str,
    timestamp_header: str | None,
    signature_header: str | None,
    body: bytes,
    *,
    now: float,
    window_s: float = CALLBACK_WINDOW_S,
) -> bool:
    """True only for a well-formed, fresh callback signed with ``secret``."""
    timestamp = callback_timestamp(
        secret, timestamp_header, signature_header, now=now, window_s=window_s
    )
    if timestamp is None or signature_header is None:
        return False
    return signature_matches(secret, timestamp, signature_header, body)


class Verdict(BaseModel):
    """Core's verdict on one source."""

    model_config = ConfigDict(frozen=True, extra="ignore", strict=True)

    source: str
    verdict: str


def _none_is_empty(value: Any) -> Any:
    return [] if value is None else value


class CoreRun(BaseModel):
    """One run as Core reports it: the body of its signed callback when a run ends, and its
    answer to create and to ``GET /v1/runs/{id}``. The one description of that body: the
    callback is parsed with it and the OpenAPI document's ``CoreEvent`` is generated from it.
    Keys it does not know are ignored; a value of the wrong type is refused."""

    model_config = ConfigDict(frozen=True, extra="ignore", strict=True)

    id: str = Field(min_length=1, description="Core's run id.")
    state: str = Field(
        min_length=1,
        description="held, judging, or how it ended.",
        examples=["completed", "failed", "cancelled"],
    )
    # The create response carries only id and state: no verdicts yet ([], as null is read).
    verdicts: Annotated[
        list[Verdict],
        BeforeValidator(_none_is_empty, json_schema_input_type=list[Verdict] | None),
    ] = Field(default_factory=list)
    error: str | None = None

    @classmethod
    def from_json(cls, data: Any) -> CoreRun:
        """Build from a Core response or callback body (parsed); ``ValueError`` if malformed."""
        return cls.model_validate(data)

    @property
    def finished(self) -> bool:
        return self.state in FINISHED_STATES


def _code_of(payload: Any) -> str | None:
    code = payload.get("code") if isinstance(payload, dict) else None
    return code if isinstance(code, str) else None


def _detail_of(payload: Any) -> str | None:
    detail = payload.get("detail") if isinstance(payload, dict) else None
    if not isinstance(detail, str) or not detail:
        return None
    return detail[:REFUSAL_DETAIL_MAX_CHARS]


class CoreClient:
    """One pooled HTTP session to Core. No retries here: callers own the retry policy."""

    def __init__(self, base_url: str, *, timeout_s: float = CORE_TIMEOUT_S) -> None:
        self._base_url = base_url.rstrip("/")
        self._timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    @property
    def base_url(self) -> str:
        return self._base_url

    async def start(self) -> None:
        if self._session is not None:
            return
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=CORE_CONNECTIONS_MAX),
            timeout=aiohttp.ClientTimeout(total=self._timeout_s),
        )

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def _request(
        self, action: str, method: str, path: str, body: Mapping[str, Any] | None = None
    ) -> tuple[int, Any]:
        """Send one request; return (status, parsed JSON or None). 5xx and I/O raise."""
        if self._session is None:
            raise RuntimeError("CoreClient.start() must be awaited before use")
        data = orjson.dumps(body) if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        url = self._base_url + path
        with tracing.span(
            action.replace("_", " "),  # "core create", "core release", ...
            kind="client",
            attributes={"http.request.method": method, "url.full": url},
        ) as span:
            tracing.inject(headers)  # traced: Core's team can join the trace (traceparent)
            try:
                async with self._session.request(
                    method, url, data=data, headers=headers
                ) as response:
                    status = response.status
                    raw = await response.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.warning(
                    "core unreachable",
                    extra={"action": action, "path": path, "error_type": type(exc).__name__},
                )
                reason = "timed out" if isinstance(exc, TimeoutError) else "connection failed"
                raise CoreUnavailable(f"Core {reason}.") from exc
            if span is not None:
                span.set_attribute("http.response.status_code", status)
                if status >= 400:  # a client span's error, as OpenTelemetry's HTTP rules say
                    tracing.set_error(span, f"Core answered {status}")
            if status >= 500:
                log.warning(
                    "core server error", extra={"action": action, "path": path, "status": status}
                )
                raise CoreUnavailable(f"Core answered {status}.")
        try:
            payload: Any = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            payload = None
        return status, payload

    def _parse_run(self, action: str, status: int, payload: Any) -> CoreRun:
        try:
            return CoreRun.from_json(payload)
        except ValueError as exc:
            log.warning(
                "core response unparseable",
                extra={"action": action, "status": status, "reason": str(exc)},
            )
            raise CoreUnavailable("Core sent an unparseable response.") from exc

    async def create_held(
        self, run_id: str, user_id: str, thesis: dict[str, str], sources: list[str]
    ) -> CoreRun:
        """Create the run held (not judging yet). Idempotent on ``run_id``."""
        action = "core_create"
        body = {
            "run_id": run_id,
            "user_id": user_id,
            "thesis": {"title": thesis.get("title"), "document_url": thesis.get("document_url")},
            "sources": sources,
            "hold": True,
        }
        status, payload = await self._request(action, "POST", "/v1/runs", body)
        if 200 <= status < 300:
            return self._parse_run(action, status, payload)
        code = _code_of(payload)
        if status == 429:
            raise ProviderBudgetExhausted()
        if status == 422 and code == "invalid_source":
            raise InvalidSource(_detail_of(payload))
        if status == 422 and code == "unparseable_thesis":
            raise UnparseableThesis(_detail_of(payload))
        log.error(
            "core create refused unexpectedly",
            extra={"action": action, "run_id": run_id, "status": status, "code": code},
        )
        raise CoreUnavailable(f"Core answered {status} to create.")

    async def release(self, core_run_id: str) -> None:
        """Start judging a held run. Idempotent; ``CoreRunGone`` if Core no longer holds it."""
        action = "core_release"
        path = f"/v1/runs/{quote(core_run_id, safe='')}/release"
        status, payload = await self._request(action, "POST", path)
        if 200 <= status < 300:
            return
        extra = {"action": action, "core_run_id": core_run_id, "status": status}
        if status in TRANSIENT_4XX:
            log.warning("core release deferred", extra=extra)
            raise CoreUnavailable(f"Core answered {status} to release.")
        if status not in (404, 409):
            log.error(
                "core release refused unexpectedly", extra={**extra, "code": _code_of(payload)}
            )
        else:
            log.info("core release refused", extra=extra)
        raise CoreRunGone()

    async def cancel(self, core_run_id: str) -> None:
        """Cancel a run; a run Core does not know is as good as cancelled."""
        action = "core_cancel"
        path = f"/v1/runs/{quote(core_run_id, safe='')}/cancel"
        status, payload = await self._request(action, "POST", path)
        if 200 <= status < 300 or status == 404:
            return
        log.error(
            "core cancel refused unexpectedly",
            extra={
                "action": action,
                "core_run_id": core_run_id,
                "status": status,
                "code": _code_of(payload),
            },
        )
        raise CoreUnavailable(f"Core answered {status} to cancel.")

    async def get_run(self, core_run_id: str) -> CoreRun | None:
        """Core's view of the run, or None if Core does not know it."""
        action = "core_get_run"
        status, payload = await self._request(
            action, "GET", f"/v1/runs/{quote(core_run_id, safe='')}"
        )
        if status == 404:
            return None
        if 200 <= status < 300:
            return self._parse_run(action, status, payload)
        log.error(
            "core get_run refused unexpectedly",
            extra={"action": action, "core_run_id": core_run_id, "status": status},
        )
        raise CoreUnavailable(f"Core answered {status} to get_run.")
