"""Schemathesis against a live instance (real PostgreSQL, the Core simulator), driven by the
instance's own ``GET /openapi.json``.

Every operation gets a bounded number of positive (schema-conforming) and negative cases,
generated deterministically (``derandomize``), sent with valid credentials for its security
scheme, and each answer must not be a server error and must conform to the document: status
code, content type, headers and body schema.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
import requests
import schemathesis
from analysis_queue.http import openapi
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.configuration import set_hypothesis_home_dir
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from support import ADMIN_TOKEN, Harness, Instance, check_invariants, thesis_body

FUZZER = "fuzzer"
# Per operation and generation mode: the whole run takes about 10 s (the timeout is the bound).
MAX_EXAMPLES = 25
# Every operation, the event stream too: it ends after STREAM_S here (HubSettings.max_stream_s),
# and each of its events is checked against the document's per-event schema.
NOT_FUZZED: frozenset[str] = frozenset()
STREAM_S = 0.15
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
REQUEST_TIMEOUT_S = 10


@pytest.fixture(autouse=True)
def _hypothesis_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Hypothesis' caches go to a temporary directory, not ``.hypothesis/`` in the work tree."""
    set_hypothesis_home_dir(tmp_path_factory.mktemp("hypothesis"))
    yield
    set_hypothesis_home_dir(None)


@dataclass(frozen=True)
class Finding:
    operation: str
    mode: str
    error: str


def _credentials(operation: Any, user_token: str) -> dict[str, str]:
    security = operation.definition.raw.get("security", [])
    schemes = {name for requirement in security for name in requirement}
    if "adminToken" in schemes:
        return {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    if "userJwt" in schemes:
        return {"Authorization": f"Bearer {user_token}"}
    return {}


class _Fuzzer:
    """Runs in a worker thread: schemathesis and requests block, the service's loop must not."""

    def __init__(self, base_url: str, user_token: str) -> None:
        self.base_url = base_url
        self.user_token = user_token
        self.session = requests.Session()
        self.statuses: Counter[tuple[str, int]] = Counter()
        self.findings: list[Finding] = []
        self.fuzzed: list[str] = []
        # The served document, loaded as a dict: ``from_url`` would leave out the operation
        # that serves the document itself, and that one is fuzzed too.
        served = self.session.get(f"{base_url}/openapi.json", timeout=REQUEST_TIMEOUT_S)
        served.raise_for_status()
        self.schema = schemathesis.openapi.from_dict(served.json())
        self.operations = {
            op.label: op for op in (r.ok() for r in self.schema.get_all_operations())
        }

    def call(self, case: Any) -> Any:
        """Send one case with the credentials its operation needs; every check must pass."""
        response = case.call_and_validate(
            base_url=self.base_url,
            session=self.session,
            headers=_credentials(case.operation, self.user_token),
            checks=CHECKS,
            timeout=REQUEST_TIMEOUT_S,
        )
        self.statuses[(case.operation.label, response.status_code)] += 1
        return response

    def seed(self) -> str:
        """Known-good calls first, so that job answers are checked against the document with
        real jobs in them (queued, running, finished with verdicts, re-checked, cancelled,
        deleted)."""
        create = self.operations["POST /v1/analyses"]
        created = [
            self.call(create.Case(body=thesis_body(n), media_type="application/json")).json()
            for n in range(3)
        ]
        replay = create.Case(
            body=thesis_body(0),
            headers={"Idempotency-Key": "fuzz-seed"},
            media_type="application/json",
        )
        for _ in range(2):
            assert self.call(replay).status_code == 201
        first = created[0]["id"]
        get = self.operations["GET /v1/analyses/{job_id}"]
        deadline = time.monotonic() + 10
        while self.call(get.Case(path_parameters={"job_id": first})).json()["status"] != (
            "succeeded"
        ):
            assert time.monotonic() < deadline, "the seed job did not finish"
            time.sleep(0.05)
        recheck = self.operations["POST /v1/analyses/{job_id}/rechecks"]
        self.call(
            recheck.Case(path_parameters={"job_id": first}, body={"sources": ["10.1000/again"]})
        )
        self.call(self.operations["GET /v1/analyses"].Case())
        events = self.call(self.operations["GET /v1/events"].Case())
        assert b"event: snapshot" in events.content, events.content[:300]
        resumed = self.call(self.operations["GET /v1/events"].Case(headers={"Last-Event-ID": "1"}))
        assert b"id: 2\n" in resumed.content and b"event: snapshot" not in resumed.content
        self.call(
            self.operations["POST /v1/analyses/{job_id}/cancel"].Case(
                path_parameters={"job_id": created[1]["id"]}
            )
        )
        self.call(
            self.operations["DELETE /v1/analyses/{job_id}"].Case(
                path_parameters={"job_id": created[2]["id"]}
            )
        )
        return str(first)

    def run(self) -> None:
        job_id = self.seed()
        for label, operation in self.operations.items():
            if label in NOT_FUZZED:
                continue
            runs: list[tuple[GenerationMode, dict[str, Any] | None]] = [
                (GenerationMode.POSITIVE, None),
                (GenerationMode.NEGATIVE, None),
            ]
            if "{job_id}" in operation.path:  # also on a job that exists, not only on 404s
                runs.append((GenerationMode.POSITIVE, {"job_id": job_id}))
            for mode, path_parameters in runs:
                try:
                    self.fuzz(operation, mode, path_parameters)
                except Unsatisfiable:
                    pass  # nothing in this operation can be made invalid (no parameters, no body)
                except Exception as exc:
                    self.findings.append(Finding(label, mode.value, str(exc)[:4000]))
            self.fuzzed.append(label)
        self.session.close()

    def fuzz(
        self, operation: Any, mode: GenerationMode, path_parameters: dict[str, Any] | None
    ) -> None:
        strategy = operation.as_strategy(generation_mode=mode, path_parameters=path_parameters)

        @settings(
            max_examples=MAX_EXAMPLES,
            derandomize=True,  # the same cases on every run
            database=None,
            deadline=None,
            phases=[Phase.explicit, Phase.generate, Phase.shrink],
            suppress_health_check=list(HealthCheck),
            report_multiple_bugs=False,
        )
        @given(case=strategy)
        def run(case: Any) -> None:
            self.call(case)

        run()


async def _ready(h: Harness) -> Instance:
    instance = await h.start_instance()
    hub = instance.services.events
    hub.settings = dataclasses.replace(hub.settings, max_stream_s=STREAM_S)
    await asyncio.wait_for(instance.services.sweeper.pass_done.wait(), 10)
    await h.grant(FUZZER, 100_000)
    return instance


async def test_served_document_is_the_generated_one(harness: Harness) -> None:
    instance = await _ready(harness)
    async with harness.http.get(f"{instance.base_url}/openapi.json") as r:
        assert r.status == 200 and r.content_type == "application/json"
        served = orjson.loads(await r.read())
    assert served == openapi.build_document(openapi.route_keys(instance.runner.app))
    assert served["openapi"] == "3.1.0"


@pytest.mark.timeout(120)
@pytest.mark.slow
async def test_schemathesis_finds_no_server_error_or_schema_mismatch(harness: Harness) -> None:
    h = harness
    instance = await _ready(h)
    token = h.auth(FUZZER)["Authorization"].removeprefix("Bearer ")
    fuzzer = await asyncio.to_thread(_Fuzzer, instance.base_url, token)
    await asyncio.to_thread(fuzzer.run)

    findings = fuzzer.findings
    assert not findings, "\n\n".join(f"{f.operation} [{f.mode}]\n{f.error}" for f in findings)
    documented = {
        f"{method.upper()} {path}"
        for path, item in openapi.build_document(openapi.route_keys(instance.runner.app))[
            "paths"
        ].items()
        for method in item
    }
    assert set(fuzzer.fuzzed) == documented - NOT_FUZZED
    # It went deep: jobs were admitted, bodies refused, credentials demanded, ids not found.
    statuses = {status for _, status in fuzzer.statuses}
    assert {200, 201, 401, 404, 422} <= statuses, sorted(fuzzer.statuses.items())
    await instance.services.dispatcher.drain()
    await check_invariants(h.database_url)
