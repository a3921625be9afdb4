"""The OpenAPI 3.1 document, served at ``GET /openapi.json``.

Generated, not kept by hand in a file: the paths and methods come from the routes the
application has really registered, the request bodies from the pydantic models
(``model_json_schema``), and only what code cannot tell is written here, per operation: its
summary, security, parameters and responses, and the schemas of the responses. A registered
route without an entry in ``OPERATIONS``, or an entry without a route, is an error when the
document is built, so the document cannot drift from the router.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import orjson
import pydantic
from aiohttp import web

from analysis_queue.core.client import CALLBACK_WINDOW_S, CoreRun
from analysis_queue.http import bodies as schemas
from analysis_queue.http import paging
from analysis_queue.http import routes as api
from analysis_queue.http.auth import MAX_USER_ID_LEN
from analysis_queue.models import EventKind

OPENAPI_VERSION = "3.1.0"
EVENT_STREAM = "text/event-stream"
# Methods aiohttp answers without a route of their own (HEAD for every GET).
IMPLICIT_METHODS = frozenset({"HEAD"})
# The request bodies, by the name the document gives their schema: generated from the models
# that parse them.
REQUEST_MODELS: dict[str, type[pydantic.BaseModel]] = {
    "AnalysisRequest": schemas.AnalysisRequest,
    "RecheckRequest": schemas.RecheckRequest,
    "CreditGrant": schemas.CreditGrant,
    "UserLimitRequest": schemas.UserLimitRequest,
    "CoreEvent": CoreRun,
}

routes = web.RouteTableDef()

RouteKey = tuple[str, str]  # (METHOD, path template)


class DocumentError(RuntimeError):
    """The routes and the operations described here disagree."""


# -- response schemas (hand-written: they are what ``Job.to_json`` and the handlers build) ----


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


_TIMESTAMP = {"type": "string", "format": "date-time"}
_UUID = {"type": "string", "format": "uuid"}

_SUMMARY_PROPERTIES: dict[str, Any] = {
    "id": _UUID,
    "run_id": _UUID,
    "status": {
        "type": "string",
        "enum": ["queued", "pending", "running", "succeeded", "failed", "cancelled"],
    },
    "queue_position": {
        "type": ["integer", "null"],
        "minimum": 1,
        "description": "1 = next; null unless queued.",
    },
    "waiting_for": {
        "type": ["string", "null"],
        "enum": ["your_previous_analysis", "provider_capacity", None],
        "description": "Why a queued job waits: its user's earlier analyses (their "
        "limit is reached), or the provider's global ceiling. null unless queued.",
    },
    "delta_of": {**_nullable(_UUID), "description": "The job a re-check re-checks."},
    "thesis": {
        "type": "object",
        "required": ["title", "document_url"],
        "properties": {
            "title": {"type": "string"},
            "document_url": {"type": "string"},
        },
    },
    "source_count": {"type": "integer", "minimum": 0},
    "verdict_counts": {
        "type": ["object", "null"],
        "additionalProperties": {"type": "integer", "minimum": 1},
        "description": "How many sources got each verdict; null until there are verdicts.",
    },
    "created_at": _TIMESTAMP,
    "promoted_at": _nullable(_TIMESTAMP),
    "started_at": _nullable(_TIMESTAMP),
    "finished_at": _nullable(_TIMESTAMP),
    "error": _nullable(
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["code", "detail"],
            "properties": {
                "code": {"type": "string"},
                "detail": {"type": ["string", "null"]},
            },
        }
    ),
}
_JOB_PROPERTIES: dict[str, Any] = {
    **_SUMMARY_PROPERTIES,
    "sources": {"type": "array", "items": {"type": "string"}},
    "verdicts": {"type": ["array", "null"], "items": _ref("Verdict")},
}

_EVENT_ID = {"type": "string", "pattern": "^[0-9]{1,19}$"}


def _sse_event(event: dict[str, Any], data: str, *, id_required: bool) -> dict[str, Any]:
    """One Server-Sent Event as a client parses it: its ``event`` name, its ``id`` (a position
    frame has none of its own; a parser carries the last one over), and ``data``, one line of
    JSON described by ``contentSchema``."""
    return {
        "type": "object",
        "required": ["event", "data", *(["id"] if id_required else [])],
        "properties": {
            "event": event,
            "id": _EVENT_ID,
            "retry": {"type": "integer", "minimum": 0},
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": _ref(data),
            },
        },
    }


_STORED_KINDS = [kind.value for kind in EventKind]

RESPONSE_SCHEMAS: dict[str, dict[str, Any]] = {
    "StreamEvent": {
        "description": "One event of `GET /v1/events`: a stored job event (with its id), a "
        "`position` frame (no id of its own), or the `snapshot` a stream starts with.",
        "oneOf": [
            _sse_event({"type": "string", "enum": _STORED_KINDS}, "JobEventData", id_required=True),
            _sse_event({"const": "position"}, "PositionData", id_required=False),
            _sse_event({"const": "snapshot"}, "SnapshotData", id_required=True),
        ],
    },
    "JobEventData": {
        "type": "object",
        "additionalProperties": False,
        "required": ["id", "kind", "at", "job"],
        "properties": {
            "id": {
                "type": "integer",
                "minimum": 1,
                "description": "The SSE id: per user, dense, in commit order.",
            },
            "kind": {"type": "string", "enum": _STORED_KINDS},
            "at": _TIMESTAMP,
            "job": {
                "anyOf": [_ref("JobSummary"), {"type": "null"}],
                "description": "The job's summary when the frame is sent (it can be ahead of "
                "the event); null if the job is gone.",
            },
        },
    },
    "PositionData": {
        "type": "object",
        "additionalProperties": False,
        "required": ["id", "kind", "at", "positions"],
        "properties": {
            "id": {"type": "null"},
            "kind": {"const": "position"},
            "at": _TIMESTAMP,
            "positions": {
                "type": "array",
                "maxItems": 500,
                "description": "The queued jobs whose position moved, and where they stand now.",
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["id", "queue_position"],
                    "properties": {
                        "id": _UUID,
                        "queue_position": {"type": "integer", "minimum": 1},
                    },
                },
            },
        },
    },
    "SnapshotData": {
        "type": "object",
        "additionalProperties": False,
        "required": ["id", "kind", "at", "analyses", "next"],
        "properties": {
            "id": {"type": "integer", "minimum": 0, "description": "The latest event id."},
            "kind": {"const": "snapshot"},
            "at": _TIMESTAMP,
            "analyses": {"type": "array", "items": _ref("JobSummary")},
            "next": {
                "type": ["string", "null"],
                "description": "The cursor of the page after these (`GET /v1/analyses?cursor=`); "
                "null: these are all.",
            },
        },
    },
    "Job": {
        "type": "object",
        "description": "An analysis job, whole: its summary with its sources and verdicts.",
        "additionalProperties": False,
        "required": list(_JOB_PROPERTIES),
        "properties": _JOB_PROPERTIES,
    },
    "JobSummary": {
        "type": "object",
        "description": "An analysis job without its sources and verdicts, as lists and event "
        "frames carry it (`GET /v1/analyses/{job_id}` has the whole job).",
        "additionalProperties": False,
        "required": list(_SUMMARY_PROPERTIES),
        "properties": _SUMMARY_PROPERTIES,
    },
    "JobList": {
        "type": "object",
        "additionalProperties": False,
        "required": ["analyses", "next"],
        "properties": {
            "analyses": {"type": "array", "items": _ref("JobSummary")},
            "next": {
                "type": ["string", "null"],
                "description": "The cursor of the next page (`?cursor=`); null on the last.",
            },
        },
    },
    "Problem": {
        "type": "object",
        "description": "RFC 9457 problem details, with a stable machine-readable `code`.",
        "required": ["type", "title", "status", "detail", "code"],
        "properties": {
            "type": {"type": "string", "format": "uri"},
            "title": {"type": "string"},
            "status": {"type": "integer", "minimum": 400, "maximum": 599},
            "detail": {"type": "string"},
            "code": {"type": "string"},
            "instance": {"type": "string"},
            "errors": {
                "type": "array",
                "description": "422 invalid_body: each offending field and what is wrong.",
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["field", "message"],
                    "properties": {"field": {"type": "string"}, "message": {"type": "string"}},
                },
            },
        },
    },
    "Credits": {
        "type": "object",
        "additionalProperties": False,
        # held is new in 0.2: a client of this release still reads a 0.1 server's answer.
        "required": ["balance"],
        "properties": {
            "balance": {"type": "integer", "minimum": 0},
            "held": {
                "type": "integer",
                "minimum": 0,
                "description": "Of the balance, what clicks still being admitted hold: a new "
                "click can spend `balance - held`.",
            },
        },
    },
    "CreditGrantResult": {
        "type": "object",
        "additionalProperties": False,
        "required": ["user_id", "balance"],
        "properties": {
            "user_id": {"type": "string", "maxLength": MAX_USER_ID_LEN},
            "balance": {"type": "integer", "minimum": 0},
        },
    },
    "Capacity": {
        "type": "object",
        "additionalProperties": False,
        "required": [
            "global_max_running",
            "slots_in_use",
            "jobs_waiting_for_capacity",
            "users_waiting_for_capacity",
        ],
        "properties": {
            "global_max_running": {
                "type": ["integer", "null"],
                "minimum": 1,
                "description": "The provider ceiling in force (AQ_GLOBAL_MAX_RUNNING); null: off.",
            },
            "slots_in_use": {"type": "integer", "minimum": 0},
            "jobs_waiting_for_capacity": {"type": "integer", "minimum": 0},
            "users_waiting_for_capacity": {"type": "integer", "minimum": 0},
        },
    },
    "UserLimit": {
        "type": "object",
        "additionalProperties": False,
        "required": ["user_id", "max_running", "default", "active", "queued"],
        "properties": {
            "user_id": {"type": "string", "maxLength": MAX_USER_ID_LEN},
            "max_running": {"type": "integer", "minimum": 1, "maximum": schemas.MAX_USER_LIMIT},
            "default": {"type": "boolean", "description": "true: no plan limit set (1)."},
            "active": {"type": "integer", "minimum": 0},
            "queued": {"type": "integer", "minimum": 0},
        },
    },
    "CoreEventOutcome": {
        "type": "object",
        "additionalProperties": False,
        "required": ["outcome"],
        "properties": {
            "outcome": {
                "type": "string",
                "examples": ["applied", "duplicate", "unknown_run", "not_finished"],
            }
        },
    },
    "Health": {
        "type": "object",
        "additionalProperties": False,
        "required": ["status"],
        "properties": {"status": {"type": "string", "enum": ["ok"]}},
    },
    "Readiness": {
        "type": "object",
        "additionalProperties": False,
        "required": ["status", "checks"],
        "properties": {
            "status": {"type": "string", "enum": ["ready", "not_ready"]},
            "checks": {
                "type": "object",
                "additionalProperties": False,
                "required": ["database", "listener", "migrations"],
                "properties": {
                    "database": {"type": "boolean"},
                    "listener": {"type": "boolean"},
                    "migrations": {"type": "boolean"},
                },
            },
        },
    },
}

SECURITY_SCHEMES: dict[str, dict[str, Any]] = {
    "userJwt": {
        "type": "http",
        "scheme": "bearer",
        "bearerFormat": "JWT",
        "description": "HS256, `sub` = user id, `exp` required; `iss` / `aud` required when "
        "`AQ_JWT_ISSUER` / `AQ_JWT_AUDIENCE` are set. `analysis-queue token USER` prints one.",
    },
    "adminToken": {
        "type": "http",
        "scheme": "bearer",
        "description": "The opaque `AQ_ADMIN_TOKEN` (`analysis-queue token --admin`).",
    },
}

# -- operations -----------------------------------------------------------------------------

_JOB_ID = {
    "name": "job_id",
    "in": "path",
    "required": True,
    "description": "The job's id. Not a UUID, unknown, deleted or another user's: 404.",
    "schema": _UUID,
}
_LIMIT = {
    "name": "limit",
    "in": "query",
    "required": False,
    "description": f"Jobs per page (default {paging.DEFAULT_LIMIT}).",
    "schema": {"type": "integer", "minimum": 1, "maximum": paging.MAX_LIMIT},
}
_CURSOR = {
    "name": "cursor",
    "in": "query",
    "required": False,
    "description": "The `next` of the previous page, as it came (opaque).",
    "schema": {"type": "string", "minLength": 1, "maxLength": 64},
}
_USER_ID = {
    "name": "user_id",
    "in": "path",
    "required": True,
    "description": "The user's id (the `sub` of their tokens).",
    "schema": {"type": "string", "minLength": 1, "maxLength": MAX_USER_ID_LEN},
}
_IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "description": "Replays the job admitted with the same key and body (`Idempotent-Replayed: "
    "true`); the same key with another body is 409 idempotency_key_reused.",
    "schema": {"type": "string", "minLength": 1, "maxLength": api.MAX_IDEMPOTENCY_KEY_LEN},
}
_CORE_HEADERS = [
    {
        "name": "X-Core-Timestamp",
        "in": "header",
        "required": True,
        "description": "Unix seconds when Core sent the callback; refused when more than "
        f"{int(CALLBACK_WINDOW_S)} s away from now (replay window).",
        "schema": {"type": "string", "pattern": "^[0-9]{1,12}$"},
    },
    {
        "name": "X-Core-Signature",
        "in": "header",
        "required": True,
        "description": '`sha256=` + hex HMAC-SHA256 of `"<timestamp>.<raw body>"` under '
        "`AQ_CORE_CALLBACK_SECRET`.",
        "schema": {"type": "string", "pattern": "^sha256=[0-9a-f]{64}$"},
    },
]

# What each problem status means, per operation kind; the codes are the stable `code` values.
_PROBLEMS: dict[int, str] = {
    400: "malformed_request: the body is not JSON (or not UTF-8), or a request repeats its "
    "Authorization, Idempotency-Key or Last-Event-ID header (with `errors`); invalid_parameter: "
    "a query parameter (with `errors`).",
    401: "unauthorized: missing, invalid or expired credentials.",
    402: "insufficient_credits.",
    404: "not_found.",
    408: "request_timeout: the body did not arrive within AQ_BODY_TIMEOUT_S.",
    409: "A conflict; see `code`.",
    413: "payload_too_large: the body exceeds 1 MiB; job_too_large: the thesis and sources "
    "together take more than `AQ_JOB_MAX_BYTES` (64 KiB by default; `limit_bytes` says).",
    415: "unsupported_media_type: the body must be application/json (UTF-8).",
    422: "invalid_body (with `errors`), or Core's refusal: invalid_source, unparseable_thesis.",
    429: "provider_budget_exhausted, or too_many_streams (event streams): try again later.",
    502: "core_run_gone.",
    503: "core_unavailable, database_unavailable, shutting_down or too_many_connections: try "
    "again shortly.",
}


@dataclass(frozen=True)
class Operation:
    """What the router cannot tell about one route."""

    operation_id: str
    summary: str
    # success status -> a JSON response's schema name, or the media type(s) of a text answer
    ok: dict[int, str]
    problems: tuple[int, ...]
    security: str | None = "userJwt"
    body: type[pydantic.BaseModel] | str | None = None  # a request model or a schema name
    parameters: tuple[dict[str, Any], ...] = ()
    ok_headers: dict[str, dict[str, Any]] = field(default_factory=dict)
    description: str = ""
    tag: str = "analyses"
    # A text/event-stream answer: the schema of each of its events (OpenAPI 3.1 reads
    # ``schema`` of a sequential media type per item, as schemathesis does).
    event_schema: str | None = None


_CREATED_HEADERS = {
    "Location": {
        "required": True,
        "description": "The new job's URL.",
        "schema": {"type": "string"},
    },
}

OPERATIONS: dict[RouteKey, Operation] = {
    ("POST", "/v1/analyses"): Operation(
        "createAnalysis",
        "Admit an analysis: debit, create a held run in Core, queue it",
        {201: "Job"},
        (400, 401, 402, 409, 413, 415, 422, 429, 503),
        body=schemas.AnalysisRequest,
        parameters=(_IDEMPOTENCY_KEY,),
        ok_headers={
            **_CREATED_HEADERS,
            "Idempotent-Replayed": {
                "required": False,
                "description": "`true` when this answer replays an earlier admit.",
                "schema": {"type": "string", "enum": ["true"]},
            },
        },
        description="Each click is admitted at once or refused synchronously; admitted jobs "
        "run one at a time per user, in admission order.",
    ),
    ("GET", "/v1/analyses"): Operation(
        "listAnalyses",
        "A page of the caller's jobs as summaries, newest first",
        {200: "JobList"},
        (400, 401, 503),
        parameters=(_LIMIT, _CURSOR),
        description="Follow `next` (`?cursor=`) for the page after; a job admitted while "
        "paging comes before the first page and never shifts a later one.",
    ),
    ("GET", "/v1/analyses/{job_id}"): Operation(
        "getAnalysis",
        "One of the caller's jobs",
        {200: "Job"},
        (401, 404, 503),
        parameters=(_JOB_ID,),
    ),
    ("DELETE", "/v1/analyses/{job_id}"): Operation(
        "deleteAnalysis",
        "Soft-delete a job: cancel (and refund) what has not run, cancel a running one in Core",
        {200: "Job"},
        (401, 404, 503),
        description="The job leaves `GET /v1/analyses` and the stream's snapshot; one that "
        "had not ended is cancelled first, as `POST /v1/analyses/{job_id}/cancel` does. A "
        "pending or running job is cancelled in Core first: its slot frees only once Core "
        "stopped the run, and while Core cannot be told the answer is 503 core_unavailable and "
        "the job goes on.",
        parameters=(_JOB_ID,),
    ),
    ("POST", "/v1/analyses/{job_id}/cancel"): Operation(
        "cancelAnalysis",
        "Cancel a job and keep it listed: refund what has not run, cancel a running one in Core",
        {200: "Job"},
        (401, 404, 409, 503),
        description="The job ends `cancelled` (error `cancelled_by_user`) and stays in "
        "`GET /v1/analyses` and the event stream. A pending or running job is cancelled in Core "
        "first: its slot frees only once Core stopped the run, and while Core cannot be told the "
        "answer is 503 core_unavailable and the job goes on. Idempotent: a cancelled job is "
        "answered as it is; a succeeded or failed one is 409 conflict.",
        parameters=(_JOB_ID,),
    ),
    ("POST", "/v1/analyses/{job_id}/rechecks"): Operation(
        "createRecheck",
        "Re-check a succeeded job against new sources (never queued)",
        {201: "Job"},
        (400, 401, 402, 404, 409, 413, 415, 422, 429, 503),
        body=schemas.RecheckRequest,
        parameters=(_JOB_ID,),
        ok_headers=_CREATED_HEADERS,
    ),
    ("GET", "/v1/credits"): Operation(
        "getCredits", "The caller's credit balance", {200: "Credits"}, (401, 503), tag="credits"
    ),
    ("POST", "/v1/admin/credits"): Operation(
        "grantCredits",
        "Grant credits to a user (admin)",
        {200: "CreditGrantResult"},
        (400, 401, 413, 415, 422, 503),
        security="adminToken",
        body=schemas.CreditGrant,
        tag="credits",
    ),
    ("GET", "/v1/admin/capacity"): Operation(
        "getCapacity",
        "The provider ceiling, slots in use and who waits for capacity (admin)",
        {200: "Capacity"},
        (401, 503),
        security="adminToken",
        tag="capacity",
    ),
    ("GET", "/v1/admin/users/{user_id}/limit"): Operation(
        "getUserLimit",
        "How many of a user's analyses may run at once (admin)",
        {200: "UserLimit"},
        (401, 404, 503),
        security="adminToken",
        parameters=(_USER_ID,),
        tag="capacity",
    ),
    ("PUT", "/v1/admin/users/{user_id}/limit"): Operation(
        "setUserLimit",
        "Set how many of a user's analyses may run at once (admin)",
        {200: "UserLimit"},
        (400, 401, 404, 413, 415, 422, 503),
        security="adminToken",
        body=schemas.UserLimitRequest,
        parameters=(_USER_ID,),
        description="Still first in, first out within the user. Raising it starts waiting jobs "
        "at once (or, with the provider ceiling on, makes them wait for capacity); lowering it "
        "lets running jobs finish. `max_running: null` restores the default of 1.",
        tag="capacity",
    ),
    ("POST", "/v1/core/events"): Operation(
        "coreEvent",
        "Core's signed callback when a run ends",
        {200: "CoreEventOutcome"},
        (400, 401, 413, 503),
        security=None,
        body="CoreEvent",
        parameters=tuple(_CORE_HEADERS),
        description="Core is trusted only through this signature: an unsigned, wrongly signed "
        f"or stale (more than {int(CALLBACK_WINDOW_S)} s) callback is 401 invalid_signature. "
        "Missing, malformed or stale signature headers are refused before the body is read. "
        "Events are idempotent; an unknown run is acknowledged (200 unknown_run).",
        tag="core",
    ),
    ("GET", "/metrics"): Operation(
        "metrics",
        "Prometheus metrics of this instance (open jobs from the database, counters since start)",
        {200: "text/plain"},
        (401, 503),
        security=None,
        description="When `AQ_METRICS_TOKEN` is set, it must come as `Authorization: Bearer` "
        "(401 otherwise). The gauges read from the database are at most `AQ_METRICS_CACHE_S` "
        "(5 s) old: scrapes more frequent than that do not reach the database.",
        tag="health",
    ),
    ("GET", "/healthz"): Operation(
        "healthz", "Liveness", {200: "Health"}, (), security=None, tag="health"
    ),
    ("GET", "/readyz"): Operation(
        "readyz",
        "Readiness: database reachable, LISTEN connection up, migrations applied",
        {200: "Readiness", 503: "Readiness"},
        (),
        security=None,
        tag="health",
    ),
    ("GET", "/v1/events"): Operation(
        "eventStream",
        "The caller's job changes as Server-Sent Events",
        {200: "text/event-stream"},
        (401, 429, 503),
        event_schema="StreamEvent",
        parameters=(
            {
                "name": "Last-Event-ID",
                "in": "header",
                "required": False,
                "description": "Resume after this event id; absent, unknown or pruned: a "
                "snapshot frame first.",
                "schema": {"type": "string"},
            },
            {
                "name": "last_event_id",
                "in": "query",
                "required": False,
                "description": "The same, for clients that cannot set headers.",
                "schema": {"type": "string"},
            },
            {
                "name": "access_token",
                "in": "query",
                "required": False,
                "description": "The Bearer JWT, for EventSource (which cannot set headers); "
                "accepted on this route only.",
                "schema": {"type": "string"},
            },
        ),
        description=(
            "A stream that does not end. Each frame is `id: <event id>` (absent on `position` "
            "frames), `event: <kind>` and one `data:` line of JSON "
            '`{"id", "kind", "at", "job"}` where `job` is the job\'s summary (JobSummary) as '
            "`GET /v1/analyses` lists it when the frame is sent. Kinds: `admitted`, "
            "`promoted`, `started`, `finished`, `cancelled`, `deleted`, `changed`; `waiting` "
            "when a queued job's `waiting_for` changed; `position` "
            '(`{"id": null, "kind", "at", "positions": [{"id", "queue_position"}, ...]}`) when '
            "jobs ahead left the queue; `snapshot` "
            '(`{"id", "kind", "at", "analyses": [summary, ...], "next"}`, the first page of '
            "`GET /v1/analyses` and its cursor) first when there is no usable Last-Event-ID. "
            "Event ids increase per user in commit order; reconnect with `Last-Event-ID` to "
            "receive what was missed, then the live stream. Idle streams get a `: keepalive` "
            "comment every 15 s. A stream ends after 30 minutes (reconnect with Last-Event-ID: "
            "nothing is lost). At most 20 streams per user are open at once (429 "
            "too_many_streams, with Retry-After). Each event is described by StreamEvent."
        ),
        tag="events",
    ),
    ("GET", "/"): Operation(
        "dashboard", "The dashboard page", {200: "text/html"}, (), security=None, tag="dashboard"
    ),
    ("GET", "/static/{name}"): Operation(
        "dashboardFile",
        "The dashboard's script, style sheet and icon",
        {200: "text/javascript, text/css, image/svg+xml"},
        (404,),
        security=None,
        parameters=(
            {
                "name": "name",
                "in": "path",
                "required": True,
                "schema": {"type": "string"},
                "description": "`app.js`, `app.css` or `favicon.svg`; anything else is 404.",
            },
        ),
        tag="dashboard",
    ),
    ("GET", "/openapi.json"): Operation(
        "openapi", "This document", {200: "OpenApiDocument"}, (), security=None, tag="meta"
    ),
}


# -- building -------------------------------------------------------------------------------


def route_keys(app: web.Application) -> tuple[RouteKey, ...]:
    """(METHOD, path template) of every route registered in ``app``, implicit HEADs aside."""
    keys = {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.resource is not None and route.method not in IMPLICIT_METHODS
    }
    return tuple(sorted(keys))


def _request_schemas() -> dict[str, dict[str, Any]]:
    """The request models' JSON schemas, their nested models hoisted into components."""
    components: dict[str, dict[str, Any]] = {}
    for name, model in REQUEST_MODELS.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[name] = schema
    return components


def _problem_response(status: int) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": _PROBLEMS[status],
        "content": {"application/problem+json": {"schema": _ref("Problem")}},
    }
    if status == 401:
        response["headers"] = {"WWW-Authenticate": {"required": True, "schema": {"type": "string"}}}
    return response


def _operation(key: RouteKey, op: Operation) -> dict[str, Any]:
    responses: dict[str, Any] = {}
    for status, answer in op.ok.items():
        content = (
            {
                media.strip(): {"schema": _text_schema(op, media.strip())}
                for media in answer.split(",")
            }
            if "/" in answer
            else {"application/json": {"schema": _ref(answer)}}
        )
        response: dict[str, Any] = {
            "description": op.summary if status < 400 else "Not ready; see `checks`.",
            "content": content,
        }
        if op.ok_headers and status < 400:
            response["headers"] = op.ok_headers
        responses[str(status)] = response
    # A body is read within AQ_BODY_TIMEOUT_S (http/routes.py::_read_body).
    statuses = (*op.problems, 408) if op.body is not None else op.problems
    for status in statuses:
        responses[str(status)] = _problem_response(status)
    spec: dict[str, Any] = {
        "operationId": op.operation_id,
        "summary": op.summary,
        "tags": [op.tag],
        "security": [{op.security: []}] if op.security else [],
        "responses": responses,
    }
    if op.description:
        spec["description"] = op.description
    if op.parameters:
        spec["parameters"] = list(op.parameters)
    if op.body is not None:
        name = op.body if isinstance(op.body, str) else op.body.__name__
        spec["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _ref(name)}},
        }
    missing = [p for p in _path_params(key[1]) if p not in {q["name"] for q in op.parameters}]
    if missing:
        raise DocumentError(f"{key[0]} {key[1]}: path parameters {missing} are not described")
    return spec


def _text_schema(op: Operation, media: str) -> dict[str, Any]:
    if media == EVENT_STREAM and op.event_schema is not None:
        return _ref(op.event_schema)
    return {"type": "string"}


def _path_params(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{") and part.endswith("}")]


def _version() -> str:
    try:
        return metadata.version("analysis-queue")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0.0.0"


def build_document(keys: Iterable[RouteKey]) -> dict[str, Any]:
    """The OpenAPI document of exactly these routes. Raises :class:`DocumentError` if a route is
    not described in ``OPERATIONS`` or a description has no route."""
    return _build(tuple(sorted(set(keys))))


@functools.cache
def _serialized(keys: tuple[RouteKey, ...]) -> bytes:
    """What ``GET /openapi.json`` sends: built once per set of routes."""
    return orjson.dumps(_build(keys))


def _build(keys: tuple[RouteKey, ...]) -> dict[str, Any]:
    undocumented = [k for k in keys if k not in OPERATIONS]
    unrouted = [k for k in OPERATIONS if k not in keys]
    if undocumented or unrouted:
        raise DocumentError(
            f"routes without an OpenAPI description: {undocumented}; "
            f"descriptions without a route: {unrouted}"
        )
    paths: dict[str, dict[str, Any]] = {}
    for method, path in keys:
        paths.setdefault(path, {})[method.lower()] = _operation(
            (method, path), OPERATIONS[(method, path)]
        )
    component_schemas = {
        **_request_schemas(),
        **RESPONSE_SCHEMAS,
        "OpenApiDocument": {"type": "object", "required": ["openapi", "info", "paths"]},
    }
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "analysis-queue",
            "version": _version(),
            "description": "A per-user analysis queue: every click is admitted or refused at "
            "once, admitted analyses run one at a time per user in admission order. Errors are "
            "application/problem+json with a stable `code`.",
        },
        "tags": [
            {"name": name}
            for name in ("analyses", "events", "credits", "core", "health", "dashboard", "meta")
        ],
        "paths": paths,
        "components": {"schemas": component_schemas, "securitySchemes": SECURITY_SCHEMES},
    }


@routes.get("/openapi.json")
async def openapi_json(request: web.Request) -> web.Response:
    """Built from this application's router on first use, then served from memory."""
    return web.Response(body=_serialized(route_keys(request.app)), content_type="application/json")
