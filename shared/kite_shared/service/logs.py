"""A KITE process's log lines: one JSON object per line on stderr, carrying the service, the instance and,
while a request is handled, its request id, tenant and trace id.

Boundary: formatting and installing log handlers only; what sets the request context is the service
framework (kite_shared.endpoints), what sets the trace is kite_shared.tracing.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from kite_shared.endpoints import request_id_var, tenant_var
from kite_shared.tracing import current_trace_id


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: easy to ship to any log store."""

    def __init__(self, service: str, instance_id: str) -> None:
        super().__init__()
        self._static = {"service": service, "instance": instance_id}

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            **self._static,
        }
        for key in ("request_id", "tenant", "trace_id"):
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class RequestContextFilter(logging.Filter):
    """Adds request id, tenant (never the key) and trace id to records that do not set them."""

    def filter(self, record: logging.LogRecord) -> bool:
        for attr, value in (("request_id", request_id_var.get()), ("tenant", tenant_var.get()),
                            ("trace_id", current_trace_id())):
            if value and not hasattr(record, attr):
                setattr(record, attr, value)
        return True


def setup_logging(service: str, instance_id: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter(service, instance_id))
    handler.addFilter(RequestContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def setup_package_logging(service: str, instance_id: str, level: str,
                          packages: tuple[str, ...] = ("kite_shared", "kite_worker")) -> None:
    """KITE's JSON log lines for KITE code running inside another program's processes (the KV connector
    in vLLM's engine processes): only KITE's loggers get the handler, the host program's logging stays."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter(service, instance_id))
    handler.addFilter(RequestContextFilter())
    for package in packages:
        logger = logging.getLogger(package)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False
