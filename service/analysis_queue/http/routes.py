"""The HTTP API: the routes and their body parsing. Errors become problem+json in problems.py."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, TypeVar
from uuid import UUID

import orjson
import pydantic
from aiohttp import web

from analysis_queue import errors, tracing
from analysis_queue.core.client import CoreRun, callback_timestamp, signature_matches
from analysis_queue.http.auth import require_admin, require_bearer
from analysis_queue.http.bodies import (
    CONTROL_CHARS,
    MAX_USER_ID_CHARS,
    AnalysisRequest,
    CreditGrant,
    RecheckRequest,
    UserLimitRequest,
)
from analysis_queue.http.paging import page_request, split_page
from analysis_queue.http.problems import Handler
from analysis_queue.http.state import SERVICES, Services
from analysis_queue.logs import request_id_var
from analysis_queue.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

log = logging.getLogger(__name__)

MAX_IDEMPOTENCY_KEY_LEN = 200
MAX_REPORTED_ERRORS = 20
MAX_FIELD_NAME_CHARS = 100
Model = TypeVar("Model", bound=pydantic.BaseModel)

routes = web.RouteTableDef()


def json_response(
    payload: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(payload), status=status, content_type="application/json", headers=headers
    )


# -- helpers ------------------------------------------------------------------------------------


def _services(request: web.Request) -> Services:
    return request.app[SERVICES]


def _admin(request: web.Request) -> None:
    """Unauthorized unless the caller presents the admin token."""
    secret = _services(request).settings.secret("admin_token")
    require_admin(request.headers.get("Authorization"), secret)


def _user(request: web.Request) -> str:
    return _services(request).tokens.user(request.headers.get("Authorization"))


async def _read_body(request: web.Request) -> bytes:
    """The whole body, within AQ_BODY_TIMEOUT_S: a client that stops halfway gets 408 instead of
    holding the handler and its connection for ever. Past client_max_size (a chunked body: a
    stated Content-Length is refused before this) aiohttp raises HTTPRequestEntityTooLarge."""
    services = _services(request)
    try:
        async with asyncio.timeout(services.settings.body_timeout_s):
            return await request.read()
    except TimeoutError as exc:
        services.metrics.http_timeouts.labels("body").inc()
        raise errors.RequestTimeout(
            f"The request body did not arrive within {services.settings.body_timeout_s:g} s."
        ) from exc


async def _body(request: web.Request, model: type[Model]) -> Model:
    if request.content_type != "application/json":
        raise errors.UnsupportedMediaType()
    if (request.charset or "utf-8").lower() not in ("utf-8", "utf8"):
        raise errors.UnsupportedMediaType("JSON must be UTF-8 (RFC 8259).")
    if request.content_length is not None and request.content_length > request.client_max_size:
        raise errors.PayloadTooLarge()  # said before a byte of it is read
    raw = await _read_body(request)
    try:
        data = orjson.loads(raw)  # refuses invalid UTF-8, lone surrogates, NaN/Infinity, depth
    except (orjson.JSONDecodeError, RecursionError) as exc:
        raise errors.MalformedRequest() from exc
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise _invalid_body(exc) from exc


def _invalid_body(exc: pydantic.ValidationError) -> errors.InvalidBody:
    """422 naming each bad field. Never echoes the input; field names an attacker chose (unknown
    keys) are cut short and lose their control characters, and the list is bounded."""
    problems = [
        {
            "field": CONTROL_CHARS.sub(
                "?", (".".join(str(p) for p in e["loc"]) or "(body)")[:MAX_FIELD_NAME_CHARS]
            ),
            "message": e["msg"],
        }
        for e in exc.errors(include_url=False, include_input=False, include_context=False)[
            :MAX_REPORTED_ERRORS
        ]
    ]
    fields = ", ".join(dict.fromkeys(p["field"] for p in problems))
    return errors.InvalidBody(f"The request body is invalid: {fields}.", errors=problems)


def _job_id(request: web.Request) -> UUID:
    try:
        return UUID(request.match_info["job_id"])
    except ValueError as exc:
        raise errors.NotFound() from exc


def _idempotency_key(request: web.Request) -> str | None:
    key = request.headers.get("Idempotency-Key")
    if key is None:
        return None
    if not 0 < len(key) <= MAX_IDEMPOTENCY_KEY_LEN or not key.isprintable():
        message = f"must be 1-{MAX_IDEMPOTENCY_KEY_LEN} printable characters"
        raise errors.InvalidBody(
            f"Idempotency-Key {message}.",
            errors=[{"field": "Idempotency-Key", "message": message}],
        )
    return key


# -- analyses -----------------------------------------------------------------------------------


@routes.post("/v1/analyses")
async def create_analysis(request: web.Request) -> web.Response:
    user_id = _user(request)
    body = await _body(request, AnalysisRequest)
    services = _services(request)
    admitted = await services.admitter.admit(
        user_id,
        body.thesis.model_dump(),
        list(body.sources),
        idempotency_key=_idempotency_key(request),
    )
    headers = {"Location": f"/v1/analyses/{admitted.job.id}"}
    if not admitted.created:
        headers["Idempotent-Replayed"] = "true"
    return json_response(admitted.job.to_json(), status=201, headers=headers)


@routes.get("/v1/analyses")
async def list_analyses(request: web.Request) -> web.Response:
    """A page of the caller's jobs as summaries, newest first; ``next`` is the cursor of the
    page after it (``?cursor=``), null on the last."""
    user_id = _user(request)
    wanted = page_request(request.query)
    rows = await _services(request).db.list_jobs(
        user_id, before_seq=wanted.before_seq, limit=wanted.limit + 1
    )
    page, cursor = split_page(rows, wanted.limit)
    return json_response({"analyses": [j.to_json() for j in page], "next": cursor})


@routes.get("/v1/analyses/{job_id}")
async def get_analysis(request: web.Request) -> web.Response:
    user_id = _user(request)
    job = await _services(request).db.get_job(_job_id(request), user_id)
    if job is None:
        raise errors.NotFound()
    return json_response(job.to_json())


@routes.delete("/v1/analyses/{job_id}")
async def delete_analysis(request: web.Request) -> web.Response:
    """Soft delete: a job that has not ended is cancelled first, by the rules of
    ``cancel_analysis`` below; a finished one is only hidden."""
    user_id = _user(request)  # 401 before anything else is looked at
    result = await _services(request).finisher.delete(_job_id(request), user_id)
    return json_response(result.job.to_json())


@routes.post("/v1/analyses/{job_id}/cancel")
async def cancel_analysis(request: web.Request) -> web.Response:
    """Cancel and keep the job listed. A queued job is cancelled and refunded, then its held
    run cancelled in Core. A pending or running job is cancelled in Core *first*: its slot (the
    user's, and the provider's when the ceiling is on) frees only after Core stopped the run, so
    a job promoted into the slot never judges beside it. If Core cannot be told, the answer is
    503 and the job goes on. A cancelled job is answered as it is; a succeeded or failed one is
    409."""
    user_id = _user(request)  # 401 before anything else is looked at
    result = await _services(request).finisher.cancel(_job_id(request), user_id)
    return json_response(result.job.to_json())


@routes.post("/v1/analyses/{job_id}/rechecks")
async def create_recheck(request: web.Request) -> web.Response:
    user_id = _user(request)
    parent_id = _job_id(request)
    body = await _body(request, RecheckRequest)
    services = _services(request)
    admitted = await services.admitter.recheck(user_id, parent_id, list(body.sources))
    return json_response(
        admitted.job.to_json(),
        status=201,
        headers={"Location": f"/v1/analyses/{admitted.job.id}"},
    )


# -- credits ------------------------------------------------------------------------------------


@routes.get("/v1/credits")
async def get_credits(request: web.Request) -> web.Response:
    user_id = _user(request)
    balance, held = await _services(request).db.credits(user_id)
    return json_response({"balance": balance, "held": held})


@routes.post("/v1/admin/credits")
async def grant_credits(request: web.Request) -> web.Response:
    services = _services(request)
    _admin(request)
    body = await _body(request, CreditGrant)
    balance = await services.db.grant_credits(body.user_id, body.amount, body.note)
    log.info(
        "credits granted", extra={"action": "grant", "user_id": body.user_id, "amount": body.amount}
    )
    return json_response({"user_id": body.user_id, "balance": balance})


# -- capacity -----------------------------------------------------------------------------------


@routes.get("/v1/admin/capacity")
async def get_capacity(request: web.Request) -> web.Response:
    services = _services(request)
    _admin(request)
    return json_response((await services.db.capacity()).to_json())


def _limit_user(request: web.Request) -> str:
    user_id = request.match_info["user_id"]
    if not 0 < len(user_id) <= MAX_USER_ID_CHARS or CONTROL_CHARS.search(user_id):
        raise errors.NotFound()
    return user_id


@routes.get("/v1/admin/users/{user_id}/limit")
async def get_user_limit(request: web.Request) -> web.Response:
    services = _services(request)
    _admin(request)
    return json_response((await services.db.user_limit(_limit_user(request))).to_json())


@routes.put("/v1/admin/users/{user_id}/limit")
async def set_user_limit(request: web.Request) -> web.Response:
    services = _services(request)
    _admin(request)
    user_id = _limit_user(request)
    body = await _body(request, UserLimitRequest)
    await services.promoter.set_user_limit(user_id, body.max_running)
    log.info(
        "user limit set",
        extra={"action": "user_limit", "user_id": user_id, "max_running": body.max_running},
    )
    return json_response((await services.db.user_limit(user_id)).to_json())


# -- Core callbacks -----------------------------------------------------------------------------


@routes.post("/v1/core/events")
async def core_event(request: web.Request) -> web.Response:
    services = _services(request)
    secret = services.settings.secret("core_callback_secret")
    signature = request.headers.get("X-Core-Signature", "")
    timestamp = callback_timestamp(
        secret, request.headers.get("X-Core-Timestamp"), signature, now=time.time()
    )
    if timestamp is None:
        # Missing, malformed or stale headers: refused before a byte of the body is read, so a
        # forger cannot make the instance hold a connection and buffer a megabyte for nothing.
        raise errors.InvalidSignature()
    if request.content_length is not None and request.content_length > request.client_max_size:
        raise errors.PayloadTooLarge()
    raw = await _read_body(request)
    if not signature_matches(secret, timestamp, signature, raw):
        raise errors.InvalidSignature()
    try:
        run = CoreRun.from_json(orjson.loads(raw))
    except (orjson.JSONDecodeError, RecursionError, ValueError, TypeError) as exc:
        raise errors.MalformedRequest("The event is not a run.") from exc
    outcome = await services.finisher.apply_core_run(run)
    return json_response({"outcome": outcome})


# -- health -------------------------------------------------------------------------------------


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    services = _services(request)
    token = services.settings.secret("metrics_token")
    if token:
        require_bearer(request.headers.get("Authorization"), token, "Metrics credentials required.")
    m = services.metrics
    await services.gauges.refresh()  # the database, at most once per AQ_METRICS_CACHE_S
    m.http_connections.set(services.edge.open_connections)
    size, idle = services.db.pool_counts()
    m.pool_size.labels("total").set(size)
    m.pool_size.labels("idle").set(idle)
    return web.Response(body=m.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})


@routes.get("/healthz")
async def healthz(_request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


@routes.get("/readyz")
async def readyz(request: web.Request) -> web.Response:
    services = _services(request)
    checks: dict[str, bool] = {}
    try:
        await services.db.ping()
        checks["database"] = True
    except errors.DatabaseUnavailable:
        checks["database"] = False
    checks["listener"] = services.listener is None or services.listener.healthy
    checks["migrations"] = services.migrated
    ready = all(checks.values()) and not services.stopping
    return json_response(
        {"status": "ready" if ready else "not_ready", "checks": checks},
        status=200 if ready else 503,
    )


# Headers that say who is asking and which request this is: one of each, or the service and a
# proxy in front of it (which may take the last where aiohttp takes the first) could act on
# different answers. X-Request-ID is only a label and is replaced when it is not usable.
SINGLE_HEADERS = ("Authorization", "Idempotency-Key", "Last-Event-ID")


@web.middleware
async def single_headers_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A request that repeats one of ``SINGLE_HEADERS`` is a 400 naming it, before any handler
    reads it."""
    for name in SINGLE_HEADERS:
        count = len(request.headers.getall(name, ()))
        if count > 1:
            message = f"sent {count} times; send it once"
            raise errors.RepeatedHeader(
                f"The {name} header is {message}.", errors=[{"field": name, "message": message}]
            )
    return await handler(request)


@web.middleware
async def tracing_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Traced, each request is a server span, a child of the caller's ``traceparent``: named by
    its route (``POST /v1/analyses/{job_id}/recheck``), an error only when it answered 5xx.
    The app has it only when tracing was on as it was built (app.py)."""
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else ""
    attributes: dict[str, str | int | bool] = {
        "http.request.method": request.method,
        "url.path": request.path,
    }
    if route:
        attributes["http.route"] = route
    with tracing.span(
        f"{request.method} {route}".strip(),
        kind="server",
        attributes=attributes,
        parent=tracing.extract(request.headers),
    ) as span:
        response = await handler(request)
        if span is not None:
            span.set_attribute("http.response.status_code", response.status)
            if response.status >= 500:
                tracing.set_error(span, f"answered {response.status}")
        return response


@web.middleware
async def request_id_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    request_id = request.headers.get("X-Request-ID", "")
    if not (0 < len(request_id) <= 100 and request_id.isprintable()):
        request_id = uuid.uuid4().hex
    token = request_id_var.set(request_id)  # every log line of this request carries it
    try:
        response = await handler(request)
    finally:
        request_id_var.reset(token)
    response.headers["X-Request-ID"] = request_id
    services = request.app.get(SERVICES)
    if services is not None:  # the problem middleware inside made every error a response
        services.metrics.http_responses.labels(str(response.status)).inc()
    return response
