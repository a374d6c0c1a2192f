"""The gateway's side of the request path: admit one generation over NATS, then read its stream.

Shared by the HTTP and gRPC front ends (each only translates its protocol to `GenerationParams` and the
events back). Boundary: knows NATS subjects and messages, and the `Fleet` (heartbeats); nothing of HTTP.

    open()   subscribes to the per-request stream subject *before* asking, then asks the fingerprinter
             (request/reply). No fingerprinter -> NoRespondersError -> ApiError 503 at once; a refusal
             (bad prompt, no worker, overloaded) -> ApiError with the mapped status.
    events() yields TokenChunk / StreamEnd; fails with ApiError when the worker reports an error, when
             its heartbeats stop (it died), or when the stream is silent for the idle timeout.
    close()  unsubscribes; if the stream did not finish (client went away) tells workers to cancel.
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
from kite_shared.messages import (Admission, Cancel, ChatMessage, ErrorInfo, GenerateRequest, MessageError,
                                  SamplingParams, StreamEnd, StreamError, TokenChunk, decode_stream_event)
from kite_gateway.errors import ApiError
from kite_gateway.fleet import Fleet

log = logging.getLogger(__name__)

# How often a waiting stream re-checks that its worker is still alive.
_LIVENESS_POLL_S = 0.5


@dataclass
class GenerationParams:
    model: str
    sampling: SamplingParams
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    reuse: bool = True
    cache_salt: str = ""


@dataclass
class Generation:
    client: "GenerationClient"
    request_id: str
    worker_id: str
    prompt_tokens: int
    _subscription: object
    _started: float = field(default_factory=time.monotonic)
    _finished: bool = False
    first_token_at: float | None = None

    async def events(self) -> AsyncIterator[TokenChunk | StreamEnd]:
        expected_seq = 0
        idle_deadline = time.monotonic() + self.client.stream_idle_timeout_s
        while True:
            try:
                msg = await self._subscription.next_msg(timeout=_LIVENESS_POLL_S)
            except NatsTimeoutError:
                if not self.client.fleet.is_alive("worker", self.worker_id):
                    raise ApiError.from_info(ErrorInfo(
                        code="worker_lost", message="The worker serving this request stopped responding"))
                if time.monotonic() > idle_deadline:
                    raise ApiError.from_info(ErrorInfo(
                        code="stream_timeout", message="The worker sent nothing within the stream timeout"))
                continue
            idle_deadline = time.monotonic() + self.client.stream_idle_timeout_s
            try:
                event = decode_stream_event(msg.data)
            except MessageError as exc:
                log.error("invalid stream event for %s: %s", self.request_id, exc)
                raise ApiError.from_info(ErrorInfo(code="internal_error", message="invalid stream event"))
            if event.seq != expected_seq:
                log.error("stream %s: expected event %d, got %d", self.request_id, expected_seq, event.seq)
                raise ApiError.from_info(ErrorInfo(code="internal_error", message="stream events were lost"))
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

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self._started

    async def close(self) -> None:
        try:
            await self._subscription.unsubscribe()
        except Exception as exc:  # connection closing: nothing left to unsubscribe from
            log.debug("unsubscribe failed: %s", exc)
        if not self._finished:
            try:
                await self.client.nc.publish(subjects.WORKER_CANCEL, Cancel(request_id=self.request_id).encode())
            except Exception as exc:
                log.warning("could not cancel %s: %s", self.request_id, exc)


@dataclass
class GenerationClient:
    nc: NATS
    fleet: Fleet
    gateway_id: str
    admit_timeout_s: float
    stream_idle_timeout_s: float

    async def open(self, params: GenerationParams) -> Generation:
        request_id = uuid.uuid4().hex
        stream_subject = subjects.stream(self.gateway_id, request_id)
        subscription = await self.nc.subscribe(stream_subject)
        request = GenerateRequest(
            request_id=request_id, model=params.model, messages=params.messages, prompt=params.prompt,
            prompt_token_ids=params.prompt_token_ids, sampling=params.sampling, reuse=params.reuse,
            cache_salt=params.cache_salt, stream_subject=stream_subject)
        try:
            reply = await self.nc.request(subjects.FINGERPRINT, request.encode(), timeout=self.admit_timeout_s)
            admission = Admission.decode(reply.data)
        except NoRespondersError:
            await subscription.unsubscribe()
            raise ApiError.from_info(ErrorInfo(code="no_fingerprinter", message="No fingerprinter is available"))
        except NatsTimeoutError:
            await subscription.unsubscribe()
            raise ApiError.from_info(ErrorInfo(code="worker_timeout", message="The request was not admitted in time"))
        except MessageError as exc:
            await subscription.unsubscribe()
            log.error("invalid admission reply: %s", exc)
            raise ApiError.from_info(ErrorInfo(code="internal_error", message="invalid admission reply"))
        except BaseException:
            await subscription.unsubscribe()
            raise
        if not admission.accepted:
            await subscription.unsubscribe()
            raise ApiError.from_info(admission.error or ErrorInfo(code="internal_error", message="refused"))
        return Generation(client=self, request_id=request_id, worker_id=admission.worker_id,
                          prompt_tokens=admission.prompt_tokens, _subscription=subscription)

    async def ping(self, service: str, timeout_s: float = 1.0) -> bool:
        from kite_shared.messages import Ping

        try:
            await self.nc.request(subjects.ping(service), Ping().encode(), timeout=timeout_s)
            return True
        except (NoRespondersError, NatsTimeoutError):
            return False


async def collect(generation: Generation) -> tuple[str, StreamEnd]:
    """Run a generation to its end; returns (full text, end event)."""
    parts: list[str] = []
    try:
        async for event in generation.events():
            parts.append(event.text)
            if isinstance(event, StreamEnd):
                return "".join(parts), event
    finally:
        await generation.close()
    raise ApiError.from_info(ErrorInfo(code="internal_error", message="stream ended without an end event"))


async def gather_open(client: GenerationClient, params: list[GenerationParams]) -> list[Generation]:
    """Admit several generations (for n > 1); if any is refused, close the others and re-raise."""
    results = await asyncio.gather(*(client.open(p) for p in params), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for r in results:
            if isinstance(r, Generation):
                await r.close()
        raise errors[0]
    return list(results)  # type: ignore[arg-type]
