"""The fingerprinter's handlers: a GenerateRequest in, tokenized and fingerprinted (core.Fingerprinter),
handed to a worker (router.Router), that worker's Admission out; and the fingerprinter's telemetry.

Layers: this module knows the core (pure) and the router (which talks to workers and the ru-pool over NATS
through its own client); the framework (kite_shared.endpoints) decodes, traces and replies.
"""

from __future__ import annotations

import time

from prometheus_client import Histogram

from typing import Callable

from kite_shared import adapters, subjects
from kite_shared.adapter_store import load_stored_adapters
from kite_shared.adapters import Adapter
from kite_shared.config import FingerprinterConfig
from kite_shared.endpoints import Endpoint, Refusal
from kite_shared.messages import (AdapterAdminReply, AdapterAdminRequest, Admission, ErrorInfo,
                                  FingerprinterTelemetry, GenerateRequest)
from kite_shared.service import ServiceRuntime
from kite_shared.tiers.pool_client import PoolClient
from kite_shared.tracing import headers_with_context
from opentelemetry import trace
from kite_shared.window import TimeWindow
from kite_fingerprinter.core import Fingerprinter, RequestError
from kite_fingerprinter.router import Router

CF_SECONDS = Histogram("kite_cf_compute_seconds", "Block hash chain time per request (tokenization excluded)",
                       buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2))
TOKENIZE_SECONDS = Histogram("kite_tokenize_seconds", "Chat template + tokenization time per request",
                             buckets=(1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1))


class FingerprinterService:
    def __init__(self, rt: ServiceRuntime, core: Fingerprinter, cfg: FingerprinterConfig,
                 load_adapter: Callable[[str, str], Adapter] | None = None) -> None:
        """`load_adapter(name, path)`: adapters.loader for this base (None: `kite adapter load` refused)."""
        self.rt = rt
        self.core = core
        self.cfg = cfg
        self.load_adapter = load_adapter
        # issue 5: cache-aware routing to a worker's own subject (queue group as the fallback)
        self.router = Router(rt.nc, cfg, cfg.admit_timeout_s)
        window = cfg.telemetry_window_s
        self.tokenize_s = TimeWindow(window)  # one sample per request: seconds
        self.dispatch_s = TimeWindow(window)
        self.invalid = TimeWindow(window)  # one sample per request the core refused (never dispatched)
        self.refused = TimeWindow(window)  # one sample per dispatched request no worker accepted

    async def start(self) -> None:
        self.rt.set_heartbeat_fields(lambda: {"model": self.core.model_name,
                                              "max_context_tokens": self.core.max_context_tokens,
                                              "adapters": sorted(self.core.adapters),
                                              "model_fingerprints": self.model_fingerprints()})
        await self.rt.serve(
            Endpoint(subjects.FINGERPRINT, self.admit, span="kite.fingerprinter.admit"),
            Endpoint(subjects.ADAPTER_ADMIN, self.adapter_admin,
                     refuse=lambda error: AdapterAdminReply(service="fingerprinter", instance_id=self.rt.instance_id,
                                                            ok=False, error=error)),
            *self.router.endpoints())
        self.rt.publish_every(self.cfg.telemetry_interval_s, subjects.telemetry("fingerprinter"), self.telemetry)
        # Freshness: the ru-pool stops serving (and purges) blocks of any earlier fingerprint of this model.
        self.pool = PoolClient(self.rt.nc)
        await self.pool.model_fingerprint_changed(self.core.model_name, self.core.identity.fingerprint_hex)
        for name, adapter in self.core.adapters.items():  # an adapter whose content changed: likewise
            await self._announce(name, adapter)
        if self.load_adapter is not None:  # and those `kite adapter load` added while this one was away
            await load_stored_adapters(self.rt.nc, self.core.adapters, self.adapter_admin)

    def model_fingerprints(self) -> dict[str, str]:
        """Each model id a request may name -> the fingerprint its blocks (and answers) are computed under."""
        base = self.core.model_name
        found = {base: self.core.identity.fingerprint_hex}
        for name, adapter in self.core.adapters.items():
            found[name] = found[f"{base}:{name}"] = adapter.identity.fingerprint_hex
        return found

    async def _announce(self, name: str, adapter: Adapter | None) -> None:
        if adapter is not None:
            await self.pool.model_fingerprint_changed(f"{self.core.model_name}:{name}",
                                                      adapter.identity.fingerprint_hex)

    async def adapter_admin(self, req: AdapterAdminRequest) -> AdapterAdminReply:
        """`kite adapter load|unload`: requests name the adapter (and are hashed under it) from now on."""
        if self.load_adapter is None:
            raise Refusal(ErrorInfo(code="unsupported", message="this fingerprinter loads no adapters"))
        return await adapters.answer_admin(req, self.core.adapters, self.load_adapter, "fingerprinter",
                                           self.rt.instance_id, self._announce)

    async def admit(self, request: GenerateRequest) -> Admission:
        started = time.perf_counter()
        try:
            with TOKENIZE_SECONDS.time():
                tokenized = self.core.tokenize(request)
        except RequestError as exc:
            self.invalid.add(time.monotonic())
            raise Refusal(exc.info) from None
        tokenized_at = time.perf_counter()
        CF_SECONDS.observe(self.core.last_cf_seconds)
        # The router picks the worker (cache-aware, kite_fingerprinter/router.py) and maps no responders,
        # timeouts and invalid replies to refusals (no_worker, worker_timeout, internal_error).
        admission = await self.router.dispatch(tokenized, request.session_id,
                                               headers=headers_with_context() or None)
        now = time.monotonic()
        self.tokenize_s.add(now, tokenized_at - started)
        self.dispatch_s.add(now, time.perf_counter() - tokenized_at)
        if not admission.accepted:
            self.refused.add(now)
        trace.get_current_span().set_attribute("kite.accepted", admission.accepted)
        return admission

    def telemetry(self) -> FingerprinterTelemetry:
        now = time.monotonic()
        num_invalid = self.invalid.count(now)
        num_requests = self.dispatch_s.count(now) + num_invalid
        num_refused = num_invalid + self.refused.count(now)
        return FingerprinterTelemetry(
            instance_id=self.rt.instance_id,
            request_rate=round(num_requests / self.cfg.telemetry_window_s, 3),
            refused_rate=round(num_refused / num_requests, 4) if num_requests else 0.0,
            tokenize_p50_s=round(self.tokenize_s.percentile(now, 0.5), 6),
            tokenize_p99_s=round(self.tokenize_s.percentile(now, 0.99), 6),
            dispatch_p50_s=round(self.dispatch_s.percentile(now, 0.5), 6),
            dispatch_p99_s=round(self.dispatch_s.percentile(now, 0.99), 6),
            routed_hit_rate=round(self.router.routed_hit_rate(now), 4),
            num_live_workers=self.router.num_live_workers(), routing_mode=self.router.mode)

