"""OpenTelemetry tracing across services, with the W3C `traceparent` carried in NATS message headers.

Configured by the standard OTEL_* variables (they are OpenTelemetry's, not KITE's registry):
    OTEL_TRACES_EXPORTER   "none" (default), "otlp" (OTLP over HTTP; OTEL_EXPORTER_OTLP_* say where) or
                           "console"
    OTEL_SERVICE_NAME      defaults to kite-<service>
With "none" the global tracer is OpenTelemetry's no-op tracer: spans cost almost nothing.

Each hop starts a span as the child of the context extracted from the incoming message headers and
injects its own context into the headers of the messages it sends, so one request is one trace:
gateway -> fingerprinter -> worker -> ru-pool.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.trace import Span, SpanKind

log = logging.getLogger(__name__)

TRACER_NAME = "kite"


def setup_tracing(service: str) -> None:
    """Install a TracerProvider when OTEL_TRACES_EXPORTER asks for one (once per process)."""
    exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower()
    if exporter_name in ("", "none"):
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if exporter_name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    elif exporter_name == "console":
        exporter = ConsoleSpanExporter()
    else:
        log.warning("OTEL_TRACES_EXPORTER=%s is not supported (otlp, console, none): tracing off", exporter_name)
        return
    name = os.environ.get("OTEL_SERVICE_NAME") or f"kite-{service}"
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def headers_with_context(span: Span | None = None) -> dict[str, str]:
    """NATS headers carrying `span`'s (or the current) trace context."""
    headers: dict[str, str] = {}
    ctx = trace.set_span_in_context(span) if span is not None else None
    inject(headers, context=ctx)
    return headers


def start_span_from_headers(name: str, headers: Mapping[str, str] | None,
                            kind: SpanKind = SpanKind.SERVER, **attributes) -> Span:
    """A span that continues the trace whose context arrived in `headers` (a new trace if none)."""
    parent = extract(dict(headers or {}))
    return tracer().start_span(name, context=parent, kind=kind, attributes=attributes or None)


def tracing_active() -> bool:
    """Whether spans are recorded: a TracerProvider is installed (by setup_tracing, or by a test's own
    `trace.set_tracer_provider`). Until then OpenTelemetry hands out its proxy provider, whose spans
    record nothing. Asked per message, so it reads the global each time: a provider may be set later."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def server_span(name: str, headers: Mapping[str, str] | None) -> Span | None:
    """start_span_from_headers for a message handler, or None when the span would be an empty one: no
    provider installed and no headers, hence no trace context to continue either. That is every message
    of an untraced deployment, where the propagator extraction, the no-op span and making it current
    were measurable CPU per message on a busy endpoint (the ru-pool's lookups). With headers but no
    provider the no-op span is still made, since it carries the caller's trace context on (log lines'
    trace_id, headers of messages the handler sends)."""
    if not headers and not tracing_active():
        return None
    return start_span_from_headers(name, headers)


def current_trace_id() -> str:
    span_context = trace.get_current_span().get_span_context()
    return format(span_context.trace_id, "032x") if span_context.is_valid else ""


def use_span(span: Span):
    """Context manager making `span` current (without ending it) for the enclosed code."""
    return trace.use_span(span, end_on_exit=False)


__all__ = ["setup_tracing", "tracer", "headers_with_context", "start_span_from_headers", "tracing_active",
           "server_span", "current_trace_id", "use_span", "otel_context", "SpanKind"]
