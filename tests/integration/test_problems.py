"""Errors as HTTP answers: every error of the service becomes problem+json with its status,
through a real aiohttp server (``http/problems.py``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from analysis_queue import errors
from analysis_queue.http.problems import problem_middleware, status_of


def _subclasses(cls: type[errors.AppError]) -> list[type[errors.AppError]]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_subclasses(sub))
    return out


APP_ERRORS: list[type[errors.AppError]] = [errors.AppError, *_subclasses(errors.AppError)]
PROBLEM_KEYS = {"type", "title", "status", "detail", "code"}


def _name(cls: type[errors.AppError]) -> str:
    return cls.__name__


async def _problem(raise_: BaseException, path: str = "/boom") -> tuple[int, dict[str, str], Any]:
    async def handler(_request: web.Request) -> web.Response:
        raise raise_

    app = web.Application(middlewares=[problem_middleware])
    app.router.add_get("/boom", handler)
    server = TestServer(app)
    client: TestClient[web.Request, web.Application] = TestClient(server)
    async with client:
        response = await client.get(path)
        body = await response.read()
        return response.status, dict(response.headers), json.loads(body)


def test_app_errors_are_discovered() -> None:
    assert {errors.Unauthorized, errors.InvalidSignature, errors.CoreUnavailable} <= set(APP_ERRORS)
    assert len(APP_ERRORS) > 15


@pytest.mark.parametrize("error_cls", APP_ERRORS, ids=_name)
async def test_app_error_becomes_problem_json(error_cls: type[errors.AppError]) -> None:
    status, headers, body = await _problem(error_cls())
    assert status == status_of(error_cls)
    assert headers["Content-Type"].split(";")[0] == "application/problem+json"
    assert PROBLEM_KEYS <= set(body)
    assert body["status"] == status_of(error_cls)
    assert body["code"] == error_cls.code
    assert body["type"].endswith("/" + error_cls.code)
    assert body["title"] == (error_cls.__doc__ or "").strip().splitlines()[0]
    assert body["detail"] == (error_cls.__doc__ or "").strip()


async def test_app_error_detail_and_extra_are_passed_on() -> None:
    status, _headers, body = await _problem(
        errors.InvalidBody("Bad field.", errors=[{"field": "x", "message": "m"}])
    )
    assert status == 422
    assert body["detail"] == "Bad field."
    assert body["errors"] == [{"field": "x", "message": "m"}]


@pytest.mark.parametrize("error_cls", [c for c in APP_ERRORS if status_of(c) == 401], ids=_name)
async def test_every_401_carries_a_challenge(error_cls: type[errors.AppError]) -> None:
    # RFC 9110 15.5.2: a 401 response MUST send WWW-Authenticate.
    status, headers, _body = await _problem(error_cls())
    assert status == 401
    assert headers.get("WWW-Authenticate", "").strip(), (
        f"{error_cls.__name__} answers 401 without WWW-Authenticate: {headers}"
    )


async def test_non_401_has_no_challenge() -> None:
    _status, headers, _body = await _problem(errors.Forbidden())
    assert "WWW-Authenticate" not in headers


async def test_unexpected_error_is_an_opaque_500(caplog: pytest.LogCaptureFixture) -> None:
    status, headers, body = await _problem(RuntimeError("secret SQL text"))
    assert status == 500
    assert headers["Content-Type"].split(";")[0] == "application/problem+json"
    assert PROBLEM_KEYS <= set(body)
    assert (body["status"], body["code"]) == (500, "internal_error")
    assert "secret SQL text" not in json.dumps(body)
    assert "RuntimeError" not in json.dumps(body)
    assert any(r.exc_info for r in caplog.records)  # logged for us, not shown to the client


async def test_unknown_route_is_problem_404() -> None:
    status, headers, body = await _problem(RuntimeError("unused"), path="/nowhere")
    assert status == 404
    assert headers["Content-Type"].split(";")[0] == "application/problem+json"
    assert (body["status"], body["code"]) == (404, "not_found")
