"""The gRPC API (proto/kite.proto, service kite.v1.Kite): GenerateRequest -> GenerationClient -> event stream.

The gRPC twin of the HTTP API: the same `GenerationClient`, the same parameter rules and cache salt
(`normalize`: a GenerateRequest is validated as the HTTP body it means) and the same service error codes, mapped to gRPC status codes instead of HTTP statuses:

    400 -> INVALID_ARGUMENT   404 -> NOT_FOUND (model_not_found)   429 -> RESOURCE_EXHAUSTED
    503 -> UNAVAILABLE   504 -> DEADLINE_EXCEEDED   500 (and anything else) -> INTERNAL

With KITE_AUTH_ENABLED on, Generate needs metadata `authorization: Bearer <key>` (UNAUTHENTICATED
otherwise, checked before anything else); Health stays open. The tenant decides the cache salt. A tenant
over its request or token rate limit (`rate_limit.TenantRateLimiter`, shared with the HTTP API) gets
RESOURCE_EXHAUSTED `rate_limit_exceeded` before any service is asked.

A failing call carries trailing metadata `kite-error-code` (the code HTTP reports in error.code) and, when
a retry may succeed, `retry-after` (seconds). The client's deadline bounds admission and streaming; when
the call ends early (deadline, client cancel, error) the generation is closed, which tells the worker to
stop and free its slot.

Semantic response cache (`semantic.SemanticResponses`, opt-in): a request with `semantic_cache` set is
looked up after its rate permit and before any generation opens, exactly as over HTTP and in the same
entries; a hit streams the entry's answer as one Chunk (text, no token ids) and an End with the usage of the
computation that produced it, charging no token; a computed answer is handed to the cache once it ended.
End.semantic_cache carries the outcome.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from prometheus_client import Counter

from kite_shared.config import GatewayConfig
from kite_shared.grpc_gen import kite_pb2, kite_pb2_grpc
from kite_shared.messages import StreamEnd
from kite_shared.service import tenant_var
from kite_gateway.auth import Authenticator
from kite_gateway.errors import ApiError
from kite_gateway.generation import GenerationClient, close_all, prompt_size, rate_permit
from kite_gateway.normalize import InvalidArgument, grpc_params
from kite_gateway.rate_limit import Permit, TenantRateLimiter
from kite_gateway.semantic import Consulted, SemanticResponses, consult_if_asked, learn_if_consulted

log = logging.getLogger(__name__)

CALLS = Counter("kite_grpc_calls_total", "gRPC API calls by method and final status code", ["method", "code"])

_STATUS_BY_HTTP = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
def _deadline_failure() -> "_Failure":
    return _Failure(grpc.StatusCode.DEADLINE_EXCEEDED, "The call's deadline passed before generation finished",
                    "deadline_exceeded")


class _Undecodable:
    """Stands for request bytes that are not a valid GenerateRequest (bad protobuf, invalid UTF-8)."""


_UNDECODABLE = _Undecodable()


def _decode_generate(data: bytes) -> kite_pb2.GenerateRequest | _Undecodable:
    # gRPC would answer a deserializer exception with UNKNOWN; bad input is INVALID_ARGUMENT.
    try:
        return kite_pb2.GenerateRequest.FromString(data)
    except Exception:
        return _UNDECODABLE


def _decode_health(data: bytes) -> kite_pb2.HealthRequest:
    try:
        return kite_pb2.HealthRequest.FromString(data)
    except Exception:
        return kite_pb2.HealthRequest()  # it has no fields: nothing to get wrong


def _add_servicer(service: "KiteService", server: grpc.aio.Server) -> None:
    """kite_pb2_grpc.add_KiteServicer_to_server, with deserializers that never raise."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate, request_deserializer=_decode_generate,
            response_serializer=kite_pb2.GenerateResponse.SerializeToString),
        "Health": grpc.unary_unary_rpc_method_handler(
            service.Health, request_deserializer=_decode_health,
            response_serializer=kite_pb2.HealthResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kite.v1.Kite", handlers),))
    server.add_registered_method_handlers("kite.v1.Kite", handlers)


class _Failure(Exception):
    """How a call ends when it does not end with an End event."""

    def __init__(self, status: grpc.StatusCode, message: str, code: str | None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after_s = retry_after_s

    @classmethod
    def from_api_error(cls, exc: ApiError) -> "_Failure":
        return cls(_STATUS_BY_HTTP.get(exc.status, grpc.StatusCode.INTERNAL), exc.message, exc.code,
                   exc.retry_after_s)

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        metadata = []
        if self.code:
            metadata.append(("kite-error-code", self.code))
        if self.retry_after_s:
            metadata.append(("retry-after", str(self.retry_after_s)))
        return tuple(metadata)


class KiteService(kite_pb2_grpc.KiteServicer):
    def __init__(self, client: GenerationClient, authenticator: Authenticator | None = None,
                 rate_limiter: TenantRateLimiter | None = None,
                 semantic: SemanticResponses | None = None) -> None:
        self._client = client
        self._auth = authenticator or Authenticator.disabled()
        self._limiter = rate_limiter or TenantRateLimiter()
        self._semantic = semantic  # None: KITE_SEMANTIC_CACHE_TENANTS is empty

    def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        if not self._auth.enabled:
            return self._auth.tenant_for_authorization(None)  # "anonymous"
        metadata = {k.lower(): v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        try:
            return self._auth.tenant_for_authorization(metadata.get("authorization"))
        except ApiError as exc:
            raise _Failure(grpc.StatusCode.UNAUTHENTICATED, exc.message, exc.code) from None

    async def Generate(self, request: kite_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        # A coroutine writing with context.write (not an async generator yielding responses), so the
        # deadline's timeout wraps every await of the call, writes included, in this one task.
        try:
            await self._generate(request, context)
        except _Failure as failure:
            CALLS.labels("Generate", failure.status.name).inc()
            await context.abort(failure.status, failure.message, failure.trailing_metadata())
        except asyncio.CancelledError:
            CALLS.labels("Generate", grpc.StatusCode.CANCELLED.name).inc()
            raise
        CALLS.labels("Generate", grpc.StatusCode.OK.name).inc()

    async def _generate(self, request: kite_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        tenant = self._tenant(context)
        tenant_var.set(tenant)  # every log line of this call names the tenant (never the key)
        if isinstance(request, _Undecodable):
            raise _Failure(grpc.StatusCode.INVALID_ARGUMENT, "the request is not a valid kite.v1.GenerateRequest "
                           "(malformed protobuf or invalid UTF-8 in a string field)", "invalid_request")
        try:
            params = grpc_params(request, tenant)
        except InvalidArgument as exc:
            raise _Failure(grpc.StatusCode.INVALID_ARGUMENT, str(exc), "invalid_value") from None
        try:
            permit = rate_permit(self._limiter, tenant, self._limiter.estimate_tokens(
                *prompt_size(params), max_tokens=params.sampling.max_tokens))
        except ApiError as exc:
            raise _Failure.from_api_error(exc) from None
        # gRPC also cancels this task when the deadline passes, but then the call ends as a bare
        # cancellation; bounding the work here ends it as DEADLINE_EXCEEDED with its error code, and
        # without relying on that. None (no deadline) means no timeout.
        deadline = asyncio.timeout(context.time_remaining())
        try:
            async with deadline:
                consulted = await consult_if_asked(self._semantic, request.semantic_cache, tenant,
                                                   "chat" if params.messages else "completion", params,
                                                   num_choices=1)
                if consulted is not None and consulted.outcome == "hit":
                    for response in _cached_answer(consulted, permit):
                        await context.write(response)
                    return
                try:
                    generation = await self._client.open(params)
                except BaseException:
                    permit.refund()  # refused before any token was computed
                    raise
                texts: list[str] = []
                try:
                    async for event in generation.events():
                        if deadline.expired():
                            # Its cancellation was lost: on Python 3.11 an await that completes in the
                            # instant the deadline's cancel arrives (wait_for, a queue) can drop the cancel.
                            raise TimeoutError
                        texts.append(event.text)
                        if isinstance(event, StreamEnd):
                            permit.settle(event.usage.prompt_tokens + event.usage.completion_tokens)
                            learn_if_consulted(self._semantic, consulted, "".join(texts), event)
                        for response in _responses(event, consulted):
                            await context.write(response)
                finally:
                    # Publishes a cancel to the workers unless the stream reached its end.
                    await close_all([generation])
        except TimeoutError as exc:
            if not deadline.expired():
                log.exception("Generate failed")
                raise _Failure(grpc.StatusCode.INTERNAL, "internal server error", "internal_error") from exc
            raise _deadline_failure() from None
        except ApiError as exc:
            when = deadline.when()
            if when is not None and asyncio.get_running_loop().time() >= when:
                # The call's deadline passed too (a stalled loop lets the stream's own timeout notice
                # first): the client asked for that bound, so that is what it hears.
                raise _deadline_failure() from None
            raise _Failure.from_api_error(exc) from None
        except Exception as exc:
            log.exception("Generate failed")
            raise _Failure(grpc.StatusCode.INTERNAL, "internal server error", "internal_error") from exc

    async def Health(self, request: kite_pb2.HealthRequest,
                     context: grpc.aio.ServicerContext) -> kite_pb2.HealthResponse:
        fingerprinter, worker = await asyncio.gather(self._client.ping("fingerprinter"),
                                                     self._client.ping("worker"))
        live_workers = len(self._client.fleet.alive("worker"))
        CALLS.labels("Health", grpc.StatusCode.OK.name).inc()
        if fingerprinter and worker:
            return kite_pb2.HealthResponse(status=kite_pb2.HealthResponse.SERVING, live_workers=live_workers)
        missing = "worker" if not worker else "fingerprinter"
        return kite_pb2.HealthResponse(status=kite_pb2.HealthResponse.NOT_SERVING, live_workers=live_workers,
                                       detail=f"No {missing} is alive and answering")


def _responses(event, consulted: Consulted | None) -> list[kite_pb2.GenerateResponse]:
    if not isinstance(event, StreamEnd):
        return [kite_pb2.GenerateResponse(chunk=kite_pb2.Chunk(text=event.text, token_ids=event.token_ids))]
    responses = []
    # StreamEnd may release the last text and token; the proto keeps End to reason and counts.
    if event.text or event.token_ids:
        responses.append(kite_pb2.GenerateResponse(
            chunk=kite_pb2.Chunk(text=event.text, token_ids=event.token_ids)))
    usage = kite_pb2.Usage(prompt_tokens=event.usage.prompt_tokens,
                           completion_tokens=event.usage.completion_tokens,
                           cached_tokens=event.usage.cached_tokens)
    responses.append(_end(event.finish_reason, usage, consulted))
    return responses


def _cached_answer(consulted: Consulted, permit: Permit) -> list[kite_pb2.GenerateResponse]:
    """A hit: the entry's answer as the stream a computation would have given, without its token ids."""
    entry = consulted.entry
    permit.settle(0)
    usage = entry.details["usage"]  # OpenAI's shape (answer_details)
    return [kite_pb2.GenerateResponse(chunk=kite_pb2.Chunk(text=entry.answer)),
            _end(entry.details["finish_reason"], kite_pb2.Usage(
                prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"],
                cached_tokens=usage["prompt_tokens_details"]["cached_tokens"]), consulted)]


def _end(finish_reason: str, usage: kite_pb2.Usage, consulted: Consulted | None) -> kite_pb2.GenerateResponse:
    report = None if consulted is None else kite_pb2.SemanticCacheReport(**consulted.report())
    return kite_pb2.GenerateResponse(end=kite_pb2.End(finish_reason=finish_reason, usage=usage,
                                                      semantic_cache=report))


def bind_address(host: str, port: int) -> str:
    # An IPv6 literal needs brackets, or its colons read as the port separator.
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


async def start_grpc_server(client: GenerationClient, cfg: GatewayConfig,
                            authenticator: Authenticator | None = None,
                            rate_limiter: TenantRateLimiter | None = None,
                            semantic: SemanticResponses | None = None) -> grpc.aio.Server:
    """Serve kite.v1.Kite on cfg.host:cfg.grpc_port; the caller stops it (server.stop(grace)) to drain."""
    server = grpc.aio.server(options=[
        # gRPC sets SO_REUSEPORT by default, which would let a second gateway silently share the port
        # (and half the traffic); a port clash must fail the start instead.
        ("grpc.so_reuseport", 0),
        # The same request size bound as the HTTP API.
        ("grpc.max_receive_message_length", cfg.max_body_bytes),
    ])
    _add_servicer(KiteService(client, authenticator, rate_limiter, semantic), server)
    address = bind_address(cfg.host, cfg.grpc_port)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise RuntimeError(f"gRPC server could not bind {address}: {exc}") from exc
    if port == 0:
        raise RuntimeError(f"gRPC server could not bind {address}")
    await server.start()
    log.info("gRPC on %s", bind_address(cfg.host, port))
    return server
