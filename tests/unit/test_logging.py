"""Structured logs: one JSON object per line with service, instance, and the request context."""

from __future__ import annotations

import io
import json
import logging

from opentelemetry.sdk.trace import TracerProvider

from kite_shared.service import JsonLogFormatter, RequestContextFilter, request_id_var, tenant_var


def test_records_carry_request_tenant_and_trace_ids():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonLogFormatter("worker", "worker-1"))
    handler.addFilter(RequestContextFilter())
    logger = logging.getLogger("kite.test.logging")
    logger.addHandler(handler)
    logger.propagate = False
    tracer = TracerProvider().get_tracer("test")
    request_token, tenant_token = request_id_var.set("req-42"), tenant_var.set("acme")
    try:
        with tracer.start_as_current_span("work") as span:
            logger.warning("inside a request")
        logger.warning("still in the request, no span")
    finally:
        request_id_var.reset(request_token)
        tenant_var.reset(tenant_token)
    logger.warning("outside")
    first, second, third = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["service"] == "worker" and first["instance"] == "worker-1" and first["msg"] == "inside a request"
    assert first["request_id"] == "req-42" and first["tenant"] == "acme"
    assert first["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert "trace_id" not in second and second["request_id"] == "req-42"
    assert not {"request_id", "tenant", "trace_id"} & set(third)
