"""Tracing: OpenTelemetry spans for each HTTP request, each SQL statement and each call to Core,
with the W3C ``traceparent`` sent to Core so that its team can join the trace.

Off unless the standard variables ask for it: an exporter named in ``OTEL_TRACES_EXPORTER``
(``otlp`` or ``console``), or an OTLP endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), and ``OTEL_SDK_DISABLED`` not ``true``. Then the
``otel`` extra must be installed; the exporter, batching, sampling and resource read their own
``OTEL_*`` variables as the SDK defines them. Off, each hook below returns at once: nothing of
OpenTelemetry is imported.

How a click's spans nest: the request's span (``POST /v1/analyses``, a child of the caller's
``traceparent`` when it sent one) holds its group commits, its call to Core and the release it
started. A group commit's span (``group commit admit``) is a child of its first click's span
and links every other click of its batch; the statement's span is its child.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, MutableMapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, SpanContext, Tracer

SERVICE_NAME = "analysis-queue"
EXPORTERS = ("otlp", "console")
Kind = Literal["internal", "server", "client"]


class TracingUnavailable(RuntimeError):
    """The OTEL_* variables ask for tracing that cannot be had here; the message names why."""


_tracer: Tracer | None = None
_provider: TracerProvider | None = None
_trace: Any = None  # opentelemetry.trace and opentelemetry.propagate, once tracing
_propagate: Any = None
_NOTHING: AbstractContextManager[None] = contextlib.nullcontext()


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether the standard variables ask for traces."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters:
        return exporters != "none"
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def configure(environ: Mapping[str, str], *, instance_id: str, version: str) -> bool:
    """Start tracing when the variables ask for it; whether it started. Raises
    :class:`TracingUnavailable` for what cannot run (no extra, an unknown exporter)."""
    if not wanted(environ):
        return False
    names = [n.strip() for n in environ.get("OTEL_TRACES_EXPORTER", "otlp").lower().split(",")]
    unknown = [n for n in names if n and n not in EXPORTERS]
    if unknown:
        raise TracingUnavailable(
            f"OTEL_TRACES_EXPORTER: {', '.join(unknown)} is not one of {', '.join(EXPORTERS)}"
        )
    protocol = environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")
    )
    if "otlp" in names and protocol not in ("", "http/protobuf"):
        raise TracingUnavailable(
            f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol} is not shipped; http/protobuf is"
        )
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError as exc:
        raise TracingUnavailable(
            "OTEL_* variables ask for traces, but the otel extra is not installed: "
            "pip install 'analysis-queue[otel]'"
        ) from exc
    # The variables name the service when they say; else it is this one.
    attributes = {"service.instance.id": instance_id, "service.version": version}
    named = "service.name=" in environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    if not (environ.get("OTEL_SERVICE_NAME") or named):
        attributes["service.name"] = SERVICE_NAME
    provider = TracerProvider(resource=Resource.create(attributes))
    for name in dict.fromkeys(n for n in names if n):
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        else:
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    use(provider, version)
    return True


def use(provider: TracerProvider, version: str = "") -> None:
    """Trace with ``provider`` from now on (``configure``; tests, with an in-memory exporter)."""
    global _tracer, _provider, _trace, _propagate
    from opentelemetry import propagate, trace

    _trace, _propagate = trace, propagate
    _provider = provider
    _tracer = provider.get_tracer("analysis_queue", version or None)


def shutdown() -> None:
    """Export what is left and stop tracing (the end of ``serve``)."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def active() -> bool:
    return _tracer is not None


def span(
    name: str,
    *,
    kind: Kind = "internal",
    attributes: Mapping[str, str | int | bool] | None = None,
    parent: SpanContext | Context | None = None,
    links: Sequence[SpanContext] = (),
) -> AbstractContextManager[Span | None]:
    """A span around a block, the current one inside it: a child of ``parent`` (a span's
    context, or a context extracted from headers), else of the current span. An exception
    leaving the block is recorded on it."""
    if _tracer is None:
        return _NOTHING
    context: Context | None
    if parent is None or isinstance(parent, dict):  # a Context is a dict
        context = parent
    else:
        context = _trace.set_span_in_context(_trace.NonRecordingSpan(parent))
    return _tracer.start_as_current_span(
        name,
        context=context,
        kind=getattr(_trace.SpanKind, kind.upper()),
        attributes=attributes,
        links=[_trace.Link(link) for link in links],
    )


def current() -> SpanContext | None:
    """The current span's context when tracing (a group commit keeps its callers')."""
    if _tracer is None:
        return None
    context: SpanContext = _trace.get_current_span().get_span_context()
    return context if context.is_valid else None


def inject(headers: MutableMapping[str, str]) -> None:
    """Add the current span's ``traceparent`` (and ``tracestate``) to outgoing headers."""
    if _tracer is not None:
        _propagate.inject(headers)


def extract(headers: Mapping[str, str]) -> Context | None:
    """The caller's context from incoming headers (``traceparent``), when tracing."""
    if _tracer is None:
        return None
    context: Context = _propagate.extract(headers)
    return context


def set_error(span: Span | None, description: str) -> None:
    if span is not None:
        span.set_status(_trace.Status(_trace.StatusCode.ERROR, description))
