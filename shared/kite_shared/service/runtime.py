"""What every KITE service process does the same way: connect, serve, heartbeat, answer pings, drain.

A service entrypoint is thin:

    async def setup(rt: ServiceRuntime) -> None:
        await rt.serve(Endpoint(subject, core_handler), ...)
        rt.publish_every(cfg.telemetry_interval_s, subjects.telemetry("worker"), build_telemetry)
        rt.on_drain(wait_for_in_flight_work)        # optional

    run_service("worker", setup)

How endpoints decode (by the table of subjects, kite_shared.subjects), reply, trace and count, and how
periodic work survives failures: `endpoints`.

run_service sets up the JSON logs (logs), connects (nats_connection), freezes the startup heap before and
after setup (heap) and stops the process's children on the way out (process).

On SIGTERM or SIGINT the runtime marks itself draining (heartbeats say so), runs the drain callbacks
(which finish in-flight work), then drains the NATS connection (nats.py flushes pending publishes and
unsubscribes) and exits 0. A signal that arrives during setup is acted on once setup returns; one that
arrives before NATS is connected ends the process at once (process.exit_on_signal_until_connected).

Boundary: the process's lifecycle and what it owns (the connection, the subscriptions, periodic tasks);
each concern it runs lives in its own module of this package.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from kite_shared import subjects
from kite_shared.config import CommonConfig, default_instance_id, load
from kite_shared.endpoints import Endpoint, cancel_and_wait, run_every
from kite_shared.messages import Heartbeat, Message, Ping, Pong
from kite_shared.security import redact_url
from kite_shared.service.heap import freeze_startup_heap, time_full_collections
from kite_shared.service.logs import setup_logging
from kite_shared.service.nats_connection import NatsErrorLog, confirm_subscriptions, connect_nats
from kite_shared.service.process import (STOP_SIGNALS, exit_before_connected, exit_now,
                                         exit_on_signal_until_connected, terminate_children)
from kite_shared.tracing import setup_tracing

log = logging.getLogger(__name__)

_BUS_CHECK_INTERVAL_S = 0.1  # how often a drain looks whether the bus is still there


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
        self.nats_errors = NatsErrorLog(common)
        self.bus_lost = False  # shutdown found NATS gone and closed without draining

    def on_drain(self, callback: Callable[[], Awaitable[None]]) -> None:
        self._drain_callbacks.append(callback)

    def set_heartbeat_fields(self, fields: Callable[[], dict[str, Any]]) -> None:
        self._heartbeat_fields = fields

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(service=self.service, instance_id=self.instance_id, started_at=self.started_at,
                         sent_at=time.time(), draining=self.draining, **self._heartbeat_fields())

    async def start(self) -> None:
        log.info("connecting to NATS %s", redact_url(self.common.nats_url))
        self.nc = await connect_nats(self.common.nats_url, self.instance_id, self.common,
                                     error_log=self.nats_errors)
        await self.serve(Endpoint(subjects.ping(self.service), self._pong))  # queue group: the service
        self.every(self.common.heartbeat_interval_s, self.publish_heartbeat, "heartbeat")

    async def serve(self, *endpoints: Endpoint) -> list[Subscription]:
        """Subscribe each endpoint (see kite_shared.endpoints), and return once the server has the
        subscriptions: nats.py only buffers a SUB, so a message published right after (a test's put, a
        peer's first request) could otherwise reach the server first and be dropped, or answered "no
        responders". nats.py's drain at shutdown unsubscribes them; a service that must stop taking work
        earlier unsubscribes the returned subscriptions."""
        subscriptions = [await self.nc.subscribe(e.subject, queue=e.queue, cb=e.on_message) for e in endpoints]
        await confirm_subscriptions(self.nc)
        return subscriptions

    def every(self, interval_s: float | Callable[[], float], work: Callable[[], Awaitable[None]],
              what: str) -> asyncio.Task:
        """Run `work` now and every `interval_s` until shutdown (after the drain callbacks, so telemetry
        still says "draining" while in-flight work finishes)."""
        task = asyncio.create_task(run_every(interval_s, work, what), name=what)
        self._tasks.append(task)
        return task

    def publish_every(self, interval_s: float | Callable[[], float], subject: str,
                      build: Callable[[], Message]) -> asyncio.Task:
        """Publish `build()` on `subject` now and every `interval_s` (telemetry)."""
        async def publish() -> None:
            await self.nc.publish(subject, build().encode())
        return self.every(interval_s, publish, f"publishing on {subject}")

    async def publish_heartbeat(self) -> None:
        await self.nc.publish(subjects.heartbeat(self.service), self.heartbeat().encode())

    async def _pong(self, _ping: Ping) -> Pong:
        return Pong(service=self.service, instance_id=self.instance_id, uptime_s=time.time() - self.started_at)

    async def shutdown(self) -> None:
        self.draining = True
        if self.nc is not None and self.nc.is_connected:
            try:
                await self.publish_heartbeat()  # tell the fleet now, not one interval later
            except Exception as exc:
                log.debug("final heartbeat not sent: %s", exc)
        for callback in self._drain_callbacks:
            await callback()
        await cancel_and_wait(self._tasks)
        await self._close_connection()

    async def _close_connection(self) -> None:
        """Drain while the bus is there (replies and publishes in flight still go out); close at once
        when it is not, or goes away meanwhile: nothing could be delivered, and nats-py's drain would sit
        out its flush timeouts (10 s each) while a supervisor that lost the bus waits for us to exit."""
        nc = self.nc
        if nc is None or nc.is_closed:
            return
        drain = None
        if nc.is_connected:  # (true while draining too)
            drain = asyncio.ensure_future(nc.drain())
            while not drain.done() and nc.is_connected:
                await asyncio.wait({drain}, timeout=_BUS_CHECK_INTERVAL_S)
            if drain.done():
                drain.result()  # a drain error is a bug worth a traceback
                return
            log.warning("NATS went away while draining: closing without it")
            drain.cancel()
        self.bus_lost = True
        if not nc.is_closed:
            try:
                await nc.close()
            except (ConnectionError, OSError) as exc:  # the socket was reset under the close: it is closed
                log.info("NATS connection closed with %r", exc)
        if drain is not None:  # closing ends what the drain still waited for (its final flush)
            await asyncio.wait({drain}, timeout=1.0)
            if drain.done() and not drain.cancelled():
                drain.exception()  # retrieved: the bus was gone, its error says nothing new


def run_service(service: str, setup: Callable[[ServiceRuntime], Awaitable[None]], uvloop: bool = False) -> None:
    """Entrypoint body shared by every service: config, connect, setup, wait for a signal, drain.

    `uvloop`: run on uvloop's event loop (libuv) instead of asyncio's. For a service whose work is many
    small messages, where the loop and the sockets are most of a message's CPU: measured on the ru-pool's
    lookups (issue 14), ~70% of a lookup's CPU was kernel socket work, asyncio and nats-py."""
    exit_on_signal_until_connected(service)
    common = load(CommonConfig)
    runtime = ServiceRuntime(service, common)
    setup_logging(service, runtime.instance_id, common.log_level)
    setup_tracing(service)
    time_full_collections()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(signum: int) -> None:
            if runtime.nc is None:  # still connecting (nats-py retries for ever)
                exit_before_connected(service, signum, runtime.nats_errors.last)
            stop.set()  # connected: drain once setup (if still running) has returned

        for sig in STOP_SIGNALS:
            # Through the event loop (its wakeup fd), not signal.signal: prompt even while the loop sleeps.
            loop.add_signal_handler(sig, on_signal, sig)
        # Twice: the imports (and a worker's engine) before anything is served, what setup built after;
        # the second walks only what is new, so a request subscribed during setup never waits for the first.
        freeze_startup_heap(f"{service} before setup")
        await runtime.start()
        await setup(runtime)
        freeze_startup_heap(f"{service} after setup")
        log.info("%s ready (instance %s, NATS %s)", service, runtime.instance_id, redact_url(common.nats_url))
        await stop.wait()
        log.info("%s draining", service)
        await runtime.shutdown()
        log.info("%s stopped", service)
        if runtime.bus_lost:
            # Nothing is left to deliver, and nats-py's reconnect task can outlive its cancellation
            # (seen: 15 s of reconnect attempts after "stopped"), holding asyncio.run's cleanup.
            exit_now()

    try:
        if uvloop:
            import uvloop as libuv_loop  # only where asked for: the others keep asyncio's loop
            libuv_loop.run(main())
        else:
            asyncio.run(main())
    finally:
        terminate_children()
