"""The OpenAPI document matches the router exactly and is valid OpenAPI 3.1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import schemathesis
from aiohttp import web
from analysis_queue.app import build_app
from analysis_queue.config import Settings
from analysis_queue.core.client import CoreRun
from analysis_queue.http import bodies as schemas
from analysis_queue.http import openapi

HTTP_METHODS = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}


def _app(tmp_path: Path) -> web.Application:
    # No lifecycle runs: the routes exist as soon as the application is built.
    settings = Settings(
        jwt_secret="unit-secret-0123456789abcdef0123456789",
        admin_token="admin",
        core_callback_secret="callback",
        database_url="postgresql://unused/unused",
        core_url="http://unused.invalid",
        data_dir=tmp_path,
    )
    return build_app(settings)


def _documented(document: dict[str, Any]) -> set[tuple[str, str]]:
    return {
        (method.upper(), path)
        for path, item in document["paths"].items()
        for method in item
        if method in HTTP_METHODS
    }


def _registered(app: web.Application) -> set[tuple[str, str]]:
    return {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.resource is not None and route.method != "HEAD"  # aiohttp's implicit HEAD
    }


def test_every_registered_route_is_documented_and_every_documented_one_exists(
    tmp_path: Path,
) -> None:
    app = _app(tmp_path)
    document = openapi.build_document(openapi.route_keys(app))

    registered, documented = _registered(app), _documented(document)

    assert registered - documented == set(), "routes missing from the OpenAPI document"
    assert documented - registered == set(), "documented operations without a route"
    assert set(openapi.OPERATIONS) == registered


def test_an_undocumented_route_or_a_stale_description_fails_the_build(tmp_path: Path) -> None:
    app = _app(tmp_path)

    async def extra(_request: web.Request) -> web.Response:
        return web.Response()

    app.router.add_post("/v1/undocumented", extra)
    with pytest.raises(openapi.DocumentError, match="undocumented"):
        openapi.build_document(openapi.route_keys(app))

    keys = openapi.route_keys(_app(tmp_path))
    with pytest.raises(openapi.DocumentError, match="/readyz"):
        openapi.build_document([k for k in keys if k != ("GET", "/readyz")])


def test_document_is_valid_openapi_3_1(tmp_path: Path) -> None:
    document = openapi.build_document(openapi.route_keys(_app(tmp_path)))
    assert document["openapi"].startswith("3.1")

    schemathesis.openapi.from_dict(document).validate()  # the OpenAPI 3.1 meta-schema


def test_request_bodies_are_the_pydantic_models(tmp_path: Path) -> None:
    document = openapi.build_document(openapi.route_keys(_app(tmp_path)))
    components = document["components"]["schemas"]
    for model in (schemas.AnalysisRequest, schemas.RecheckRequest, schemas.CreditGrant):
        generated = model.model_json_schema(ref_template="#/components/schemas/{model}")
        generated.pop("$defs", None)
        assert components[model.__name__] == generated
    body = document["paths"]["/v1/analyses"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/AnalysisRequest"
    }
    assert components["AnalysisRequest"]["additionalProperties"] is False
    # Core's callback body is the model the callback route parses it with.
    generated = CoreRun.model_json_schema(ref_template="#/components/schemas/{model}")
    generated.pop("$defs", None)
    assert components["CoreEvent"] == generated
    callback = document["paths"]["/v1/core/events"]["post"]["requestBody"]
    assert callback["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CoreEvent"
    }
    assert components["Verdict"]["required"] == ["source", "verdict"]


def test_security_and_the_core_callback_are_described(tmp_path: Path) -> None:
    document = openapi.build_document(openapi.route_keys(_app(tmp_path)))
    schemes = document["components"]["securitySchemes"]
    assert schemes["userJwt"] == {**schemes["userJwt"], "type": "http", "scheme": "bearer"}
    assert schemes["userJwt"]["bearerFormat"] == "JWT"
    assert schemes["adminToken"]["scheme"] == "bearer"
    paths = document["paths"]
    assert paths["/v1/analyses"]["post"]["security"] == [{"userJwt": []}]
    assert paths["/v1/admin/credits"]["post"]["security"] == [{"adminToken": []}]
    assert paths["/healthz"]["get"]["security"] == []

    callback = paths["/v1/core/events"]["post"]
    assert callback["security"] == []
    headers = {p["name"]: p for p in callback["parameters"] if p["in"] == "header"}
    assert headers["X-Core-Timestamp"]["required"] and headers["X-Core-Signature"]["required"]
    assert "401" in callback["responses"]

    for path, item in paths.items():
        for method, operation in item.items():
            for status, response in operation["responses"].items():
                if int(status) >= 400 and not (path == "/readyz" and status == "503"):
                    media = response["content"]
                    assert list(media) == ["application/problem+json"], (method, path, status)
