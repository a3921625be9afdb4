"""Tracing with OpenTelemetry's SDK and its in-memory exporter: one admit's spans nest as
analysis_queue/tracing.py says, Core receives each call's trace context, a group commit links
the clicks it wrote; and with tracing off, Core receives none."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from analysis_queue import tracing
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from support import Harness, thesis_body, wait_for

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"


@pytest.fixture
async def exporter(harness: Harness) -> AsyncIterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    yield exporter
    for instance in list(harness.instances):  # their last spans end before the provider does
        await harness.stop_instance(instance)
    tracing.shutdown()


def _one(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{len(found)} spans named {name!r}: {[s.name for s in spans]}"
    return found[0]


def _parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def _id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.span_id


async def test_one_admit_nests_under_its_request_and_reaches_core(
    harness: Harness, exporter: InMemorySpanExporter
) -> None:
    h = harness
    h.sim.judge_time_s = 60  # the job stays running: its release is the last step traced
    instance = await h.start_instance()
    await h.grant("lecturer", 1)
    exporter.clear()
    headers = {**h.auth("lecturer"), "traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
    async with h.http.post(
        f"{instance.base_url}/v1/analyses", json=thesis_body(1), headers=headers
    ) as r:
        assert r.status == 201, await r.text()
        job = await r.json()

    async def released() -> bool:
        return any(s.name == "core release" for s in exporter.get_finished_spans())

    await wait_for(released, what="the release's span")
    await wait_for(lambda: _has(exporter, "group commit running"), what="the running mark's span")
    spans = [
        s
        for s in exporter.get_finished_spans()
        if s.context is not None and s.context.trace_id == int(CALLER_TRACE, 16)
    ]
    server = _one(spans, "POST /v1/analyses")
    assert server.kind is SpanKind.SERVER
    assert _parent_of(server) == int(CALLER_SPAN, 16), "not a child of the caller's traceparent"
    assert server.attributes is not None
    assert server.attributes["http.route"] == "/v1/analyses"
    assert server.attributes["http.response.status_code"] == 201

    reserve_batch = _one(spans, "group commit reserve")
    create = _one(spans, "core create")
    admit_batch = _one(spans, "group commit admit")
    release = _one(spans, "release")
    for child in (reserve_batch, create, admit_batch, release):
        assert _parent_of(child) == _id(server), f"{child.name} is not the request's child"
    for batch, statement in ((reserve_batch, "reserve"), (admit_batch, "admit")):
        sql = _one(spans, statement)
        assert _parent_of(sql) == _id(batch), f"{statement} is not its group commit's child"
        assert sql.kind is SpanKind.CLIENT
        assert sql.attributes is not None and sql.attributes["db.system.name"] == "postgresql"
        assert batch.attributes is not None and batch.attributes["aq.batch.size"] == 1
    # The three steps of an admit, in their order: reserve, Core's held run, admit.
    assert reserve_batch.end_time is not None and create.start_time is not None
    assert reserve_batch.end_time <= create.start_time
    assert create.end_time is not None and admit_batch.start_time is not None
    assert create.end_time <= admit_batch.start_time
    assert create.kind is SpanKind.CLIENT and create.attributes is not None
    assert create.attributes["http.response.status_code"] == 201
    core_release = _one(spans, "core release")
    assert _parent_of(core_release) == _id(release)
    assert _parent_of(_one(spans, "group commit running")) == _id(release)

    # Core received each call's own span as its parent: its team can join the trace.
    sent = dict(h.sim.traceparents)
    run = job["id"]
    assert sent["POST /v1/runs"] == f"00-{CALLER_TRACE}-{_id(create):016x}-01", sent
    release_path = next(p for p in sent if p.endswith("/release"))
    assert sent[release_path] == f"00-{CALLER_TRACE}-{_id(core_release):016x}-01", (run, sent)


async def _has(exporter: InMemorySpanExporter, name: str) -> bool:
    return any(s.name == name for s in exporter.get_finished_spans())


async def test_a_group_commit_links_every_click_it_wrote(
    harness: Harness, exporter: InMemorySpanExporter
) -> None:
    h = harness
    h.sim.judge_time_s = 60
    instance = await h.start_instance()
    users = [f"user-{n}" for n in range(6)]
    for user in users:
        await h.grant(user, 1)
    exporter.clear()

    async def click(user: str) -> None:
        async with h.http.post(
            f"{instance.base_url}/v1/analyses", json=thesis_body(1), headers=h.auth(user)
        ) as r:
            assert r.status == 201, await r.text()

    await asyncio.gather(*(click(u) for u in users))
    spans = exporter.get_finished_spans()
    requests = {_id(s) for s in spans if s.name == "POST /v1/analyses"}
    assert len(requests) == len(users)
    for name in ("group commit reserve", "group commit admit"):
        written: list[int] = []
        for batch in (s for s in spans if s.name == name):
            callers = [_parent_of(batch), *(link.context.span_id for link in batch.links)]
            assert batch.attributes is not None
            assert batch.attributes["aq.batch.size"] == len(callers), name
            written += [c for c in callers if c is not None]
        assert sorted(written) == sorted(requests), f"{name}: each click once, by its span"


async def test_untraced_core_gets_no_trace_context(harness: Harness) -> None:
    h = harness
    assert not tracing.active()
    await h.start_instance()
    await h.grant("lecturer", 1)
    status, _ = await h.admit("lecturer", 1)
    assert status == 201

    async def released() -> bool:  # both of the click's calls to Core made
        return any(r["state"] != "held" for r in h.sim.runs_snapshot())

    await wait_for(released, what="the release")
    assert not h.sim.traceparents, "Core got a trace context with tracing off"


async def test_the_next_job_starts_in_the_trace_of_the_completion_that_freed_its_slot(
    harness: Harness, exporter: InMemorySpanExporter
) -> None:
    h = harness
    h.sim.judge_time_s = 0.2
    await h.start_instance()
    await h.grant("lecturer", 2)
    _, first = await h.admit("lecturer", 1)
    _, second = await h.admit("lecturer", 2)
    assert second["status"] == "queued"

    def release_of(job_id: str) -> ReadableSpan | None:
        for span in exporter.get_finished_spans():
            if span.name == "release" and (span.attributes or {}).get("aq.job_id") == job_id:
                return span
        return None

    async def second_released() -> bool:
        return release_of(second["id"]) is not None

    await wait_for(second_released, what="the second job's release")
    release = release_of(second["id"])
    assert release is not None
    spans = {_id(s): s for s in exporter.get_finished_spans()}
    parent = spans.get(_parent_of(release) or 0)
    assert parent is not None and parent.name == "POST /v1/core/events", (
        f"the second release's parent is {parent.name if parent else None}"
    )
    finish = [s for s in spans.values() if s.name == "group commit finish"]
    assert any(_parent_of(s) == _id(parent) for s in finish), "the completion's own batch"
    assert first["id"] != second["id"]
