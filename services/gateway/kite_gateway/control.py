"""The gateway's control plane (issue 5): request/error rates out, admission decisions in.

- `RequestStats` counts API answers (HTTP middleware) over KITE_TELEMETRY_WINDOW_S; `GatewayControl`
  publishes them as telemetry.GatewayTelemetry every KITE_TELEMETRY_INTERVAL_S.
- `AdmissionGate` holds the arbitrator's latest `admission` decision. While it says shed (predicted time to
  first token above the SLO), `GenerationClient.open` refuses new generations at once with 503
  `overloaded` and the decision's Retry-After, before anything is sent to a fingerprinter or worker.
  A migration (already-admitted stream) is never refused. No arbitrator -> always open.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import Counter

from kite_shared import subjects
from kite_shared.endpoints import Endpoint
from kite_shared.messages import Decision, GatewayTelemetry
from kite_shared.service import ServiceRuntime
from kite_shared.window import TimeWindow
from kite_gateway.errors import ApiError

log = logging.getLogger(__name__)

REJECTED = Counter("kite_gateway_admission_rejected_total", "Requests refused early by admission control")
_UNCOUNTED_PATHS = ("/health", "/metrics")


class RequestStats:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._answers = TimeWindow(window_s)  # one sample per API answer: 1 for a 5xx, else 0
        self._rejects = TimeWindow(window_s)  # one sample per early reject

    def observe(self, path: str, status: int, now: float | None = None) -> None:
        if path in _UNCOUNTED_PATHS:
            return
        self._answers.add(time.monotonic() if now is None else now, float(status >= 500))

    def rejected(self, now: float | None = None) -> None:
        self._rejects.add(time.monotonic() if now is None else now)

    def rates(self, now: float | None = None) -> tuple[float, float, float]:
        """(requests per second, error fraction, rejected fraction) over the window."""
        now = time.monotonic() if now is None else now
        n = self._answers.count(now)
        if not n:
            return 0.0, 0.0, 0.0
        return n / self.window_s, self._answers.total(now) / n, min(1.0, self._rejects.count(now) / n)


class AdmissionGate:
    def __init__(self, stats: RequestStats | None = None) -> None:
        self.decision: Decision | None = None
        self.stats = stats

    def apply(self, d: Decision) -> None:
        if self.decision is None or d.admit != self.decision.admit:
            log.info("admission %s (decision %s: %s)", "open" if d.admit else "shed", d.decision_id, d.reason)
        self.decision = d

    def check(self) -> None:
        d = self.decision
        if d is not None and not d.admit:
            REJECTED.inc()
            if self.stats is not None:
                self.stats.rejected()
            raise ApiError(503, f"Overloaded: the predicted time to first token ({d.predicted_ttft_s:.1f} s) "
                                "exceeds the service objective; retry later", type="service_unavailable",
                           code="overloaded", retry_after_s=max(1, d.retry_after_s))


class GatewayControl:
    def __init__(self, instance_id: str, window_s: float) -> None:
        self.instance_id = instance_id
        self.stats = RequestStats(window_s)
        self.gate = AdmissionGate(self.stats)

    async def start(self, rt: ServiceRuntime, telemetry_interval_s: float) -> None:
        await rt.serve(Endpoint(subjects.DECISIONS, self.on_decision))
        rt.publish_every(telemetry_interval_s, subjects.telemetry("gateway"), self.telemetry)

    async def on_decision(self, d: Decision) -> None:
        if d.action == "admission":
            self.gate.apply(d)

    def telemetry(self) -> GatewayTelemetry:
        rate, errors, rejected = self.stats.rates()
        return GatewayTelemetry(instance_id=self.instance_id, request_rate=round(rate, 3),
                                error_rate=round(errors, 4), rejected_rate=round(rejected, 4))
