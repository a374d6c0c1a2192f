"""The gateway's side of the request path: admit one generation over NATS, then read its stream.

Shared by the HTTP and gRPC front ends (each only translates its protocol to `GenerationParams` and the
events back). Boundary: knows NATS subjects and messages, and the `Fleet` (heartbeats); nothing of HTTP.

    open()   opens an inbox for the per-request stream subject *before* asking, then asks the fingerprinter
             (request/reply). No fingerprinter -> NoRespondersError -> ApiError 503 at once; a refusal
             (bad prompt, no worker, overloaded) -> ApiError with the mapped status.
    events() yields TokenChunk / StreamEnd; fails with ApiError when the worker reports an error, when
             its heartbeats stop (it died), or when the stream is silent for the idle timeout.
    close()  closes the inbox; if the stream did not finish (client went away) tells workers to cancel.

Stream events reach the gateway through one subscription to all of its stream subjects and one to its
batch subject (`StreamInboxes`), which hand each event to the queue of the request it names: a
subscription per request cost a SUB and an UNSUB on the wire per request, and nats-py's `next_msg` a task,
a timer and a uuid per event; a batch carries one engine step's tokens of every request in one message
(issue 38).

Request migration (as Dynamo does): when the serving worker dies (its heartbeats stop), the stream is
silent for the idle timeout, or stream events were lost, `events()` re-submits the request, under a new
request id, with the tokens already streamed as `resume_token_ids`. The fingerprinter appends them to the
prompt, a live worker continues the answer, and the consumer sees one seamless stream: no token lost or
repeated (the new worker primes its detokenizer with those tokens), usage counted over both. At most
`max_migrations` times per generation; otherwise, or when no worker takes it, a clean ApiError.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError, TimeoutError as NatsTimeoutError

from kite_shared import subjects
from prometheus_client import Counter

from kite_shared.messages import (Admission, Cancel, ChatMessage, ErrorInfo, GenerateRequest, MessageError,
                                  SamplingParams, StreamBatch, StreamEnd, StreamError, TokenChunk, Usage,
                                  STREAM_EVENT, decode_or_log)
from kite_shared.security import ANONYMOUS_TENANT
from kite_shared.service import request_id_var
from kite_shared.tracing import SpanKind, headers_with_context, tracer
from kite_gateway.errors import ApiError
from kite_gateway.fleet import Fleet
from kite_gateway.rate_limit import Permit, RateLimitExceeded, TenantRateLimiter

log = logging.getLogger(__name__)

# How often a waiting stream re-checks that its worker is still alive.
_LIVENESS_POLL_S = 0.5
# A migration must be admitted quickly: the client is waiting mid-stream (a clean error within seconds,
# never a hung stream).
_MIGRATION_ADMIT_TIMEOUT_S = 5.0

MIGRATIONS = Counter("kite_gateway_migrations_total",
                     "Generations re-submitted to another worker mid-stream, by outcome", ["outcome"])
RATE_LIMITED = Counter("kite_gateway_rate_limited_total",
                       "Requests refused with 429 because their tenant was over a rate limit, by limit",
                       ["limit"])


class _Migratable(Exception):
    """The attempt's worker is gone or its stream is broken: the generation may continue elsewhere."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info


@dataclass
class GenerationParams:
    model: str
    sampling: SamplingParams
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    reuse: bool = True
    cache_salt: str = ""  # already derived from the tenant (security.tenant_cache_salt)
    tenant: str = ANONYMOUS_TENANT  # the authenticated caller; owns the blocks this request stores
    session_id: str = ""  # routing affinity (issue 5)


@dataclass
class Generation:
    client: "GenerationClient"
    request_id: str  # of the current attempt (a migration opens a new one)
    worker_id: str  # serving the current attempt
    prompt_tokens: int  # of the original prompt
    _inbox: "asyncio.Queue[bytes]"  # the current attempt's encoded stream events (StreamInboxes)
    params: "GenerationParams | None" = None  # needed to migrate; None disables migration
    _span: object = None  # the gateway's trace span of the whole generation (all attempts); close() ends it
    _started: float = field(default_factory=time.monotonic)
    _finished: bool = False
    first_token_at: float | None = None
    migrations: int = 0
    _streamed_ids: list[int] = field(default_factory=list)  # tokens handed to the consumer so far
    _resumed: int = 0  # tokens the current attempt was given as already generated

    async def events(self) -> AsyncIterator[TokenChunk | StreamEnd]:
        while True:
            try:
                async for event in self._attempt_events():
                    if isinstance(event, StreamEnd):
                        yield self._total_usage(event)
                        return
                    self._streamed_ids.extend(event.token_ids)
                    yield event
                return
            except _Migratable as exc:
                await self._migrate(exc.info)

    async def _attempt_events(self) -> AsyncIterator[TokenChunk | StreamEnd]:
        expected_seq = 0
        first_timeout = self.client.first_event_timeout_s or self.client.stream_idle_timeout_s
        idle_deadline = time.monotonic() + first_timeout
        while True:
            try:
                data = self._inbox.get_nowait() if not self._inbox.empty() else await _next(self._inbox)
            except TimeoutError:
                if not self.client.fleet.is_alive("worker", self.worker_id):
                    raise _Migratable(ErrorInfo(
                        code="worker_lost", message="The worker serving this request stopped responding"))
                if time.monotonic() > idle_deadline:
                    info = ErrorInfo(code="stream_timeout",
                                     message="The worker sent nothing within the stream timeout")
                    if expected_seq == 0 and first_timeout > self.client.stream_idle_timeout_s:
                        # Still queued at a live worker: an overload, which moving it would only spread.
                        raise ApiError.from_info(info)
                    raise _Migratable(info)
                continue
            idle_deadline = time.monotonic() + self.client.stream_idle_timeout_s
            try:
                event = STREAM_EVENT.decode(data)
            except MessageError as exc:
                log.error("invalid stream event for %s: %s", self.request_id, exc)
                raise ApiError.from_info(ErrorInfo(code="internal_error", message="invalid stream event"))
            if event.seq != expected_seq:
                # Everything before the gap reached the consumer in order: continue from there elsewhere.
                log.error("stream %s: expected event %d, got %d", self.request_id, expected_seq, event.seq)
                raise _Migratable(ErrorInfo(code="internal_error", message="stream events were lost"))
            expected_seq += 1
            if isinstance(event, StreamError):
                self._finished = True
                raise ApiError.from_info(event.error)
            if self.first_token_at is None:
                self.first_token_at = time.monotonic()
            if isinstance(event, StreamEnd):
                self._finished = True
                yield event
                return
            yield event

    def _total_usage(self, end: StreamEnd) -> StreamEnd:
        """Usage as if one worker had served it: the original prompt, every generated token."""
        if not self.migrations:
            return end
        usage = Usage(prompt_tokens=self.prompt_tokens,
                      completion_tokens=self._resumed + end.usage.completion_tokens,
                      cached_tokens=min(end.usage.cached_tokens, self.prompt_tokens))
        return end.model_copy(update={"usage": usage})

    async def _migrate(self, reason: ErrorInfo) -> None:
        """Continue on another worker, or raise ApiError(reason) when that is not allowed or possible."""
        old_request, old_worker = self.request_id, self.worker_id
        await self._close_attempt()
        if self.params is None or self.migrations >= self.client.max_migrations:
            MIGRATIONS.labels("limit").inc()
            raise ApiError.from_info(reason)
        self.migrations += 1
        resumed = list(self._streamed_ids)
        log.warning("request %s on %s: %s; migrating with %d tokens already sent (migration %d of %d)",
                    old_request, old_worker, reason.message, len(resumed), self.migrations,
                    self.client.max_migrations)
        try:
            request_id, inbox, admission = await self.client._admit(
                self.params, resume_token_ids=resumed,
                timeout_s=min(self.client.admit_timeout_s, _MIGRATION_ADMIT_TIMEOUT_S), span=self._span)
        except ApiError as exc:
            MIGRATIONS.labels("failed").inc()
            log.warning("migration of %s failed: %s", old_request, exc.message)
            raise ApiError.from_info(ErrorInfo(
                code=reason.code if exc.status >= 500 else exc.code or reason.code,
                message=f"{reason.message}; continuing on another worker failed: {exc.message}")) from None
        MIGRATIONS.labels("ok").inc()
        log.info("request %s continues as %s on %s", old_request, request_id, admission.worker_id)
        self.request_id, self.worker_id, self._inbox = request_id, admission.worker_id, inbox
        self._resumed = len(resumed)
        self._finished = False

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self._started

    async def _close_attempt(self) -> None:
        self.client.streams.close(self.request_id)
        if not self._finished:
            self._finished = True  # cancel once per attempt
            try:
                await self.client.nc.publish(subjects.WORKER_CANCEL, Cancel(request_id=self.request_id).encode())
            except Exception as exc:
                log.warning("could not cancel %s: %s", self.request_id, exc)

    async def close(self) -> None:
        await self._close_attempt()
        if self._span is not None:
            self._span.set_attribute("kite.migrations", self.migrations)
            self._span.end()
            self._span = None


async def _next(inbox: asyncio.Queue[bytes]) -> bytes:
    """The next event, or TimeoutError after _LIVENESS_POLL_S (a timer, no task: this runs per token)."""
    async with asyncio.timeout(_LIVENESS_POLL_S):
        return await inbox.get()


class StreamInboxes:
    """One subscription to every stream subject of this gateway (`subjects.stream_wildcard`) and one to its
    batch subject (`subjects.stream_batch`), made at the first request; each event goes to the queue of
    the request it names (by its subject, or by its place in a StreamBatch). A worker sends every event of
    a request through one of the two, so a request's events arrive in order. Events of a request with no
    open inbox (it closed: cancelled, migrated, finished) are dropped."""

    def __init__(self, nc: NATS, gateway_id: str) -> None:
        self.nc = nc
        self.gateway_id = gateway_id
        self.batch_subject = subjects.stream_batch(gateway_id)
        self._inboxes: dict[str, asyncio.Queue[bytes]] = {}
        self._subscribed = False
        self._subscribing = asyncio.Lock()

    async def open(self, request_id: str) -> tuple[str, asyncio.Queue[bytes]]:
        """(the request's stream subject, its inbox). The subscriptions are sent before this returns, so
        they reach the server before anything the caller publishes next on the same connection."""
        if not self._subscribed:
            async with self._subscribing:
                if not self._subscribed:
                    await self.nc.subscribe(subjects.stream_wildcard(self.gateway_id), cb=self._deliver)
                    await self.nc.subscribe(self.batch_subject, cb=self._deliver_batch)
                    self._subscribed = True
        inbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._inboxes[request_id] = inbox
        return subjects.stream(self.gateway_id, request_id), inbox

    def close(self, request_id: str) -> None:
        self._inboxes.pop(request_id, None)

    async def _deliver(self, msg) -> None:
        inbox = self._inboxes.get(msg.subject.rpartition(".")[2])
        if inbox is not None:
            inbox.put_nowait(msg.data)

    async def _deliver_batch(self, msg) -> None:
        batch = decode_or_log(StreamBatch.decode, msg.data, log, "invalid stream batch on %s", msg.subject,
                              level=logging.ERROR)
        if batch is None:  # its requests' streams then stop and migrate, as for any lost event
            return
        for request_id, data in zip(batch.request_ids, batch.events):
            inbox = self._inboxes.get(request_id)
            if inbox is not None:
                inbox.put_nowait(data)


@dataclass
class GenerationClient:
    nc: NATS
    fleet: Fleet
    gateway_id: str
    admit_timeout_s: float
    stream_idle_timeout_s: float
    max_migrations: int = 2  # KITE_GATEWAY_MAX_MIGRATIONS; 0 turns request migration off
    # KITE_GATEWAY_FIRST_EVENT_TIMEOUT_S: a request queued at a live worker legitimately waits longer than
    # the idle timeout allows between events; None = the idle timeout.
    first_event_timeout_s: float | None = None
    admission: object | None = None  # control.AdmissionGate (issue 5): early 503 while the arbitrator sheds
    streams: StreamInboxes = field(init=False)

    def __post_init__(self) -> None:
        self.streams = StreamInboxes(self.nc, self.gateway_id)

    async def open(self, params: GenerationParams) -> Generation:
        if self.admission is not None:
            self.admission.check()  # raises ApiError 503 + Retry-After before anything is sent
        span = tracer().start_span("kite.gateway.generate", kind=SpanKind.CLIENT,
                                   attributes={"kite.model": params.model})
        try:
            request_id, inbox, admission = await self._admit(params, span=span)
        except BaseException as exc:
            span.record_exception(exc)
            span.end()
            raise
        span.set_attribute("kite.request_id", request_id)
        span.set_attribute("kite.worker", admission.worker_id)
        return Generation(client=self, request_id=request_id, worker_id=admission.worker_id,
                          prompt_tokens=admission.prompt_tokens, _inbox=inbox, params=params,
                          _span=span)

    async def _admit(self, params: GenerationParams, resume_token_ids: list[int] | None = None,
                     timeout_s: float | None = None, span=None) -> tuple[str, asyncio.Queue, Admission]:
        """Open an inbox for a new stream subject, ask the fingerprinter; (request id, inbox, admission).
        `span`'s trace context travels in the request headers, so every service joins the same trace."""
        request_id = uuid.uuid4().hex
        request_id_var.set(request_id)
        stream_subject, inbox = await self.streams.open(request_id)
        request = GenerateRequest(
            request_id=request_id, model=params.model, messages=params.messages, prompt=params.prompt,
            prompt_token_ids=params.prompt_token_ids, sampling=params.sampling, reuse=params.reuse,
            cache_salt=params.cache_salt, tenant=params.tenant, stream_subject=stream_subject,
            stream_batch_subject=self.streams.batch_subject,
            session_id=params.session_id,
            resume_token_ids=resume_token_ids or [])
        try:
            reply = await self.nc.request(subjects.FINGERPRINT, request.encode(),
                                          timeout=timeout_s or self.admit_timeout_s,
                                          headers=headers_with_context(span) or None)
            admission = Admission.decode(reply.data)
        except NoRespondersError:
            self.streams.close(request_id)
            raise ApiError.from_info(ErrorInfo(code="no_fingerprinter", message="No fingerprinter is available"))
        except NatsTimeoutError:
            self.streams.close(request_id)
            raise ApiError.from_info(ErrorInfo(code="worker_timeout", message="The request was not admitted in time"))
        except MessageError as exc:
            self.streams.close(request_id)
            log.error("invalid admission reply: %s", exc)
            raise ApiError.from_info(ErrorInfo(code="internal_error", message="invalid admission reply"))
        except BaseException:
            self.streams.close(request_id)
            raise
        if not admission.accepted:
            self.streams.close(request_id)
            raise ApiError.from_info(admission.error or ErrorInfo(code="internal_error", message="refused"))
        return request_id, inbox, admission

    async def ping(self, service: str, timeout_s: float = 1.0) -> bool:
        from kite_shared.messages import Ping

        try:
            await self.nc.request(subjects.ping(service), Ping().encode(), timeout=timeout_s)
            return True
        except (NoRespondersError, NatsTimeoutError):
            return False


def prompt_size(params: GenerationParams) -> tuple[int, int]:
    """(characters, token ids) of a generation's prompt: what the rate limiter's token estimate counts."""
    chars = sum(len(m.content) for m in params.messages or ()) + len(params.prompt or "")
    return chars, len(params.prompt_token_ids or ())


def rate_permit(limiter: TenantRateLimiter, tenant: str, tokens: int) -> Permit:
    """Charge a request to its tenant's rate limits; ApiError 429 + Retry-After when it is over one."""
    try:
        return limiter.acquire(tenant, tokens)
    except RateLimitExceeded as exc:
        RATE_LIMITED.labels(exc.limit).inc()
        log.info("tenant %s over its %s per minute limit (%d); retry after %d s", exc.tenant, exc.limit,
                 exc.per_minute, exc.retry_after_s)
        raise ApiError.rate_limited(exc) from None


async def collect(generation: Generation) -> tuple[str, StreamEnd]:
    """Run a generation to its end; returns (full text, end event)."""
    parts: list[str] = []
    try:
        async for event in generation.events():
            parts.append(event.text)
            if isinstance(event, StreamEnd):
                return "".join(parts), event
    finally:
        await close_all([generation])
    raise ApiError.from_info(ErrorInfo(code="internal_error", message="stream ended without an end event"))


async def close_all(generations: list[Generation]) -> None:
    """Close every generation, each to its end even when the caller is cancelled meanwhile: a client gone
    cancels its request's awaits (a streaming response's cancel scope, every await in its generator's
    `finally`), and a close cut short leaves a worker generating for nobody until its idle timeout."""
    closing = asyncio.gather(*(g.close() for g in generations))  # every close starts now
    _CLOSING.add(closing)
    closing.add_done_callback(_closed)
    await asyncio.shield(closing)


_CLOSING: set[asyncio.Future] = set()  # closes under way whose caller may be gone (asyncio keeps them weakly)


def _closed(closing: asyncio.Future) -> None:
    _CLOSING.discard(closing)
    if not closing.cancelled() and closing.exception() is not None:  # retrieved: its caller may be gone
        log.warning("closing a generation failed: %r", closing.exception())


async def gather_open(client: GenerationClient, params: list[GenerationParams]) -> list[Generation]:
    """Admit several generations (for n > 1); if any is refused, close the others and re-raise."""
    results = await asyncio.gather(*(client.open(p) for p in params), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await close_all([r for r in results if isinstance(r, Generation)])
        raise errors[0]
    return list(results)  # type: ignore[arg-type]
