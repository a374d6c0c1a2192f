"""Gateway entrypoint: connect to NATS, track heartbeats, serve HTTP (and gRPC), drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from kite_shared import subjects
from kite_shared.config import GatewayConfig, load
from kite_shared.endpoints import Endpoint
from kite_shared.messages import Heartbeat
from kite_shared.security import ANONYMOUS_TENANT
from kite_shared.service import ServiceRuntime, run_service
from kite_gateway.auth import Authenticator
from kite_gateway.control import GatewayControl
from kite_gateway.fleet import Fleet
from kite_gateway.generation import GenerationClient
from kite_gateway.http_api import create_app
from kite_gateway.rate_limit import TenantRateLimiter
from kite_gateway.semantic import SemanticResponses

log = logging.getLogger("kite_gateway")


async def start_gateway(rt: ServiceRuntime, cfg: GatewayConfig) -> GenerationClient:
    fleet = Fleet(dead_after_s=cfg.worker_dead_after_s)

    async def on_heartbeat(beat: Heartbeat) -> None:
        fleet.observe(beat)

    await rt.serve(Endpoint(subjects.HEARTBEAT_WILDCARD, on_heartbeat))
    client = GenerationClient(nc=rt.nc, fleet=fleet, gateway_id=rt.instance_id.replace(".", "_"),
                              admit_timeout_s=cfg.admit_timeout_s,
                              stream_idle_timeout_s=cfg.stream_idle_timeout_s,
                              max_migrations=cfg.max_migrations,
                              first_event_timeout_s=cfg.first_event_timeout_s)
    # issue 5: telemetry (request and error rates) and the arbitrator's admission decisions
    control = GatewayControl(rt.instance_id, cfg.telemetry_window_s)
    client.admission = control.gate
    client.control = control  # read by the HTTP middleware
    await control.start(rt, cfg.telemetry_interval_s)

    authenticator = Authenticator.from_config(cfg)
    if not authenticator.enabled:
        log.warning("authentication is off (KITE_AUTH_ENABLED=off): every caller is tenant 'anonymous'")
    else:
        log.info("authentication on: %d tenant(s)", len(authenticator.tenants))
    limiter = TenantRateLimiter.from_config(cfg)
    _log_rate_limits(cfg, authenticator)
    semantic = SemanticResponses.from_config(cfg, fleet, origin=rt.instance_id)
    if semantic is not None:
        await semantic.start()  # the embedding model loads before the first request, not during it
        log.info("semantic response cache on for tenant(s) %s (delta %.3g)",
                 ",".join(sorted(semantic.tenants)), cfg.semantic_cache_delta)
    app = create_app(lambda: client, cfg.model_name, cfg.max_n, cfg.max_body_bytes, authenticator, limiter,
                     semantic)
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.http_port, log_level="warning",
                                           access_log=False, lifespan="off"))
    http_task = asyncio.create_task(server.serve())
    stoppers = []
    if cfg.grpc_port:
        from kite_gateway.grpc_api import start_grpc_server

        grpc_server = await start_grpc_server(client, cfg, authenticator, limiter, semantic)
        stoppers.append(lambda: grpc_server.stop(grace=30))

    async def drain() -> None:
        # uvicorn stops accepting, then waits for in-flight requests (including streams) to finish.
        server.should_exit = True
        for stop in stoppers:
            await stop()
        await http_task
        if semantic is not None:
            await semantic.close()  # after the last response: its answer's write is awaited here

    rt.on_drain(drain)
    log.info("HTTP on http://%s:%d", cfg.host, cfg.http_port)
    return client


def _log_rate_limits(cfg: GatewayConfig, authenticator: Authenticator) -> None:
    requests, tokens = cfg.tenant_request_overrides(), cfg.tenant_token_overrides()
    log.info("tenant rate limits per minute (in this gateway process): requests %s, tokens %s; "
             "overrides: requests %s, tokens %s", cfg.tenant_requests_per_minute or "unlimited",
             cfg.tenant_tokens_per_minute or "unlimited", requests or "none", tokens or "none")
    # A misspelt tenant silently keeps the default limit: say so at startup.
    known = authenticator.tenants if authenticator.enabled else {ANONYMOUS_TENANT}
    for tenant in sorted((set(requests) | set(tokens)) - known):
        log.warning("a rate limit override names tenant %r, which no API key belongs to", tenant)


def main() -> None:
    cfg = load(GatewayConfig)

    async def setup(rt: ServiceRuntime) -> None:
        await start_gateway(rt, cfg)

    run_service("gateway", setup)


if __name__ == "__main__":
    main()
