"""Hostile input, table-driven: every row is one request a client should never send, answered
with the right 4xx as application/problem+json, leaking nothing, and leaving the database as it
was (rows in analysis_jobs, credit_ledger, core_run_reservations and credit_accounts, and the
balances) with Core never asked.

The caller of the user routes holds credits, so an input that slipped past the edge would show
up as a new job and a debit. Strings that are legitimately accepted (SQL in a title or in a user
id is just text) are sent by a caller without credits, and are shown to be stored verbatim by
the last tests.
"""

from __future__ import annotations

import asyncio
import io
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import asyncpg
import jwt
import orjson
import pytest
import pytest_asyncio
from aiohttp import ClientSession
from analysis_queue.dev.core_sim import CoreSimulator
from support import (
    ADMIN_TOKEN,
    CALLBACK_SECRET,
    JWT_SECRET,
    Harness,
    Instance,
    check_invariants,
    fetch,
    fetchval,
    thesis_body,
    with_database,
)

PROBLEM_JSON = "application/problem+json"
SQL = "'; DROP TABLE analysis_jobs; --"
CRLF = "\r\nX-Injected: 1"
RICH = "rich"  # holds credits: anything admitted by mistake would leave a job and a debit
BROKE = "broke"  # holds none: text that is legitimately accepted still stops at 402
TEN_MB = 10 * 1024 * 1024
LEAKS = (
    "Traceback",
    'File "',
    "asyncpg",
    "psycopg",
    "SELECT ",
    "INSERT ",
    "UPDATE ",
    "syntax error",
    JWT_SECRET,
    ADMIN_TOKEN,
    CALLBACK_SECRET,
)


@dataclass(frozen=True)
class Hostile:
    """One request: JSON (``json``) or raw bytes (``data``), as ``user`` (a JWT ``sub``), the
    admin, or a prepared Authorization header."""

    method: str
    path: str
    status: int
    code: str
    json: Any = None
    data: bytes | None = None
    content_type: str | None = "application/json"
    user: str | None = RICH
    admin: bool = False
    authorization: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    chunked: bool = False


def _analysis(**thesis: str) -> dict[str, Any]:
    body = thesis_body(1)
    body["thesis"].update(thesis)
    return body


def _sources(*sources: str) -> dict[str, Any]:
    return {**thesis_body(1), "sources": ["10.1000/ok.1", *sources]}


def _grant(**fields: Any) -> dict[str, Any]:
    return {"user_id": "someone", "amount": 1, **fields}


def _token(sub: Any) -> str:
    now = int(time.time())
    return "Bearer " + jwt.encode({"sub": sub, "exp": now + 600}, JWT_SECRET, algorithm="HS256")


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _nested_in_title(depth: int) -> bytes:
    return (
        b'{"thesis": {"title": ' + _nested(depth) + b', "document_url": "https://x.example/a.pdf"}}'
    )


def _raw_number(literal: bytes) -> bytes:
    return b'{"user_id": "someone", "amount": ' + literal + b"}"


VALID = orjson.dumps(thesis_body(1))
RECHECK = f"/v1/analyses/{uuid.uuid4()}/rechecks"
GRANT = "/v1/admin/credits"
CREATE = "/v1/analyses"


def _admin(body: Any, status: int = 422, code: str = "invalid_body") -> Hostile:
    return Hostile("POST", GRANT, status, code, json=body, user=None, admin=True)


CASES: dict[str, Hostile] = {
    # -- content types ----------------------------------------------------------------------
    "text_plain": Hostile(
        "POST", CREATE, 415, "unsupported_media_type", data=VALID, content_type="text/plain"
    ),
    "form_urlencoded": Hostile(
        "POST",
        CREATE,
        415,
        "unsupported_media_type",
        data=b"thesis=x&sources=y",
        content_type="application/x-www-form-urlencoded",
    ),
    "multipart": Hostile(
        "POST",
        CREATE,
        415,
        "unsupported_media_type",
        data=VALID,
        content_type="multipart/form-data; boundary=x",
    ),
    "no_content_type": Hostile(
        "POST", CREATE, 415, "unsupported_media_type", data=VALID, content_type=None
    ),
    "json_latin1": Hostile(
        "POST",
        CREATE,
        415,
        "unsupported_media_type",
        data=VALID,
        content_type="application/json; charset=latin-1",
    ),
    "json_lookalike": Hostile(
        "POST",
        CREATE,
        415,
        "unsupported_media_type",
        data=VALID,
        content_type="application/json-patch+json",
    ),
    "admin_text_plain": Hostile(
        "POST",
        GRANT,
        415,
        "unsupported_media_type",
        data=orjson.dumps(_grant()),
        content_type="text/plain",
        user=None,
        admin=True,
    ),
    # -- not JSON, not UTF-8 ------------------------------------------------------------------
    "invalid_utf8": Hostile(
        "POST",
        CREATE,
        400,
        "malformed_request",
        data=VALID.replace(b"Thesis 1", b"Thesis \xff\xfe"),
    ),
    "overlong_utf8": Hostile(
        "POST",
        CREATE,
        400,
        "malformed_request",
        data=VALID.replace(b"Thesis 1", b"Thesis \xc0\xaf"),
    ),
    "lone_surrogate": Hostile(
        "POST", CREATE, 400, "malformed_request", data=VALID.replace(b"Thesis 1", b"Thesis \\ud800")
    ),
    "utf16": Hostile(
        "POST", CREATE, 400, "malformed_request", data=VALID.decode().encode("utf-16")
    ),
    "empty_body": Hostile("POST", CREATE, 400, "malformed_request", data=b""),
    "truncated": Hostile("POST", CREATE, 400, "malformed_request", data=VALID[:-3]),
    "nan": Hostile(
        "POST", GRANT, 400, "malformed_request", data=_raw_number(b"NaN"), user=None, admin=True
    ),
    # -- size and depth -----------------------------------------------------------------------
    "10mb_body": Hostile(
        "POST", CREATE, 413, "payload_too_large", data=b'{"x": "' + b"a" * TEN_MB + b'"}'
    ),
    "10mb_chunked": Hostile(
        "POST",
        CREATE,
        413,
        "payload_too_large",
        data=b'{"x": "' + b"a" * TEN_MB + b'"}',
        chunked=True,
    ),
    "10mb_admin": Hostile(
        "POST", GRANT, 413, "payload_too_large", data=b" " * TEN_MB, user=None, admin=True
    ),
    # Refused on its headers, before the body is read (a signed one over 1 MiB is 413:
    # test_edge_refusals.py, which can sign at the moment of sending).
    "10mb_callback_unsigned": Hostile(
        "POST", "/v1/core/events", 401, "invalid_signature", data=b" " * TEN_MB, user=None
    ),
    "nested_100k": Hostile("POST", CREATE, 400, "malformed_request", data=_nested(100_000)),
    "nested_100k_in_field": Hostile(
        "POST", CREATE, 400, "malformed_request", data=_nested_in_title(100_000)
    ),
    "nested_100k_recheck": Hostile(
        "POST", RECHECK, 400, "malformed_request", data=_nested(100_000)
    ),
    "201_sources": Hostile("POST", CREATE, 422, "invalid_body", json=thesis_body(1, sources=201)),
    "long_title": Hostile("POST", CREATE, 422, "invalid_body", json=_analysis(title="x" * 501)),
    "long_source": Hostile(
        "POST", CREATE, 422, "invalid_body", json=_sources("https://x.example/" + "a" * 2000)
    ),
    # -- numbers --------------------------------------------------------------------------------
    "amount_1e400": Hostile(
        "POST", GRANT, 400, "malformed_request", data=_raw_number(b"1e400"), user=None, admin=True
    ),
    "amount_10_pow_1000": Hostile(
        "POST",
        GRANT,
        400,
        "malformed_request",
        data=_raw_number(str(10**1000).encode()),
        user=None,
        admin=True,
    ),
    "amount_2_pow_64": Hostile(
        "POST",
        GRANT,
        422,
        "invalid_body",
        data=_raw_number(str(2**64).encode()),
        user=None,
        admin=True,
    ),
    "amount_2_pow_63": _admin(_grant(amount=2**63)),
    "amount_zero": _admin(_grant(amount=0)),
    "amount_negative": _admin(_grant(amount=-1)),
    "amount_very_negative": _admin(_grant(amount=-(2**62))),
    "amount_over_max": _admin(_grant(amount=1_000_001)),
    "amount_float": _admin(_grant(amount=1.5)),
    "amount_float_integral": _admin(_grant(amount=5.0)),
    "amount_string": _admin(_grant(amount="5")),
    "amount_bool": _admin(_grant(amount=True)),
    "amount_null": _admin(_grant(amount=None)),
    # -- injection strings in every string field ------------------------------------------------
    "sql_document_url": Hostile(
        "POST", CREATE, 422, "invalid_body", json=_analysis(document_url=SQL)
    ),
    "crlf_document_url": Hostile(
        "POST",
        CREATE,
        422,
        "invalid_body",
        json=_analysis(document_url="https://x.example/a.pdf" + CRLF),
    ),
    "crlf_title": Hostile("POST", CREATE, 422, "invalid_body", json=_analysis(title="T" + CRLF)),
    "nul_title": Hostile("POST", CREATE, 422, "invalid_body", json=_analysis(title="T\x00")),
    "sql_source": Hostile("POST", CREATE, 422, "invalid_body", json=_sources(SQL)),
    "crlf_source": Hostile("POST", CREATE, 422, "invalid_body", json=_sources("10.1000/x" + CRLF)),
    "sql_recheck_source": Hostile("POST", RECHECK, 422, "invalid_body", json={"sources": [SQL]}),
    "crlf_recheck_source": Hostile(
        "POST", RECHECK, 422, "invalid_body", json={"sources": ["https://x.example/" + CRLF]}
    ),
    "crlf_grant_user_id": _admin(_grant(user_id="someone" + CRLF)),
    "nul_grant_user_id": _admin(_grant(user_id="some\x00one")),
    "crlf_grant_note": _admin(_grant(note="note" + CRLF)),
    "nul_grant_note": _admin(_grant(note="\x00")),
    "sql_field_name": Hostile(
        "POST", CREATE, 422, "invalid_body", json={**thesis_body(1), SQL + CRLF: 1}
    ),
    "sql_title_no_credit": Hostile(
        "POST", CREATE, 402, "insufficient_credits", json=_analysis(title=SQL), user=BROKE
    ),
    "sql_sub": Hostile(
        "POST",
        CREATE,
        402,
        "insufficient_credits",
        json=thesis_body(1),
        user=None,
        authorization=_token(SQL),
    ),
    "crlf_sub": Hostile(
        "POST",
        CREATE,
        401,
        "unauthorized",
        json=thesis_body(1),
        user=None,
        authorization=_token("rich" + CRLF),
    ),
    "nul_sub": Hostile(
        "POST",
        CREATE,
        401,
        "unauthorized",
        json=thesis_body(1),
        user=None,
        authorization=_token("rich\x00"),
    ),
    "long_sub": Hostile(
        "GET", "/v1/credits", 401, "unauthorized", user=None, authorization=_token("r" * 201)
    ),
    "numeric_sub": Hostile(
        "GET", "/v1/credits", 401, "unauthorized", user=None, authorization=_token(12345)
    ),
    "sql_admin_token": Hostile(
        "POST", GRANT, 401, "unauthorized", json=_grant(), user=None, authorization="Bearer " + SQL
    ),
    "user_jwt_as_admin": Hostile("POST", GRANT, 401, "unauthorized", json=_grant(amount=10)),
    # -- ids, keys, methods -------------------------------------------------------------------
    "sql_job_id": Hostile("GET", f"{CREATE}/{quote(SQL)}", 404, "not_found"),
    "sql_job_id_delete": Hostile("DELETE", f"{CREATE}/{quote(SQL)}", 404, "not_found"),
    "sql_job_id_recheck": Hostile(
        "POST", f"{CREATE}/{quote(SQL)}/rechecks", 404, "not_found", json={"sources": ["10.1000/x"]}
    ),
    "crlf_job_id": Hostile("GET", f"{CREATE}/{quote(CRLF)}", 404, "not_found"),
    "int_job_id": Hostile("DELETE", f"{CREATE}/1", 404, "not_found"),
    "uuid_like_job_id": Hostile("GET", f"{CREATE}/{'0' * 31}g", 404, "not_found"),
    "long_idempotency_key": Hostile(
        "POST",
        CREATE,
        422,
        "invalid_body",
        json=thesis_body(1),
        headers={"Idempotency-Key": "k" * 201},
    ),
    "very_long_idempotency_key": Hostile(
        "POST",
        CREATE,
        422,
        "invalid_body",
        json=thesis_body(1),
        headers={"Idempotency-Key": "k" * 8000},
    ),
    "sql_idempotency_key_no_credit": Hostile(
        "POST",
        CREATE,
        402,
        "insufficient_credits",
        json=thesis_body(1),
        user=BROKE,
        headers={"Idempotency-Key": SQL},
    ),
    "put_on_collection": Hostile("PUT", CREATE, 405, "method_not_allowed", json=thesis_body(1)),
    "patch_on_credits": Hostile("PATCH", "/v1/credits", 405, "method_not_allowed", json={}),
    "unknown_path": Hostile("GET", "/v1/analyses/x/y/z", 404, "not_found"),
    "top_level_array": Hostile("POST", CREATE, 422, "invalid_body", json=[thesis_body(1)]),
    "top_level_string": Hostile("POST", CREATE, 422, "invalid_body", json=SQL),
}


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    content_type: str
    raw: bytes


async def _send(h: Harness, instance: Instance, case: Hostile) -> Reply:
    headers = dict(case.headers)
    if case.content_type is not None:
        headers["Content-Type"] = case.content_type
    if case.authorization is not None:
        headers["Authorization"] = case.authorization
    elif case.admin:
        headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
    elif case.user is not None:
        headers.update(h.auth(case.user))
    data: Any = case.data
    if case.json is not None:
        data = orjson.dumps(case.json)
    if case.chunked and data is not None:
        payload = data

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(0, len(payload), 64 * 1024):
                yield payload[i : i + 64 * 1024]

        data = chunks()
    elif isinstance(data, bytes) and len(data) > 1024 * 1024:
        data = io.BytesIO(data)  # sized, so still sent with a Content-Length
    elif data is None and case.content_type is None:
        data = b""
    if case.content_type is None and "Content-Type" not in headers:
        # aiohttp would label raw bytes application/octet-stream; send no type at all.
        headers["Content-Type"] = ""
    async with h.http.request(
        case.method, f"{instance.base_url}{case.path}", data=data, headers=headers
    ) as r:
        return Reply(r.status, dict(r.headers), r.content_type, await r.read())


async def _snapshot(h: Harness) -> dict[str, Any]:
    counts = await fetch(
        h.database_url,
        """SELECT (SELECT count(*) FROM analysis_jobs) AS jobs,
                  (SELECT count(*) FROM credit_ledger) AS ledger,
                  (SELECT count(*) FROM core_run_reservations) AS reservations,
                  (SELECT count(*) FROM credit_accounts) AS accounts,
                  (SELECT coalesce(sum(balance), 0) FROM credit_accounts) AS balances""",
    )
    return {**dict(counts[0]), "core_runs": len(h.sim.runs_snapshot())}


@dataclass
class Shared:
    harness: Harness
    instance: Instance


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared(
    pg_server: str, template_db: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Shared]:
    """One database and one instance for the whole table: no row of it may change anything, and
    each row checks exactly that, so they need not pay for a fresh database each."""
    name = f"aq_hostile_{os.getpid()}"
    await _admin(pg_server, f"CREATE DATABASE {name} TEMPLATE {template_db}")
    sim = CoreSimulator(callback_secret=CALLBACK_SECRET, judge_time_s=0.05)
    await sim.start()
    h = Harness(
        with_database(pg_server, name), tmp_path_factory.mktemp("hostile"), sim, ClientSession()
    )
    try:
        instance = await _ready_instance(h)
        yield Shared(h, instance)
    finally:
        await h.close()
        await _admin(pg_server, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


async def _admin(dsn: str, sql: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def _ready_instance(h: Harness) -> Instance:
    instance = await h.start_instance()
    await asyncio.wait_for(instance.services.sweeper.pass_done.wait(), 10)
    await h.grant(RICH, 5)
    return instance


@pytest.fixture
async def instance(harness: Harness) -> Instance:
    return await _ready_instance(harness)


def _assert_problem(reply: Reply, case: Hostile) -> dict[str, Any]:
    assert (reply.status, reply.content_type) == (case.status, PROBLEM_JSON), reply
    body = orjson.loads(reply.raw)
    assert isinstance(body, dict), body
    for key in ("type", "title", "status", "detail", "code"):
        assert key in body, (key, body)
    assert body["status"] == case.status and body["code"] == case.code, body
    assert body["type"].endswith("/" + case.code), body
    text = reply.raw.decode()
    for leak in LEAKS:
        assert leak not in text, (leak, body)
    assert "X-Injected" not in reply.headers, reply.headers
    return body


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
async def test_hostile_request_is_refused_with_a_problem_and_changes_nothing(
    shared: Shared, case: Hostile
) -> None:
    harness = shared.harness
    before = await _snapshot(harness)

    reply = await _send(harness, shared.instance, case)

    body = _assert_problem(reply, case)
    if case.code == "invalid_body" and case.json is not None:
        fields = [e["field"] for e in body.get("errors", [])]
        assert fields, body
        assert all(len(f) <= 100 and "\r" not in f and "\n" not in f for f in fields), fields
        assert fields[0] in body["detail"] or "Idempotency-Key" in body["detail"], body
    if case.status == 405:
        assert reply.headers.get("Allow"), reply.headers
    if case.status == 401:
        scheme = "HMAC-SHA256" if case.code == "invalid_signature" else "Bearer"
        assert reply.headers.get("WWW-Authenticate", "").startswith(scheme), reply.headers
    assert await _snapshot(harness) == before
    await check_invariants(harness.database_url)


def test_every_string_field_is_attacked() -> None:
    """The table covers SQL and header injection in each string field of each body model, the
    JWT's ``sub`` and the ids and keys in the URL and headers."""
    attacked = {
        "thesis.title": {"crlf_title", "sql_title_no_credit"},
        "thesis.document_url": {"sql_document_url", "crlf_document_url"},
        "sources": {"sql_source", "crlf_source"},
        "recheck.sources": {"sql_recheck_source", "crlf_recheck_source"},
        "grant.user_id": {"crlf_grant_user_id"},  # SQL: test_sql_text_is_stored_verbatim
        "grant.note": {"crlf_grant_note"},  # SQL: test_sql_text_is_stored_verbatim
        "jwt.sub": {"sql_sub", "crlf_sub"},
        "job_id": {"sql_job_id", "crlf_job_id"},
        "Idempotency-Key": {"sql_idempotency_key_no_credit", "long_idempotency_key"},
    }
    for target, ids in attacked.items():
        assert ids <= set(CASES), (target, ids - set(CASES))


async def test_sql_text_is_stored_verbatim_and_harms_nothing(
    harness: Harness, instance: Instance
) -> None:
    """Text fields may hold anything printable: the queries are parameterised, so SQL is data."""
    h = harness
    async with h.http.post(
        f"{instance.base_url}{GRANT}",
        json={"user_id": SQL, "amount": 2, "note": SQL},
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    ) as r:
        assert r.status == 200, await r.text()
        assert await r.json() == {"user_id": SQL, "balance": 2}
    async with h.http.post(
        f"{instance.base_url}{CREATE}",
        json=_analysis(title=SQL),
        headers={"Authorization": _token(SQL), "Idempotency-Key": SQL},
    ) as r:
        assert r.status == 201, await r.text()
        job = await r.json()
    assert job["thesis"]["title"] == SQL

    rows = await fetch(h.database_url, "SELECT user_id, thesis, idempotency_key FROM analysis_jobs")
    assert [(r["user_id"], r["idempotency_key"]) for r in rows] == [(SQL, SQL)]
    notes = await fetch(
        h.database_url, "SELECT note FROM credit_ledger WHERE user_id = $1 AND kind = 'grant'", SQL
    )
    assert [r["note"] for r in notes] == [SQL]
    assert await fetchval(h.database_url, "SELECT to_regclass('analysis_jobs') IS NOT NULL")
    async with h.http.get(
        f"{instance.base_url}{CREATE}/{job['id']}", headers={"Authorization": _token(SQL)}
    ) as r:
        assert r.status == 200 and (await r.json())["thesis"]["title"] == SQL
    async with h.http.get(f"{instance.base_url}{CREATE}/{job['id']}", headers=h.auth(RICH)) as r:
        assert r.status == 404, "another user's job, whatever its owner's name"
    await check_invariants(h.database_url)
