"""Arbitrator entrypoint: config, the metrics port, then the service (kite_arbitrator/service.py) on the
shared runtime (kite_shared.service.run_service: NATS connection, heartbeat, drain on SIGTERM)."""

from __future__ import annotations

from prometheus_client import start_http_server

from kite_shared.config import ArbitratorConfig, load
from kite_shared.service import ServiceRuntime, run_service
from kite_arbitrator.service import ArbitratorService


def main() -> None:
    cfg = load(ArbitratorConfig)
    if cfg.metrics_port:
        start_http_server(cfg.metrics_port, addr="0.0.0.0")

    async def setup(rt: ServiceRuntime) -> None:
        await ArbitratorService(rt, cfg).start()

    run_service("arbitrator", setup)


if __name__ == "__main__":
    main()
