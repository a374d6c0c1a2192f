"""One request is one trace: gateway -> fingerprinter -> worker -> ru-pool share a trace id, carried as a W3C
traceparent in NATS headers. The services run in this process (real NATS, real model) so one in-memory
exporter sees every span."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kite_cli.local_servers import free_port
from kite_shared.config import (CommonConfig, FingerprinterConfig, GatewayConfig, ModelConfig, RuPoolConfig,
                                TierConfig, WorkerConfig, load)
from kite_shared.service import ServiceRuntime
from tests.helpers import wait_until_async

MODEL = "smollm2-135m-instruct"


@pytest.fixture()
def exporter() -> InMemorySpanExporter:
    memory = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return memory


async def test_one_request_is_one_trace_across_every_service(nats_server, exporter, tmp_path, monkeypatch):
    from kite_fingerprinter.__main__ import build_core
    from kite_fingerprinter.service import FingerprinterService
    from kite_gateway.__main__ import start_gateway
    from kite_ru_pool.service import PoolService
    from kite_worker.__main__ import load_engine, start_worker

    monkeypatch.setenv("KITE_COLD_DIR", str(tmp_path / "cold"))
    monkeypatch.setenv("KITE_REDIS_URL", "")
    common = load(CommonConfig, {"KITE_NATS_URL": nats_server.url, "KITE_HEARTBEAT_INTERVAL_S": "0.2"})
    runtimes = {name: ServiceRuntime(name, common) for name in ("gateway", "fingerprinter", "worker", "ru-pool")}
    for rt in runtimes.values():
        await rt.start()
    pool = PoolService(load(RuPoolConfig), load(TierConfig), runtimes["ru-pool"].nc)
    await pool.start()
    model_cfg = load(ModelConfig, engine="transformers")  # in-process: the reference engine starts in seconds
    fingerprinter_cfg = load(FingerprinterConfig, admit_timeout_s=10.0)
    await FingerprinterService(runtimes["fingerprinter"], build_core(model_cfg, fingerprinter_cfg),
                               fingerprinter_cfg).start()
    worker_cfg = load(WorkerConfig)
    loaded = await asyncio.to_thread(load_engine, model_cfg, worker_cfg, runtimes["worker"].instance_id)
    await start_worker(runtimes["worker"], loaded, worker_cfg)
    port = free_port()
    gateway_cfg = load(GatewayConfig, {"KITE_GATEWAY_HTTP_PORT": str(port), "KITE_GATEWAY_GRPC_PORT": "0",
                                       "KITE_AUTH_ENABLED": "off"})
    await start_gateway(runtimes["gateway"], gateway_cfg)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            # uvicorn binds in the background; the worker's heartbeat must arrive (before: 200 tries 0.1 s apart)
            await wait_until_async(lambda: http.get("/health"), 20, "the gateway's /health to answer 200",
                                   done=lambda r: r.status_code == 200, interval_s=0.1, ignore=(httpx.ConnectError,))
            exporter.clear()
            r = await http.post("/v1/chat/completions", json={
                "model": MODEL, "temperature": 0, "max_tokens": 4,
                "messages": [{"role": "user", "content": "Tracing test: " + "one block of text " * 4}]})
            assert r.status_code == 200, r.text
        # The worker ends its span when the last stream event is published (before: 50 tries 0.1 s apart).
        await wait_until_async(lambda: {s.name for s in exporter.get_finished_spans()}, 5,
                               "the worker's kite.worker.generate span to end",
                               done=lambda names: "kite.worker.generate" in names, interval_s=0.1)
        spans = exporter.get_finished_spans()
        by_name = {s.name: s for s in spans}
        assert {"kite.gateway.generate", "kite.fingerprinter.admit", "kite.worker.generate",
                "kite.ru_pool.lookup"} <= set(by_name), sorted(by_name)
        trace_ids = {s.context.trace_id for s in by_name.values()
                     if s.name.startswith(("kite.gateway", "kite.fingerprinter", "kite.worker", "kite.ru_pool"))}
        assert len(trace_ids) == 1
        gateway_span = by_name["kite.gateway.generate"]
        assert by_name["kite.fingerprinter.admit"].parent.span_id == gateway_span.context.span_id
        assert by_name["kite.ru_pool.lookup"].parent.span_id == by_name["kite.worker.generate"].context.span_id
    finally:
        for rt in reversed(list(runtimes.values())):
            await rt.shutdown()
        await pool.stop()
