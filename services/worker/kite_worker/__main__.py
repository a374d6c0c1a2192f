"""Worker entrypoint: config, load the model (before joining NATS, so a worker that answers pings can also
serve), start the service (kite_worker/service.py), drain on SIGTERM."""

from __future__ import annotations

from prometheus_client import start_http_server

from kite_shared.config import CommonConfig, ModelConfig, WorkerConfig, default_instance_id, load
from kite_shared.service import ServiceRuntime, exit_on_signal_until_connected, run_service
from kite_worker.service import WorkerService, load_engine


def main() -> None:
    exit_on_signal_until_connected("worker")  # loading the model takes a while: SIGTERM ends it
    model_cfg = load(ModelConfig)
    worker_cfg = load(WorkerConfig)
    instance_id = load(CommonConfig).instance_id or default_instance_id("worker")
    loaded = load_engine(model_cfg, worker_cfg, instance_id)
    if worker_cfg.metrics_port:
        start_http_server(worker_cfg.metrics_port, addr="0.0.0.0")

    async def setup(rt: ServiceRuntime) -> None:
        await WorkerService(rt, loaded, worker_cfg).start()

    run_service("worker", setup)


if __name__ == "__main__":
    main()
