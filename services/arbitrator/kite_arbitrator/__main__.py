"""Arbitrator entrypoint. Today it listens to heartbeats and telemetry and logs what it receives; the
decision engine (write policy, admission, routing weights, warm capacity) lands with issue 5."""

from __future__ import annotations

import logging
from collections import Counter

from nats.aio.msg import Msg
from prometheus_client import Counter as MetricCounter, start_http_server

from kite_shared import subjects
from kite_shared.config import ArbitratorConfig, load
from kite_shared.messages import Heartbeat, MessageError
from kite_shared.service import ServiceRuntime, run_service

log = logging.getLogger("kite_arbitrator")

RECEIVED = MetricCounter("kite_arbitrator_messages_total", "Messages the arbitrator received, by kind",
                         ["kind"])


class ArbitratorService:
    def __init__(self, rt: ServiceRuntime) -> None:
        self.rt = rt
        self.received: Counter[str] = Counter()  # subject -> messages seen
        self.live: dict[str, Heartbeat] = {}  # instance -> last heartbeat

    async def start(self) -> None:
        await self.rt.nc.subscribe(subjects.HEARTBEAT_WILDCARD, cb=self.on_heartbeat)
        await self.rt.nc.subscribe(subjects.TELEMETRY_WILDCARD, cb=self.on_telemetry)

    async def on_heartbeat(self, msg: Msg) -> None:
        try:
            beat = Heartbeat.decode(msg.data)
        except MessageError as exc:
            log.warning("bad heartbeat on %s: %s", msg.subject, exc)
            return
        if beat.instance_id not in self.live:
            log.info("new %s instance %s", beat.service, beat.instance_id)
        self.live[beat.instance_id] = beat
        self.received[msg.subject] += 1
        RECEIVED.labels("heartbeat").inc()
        log.debug("heartbeat %s running=%d queued=%d", beat.instance_id, beat.num_running, beat.num_queued)

    async def on_telemetry(self, msg: Msg) -> None:
        self.received[msg.subject] += 1
        RECEIVED.labels("telemetry").inc()
        log.info("telemetry on %s (%d bytes)", msg.subject, len(msg.data))


def main() -> None:
    cfg = load(ArbitratorConfig)
    if cfg.metrics_port:
        start_http_server(cfg.metrics_port, addr="0.0.0.0")

    async def setup(rt: ServiceRuntime) -> None:
        await ArbitratorService(rt).start()

    run_service("arbitrator", setup)


if __name__ == "__main__":
    main()
