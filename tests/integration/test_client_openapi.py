"""The client's models against a live instance's ``/openapi.json``, so that the two cannot
drift: each model has exactly the schema's properties, the same required ones, and the same
types (nested models, enums, formats and nullability included). And against live answers:
every answer parsed and dumped again is the JSON the service sent."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest
from analysis_queue.client import models
from analysis_queue.client.sse import SseParser
from analysis_queue.http.auth import mint_token
from support import ADMIN_TOKEN, JWT_SECRET, Harness

# The document's component schemas and the client's model of each.
MODELS: dict[str, type[pydantic.BaseModel]] = {
    "Job": models.Analysis,
    "JobSummary": models.AnalysisSummary,
    "JobList": models.AnalysisPage,
    "JobEventData": models.JobEvent,
    "PositionData": models.PositionEvent,
    "SnapshotData": models.SnapshotEvent,
    "Verdict": models.Verdict,
    "Problem": models.Problem,
    "Credits": models.Credits,
    "CreditGrantResult": models.CreditGrantResult,
    "Capacity": models.Capacity,
    "UserLimit": models.UserLimit,
}
COMPONENT_OF = {model.__name__: name for name, model in MODELS.items()}
# Kept apart on purpose: the client takes a kind it does not know as a string, so that a newer
# service's events never stop its stream (test_stored_kinds_are_the_documented_ones).
LENIENT = {("JobEventData", "kind")}
FORMATS = {"uuid", "date-time"}

Shape = Any


class Schemas:
    """One side's schemas: ``$ref`` names resolve in ``defs``; a ref to one of MODELS stays a
    reference (compared by name), any other is inlined."""

    def __init__(self, defs: dict[str, Any], names: dict[str, str]) -> None:
        self.defs = defs
        self.names = names  # the side's schema name -> the document's component name

    def shape(self, schema: dict[str, Any]) -> frozenset[Shape]:
        """The alternatives a value may take, each as a hashable shape."""
        if "$ref" in schema:
            name = schema["$ref"].rsplit("/", 1)[-1]
            if name in self.names:
                return frozenset({("model", self.names[name])})
            return self.shape(self.defs[name])
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return frozenset().union(*(self.shape(s) for s in schema[key]))
        if "const" in schema:
            return frozenset({("enum", frozenset({schema["const"]}))})
        if "enum" in schema:
            values = set(schema["enum"])
            out: set[Shape] = {("enum", frozenset(values - {None}))}
            return frozenset(out | ({("null",)} if None in values else set()))
        types = schema.get("type", [])
        return frozenset(
            self._typed(t, schema) for t in ([types] if isinstance(types, str) else types)
        )

    def _typed(self, kind: str, schema: dict[str, Any]) -> Shape:
        if kind == "array":
            return ("array", self.shape(schema.get("items", {})))
        if kind == "object" and "properties" in schema:
            return ("object", self.fields(schema))
        if kind == "object":
            return ("map", self.shape(schema.get("additionalProperties", {})))
        if kind == "string" and schema.get("format") in FORMATS:
            return ("string", schema["format"])
        return (kind,)

    def fields(self, schema: dict[str, Any]) -> tuple[tuple[str, frozenset[Shape], bool], ...]:
        required = set(schema.get("required", []))
        return tuple(
            sorted(
                (name, self.shape(prop), name in required)
                for name, prop in schema["properties"].items()
            )
        )


@pytest.fixture
async def document(harness: Harness) -> dict[str, Any]:
    instance = await harness.start_instance()
    async with harness.http.get(f"{instance.base_url}/openapi.json") as r:
        assert r.status == 200
        return dict(await r.json())


def _client_side(model: type[pydantic.BaseModel]) -> tuple[Schemas, dict[str, Any]]:
    schema = model.model_json_schema(ref_template="#/$defs/{model}")
    names = {**COMPONENT_OF}
    names.pop(model.__name__, None)  # the model itself is compared field by field
    return Schemas(schema.get("$defs", {}), names), schema


def _without_absent_null(
    fields: tuple[tuple[str, frozenset[Shape], bool], ...],
) -> dict[str, tuple[frozenset[Shape], bool]]:
    """A property that may be absent is None in the model when it is: that None is no type."""
    return {
        name: (shapes if required else shapes - {("null",)}, required)
        for name, shapes, required in fields
    }


def _differences(components: dict[str, Any], component: str) -> list[str]:
    served = Schemas(components, {n: n for n in MODELS if n != component})
    theirs = _without_absent_null(served.fields(components[component]))
    side, schema = _client_side(MODELS[component])
    ours = _without_absent_null(side.fields(schema))
    if sorted(ours) != sorted(theirs):
        return [f"{component}: properties {sorted(ours)} != {sorted(theirs)}"]
    return [
        f"{component}.{name}: {ours[name]} != {theirs[name]}"
        for name in theirs
        if (component, name) not in LENIENT and ours[name] != theirs[name]
    ]


async def test_each_model_matches_its_schema(document: dict[str, Any]) -> None:
    components = document["components"]["schemas"]
    assert [d for component in sorted(MODELS) for d in _differences(components, component)] == []


def test_the_comparison_sees_a_difference() -> None:
    """A field of another type, a missing one or an optional one are all told apart."""

    class Wrong(pydantic.BaseModel):
        balance: str

    class Missing(pydantic.BaseModel):
        pass

    class Optional(pydantic.BaseModel):
        balance: int | None = None

    right = _client_side(models.Credits)
    for other in (Wrong, Missing, Optional):
        side, schema = _client_side(other)
        assert side.fields(schema) != right[0].fields(right[1])


async def test_stored_kinds_and_statuses_are_the_documented_ones(document: dict[str, Any]) -> None:
    components = document["components"]["schemas"]
    kinds = set(components["JobEventData"]["properties"]["kind"]["enum"])
    assert kinds == {k.value for k in models.STORED_KINDS}
    stream = components["StreamEvent"]["oneOf"]
    names = set(stream[0]["properties"]["event"]["enum"])
    names |= {s["properties"]["event"]["const"] for s in stream[1:]}
    assert names == {k.value for k in models.EventKind}
    statuses = components["JobSummary"]["properties"]["status"]["enum"]
    assert set(statuses) == {s.value for s in models.AnalysisStatus}


async def test_live_answers_dump_back_to_what_was_sent(harness: Harness) -> None:
    """Parsed into the models and dumped again, every answer is the JSON the service sent:
    nothing the service says is lost or reshaped."""
    harness.sim.judge_time_s = 60.0  # the first job runs, the second stays queued
    instance = await harness.start_instance()
    base, http = instance.base_url, harness.http
    user = {"Authorization": f"Bearer {mint_token('zoe', JWT_SECRET)}"}
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    body = {
        "thesis": {"title": "T", "document_url": "https://u.example/t.pdf"},
        "sources": ["10.1000/z"],
    }

    async def same(model: type[pydantic.BaseModel], method: str, path: str, **kw: Any) -> Any:
        async with http.request(method, f"{base}{path}", **kw) as r:
            raw = await r.json(content_type=None)
        assert model.model_validate(raw).model_dump(mode="json", exclude_unset=True) == raw, path
        return raw

    await same(
        models.CreditGrantResult,
        "POST",
        "/v1/admin/credits",
        headers=admin,
        json={"user_id": "zoe", "amount": 3},
    )
    first = await same(models.Analysis, "POST", "/v1/analyses", headers=user, json=body)
    await same(models.Analysis, "POST", "/v1/analyses", headers=user, json=body)
    await same(models.Analysis, "GET", f"/v1/analyses/{first['id']}", headers=user)
    await same(models.AnalysisPage, "GET", "/v1/analyses?limit=1", headers=user)
    await same(models.Credits, "GET", "/v1/credits", headers=user)
    await same(models.Capacity, "GET", "/v1/admin/capacity", headers=admin)
    await same(models.UserLimit, "GET", "/v1/admin/users/zoe/limit", headers=admin)
    await same(models.Problem, "GET", "/v1/analyses?limit=0", headers=user)
    await same(models.Problem, "POST", "/v1/analyses", headers=user, json={"thesis": 1})

    async with http.get(f"{base}/v1/events?last_event_id=0", headers=user) as r:
        parser, frames = SseParser(), []
        async for chunk in r.content.iter_any():
            frames += parser.feed(chunk)
            if any(f.event == "position" for f in frames):
                break
    assert [f.event for f in frames].count("admitted") == 2
    for frame in frames:
        raw = json.loads(frame.data)
        assert models.parse_event(frame.event, frame.data).model_dump(mode="json") == raw
