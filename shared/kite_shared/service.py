"""What every KITE service process does the same way: logging, NATS connection, heartbeat, ping, drain.

A service entrypoint is thin:

    async def setup(rt: ServiceRuntime) -> None:
        await rt.serve(Endpoint(subject, Request.decode, core_handler, refuse=..., queue=...), ...)
        rt.publish_every(cfg.telemetry_interval_s, subjects.telemetry("worker"), build_telemetry)
        rt.on_drain(wait_for_in_flight_work)        # optional

    run_service("worker", setup)

How endpoints decode, reply, trace and count, and how periodic work survives failures: `endpoints`.

Once setup has returned, the heap built so far (torch, transformers and vLLM's modules in a worker: about
720,000 objects) is frozen out of the garbage collector's reach (freeze_startup_heap), as vLLM's own API
server does: otherwise every full collection walks it on the event loop, a pause of about 0.4 s on this
2-core machine with every request in flight stopped, and CPython starts one whenever long-lived objects
have grown by a quarter. Full collections are timed in kite_gc_full_collection_seconds.

On SIGTERM or SIGINT the runtime marks itself draining (heartbeats say so), runs the drain callbacks
(which finish in-flight work), then drains the NATS connection (nats.py flushes pending publishes and
unsubscribes) and exits 0. A signal that arrives during setup is acted on once setup returns.

Before the NATS connection is up a service serves nothing, so SIGTERM or SIGINT then end the process at
once, with status 0 and the log line "<service> stopping before NATS connected" (see
exit_on_signal_until_connected): connecting retries for ever (a wrong password, no server yet), and an
orchestrator must not have to wait out its grace period and SIGKILL it. An entrypoint that loads something
slow (a model) before run_service calls exit_on_signal_until_connected first.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import ssl
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import nats
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription
from prometheus_client import Counter, Histogram

from kite_shared import subjects
from kite_shared.config import CommonConfig, ConfigError, default_instance_id, load
from kite_shared.endpoints import Endpoint, cancel_and_wait, request_id_var, run_every, tenant_var  # noqa: F401 (re-exported)
from kite_shared.messages import Heartbeat, Message, Ping, Pong
from kite_shared.security import redact_url
from kite_shared.tracing import current_trace_id, setup_tracing

log = logging.getLogger(__name__)

NATS_RECONNECTS = Counter("kite_nats_reconnects_total", "Times this process reconnected to NATS")
GC_FULL_COLLECTION_SECONDS = Histogram(
    "kite_gc_full_collection_seconds",
    "Full (generation 2) collections of Python's cyclic garbage collector: each stops every thread of the process",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


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


def setup_package_logging(service: str, instance_id: str, level: str,
                          packages: tuple[str, ...] = ("kite_shared", "kite_worker")) -> None:
    """KITE's JSON log lines for KITE code running inside another program's processes (the KV connector
    in vLLM's engine processes): only KITE's loggers get the handler, the host program's logging stays."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter(service, instance_id))
    handler.addFilter(RequestContextFilter())
    for package in packages:
        logger = logging.getLogger(package)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False


def nats_auth_options(common: CommonConfig | None) -> dict[str, Any]:
    """nats.connect keyword arguments for credentials and TLS from the registry (KITE_NATS_*).

    User/password, token and NKey seed file are exclusive choices of NATS server auth; credentials may
    also be in the URL (nats://user:pass@host), which is never logged unredacted. A CA, client cert or
    key turns TLS on (a tls:// URL turns it on with the system CAs). Errors name the variable and the
    file, never a secret or a file's contents.
    """
    if common is None:
        return {}
    options: dict[str, Any] = {}
    if common.nats_password and not common.nats_user:
        raise ConfigError("KITE_NATS_PASSWORD is set but KITE_NATS_USER is empty")
    if common.nats_user or common.nats_password:
        options.update(user=common.nats_user, password=common.nats_password)
    if common.nats_token:
        options["token"] = common.nats_token
    if sum(bool(x) for x in (common.nats_user or common.nats_password, common.nats_token,
                             common.nats_nkey_seed_file)) > 1:
        raise ConfigError("set only one of KITE_NATS_USER/KITE_NATS_PASSWORD, KITE_NATS_TOKEN and "
                          "KITE_NATS_NKEY_SEED_FILE")
    if common.nats_nkey_seed_file:
        options["nkeys_seed"] = str(_check_nkey_seed_file(Path(common.nats_nkey_seed_file).expanduser()))
    if common.nats_tls_ca or common.nats_tls_cert or common.nats_tls_key:
        if bool(common.nats_tls_cert) != bool(common.nats_tls_key):
            raise ConfigError("KITE_NATS_TLS_CERT and KITE_NATS_TLS_KEY go together")
        ca = str(Path(common.nats_tls_ca).expanduser()) if common.nats_tls_ca else None
        try:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
        except OSError as exc:  # ssl.SSLError is an OSError too
            raise ConfigError(f"KITE_NATS_TLS_CA={ca!r}: cannot load a CA bundle from it: {exc}") from None
        if common.nats_tls_cert:
            cert, key = (str(Path(p).expanduser()) for p in (common.nats_tls_cert, common.nats_tls_key))
            _warn_if_others_can_read(Path(key), "KITE_NATS_TLS_KEY")
            try:
                # Without a password callback OpenSSL would prompt on the terminal for an encrypted key.
                context.load_cert_chain(cert, key, password=_refuse_encrypted_key)
            except OSError as exc:
                raise ConfigError(f"KITE_NATS_TLS_CERT={cert!r} / KITE_NATS_TLS_KEY={key!r}: cannot load "
                                  f"the client certificate and key: {exc}") from None
        options["tls"] = context
    return options


def _refuse_encrypted_key() -> bytes:
    raise ConfigError("KITE_NATS_TLS_KEY is encrypted: give an unencrypted key file (readable only by "
                      "the service, mode 0600)")


def _warn_if_others_can_read(path: Path, variable: str) -> None:
    try:
        mode = path.stat().st_mode
    except OSError:
        return  # the load that follows reports it
    if mode & 0o077:
        log.warning("%s=%s can be read by other users (mode %o): chmod 600 it", variable, path, mode & 0o777)


def _check_nkey_seed_file(path: Path) -> Path:
    """`path` if it holds a valid NKey seed (nats-py reads it again at every connect to sign the nonce)."""
    try:
        import nkeys  # nats-py signs the server's nonce with it
    except ImportError:
        raise ConfigError("KITE_NATS_NKEY_SEED_FILE needs the `nkeys` package (pip install nkeys)") from None
    try:
        seed = bytearray(path.read_bytes().strip())
    except OSError as exc:
        raise ConfigError(f"KITE_NATS_NKEY_SEED_FILE={str(path)!r}: cannot read it: {exc.strerror}") from None
    try:
        nkeys.from_seed(seed).wipe()
    except Exception:  # nkeys' errors carry no text; never echo the file's contents
        raise ConfigError(f"KITE_NATS_NKEY_SEED_FILE={str(path)!r}: does not hold an NKey seed (one line "
                          "starting with SU, as written by `nk -gen user`)") from None
    finally:
        seed[:] = b"\0" * len(seed)
    _warn_if_others_can_read(path, "KITE_NATS_NKEY_SEED_FILE")
    return path


class _KiteNatsClient(NATS):
    """A nats-py client that never sends CONNECT (credentials included) in plaintext when TLS is wanted.

    nats-py upgrades a connection to TLS only when the server's INFO says `tls_required`, even for a tls://
    URL or a `tls=` context: a server without TLS (or anyone in the middle rewriting INFO) would receive
    the password or token in the clear. With TLS configured this client refuses the server instead
    (nats.errors.SecureConnWantedError, "secure connection not available").
    """

    def _connect_command(self) -> bytes:
        server = self._current_server
        scheme = server.uri.scheme if server is not None else ""
        wants_tls = "tls" in self.options or scheme == "tls"
        has_tls = bool(self.options.get("tls_handshake_first") or self._server_info.get("tls_required"))
        if wants_tls and not has_tls and scheme not in ("ws", "wss"):
            raise nats.errors.SecureConnWantedError()
        return super()._connect_command()


class NatsErrorLog:
    """The error callback of a NATS connection: logs each error, an unchanged repeat of one only with backoff.

    With max_reconnect_attempts=-1 nats-py's connect() itself retries for ever, the first connect included
    (it never raises while allow_reconnect is on), calling the error callback at every failed attempt, one
    each reconnect_time_wait: a wrong password would otherwise log two lines a second for as long as it
    stays wrong. A repeat is logged at its 2nd, 4th, 8th, ... occurrence and at least once a minute, with
    its count. An authorization violation or a refused TLS setup will not fix itself: logged at ERROR,
    the rest at WARNING. Secrets are scrubbed (_scrub). The counts restart at every (re)connect.
    """

    REPEAT_EVERY_S = 60.0

    def __init__(self, common: CommonConfig | None, clock: Callable[[], float] = time.monotonic) -> None:
        self._common = common
        self._clock = clock
        self._repeats: dict[str, tuple[int, float]] = {}  # error text -> (times seen, when last logged)
        self.failures = 0  # errors since the last (re)connect
        self.last = ""  # the last error's text (scrubbed)

    async def __call__(self, exc: Exception) -> None:
        text = _scrub(str(exc) or type(exc).__name__, self._common)
        if isinstance(exc, OSError) and self._common is not None:
            # A socket error names the address on asyncio's loop but not on uvloop's ("[Errno 111]
            # Connection refused"): say where the service was connecting, credentials left out.
            text += f" (connecting to {redact_url(self._common.nats_url)})"
        self.failures += 1
        self.last = text
        now = self._clock()
        seen, logged_at = self._repeats.get(text, (0, now))
        seen += 1
        if seen & (seen - 1) and now - logged_at < self.REPEAT_EVERY_S:  # not a power of two, not yet due
            self._repeats[text] = (seen, logged_at)
            return
        self._repeats[text] = (seen, now)
        level, hint = logging.WARNING, ""
        if "authorization violation" in text.lower() or isinstance(exc, nats.errors.AuthorizationError):
            level, hint = logging.ERROR, (" (the NATS server refuses this service's credentials: check "
                                          "KITE_NATS_USER/KITE_NATS_PASSWORD, KITE_NATS_TOKEN, "
                                          "KITE_NATS_NKEY_SEED_FILE or the user in KITE_NATS_URL)")
        elif isinstance(exc, (nats.errors.SecureConnWantedError, ssl.SSLCertVerificationError)):
            level = logging.ERROR
        repeats = f" ({seen} times)" if seen > 1 else ""
        log.log(level, "NATS error: %s%s%s", text, repeats, hint)

    def connected(self) -> None:
        self._repeats.clear()
        self.failures = 0


async def connect_nats(url: str, name: str, common: CommonConfig | None = None, *,
                       error_log: NatsErrorLog | None = None, **overrides: Any) -> NATS:
    """Connect with reconnects forever; credentials and TLS from `common` (nats_auth_options).

    Reconnects forever includes the first connect: this returns only once connected, however long that
    takes (a NATS server not up yet, a wrong password), logging why meanwhile (NatsErrorLog, or
    `error_log`). `overrides` replace nats.connect options (tests and CLIs: allow_reconnect=False, which
    makes a failed first attempt raise; connect_timeout=...).
    """
    options = nats_auth_options(common)
    errors = error_log or NatsErrorLog(common)

    async def on_error(exc: Exception) -> None:  # nats-py wants a coroutine function, not a callable object
        await errors(exc)

    async def on_disconnect() -> None:
        log.warning("NATS disconnected; reconnecting")

    async def on_reconnect() -> None:
        NATS_RECONNECTS.inc()
        errors.connected()
        log.info("NATS reconnected")

    options.update(
        servers=[u.strip() for u in url.split(",") if u.strip()],
        name=name,
        max_reconnect_attempts=-1,  # a NATS restart must never need a manual service restart
        reconnect_time_wait=0.5,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )
    options.update(overrides)
    nc = _KiteNatsClient()
    await nc.connect(**options)
    if errors.failures:
        log.info("NATS connected after %d failed attempt(s)", errors.failures)
    errors.connected()
    return nc


def _scrub(text: str, common: CommonConfig | None) -> str:
    """`text` with any configured NATS secret replaced, in case a client error echoes one."""
    if common is not None:
        for secret in (common.nats_password, common.nats_token):
            if secret:
                text = text.replace(secret, "***")
    return text


SUBSCRIPTIONS_CONFIRM_TIMEOUT_S = 5.0  # one PING round trip's wait (nats.py's default is 10 s)


async def confirm_subscriptions(nc: NATS) -> None:
    """Return once the server has processed every SUB sent so far (a PING round trip: it answers in order).
    A reconnect meanwhile drops the PING's pending answer (nats.py forgets its pongs) but sends every
    subscription again to the new connection: so an unanswered PING is asked again, until one is answered.
    Before, the flush's timeout ended the service's setup, and the process: a service that lost its
    connection while it started exited instead of serving once reconnected."""
    while True:
        try:
            await nc.flush(timeout=SUBSCRIPTIONS_CONFIRM_TIMEOUT_S)
            return
        except nats.errors.FlushTimeoutError:
            if nc.is_closed:
                raise
            log.warning("NATS did not confirm the subscriptions within %.0f s (connected: %s); asking again",
                        SUBSCRIPTIONS_CONFIRM_TIMEOUT_S, nc.is_connected)


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
        await self.serve(Endpoint(subjects.ping(self.service), Ping.decode, self._pong, queue=self.service))
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


def freeze_startup_heap(what: str) -> float:
    """Collect once, then move every object that survived into the permanent generation, which later
    collections skip (vLLM's `freeze_gc_heap`). What is frozen is still freed by reference counting; only
    a reference cycle among frozen objects is never collected, and a process's startup heap (modules,
    classes, the model's configuration) is kept for its lifetime anyway. Seconds it took."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    took = time.perf_counter() - started
    log.info("%s: froze %d objects of the startup heap out of garbage collection (%.0f ms)", what,
             gc.get_freeze_count(), took * 1e3)
    return took


class _FullCollectionTimer:
    """A `gc.callbacks` entry timing generation-2 collections into GC_FULL_COLLECTION_SECONDS (the young
    generations' collections, hundreds a second, return after one comparison)."""

    def __init__(self) -> None:
        self._started: float | None = None

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            GC_FULL_COLLECTION_SECONDS.observe(time.perf_counter() - self._started)
            self._started = None


def time_full_collections() -> None:
    """Time this process's full collections from now on (once per process)."""
    if not any(isinstance(callback, _FullCollectionTimer) for callback in gc.callbacks):
        gc.callbacks.append(_FullCollectionTimer())


def exit_on_signal_until_connected(service: str) -> None:
    """From now until run_service is connected to NATS, SIGTERM and SIGINT end the process at once, status 0.

    Until then the service serves nothing, so there is nothing to drain; but it may be busy for long
    (loading a model, or connecting to NATS, which retries for ever), and an orchestrator would otherwise
    wait out its grace period and SIGKILL it. run_service calls this first; an entrypoint that loads
    something slow before calling run_service calls it before that.
    """
    def on_signal(signum: int, _frame: object) -> None:
        _exit_before_connected(service, signum, "")

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)


def _exit_before_connected(service: str, signum: int, last_nats_error: str) -> None:
    why = f"; last NATS error: {last_nats_error}" if last_nats_error else ""
    log.warning("%s stopping before NATS connected (%s%s): nothing to drain", service,
                signal.Signals(signum).name, why)
    # Not SystemExit: raised into whatever was running (model loading, nats-py's connect loop) it could
    # be caught, or leave the interpreter waiting at exit for threads and atexit hooks (tracing exporters).
    _exit_now()


def terminate_children(grace_s: float = 5.0) -> None:
    """End every process this one started (vLLM's engine-core and model-runner processes, in the
    worker) before exiting, so none outlives it: they would hold gigabytes and spin on their queues.
    SIGTERM first, SIGKILL after `grace_s`."""
    import psutil

    # Python's multiprocessing resource tracker ignores SIGTERM by design and exits by itself when this
    # process does (its pipe closes): waiting for it would only add the whole grace period.
    children = [c for c in psutil.Process().children(recursive=True) if not _is_resource_tracker(c)]
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def _is_resource_tracker(proc) -> bool:
    import psutil

    try:
        return "multiprocessing.resource_tracker" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


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
                _exit_before_connected(service, signum, runtime.nats_errors.last)
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
            _exit_now()

    try:
        if uvloop:
            import uvloop as libuv_loop  # only where asked for: the others keep asyncio's loop
            libuv_loop.run(main())
        else:
            asyncio.run(main())
    finally:
        terminate_children()


def _exit_now() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    terminate_children()
    os._exit(0)
