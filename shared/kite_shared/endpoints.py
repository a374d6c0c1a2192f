"""How a KITE service answers NATS messages and runs periodic work, written once for every service.

nats.py's `micro` is the model: a service declares its endpoints (subject + handler) and the framework does
the rest, the same way everywhere:

    rt.serve(
        Endpoint(subjects.POOL_LOOKUP, pool.lookup, span="kite.ru_pool.lookup"),
        Endpoint(subjects.POOL_BLOCK_EVENTS, pool.on_block_event),  # an event: no reply
    )
    rt.publish_every(cfg.telemetry_interval_s, subjects.telemetry("ru-pool"), pool.telemetry)

What a subject carries, its reply, how that reply carries an error and the subscribers' queue group come
from the table of subjects (kite_shared.subjects.TABLE, REFUSALS); an endpoint gives its own `refuse` only
where the error reply names its responder (AdapterAdminReply). A subject missing from the table is refused
when the Endpoint is made.

For each message the framework
1. continues the caller's trace (traceparent in the NATS headers) in a span named `span`, if one is named;
2. decodes the bytes as the subject's message; a MessageError is answered with the error reply
   (`refusal(ErrorInfo("invalid_message"))`), or, for a subject whose reply carries no error (an event,
   a ping), logged and dropped: there is no one to tell;
3. sets the request context (request id, tenant) that every log line then carries;
4. awaits `handle(request)`, which returns the reply (or None: nothing to send). A handler refuses a request
   by raising `Refusal(ErrorInfo)`; any other exception is a bug: logged with its traceback and answered
   with `internal_error`, so an asker never waits out its timeout and the subscription lives on;
5. sends the reply if the message has a reply subject, and counts the outcome and the handling time
   (`kite_endpoint_messages_total{endpoint, outcome}`, `kite_endpoint_seconds{endpoint}`).

Handlers run one message at a time per endpoint (nats.py awaits a subscription's callback before taking
its next message), so a handler that starts long work spawns it and returns its reply first.

Periodic work (`every`, `publish_every`) runs until the service shuts down. A bus that is away (NATS
reconnecting, closed) skips a round quietly: the next one goes out. Any other exception is logged with its
traceback (once per distinct error, so a failure every second does not flood the log) and the loop goes on.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Generic, TypeVar

import nats.errors
from prometheus_client import Counter, Histogram
from pydantic import BaseModel

from kite_shared import subjects
from kite_shared.messages import ErrorInfo, Message, MessageError
from kite_shared.tracing import server_span, use_span

log = logging.getLogger(__name__)

Req = TypeVar("Req")

# Set for the request being handled (by Endpoint, or by a handler itself); every log record made meanwhile
# carries them (kite_shared.service.logs.RequestContextFilter).
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("kite_request_id", default="")
tenant_var: contextvars.ContextVar[str] = contextvars.ContextVar("kite_tenant", default="")

ENDPOINT_MESSAGES = Counter("kite_endpoint_messages_total",
                            "NATS messages handled by an endpoint, by outcome (ok, the refusal's error code, "
                            "invalid_message, internal_error)", ["endpoint", "outcome"])
ENDPOINT_SECONDS = Histogram("kite_endpoint_seconds", "Time from receiving a message to having replied",
                             ["endpoint"], buckets=(1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5, 2.5))


class Refusal(Exception):
    """Raised by a handler to answer with an error instead of a result (the endpoint's error reply)."""

    def __init__(self, error: ErrorInfo) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(frozen=True)
class Endpoint(Generic[Req]):
    subject: str  # a subject of kite_shared.subjects.TABLE (or an instance of a row's pattern)
    handle: Callable[[Req], Awaitable[Message | None]]
    # The reply that carries an error, for a reply type that names its responder; else the table's.
    refuse: Callable[[ErrorInfo], Message] | None = None
    span: str = ""  # trace span around the handling ("" = none: high-rate events are not traced)
    name: str = ""  # metrics label; the subject when empty
    # From the table: the subject's decoder (a Message class's, a OneOf's, or bytes for raw payloads); the
    # reply that carries an error (invalid message, refusal, handler bug), None where nobody waits for an
    # answer or the reply carries no error, so a bad message is logged and dropped; the queue group (each
    # message goes to one member; "" = every subscriber gets it).
    decode: Callable[[bytes], Req] = field(init=False, repr=False, compare=False)
    refusal: Callable[[ErrorInfo], Message] | None = field(init=False, repr=False, compare=False)
    queue: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        spec = subjects.spec_of(self.subject)
        if self.refuse is not None and spec.reply is None:
            raise ValueError(f"{self.subject} is published: nobody waits for a reply to refuse with")
        # A frozen dataclass's derived fields are set once, here.
        object.__setattr__(self, "decode", spec.decode)
        object.__setattr__(self, "refusal", self.refuse or spec.refusal)
        object.__setattr__(self, "queue", spec.queue_for(self.subject))

    @property
    def label(self) -> str:
        return self.name or self.subject

    # The endpoint's metric children, looked up once: `.labels()` checks and joins the label values and
    # takes the metric's lock on every call, a measurable share of a busy endpoint's per-message CPU.
    # (cached_property writes the instance __dict__ directly, which a frozen dataclass allows.)
    @functools.cached_property
    def _seconds(self) -> Any:
        return ENDPOINT_SECONDS.labels(self.label)

    @functools.cached_property
    def _messages(self) -> dict[str, Any]:
        return {}  # outcome -> ENDPOINT_MESSAGES child, filled as outcomes occur

    def _count(self, outcome: str) -> None:
        child = self._messages.get(outcome)
        if child is None:
            child = self._messages[outcome] = ENDPOINT_MESSAGES.labels(self.label, outcome)
        child.inc()

    async def answer(self, data: bytes, headers: dict[str, str] | None = None) -> Message | None:
        """The reply to one message (None when there is nothing to send). Never raises but for
        cancellation: every failure becomes an error reply or a log line."""
        started = time.perf_counter()
        # None when tracing is off and the message carries no trace context (tracing.server_span): no
        # span to record or pass on, so none is made.
        span = server_span(self.span, headers) if self.span else None
        if span is not None:
            with use_span(span):
                try:
                    reply, outcome = await self._answer(data)
                finally:
                    span.end()
        else:
            reply, outcome = await self._answer(data)
        self._count(outcome)
        self._seconds.observe(time.perf_counter() - started)
        return reply

    async def _answer(self, data: bytes) -> tuple[Message | None, str]:
        try:
            request = self.decode(data)
        except MessageError as exc:
            if self.refusal is None:
                log.warning("dropped a bad message on %s: %s", self.subject, exc)
                return None, "invalid_message"
            return self.refusal(ErrorInfo(code="invalid_message", message=str(exc))), "invalid_message"
        _set_request_context(request)
        try:
            return await self.handle(request), "ok"
        except Refusal as exc:
            if self.refusal is None:
                log.warning("refused an event on %s: %s", self.subject, exc.error.message)
                return None, exc.error.code
            return self.refusal(exc.error), exc.error.code
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("handler for %s failed", self.subject)
            if self.refusal is None:
                return None, "internal_error"
            return self.refusal(ErrorInfo(code="internal_error",
                                          message=f"the service failed to handle {self.label}")), "internal_error"

    async def on_message(self, msg: Any) -> None:
        """nats.py subscription callback."""
        reply = await self.answer(msg.data, msg.headers)
        if reply is not None and msg.reply:
            try:
                await msg.respond(reply.encode())
            except nats.errors.Error as exc:  # the bus went away meanwhile: the asker times out
                log.warning("reply on %s not sent: %r", self.subject, exc)


_CONTEXT_ATTRS = ("request_id", "tenant")


@functools.cache
def _context_attrs(cls: type) -> tuple[str, ...]:
    """Which of _CONTEXT_ATTRS a request of type `cls` may have. A pydantic model's attributes are fixed
    by its class (its fields, or a property), so a message without them (a lookup, a get) is not asked:
    asking costs an AttributeError raised from pydantic's Python-level __getattr__, twice per message.
    Anything else (raw bytes, a model that allows extra fields) is asked on every instance."""
    if issubclass(cls, BaseModel) and cls.model_config.get("extra") != "allow":
        return tuple(a for a in _CONTEXT_ATTRS if a in cls.model_fields or hasattr(cls, a))
    return _CONTEXT_ATTRS


def _set_request_context(request: object) -> None:
    attrs = _context_attrs(type(request))
    if not attrs:
        return
    request_id = getattr(request, "request_id", None) if "request_id" in attrs else None
    if isinstance(request_id, str):
        request_id_var.set(request_id)
    tenant = getattr(request, "tenant", None) if "tenant" in attrs else None
    if isinstance(tenant, str) and tenant:
        tenant_var.set(tenant)


async def run_every(interval_s: float | Callable[[], float], work: Callable[[], Awaitable[None]],
                    what: str) -> None:
    """`work()` now and then every `interval_s` seconds (a number, or a function read each round, for a
    setting that can change), until cancelled. See the module docstring for how failures are handled."""
    last_error = ""
    task = asyncio.current_task()
    while True:
        try:
            await work()
            last_error = ""
            if task.cancelling():
                # Python 3.11's asyncio.wait_for (in `work`, in nats.py) returns its result when it is
                # cancelled just as its inner future completes, swallowing the cancel: end here anyway.
                raise asyncio.CancelledError
        except asyncio.CancelledError:
            raise
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError,
                nats.errors.ConnectionDrainingError, nats.errors.OutboundBufferLimitError,
                nats.errors.NoServersError, nats.errors.StaleConnectionError) as exc:
            log.debug("%s skipped: NATS unavailable (%r)", what, exc)
        except Exception as exc:
            if repr(exc) != last_error:
                log.exception("%s failed; trying again every round", what)
                last_error = repr(exc)
            else:
                log.debug("%s failed again: %r", what, exc)
        await asyncio.sleep(interval_s() if callable(interval_s) else interval_s)


async def cancel_and_wait(tasks: list[asyncio.Future], recancel_interval_s: float = 0.5) -> None:
    """Cancel `tasks` (tasks, or futures such as a gather's) and wait until every one has ended. A task
    whose cancel was swallowed (Python 3.11's wait_for, see run_every) is cancelled again each
    `recancel_interval_s`, so a stop never hangs on it. An error other than the cancel is logged."""
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=recancel_interval_s)
    for task in tasks:
        # A gather cancelled from outside ends with CancelledError as its exception, not as cancelled().
        error = None if task.cancelled() else task.exception()
        if error is not None and not isinstance(error, asyncio.CancelledError):
            name = task.get_name() if isinstance(task, asyncio.Task) else repr(task)
            log.warning("%s ended with %r while being stopped", name, error)
