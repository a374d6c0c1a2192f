"""What every KITE service process does the same way: logging, NATS connection, heartbeat, ping, drain.

A service entrypoint is thin:

    async def setup(rt: ServiceRuntime) -> None:
        await rt.nc.subscribe(..., cb=handler)      # register handlers
        rt.on_drain(wait_for_in_flight_work)        # optional

    run_service("worker", setup, heartbeat_fields=lambda: {...})

On SIGTERM or SIGINT the runtime marks itself draining (heartbeats say so), runs the drain callbacks
(which finish in-flight work), then drains the NATS connection (nats.py flushes pending publishes and
unsubscribes) and exits 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from typing import Any, Awaitable, Callable

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from kite_shared import subjects
from kite_shared.config import CommonConfig, default_instance_id, load
from kite_shared.messages import Heartbeat, Ping, Pong

log = logging.getLogger(__name__)


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


def setup_logging(service: str, instance_id: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter(service, instance_id))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


async def connect_nats(url: str, name: str) -> NATS:
    async def on_error(exc: Exception) -> None:
        log.warning("NATS error: %s", exc)

    async def on_disconnect() -> None:
        log.warning("NATS disconnected; reconnecting")

    async def on_reconnect() -> None:
        log.info("NATS reconnected")

    return await nats.connect(
        servers=[u.strip() for u in url.split(",") if u.strip()],
        name=name,
        max_reconnect_attempts=-1,  # a NATS restart must never need a manual service restart
        reconnect_time_wait=0.5,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )


class ServiceRuntime:
    def __init__(self, service: str, common: CommonConfig) -> None:
        self.service = service
        self.common = common
        self.instance_id = common.instance_id or default_instance_id(service)
        self.started_at = time.time()
        self.draining = False
        self.nc: NATS = None  # type: ignore[assignment]  # set by start()
        self._drain_callbacks: list[Callable[[], Awaitable[None]]] = []
        self._heartbeat_fields: Callable[[], dict[str, Any]] = dict
        self._tasks: list[asyncio.Task] = []

    def on_drain(self, callback: Callable[[], Awaitable[None]]) -> None:
        self._drain_callbacks.append(callback)

    def set_heartbeat_fields(self, fields: Callable[[], dict[str, Any]]) -> None:
        self._heartbeat_fields = fields

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(service=self.service, instance_id=self.instance_id, started_at=self.started_at,
                         sent_at=time.time(), draining=self.draining, **self._heartbeat_fields())

    async def start(self) -> None:
        self.nc = await connect_nats(self.common.nats_url, self.instance_id)
        await self.nc.subscribe(subjects.ping(self.service), queue=self.service, cb=self._on_ping)
        self._tasks.append(asyncio.create_task(self._heartbeat_loop()))

    async def publish_heartbeat(self) -> None:
        await self.nc.publish(subjects.heartbeat(self.service), self.heartbeat().encode())

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                await self.publish_heartbeat()
            except Exception as exc:  # reconnecting: the next beat will go out
                log.debug("heartbeat not sent: %s", exc)
            await asyncio.sleep(self.common.heartbeat_interval_s)

    async def _on_ping(self, msg: Msg) -> None:
        if not msg.reply:
            return
        try:
            Ping.decode(msg.data)
        except ValueError as exc:
            log.warning("bad ping: %s", exc)
            return
        pong = Pong(service=self.service, instance_id=self.instance_id,
                    uptime_s=time.time() - self.started_at)
        await msg.respond(pong.encode())

    async def shutdown(self) -> None:
        self.draining = True
        if self.nc is not None and self.nc.is_connected:
            try:
                await self.publish_heartbeat()  # tell the fleet now, not one interval later
            except Exception as exc:
                log.debug("final heartbeat not sent: %s", exc)
        for callback in self._drain_callbacks:
            await callback()
        for task in self._tasks:
            task.cancel()
        if self.nc is not None and not self.nc.is_closed:
            await self.nc.drain()


def run_service(service: str, setup: Callable[[ServiceRuntime], Awaitable[None]]) -> None:
    """Entrypoint body shared by every service: config, connect, setup, wait for a signal, drain."""
    common = load(CommonConfig)
    runtime = ServiceRuntime(service, common)
    setup_logging(service, runtime.instance_id, common.log_level)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await runtime.start()
        await setup(runtime)
        log.info("%s ready (instance %s, NATS %s)", service, runtime.instance_id, common.nats_url)
        await stop.wait()
        log.info("%s draining", service)
        await runtime.shutdown()
        log.info("%s stopped", service)

    asyncio.run(main())
