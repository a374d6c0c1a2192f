"""Worker entrypoint: config, the engine (loaded before joining NATS, so a worker that answers pings can
also serve), the handler table, drain on SIGTERM.

Everything the worker answers and runs is in `start_worker`; how each part works: kite_worker.service
(admission, cancellation, stream events, drain), kite_worker.control (telemetry, arbitrator decisions),
kite_worker.engines (the engine KITE_ENGINE names, behind one contract). Boundary: wires the others
together; no worker module imports this one.
"""

from __future__ import annotations

import sys

import torch
from prometheus_client import start_http_server

from kite_shared import adapters, model_store, subjects
from kite_shared.adapter_store import load_stored_adapters
from kite_shared.config import CommonConfig, ConfigError, ModelConfig, WorkerConfig, default_instance_id, load
from kite_shared.endpoints import Endpoint
from kite_shared.service import ServiceRuntime, exit_on_signal_until_connected, run_service
from kite_worker import codec_guard
from kite_worker.engines import create_engine
from kite_worker.service import LoadedModel, WorkerService


def load_engine(model_cfg: ModelConfig, worker_cfg: WorkerConfig, instance_id: str) -> LoadedModel:
    """The engine KITE_ENGINE names, its model loaded (vLLM: started)."""
    if worker_cfg.num_threads > 0:
        torch.set_num_threads(worker_cfg.num_threads)
    model_store.check_worker_device(model_cfg)
    local = model_store.prepare(model_cfg)
    identity = model_store.identity(local, model_cfg)
    # Before the engine takes the memory: lossy storage the guard refuses never serves (exact: no check).
    codec_guard.check(local, model_cfg, worker_cfg.kv_codec_min_agreement)
    served_adapters = adapters.load_configured(model_cfg, local, identity)
    load_adapter = adapters.loader(model_cfg, local, identity)
    engine = create_engine(local, identity, served_adapters, model_cfg, worker_cfg, instance_id)
    return LoadedModel(local, identity, engine, load_adapter)


async def start_worker(rt: ServiceRuntime, loaded: LoadedModel, cfg: WorkerConfig) -> WorkerService:
    """The worker's handler table: what it answers, what it runs until shutdown, how it drains."""
    worker = WorkerService(rt, loaded, cfg)
    rt.set_heartbeat_fields(worker.heartbeat_fields)  # from the next beat on: the model and its window
    await worker.start()  # the engine runs; the ru-pool hears that this worker's cache is empty
    await rt.serve(
        Endpoint(subjects.WORKER_CANCEL, worker.cancel),
        Endpoint(subjects.DECISIONS, worker.control.on_decision),
        Endpoint(subjects.ADAPTER_ADMIN, worker.adapter_admin, refuse=worker.adapter_reply),
    )
    # Subscribed while the worker takes requests: not on standby, not draining (WorkerService.join/leave).
    worker.take_requests_on(
        Endpoint(subjects.WORKER_GENERATE, worker.generate, span="kite.worker.admit"),
        Endpoint(subjects.worker_generate(rt.instance_id), worker.generate, span="kite.worker.admit",
                 name="kite.v1.worker.<instance>.generate"),
    )
    # Rounds that wait for their own work (a message due, a stream event, a block), run until shutdown.
    rt.every(0, worker.control.publish_when_due, "worker telemetry")
    rt.every(0, worker.publish_stream_events, "publishing stream events")
    for engine_round, name in loaded.engine.rounds():
        rt.every(0, engine_round, name)
    rt.on_drain(worker.drain)
    # Adapters loaded at run time before this worker started (KITE_ADAPTERS wins).
    await load_stored_adapters(rt.nc, loaded.engine.adapters, worker.adapter_admin)
    await worker.control.start()  # takes requests, unless standing by (KITE_WORKER_STANDBY)
    return worker


def main() -> None:
    exit_on_signal_until_connected("worker")  # loading the model takes a while: SIGTERM ends it
    try:
        model_cfg = load(ModelConfig)
        worker_cfg = load(WorkerConfig)
        instance_id = load(CommonConfig).instance_id or default_instance_id("worker")
        loaded = load_engine(model_cfg, worker_cfg, instance_id)
    except ConfigError as exc:  # a bad setting, lossy storage its guard refused, a KV budget too small: the reason, not a traceback
        sys.exit(f"worker: {exc}")
    if worker_cfg.metrics_port:
        start_http_server(worker_cfg.metrics_port, addr="0.0.0.0")

    async def setup(rt: ServiceRuntime) -> None:
        await start_worker(rt, loaded, worker_cfg)

    run_service("worker", setup)


if __name__ == "__main__":
    main()
