"""When tracing starts, as the standard OTEL_* variables say, and what it refuses to start."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from analysis_queue import tracing


@pytest.fixture(autouse=True)
def _untraced() -> Iterator[None]:
    yield
    tracing.shutdown()


@pytest.mark.parametrize(
    ("environ", "wanted"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "aq"}, False),  # naming the service asks for nothing
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "false"}, True),
    ],
)
def test_off_unless_the_standard_variables_ask(environ: dict[str, str], wanted: bool) -> None:
    assert tracing.wanted(environ) is wanted


def test_off_it_makes_no_span_and_sends_no_context() -> None:
    assert not tracing.configure({}, instance_id="i", version="0")
    assert not tracing.active()
    with tracing.span("anything") as span:
        assert span is None
    headers: dict[str, str] = {}
    tracing.inject(headers)
    assert headers == {} and tracing.current() is None and tracing.extract({}) is None


def test_on_it_names_the_service_and_the_instance() -> None:
    assert tracing.configure(
        {"OTEL_TRACES_EXPORTER": "console"}, instance_id="host-7", version="1.2.3"
    )
    assert tracing.active()
    assert tracing._provider is not None
    attributes = tracing._provider.resource.attributes
    assert attributes["service.name"] == "analysis-queue"
    assert attributes["service.instance.id"] == "host-7"
    assert attributes["service.version"] == "1.2.3"
    tracing.shutdown()
    assert not tracing.active()


@pytest.mark.parametrize(
    ("environ", "says"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER: zipkin is not one of"),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "OTEL_EXPORTER_OTLP_PROTOCOL: grpc is not shipped",
        ),
    ],
)
def test_what_it_cannot_export_it_names(environ: dict[str, str], says: str) -> None:
    with pytest.raises(tracing.TracingUnavailable, match=says):
        tracing.configure(environ, instance_id="i", version="0")
    assert not tracing.active()


def test_serve_refuses_an_exporter_it_does_not_have_as_a_configuration_error() -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("AQ_", "OTEL_"))},
        "AQ_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none",
        "AQ_CORE_URL": "http://127.0.0.1:1",
        "AQ_JWT_SECRET": "x" * 32,
        "AQ_ADMIN_TOKEN": "admin",
        "AQ_CORE_CALLBACK_SECRET": "callback",
        "OTEL_TRACES_EXPORTER": "zipkin",
    }
    done = subprocess.run(
        [sys.executable, "-m", "analysis_queue", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 78, done.stderr
    assert "OTEL_TRACES_EXPORTER: zipkin is not one of otlp, console" in done.stderr
