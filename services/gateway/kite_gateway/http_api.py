"""The OpenAI-compatible HTTP API (FastAPI): decode and validate -> GenerationClient -> OpenAI JSON / SSE.

Every failure is an OpenAI error object with the right status: FastAPI's 422 validation errors and
invalid JSON become 400, service refusals map through `errors.STATUS_BY_CODE`, bodies over the limit
get 413, and an error after streaming has started is sent as a final SSE `data: {"error": ...}` event
followed by `data: [DONE]`.

Authentication (`auth.Authenticator`): /v1/* needs `Authorization: Bearer <key>` when KITE_AUTH_ENABLED
is on (401 `invalid_api_key` / `missing_api_key` otherwise, checked before the body is read); /health,
/metrics and /openapi.json stay open. The caller's tenant, not the client, decides the cache salt.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kite_shared.messages import StreamEnd, TokenChunk
from kite_shared.security import tenant_cache_salt
from kite_shared.service import tenant_var
from kite_gateway.auth import Authenticator
from kite_gateway.errors import ApiError
from kite_gateway.generation import Generation, GenerationClient, GenerationParams, collect, gather_open
from kite_gateway.openai_protocol import (ChatCompletionRequest, CompletionRequest, batch_usage_body, now,
                                          usage_body)

log = logging.getLogger(__name__)

REQUESTS = Counter("kite_requests_total", "HTTP API requests by endpoint and status", ["endpoint", "status"])
TTFT = Histogram("kite_ttft_seconds", "Time to first token seen by the gateway",
                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
TPOT = Histogram("kite_time_per_output_token_seconds", "Mean time per output token after the first",
                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))
LATENCY = Histogram("kite_request_duration_seconds", "End-to-end request time",
                    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
CACHED_TOKENS = Counter("kite_gateway_prompt_tokens_total", "Prompt tokens served, by KV source", ["source"])


def _json_body(model: type) -> dict:
    """openapi_extra declaring the JSON body a handler parses itself (so /openapi.json documents it)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


def create_app(client_factory: Callable[[], GenerationClient], model_name: str, max_n: int,
               max_body_bytes: int, authenticator: Authenticator | None = None) -> FastAPI:
    app = FastAPI(title="KITE", version="1", docs_url=None, redoc_url=None)
    auth = authenticator or Authenticator.disabled()

    def client() -> GenerationClient:
        return client_factory()

    def tenant_of(request: Request) -> str:
        """The caller's tenant (ApiError 401 when auth is on and the Bearer key is missing or unknown)."""
        tenant = auth.tenant_for_authorization(request.headers.get("authorization"))
        tenant_var.set(tenant)  # every log line of this request names the tenant (never the key)
        return tenant

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            err = ApiError(400, "We could not parse the JSON body of your request.", code="invalid_json")
        else:
            message = first.get("msg", "invalid request")
            err = ApiError(400, f"{'.'.join(loc) or 'body'}: {message}", code="invalid_value",
                           param=".".join(loc) or None)
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), type=kind).body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(ApiError(500, "internal server error", type="server_error").body(), status_code=500)

    @app.middleware("http")
    async def _limits_and_metrics(request: Request, call_next):
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > max_body_bytes):
            response: Response = JSONResponse(ApiError(
                413, f"Request body exceeds {max_body_bytes} bytes", code="request_too_large").body(),
                status_code=413)
        else:
            response = await call_next(request)
        REQUESTS.labels(request.url.path, str(response.status_code)).inc()
        control = getattr(client(), "control", None)  # issue 5: request and error rates for telemetry
        if control is not None:
            control.stats.observe(request.url.path, response.status_code)
        return response

    async def parse(request: Request, model: type) -> object:
        raw = await request.body()
        if len(raw) > max_body_bytes:
            raise ApiError(413, f"Request body exceeds {max_body_bytes} bytes", code="request_too_large")
        try:
            # Strict UTF-8 (json.loads(bytes) would let surrogate bytes through), and no lone surrogate
            # from \ud800-style escapes either: such strings cannot be encoded for the services.
            data = json.loads(raw.decode("utf-8"))
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except (UnicodeError, json.JSONDecodeError):
            raise ApiError(400, "We could not parse the JSON body of your request.", code="invalid_json")
        except (ValueError, RecursionError):  # e.g. absurdly deep nesting
            raise ApiError(400, "We could not parse the JSON body of your request.", code="invalid_json")
        if not isinstance(data, dict):
            raise ApiError(400, "The request body must be a JSON object.", code="invalid_json")
        from pydantic import ValidationError

        try:
            body = model.model_validate(data)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None
        if body.n > max_n:
            raise ApiError(400, f"n must be at most {max_n}", code="invalid_value", param="n")
        unsupported = body.unsupported()
        if unsupported:
            raise ApiError(400, unsupported[1], code="unsupported_parameter", param=unsupported[0])
        return body

    @app.get("/health")
    async def health() -> JSONResponse:
        c = client()
        fingerprinter, worker = await asyncio.gather(c.ping("fingerprinter"), c.ping("worker"))
        live_workers = len(c.fleet.alive("worker"))
        if fingerprinter and worker:
            return JSONResponse({"status": "ok", "workers": live_workers})
        missing = "worker" if not worker else "fingerprinter"
        err = ApiError(503, f"No {missing} is alive and answering", type="service_unavailable",
                       code=f"no_{missing}", retry_after_s=1)
        return JSONResponse(err.body(), status_code=503, headers=err.headers())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        tenant_of(request)
        names = {model_name, *client().fleet.models()}
        return JSONResponse({"object": "list", "data": [
            {"id": n, "object": "model", "created": 0, "owned_by": "kite"} for n in sorted(names)]})

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        tenant = tenant_of(request)
        body: ChatCompletionRequest = await parse(request, ChatCompletionRequest)  # type: ignore[assignment]
        params = GenerationParams(model=body.model, sampling=body.sampling(body.resolved_max_tokens),
                                  messages=[m.to_message() for m in body.messages], reuse=body.kite.reuse,
                                  cache_salt=tenant_cache_salt(tenant, body.cache_salt), tenant=tenant,
                                  session_id=body.kite.session_id)
        started = time.monotonic()
        generations = await gather_open(client(), [params] * body.n)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return _sse(_chat_stream(response_id, body, generations, started), _worker_header(generations))
        results = await asyncio.gather(*(collect(g) for g in generations))
        _observe([end for _, end in results], generations, started)
        return JSONResponse({
            "id": response_id, "object": "chat.completion", "created": now(), "model": body.model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": end.finish_reason}
                        for i, (text, end) in enumerate(results)],
            "usage": usage_body([end for _, end in results]),
        }, headers=_worker_header(generations))

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        tenant = tenant_of(request)
        body: CompletionRequest = await parse(request, CompletionRequest)  # type: ignore[assignment]
        prompts = body.prompts()
        if not prompts or len(prompts) * body.n > max_n:
            raise ApiError(400, f"between 1 and {max_n} completions (prompts x n) per request",
                           code="invalid_value", param="prompt")
        params = []
        for p in prompts:
            text, ids = (p, None) if isinstance(p, str) else (None, list(p))
            params += [GenerationParams(model=body.model, sampling=body.sampling(body.max_tokens), prompt=text,
                                        prompt_token_ids=ids, reuse=body.kite.reuse,
                                        cache_salt=tenant_cache_salt(tenant, body.cache_salt),
                                        tenant=tenant, session_id=body.kite.session_id)] * body.n
        started = time.monotonic()
        generations = await gather_open(client(), params)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return _sse(_completion_stream(response_id, body, generations, started),
                        _worker_header(generations))
        results = await asyncio.gather(*(collect(g) for g in generations))
        ends = [end for _, end in results]
        _observe(ends, generations, started)
        return JSONResponse({
            "id": response_id, "object": "text_completion", "created": now(), "model": body.model,
            "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": end.finish_reason}
                        for i, (text, end) in enumerate(results)],
            "usage": batch_usage_body([ends[i:i + body.n] for i in range(0, len(ends), body.n)]),
        }, headers=_worker_header(generations))

    return app


def _observe(ends: list[StreamEnd], generations: list[Generation], started: float) -> None:
    elapsed = time.monotonic() - started
    LATENCY.observe(elapsed)
    for end, generation in zip(ends, generations):
        if generation.ttft_s is not None:
            TTFT.observe(generation.ttft_s)
            if end.usage.completion_tokens > 1:
                TPOT.observe((elapsed - generation.ttft_s) / (end.usage.completion_tokens - 1))
        CACHED_TOKENS.labels("reused").inc(end.usage.cached_tokens)
        CACHED_TOKENS.labels("computed").inc(end.usage.prompt_tokens - end.usage.cached_tokens)


def _worker_header(generations: list[Generation]) -> dict[str, str]:
    # Which worker(s) served the request: for operators and for tests of load balancing.
    return {"X-Kite-Worker": ",".join(sorted({g.worker_id for g in generations}))}


def _sse(events: AsyncIterator[dict], headers: dict[str, str]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        async for event in events:
            yield b"data: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})


async def _merged(generations: list[Generation]) -> AsyncIterator[tuple[int, TokenChunk | StreamEnd]]:
    """Events of several generations as they arrive, tagged with the choice index."""
    if len(generations) == 1:
        async for event in generations[0].events():
            yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for event in generation.events():
                await queue.put((index, event))
        except BaseException as exc:
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(generations)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield index, item
            if isinstance(item, StreamEnd):
                remaining -= 1
    finally:
        for task in tasks:
            task.cancel()


async def _stream_choices(kind: str, response_id: str, body, generations: list[Generation], started: float,
                          delta: Callable[[str], dict], first: Callable[[], dict] | None) -> AsyncIterator[dict]:
    created = now()
    usage_field = {"usage": None} if body.include_usage else {}

    def chunk(choices: list[dict]) -> dict:
        return {"id": response_id, "object": kind, "created": created, "model": body.model,
                "choices": choices, **usage_field}

    ends: list[StreamEnd] = [None] * len(generations)  # type: ignore[list-item]
    try:
        if first is not None:
            yield chunk([{"index": i, **first(), "logprobs": None, "finish_reason": None}
                         for i in range(len(generations))])
        async for index, event in _merged(generations):
            if isinstance(event, StreamEnd):
                ends[index] = event
                yield chunk([{"index": index, **delta(event.text), "logprobs": None,
                              "finish_reason": event.finish_reason}])
            elif event.text:
                yield chunk([{"index": index, **delta(event.text), "logprobs": None, "finish_reason": None}])
        _observe(ends, generations, started)
        if body.include_usage:
            n = getattr(body, "n", 1)
            groups = [ends[i:i + n] for i in range(0, len(ends), n)]
            yield {"id": response_id, "object": kind, "created": created, "model": body.model, "choices": [],
                   "usage": batch_usage_body(groups)}
    except ApiError as exc:
        yield exc.body()
    finally:
        for generation in generations:
            await generation.close()


def _chat_stream(response_id: str, body: ChatCompletionRequest, generations: list[Generation],
                 started: float) -> AsyncIterator[dict]:
    return _stream_choices("chat.completion.chunk", response_id, body, generations, started,
                           delta=lambda text: {"delta": {"content": text} if text else {}},
                           first=lambda: {"delta": {"role": "assistant", "content": ""}})


def _completion_stream(response_id: str, body: CompletionRequest, generations: list[Generation],
                       started: float) -> AsyncIterator[dict]:
    return _stream_choices("text_completion", response_id, body, generations, started,
                           delta=lambda text: {"text": text}, first=None)
