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
import contextvars
import json
import logging
import signal
import ssl
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from prometheus_client import Counter

from kite_shared import subjects
from kite_shared.config import CommonConfig, ConfigError, default_instance_id, load
from kite_shared.messages import Heartbeat, Ping, Pong
from kite_shared.security import redact_url
from kite_shared.tracing import current_trace_id, setup_tracing

log = logging.getLogger(__name__)

NATS_RECONNECTS = Counter("kite_nats_reconnects_total", "Times this process reconnected to NATS")


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


# Set by handlers for the request they are working on; every log record made meanwhile carries them.
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("kite_request_id", default="")
tenant_var: contextvars.ContextVar[str] = contextvars.ContextVar("kite_tenant", default="")


class RequestContextFilter(logging.Filter):
    """Adds request id, tenant (never the key) and trace id to records that do not set them."""

    def filter(self, record: logging.LogRecord) -> bool:
        for attr, value in (("request_id", request_id_var.get()), ("tenant", tenant_var.get()),
                            ("trace_id", current_trace_id())):
            if value and not hasattr(record, attr):
                setattr(record, attr, value)
        return True


def setup_logging(service: str, instance_id: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter(service, instance_id))
    handler.addFilter(RequestContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def nats_auth_options(common: CommonConfig | None) -> dict[str, Any]:
    """nats.connect keyword arguments for credentials and TLS from the registry (KITE_NATS_*).

    User/password, token and NKey seed file are exclusive choices of NATS server auth; credentials may
    also be in the URL (nats://user:pass@host), which is never logged unredacted. A CA, client cert or
    key turns TLS on (a tls:// URL turns it on with the system CAs).
    """
    if common is None:
        return {}
    options: dict[str, Any] = {}
    if common.nats_user or common.nats_password:
        options.update(user=common.nats_user, password=common.nats_password)
    if common.nats_token:
        options["token"] = common.nats_token
    if common.nats_nkey_seed_file:
        try:
            import nkeys  # noqa: F401  (nats-py signs the server's nonce with it)
        except ImportError:
            raise ConfigError("KITE_NATS_NKEY_SEED_FILE needs the `nkeys` package (pip install nkeys)") from None
        if not Path(common.nats_nkey_seed_file).expanduser().is_file():
            raise ConfigError("KITE_NATS_NKEY_SEED_FILE: no such file")
        options["nkeys_seed"] = str(Path(common.nats_nkey_seed_file).expanduser())
    if sum(bool(x) for x in (common.nats_user or common.nats_password, common.nats_token,
                             common.nats_nkey_seed_file)) > 1:
        raise ConfigError("set only one of KITE_NATS_USER/KITE_NATS_PASSWORD, KITE_NATS_TOKEN and "
                          "KITE_NATS_NKEY_SEED_FILE")
    if common.nats_tls_ca or common.nats_tls_cert or common.nats_tls_key:
        if bool(common.nats_tls_cert) != bool(common.nats_tls_key):
            raise ConfigError("KITE_NATS_TLS_CERT and KITE_NATS_TLS_KEY go together")
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=common.nats_tls_ca or None)
        if common.nats_tls_cert:
            context.load_cert_chain(common.nats_tls_cert, common.nats_tls_key)
        options["tls"] = context
    return options


async def connect_nats(url: str, name: str, common: CommonConfig | None = None) -> NATS:
    """Connect with reconnects forever; credentials and TLS from `common` (nats_auth_options)."""
    options = nats_auth_options(common)

    async def on_error(exc: Exception) -> None:
        log.warning("NATS error: %s", _scrub(str(exc), common))

    async def on_disconnect() -> None:
        log.warning("NATS disconnected; reconnecting")

    async def on_reconnect() -> None:
        NATS_RECONNECTS.inc()
        log.info("NATS reconnected")

    return await nats.connect(
        servers=[u.strip() for u in url.split(",") if u.strip()],
        name=name,
        max_reconnect_attempts=-1,  # a NATS restart must never need a manual service restart
        reconnect_time_wait=0.5,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        **options,
    )


def _scrub(text: str, common: CommonConfig | None) -> str:
    """`text` with any configured NATS secret replaced, in case a client error echoes one."""
    if common is not None:
        for secret in (common.nats_password, common.nats_token):
            if secret:
                text = text.replace(secret, "***")
    return text


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
        self.nc = await connect_nats(self.common.nats_url, self.instance_id, self.common)
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
    setup_tracing(service)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await runtime.start()
        await setup(runtime)
        log.info("%s ready (instance %s, NATS %s)", service, runtime.instance_id, redact_url(common.nats_url))
        await stop.wait()
        log.info("%s draining", service)
        await runtime.shutdown()
        log.info("%s stopped", service)

    asyncio.run(main())
