"""Fingerprinter entrypoint: tokenize + fingerprint requests, hand them to a worker, relay its admission."""

from __future__ import annotations

import logging

from nats.aio.msg import Msg
from prometheus_client import Histogram, start_http_server

from kite_shared import model_store, subjects
from kite_shared.config import FingerprinterConfig, ModelConfig, load
from kite_shared.messages import Admission, ErrorInfo, GenerateRequest, MessageError
from kite_shared.service import ServiceRuntime, exit_on_signal_until_connected, request_id_var, run_service
from kite_shared.tiers.pool_client import PoolClient
from kite_shared.tracing import headers_with_context, start_span_from_headers, use_span
from kite_fingerprinter.core import Fingerprinter, RequestError
from kite_fingerprinter.router import Router

log = logging.getLogger("kite_fingerprinter")

CF_SECONDS = Histogram("kite_cf_compute_seconds", "Block hash chain time per request (tokenization excluded)",
                       buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2))
TOKENIZE_SECONDS = Histogram("kite_tokenize_seconds", "Chat template + tokenization time per request",
                             buckets=(1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1))


class FingerprinterService:
    def __init__(self, rt: ServiceRuntime, core: Fingerprinter, worker_timeout_s: float,
                 cfg: FingerprinterConfig | None = None) -> None:
        self.rt = rt
        self.core = core
        self.worker_timeout_s = worker_timeout_s
        # issue 5: cache-aware routing to a worker's own subject (queue group as the fallback)
        self.router = Router(rt.nc, cfg or load(FingerprinterConfig), worker_timeout_s)

    async def start(self) -> None:
        self.rt.set_heartbeat_fields(lambda: {"model": self.core.model_name,
                                              "max_context_tokens": self.core.max_context_tokens})
        await self.router.start()
        await self.rt.nc.subscribe(subjects.FINGERPRINT, queue=subjects.FINGERPRINTER_QUEUE, cb=self.on_request)
        # Freshness: the ru-pool stops serving (and purges) blocks of any earlier fingerprint of this model.
        await PoolClient(self.rt.nc).model_fingerprint_changed(self.core.model_name,
                                                               self.core.identity.fingerprint_hex)

    async def on_request(self, msg: Msg) -> None:
        span = start_span_from_headers("kite.fingerprinter.admit", msg.headers)
        with use_span(span):
            try:
                admission = await self._admit(msg.data)
                span.set_attribute("kite.accepted", admission.accepted)
            finally:
                span.end()
        if msg.reply:
            await msg.respond(admission.encode())

    async def _admit(self, data: bytes) -> Admission:
        try:
            request = GenerateRequest.decode(data)
        except MessageError as exc:
            return Admission(accepted=False, error=ErrorInfo(code="invalid_message", message=str(exc)))
        request_id_var.set(request.request_id)
        try:
            with TOKENIZE_SECONDS.time():
                tokenized = self.core.tokenize(request)
        except RequestError as exc:
            return Admission(accepted=False, error=exc.info)
        CF_SECONDS.observe(self.core.last_cf_seconds)
        # The router picks the worker (cache-aware, kite_fingerprinter/router.py) and maps no responders,
        # timeouts and invalid replies to refusals (no_worker, worker_timeout, internal_error).
        return await self.router.dispatch(tokenized, request.session_id, headers=headers_with_context() or None)


def build_core(model_cfg: ModelConfig, cfg: FingerprinterConfig) -> Fingerprinter:
    local = model_store.prepare(model_cfg)
    return Fingerprinter(
        tokenizer=model_store.load_tokenizer(local), identity=model_store.identity(local, model_cfg),
        model_name=local.name, block_size=model_cfg.block_size, max_context_tokens=local.max_context_tokens,
        default_max_tokens=cfg.default_max_tokens)


def main() -> None:
    exit_on_signal_until_connected("fingerprinter")  # loading the tokenizer may take a while
    model_cfg = load(ModelConfig)
    cfg = load(FingerprinterConfig)
    core = build_core(model_cfg, cfg)
    if cfg.metrics_port:
        start_http_server(cfg.metrics_port, addr="0.0.0.0")

    async def setup(rt: ServiceRuntime) -> None:
        await FingerprinterService(rt, core, cfg.admit_timeout_s, cfg).start()

    run_service("fingerprinter", setup)


if __name__ == "__main__":
    main()
