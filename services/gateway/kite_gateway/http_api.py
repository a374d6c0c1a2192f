"""The OpenAI-compatible HTTP API (FastAPI): decode and validate -> GenerationClient -> OpenAI JSON / SSE.

Every failure is an OpenAI error object with the right status: FastAPI's 422 validation errors and
invalid JSON become 400, service refusals map through `errors.STATUS_BY_CODE`, bodies over the limit
get 413, and an error after streaming has started is sent as a final SSE `data: {"error": ...}` event
followed by `data: [DONE]`.

Authentication (`auth.Authenticator`): /v1/* needs `Authorization: Bearer <key>` when KITE_AUTH_ENABLED
is on (401 `invalid_api_key` / `missing_api_key` otherwise, checked before the body is read); /health,
/metrics and /openapi.json stay open. The caller's tenant, not the client, decides the cache salt.

Rate limits (`rate_limit.TenantRateLimiter`): a valid generation request of a tenant over its request or
token rate gets 429 `rate_limit_exceeded` with Retry-After before any service is asked; admitted ones
carry OpenAI's x-ratelimit-* headers. /openapi.json documents every error status with the error object.

Semantic response cache (`semantic.SemanticResponses`, opt-in): a request sending
`kite: {"semantic_cache": true}` is looked up after its rate permit and before any generation opens; a hit
is answered from the entry (no service is asked, no token charged), any other outcome is computed and its
answer learnt. Such a response says what the cache did: the `X-Kite-Semantic-Cache` header and the body's
(a stream's first chunk's) `kite.semantic_cache` field.
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
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kite_shared.messages import StreamEnd, TokenChunk
from kite_shared.service import cancel_and_wait, tenant_var
from kite_gateway.auth import Authenticator
from kite_gateway.errors import ApiError
from kite_gateway.generation import (Generation, GenerationClient, GenerationParams, close_all, collect,
                                     gather_open, prompt_size, rate_permit)
from kite_gateway.normalize import chat_params, completion_params
from kite_gateway.openai_protocol import (ChatCompletionRequest, CompletionRequest, ErrorResponse,
                                          batch_usage_body, now, usage_body)
from kite_gateway.rate_limit import Permit, TenantRateLimiter
from kite_gateway.semantic import Consulted, SemanticResponses, consult_if_asked, learn_if_consulted

log = logging.getLogger(__name__)

REQUESTS = Counter("kite_requests_total", "HTTP API requests by endpoint and status", ["endpoint", "status"])
TTFT = Histogram("kite_ttft_seconds", "Time to first token seen by the gateway",
                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
TPOT = Histogram("kite_time_per_output_token_seconds", "Mean time per output token after the first",
                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))
LATENCY = Histogram("kite_request_duration_seconds", "End-to-end request time",
                    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
CACHED_TOKENS = Counter("kite_gateway_prompt_tokens_total", "Prompt tokens served, by KV source", ["source"])


def _json_body(model: type, max_n: int, model_name: str) -> dict:
    """openapi_extra declaring the JSON body a handler parses itself (so /openapi.json documents it)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})
    # The served model as the example: schema-driven tools (schemathesis' examples phase, API explorers)
    # then send requests that reach generation instead of a 404.
    schema["properties"]["model"]["examples"] = [model_name]
    # KITE_GATEWAY_MAX_N, a setting, bounds n, a batch of prompts, and their product (completions).
    schema["properties"]["n"]["maximum"] = max_n
    prompt = schema["properties"].get("prompt")
    if prompt is not None:
        schema["properties"]["prompt"] = _batches_at_most(prompt, max_n)
        # prompts x n <= max_n: one branch per value of n above 1
        schema["anyOf"] = [{"properties": {"n": {"maximum": 1}}}] + [
            {"required": ["n"], "properties": {"n": {"const": n}, "prompt": _batches_at_most(prompt, max_n // n)}}
            for n in range(2, max_n + 1)]

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


def _batches_at_most(prompt: dict, num_prompts: int) -> dict:
    """The prompt schema with a batch of prompts (list of strings, list of token lists; not one token
    list) bounded to `num_prompts`."""
    return {**prompt, "anyOf": [{**v, "maxItems": num_prompts} if v.get("items", {}).get("type") in ("string", "array")
                                else v for v in prompt["anyOf"]]}


def _header(description: str, required: bool = False, kind: str = "integer") -> dict:
    return {"description": description, "required": required, "schema": {"type": kind}}


_RATE_HEADERS = {
    f"x-ratelimit-{what}-{kind}": _header(text, kind="string" if what == "reset" else "integer")
    for kind in ("requests", "tokens")
    for what, text in (("limit", f"The tenant's {kind} per minute (sent only when such a limit applies)"),
                       ("remaining", f"{kind.capitalize()} left in the tenant's budget now"),
                       ("reset", "Time until the budget is full again, e.g. 1.5s or 6m0s"))}


def _error(description: str, headers: dict | None = None) -> dict:
    """An OpenAPI response: the OpenAI error object, with these headers."""
    return {"model": ErrorResponse, "description": description, **({"headers": headers} if headers else {})}


def _generation_responses(auth_enabled: bool) -> dict:
    responses = {
        200: {"description": "The completion as JSON, or with `stream: true` server-sent events ending in "
                             "`data: [DONE]`",
              # Before OpenAPI 3.2's itemSchema, an event stream's schema describes one event.
              "content": {"text/event-stream": {"schema": {
                  "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}},
                  "description": "One server-sent event; `data` is a JSON chunk (chat.completion.chunk or "
                                 "text_completion), an error object if the stream fails after it began, "
                                 "or `[DONE]`"}}},
              "headers": {"X-Kite-Worker": _header("The worker instance(s) that served the request",
                                                   kind="string"),
                          "X-Kite-Semantic-Cache": _header(
                              "What the semantic response cache did (only when the request asked for it): "
                              "hit, miss, explore, guarded or bypass", kind="string"), **_RATE_HEADERS}},
        400: _error("Invalid request: unparsable JSON, a bad or unsupported parameter, or a prompt plus "
                    "max_tokens beyond the context (`context_length_exceeded`)"),
        404: _error("The model does not exist (`model_not_found`)"),
        413: _error("The request body is larger than KITE_GATEWAY_MAX_BODY_BYTES"),
        429: _error("The tenant is over its request or token rate limit (`rate_limit_exceeded`)", {
            "Retry-After": _header("Seconds until the tenant's budget allows this request", required=True),
            **_RATE_HEADERS}),
        500: _error("Internal error"),
        503: _error("No fingerprinter or worker, overloaded (admission control) or shutting down",
                    {"Retry-After": _header("Seconds to wait before retrying (when a retry may succeed)")}),
        504: _error("The worker sent nothing within the stream timeout"),
    }
    if auth_enabled:
        responses[401] = _error("Missing or invalid API key", {
            "WWW-Authenticate": _header("Always `Bearer`", required=True, kind="string")})
    return dict(sorted(responses.items()))


def create_app(client_factory: Callable[[], GenerationClient], model_name: str, max_n: int,
               max_body_bytes: int, authenticator: Authenticator | None = None,
               rate_limiter: TenantRateLimiter | None = None,
               semantic: SemanticResponses | None = None) -> FastAPI:
    app = FastAPI(title="KITE", version="1", docs_url=None, redoc_url=None)
    auth = authenticator or Authenticator.disabled()
    limiter = rate_limiter or TenantRateLimiter()
    generation_responses = _generation_responses(auth.enabled)

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
        # Starlette's own headers matter: a 405 names the allowed methods in Allow (RFC 9110).
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), type=kind).body(),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(ApiError(500, "internal server error", type="server_error").body(), status_code=500)

    def answered(path: str, status: int) -> None:
        REQUESTS.labels(path, str(status)).inc()
        control = getattr(client(), "control", None)  # issue 5: request and error rates for telemetry
        if control is not None:
            control.stats.observe(path, status)

    app.add_middleware(LimitsAndMetrics, max_body_bytes=max_body_bytes, answered=answered)

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

    @app.get("/health", responses={503: _error(
        "No fingerprinter or no worker answers", {"Retry-After": _header("Seconds to wait", required=True)})})
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

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format"}})
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses={401: _error("Missing or invalid API key")} if auth.enabled else None)
    async def models(request: Request) -> JSONResponse:
        tenant_of(request)
        served = client().fleet.models()  # id -> the context window its live workers serve
        # max_model_len as vLLM's /v1/models says it (a model no live worker serves yet has no figure)
        return JSONResponse({"object": "list", "data": [
            {"id": n, "object": "model", "created": 0, "owned_by": "kite",
             **({"max_model_len": served[n]} if n in served else {})} for n in sorted({model_name, *served})]})

    async def open_all(permit: Permit, params: list[GenerationParams]) -> list[Generation]:
        try:
            return await gather_open(client(), params)
        except BaseException:
            permit.refund()  # refused before any token was computed
            raise

    async def consult(tenant: str, body, params: list[GenerationParams], kind: str) -> Consulted | None:
        return await consult_if_asked(semantic, body.kite.semantic_cache, tenant, kind, params[0],
                                      num_choices=len(params))

    def learn(consulted: Consulted | None, results: list[tuple[str, StreamEnd]]) -> None:
        if len(results) == 1:  # only one-choice requests are consulted
            learn_if_consulted(semantic, consulted, *results[0])

    async def generate(request: Request, permit: Permit, params: list[GenerationParams], id_prefix: str,
                       stream_events) -> Response | tuple[str, dict[str, str], list]:
        """Open every generation, then stream them (`stream_events(response id, generations, started)`
        gives the SSE events), or collect them: (response id, headers, [(text, StreamEnd)]) for the JSON
        answer the caller builds. A client gone first gets nothing (499)."""
        started = time.monotonic()
        generations = await open_all(permit, params)
        response_id = f"{id_prefix}-{uuid.uuid4().hex}"
        headers = {**permit.headers, **_worker_header(generations)}
        if stream_events:
            return _sse(stream_events(response_id, generations, started), headers)
        results = await _unless_disconnected(request, asyncio.gather(*(collect(g) for g in generations)))
        if results is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        _observe([end for _, end in results], generations, started)
        return response_id, headers, results

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest, max_n, model_name),
              responses=generation_responses)
    async def chat_completions(request: Request) -> Response:
        tenant = tenant_of(request)
        body: ChatCompletionRequest = await parse(request, ChatCompletionRequest)  # type: ignore[assignment]
        params = chat_params(body, tenant)
        permit = rate_permit(limiter, tenant, limiter.estimate_tokens(
            *prompt_size(params), max_tokens=body.resolved_max_tokens, choices=body.n))
        consulted = await consult(tenant, body, [params] * body.n, "chat")
        if consulted is not None and consulted.outcome == "hit":
            return _cached_answer("chatcmpl", body, consulted, permit)
        answered = await generate(request, permit, [params] * body.n, "chatcmpl", body.stream and (
            lambda response_id, generations, started: _chat_stream(
                response_id, body, generations, started, permit, consulted, learn)))
        if isinstance(answered, Response):
            return _with_report(answered, consulted)
        response_id, headers, results = answered
        usage = usage_body([end for _, end in results])
        permit.settle(usage["total_tokens"])
        learn(consulted, results)
        return _with_report(JSONResponse({
            "id": response_id, "object": "chat.completion", "created": now(), "model": body.model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": end.finish_reason}
                        for i, (text, end) in enumerate(results)],
            "usage": usage, **_report_field(consulted),
        }, headers=headers), consulted)

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest, max_n, model_name),
              responses=generation_responses)
    async def completions(request: Request) -> Response:
        tenant = tenant_of(request)
        body: CompletionRequest = await parse(request, CompletionRequest)  # type: ignore[assignment]
        prompts = body.prompts()
        if not prompts or len(prompts) * body.n > max_n:
            raise ApiError(400, f"between 1 and {max_n} completions (prompts x n) per request",
                           code="invalid_value", param="prompt")
        params = []
        tokens = 0
        for one in completion_params(body, tenant):
            params += [one] * body.n
            tokens += limiter.estimate_tokens(*prompt_size(one), max_tokens=body.max_tokens, choices=body.n)
        permit = rate_permit(limiter, tenant, tokens)
        consulted = await consult(tenant, body, params, "completion")
        if consulted is not None and consulted.outcome == "hit":
            return _cached_answer("cmpl", body, consulted, permit)
        answered = await generate(request, permit, params, "cmpl", body.stream and (
            lambda response_id, generations, started: _completion_stream(
                response_id, body, generations, started, permit, consulted, learn)))
        if isinstance(answered, Response):
            return _with_report(answered, consulted)
        response_id, headers, results = answered
        ends = [end for _, end in results]
        usage = batch_usage_body([ends[i:i + body.n] for i in range(0, len(ends), body.n)])
        permit.settle(usage["total_tokens"])
        learn(consulted, results)
        return _with_report(JSONResponse({
            "id": response_id, "object": "text_completion", "created": now(), "model": body.model,
            "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": end.finish_reason}
                        for i, (text, end) in enumerate(results)],
            "usage": usage, **_report_field(consulted),
        }, headers=headers), consulted)

    if auth.enabled:
        _declare_bearer_auth(app)
    return app


class LimitsAndMetrics:
    """Refuses a declared body over the limit (413) before the app reads it, and counts every answer by
    path and status as its response starts. A plain ASGI middleware: Starlette's `BaseHTTPMiddleware`
    (`@app.middleware("http")`) relays every streamed chunk through an extra task and memory stream, which
    cost the gateway about a tenth of its CPU per streamed token (issue 38's profile)."""

    def __init__(self, app, max_body_bytes: int, answered: Callable[[str, int], None]) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.answered = answered

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        declared = next((value for name, value in scope["headers"] if name == b"content-length"), None)
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            self.answered(path, 413)
            await JSONResponse(ApiError(413, f"Request body exceeds {self.max_body_bytes} bytes",
                                        code="request_too_large").body(), status_code=413)(scope, receive, send)
            return

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                self.answered(path, message["status"])
            await send(message)

        await self.app(scope, receive, counted)


def _declare_bearer_auth(app: FastAPI) -> None:
    """/openapi.json says what the gateway enforces: /v1/* needs a Bearer key, the rest is open."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()  # caches itself in app.openapi_schema, which is amended in place
            schema.setdefault("components", {})["securitySchemes"] = {"apiKey": {
                "type": "http", "scheme": "bearer", "description": "An API key (`kite keys new TENANT`)"}}
            for path, operations in schema["paths"].items():
                if path.startswith("/v1/"):
                    for operation in operations.values():
                        operation["security"] = [{"apiKey": []}]
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


CLIENT_CLOSED_REQUEST = 499  # nginx's code for "the client went away first"; nobody receives it


async def _unless_disconnected(request: Request, work):
    """`work`'s result, or None when the client disconnects first: then `work` is cancelled, and each
    generation's close() tells its worker to stop (a non-streaming request otherwise runs to its end for
    nobody, holding a worker for as long as its max_tokens allow). The request body has been read, so the
    next ASGI message is the disconnect (vLLM's `with_cancellation` listens the same way).
    Which came first decides, not the work's state afterwards: a gather cancelled from outside ends
    with CancelledError as its exception, not as cancelled(), and re-raising that would end the handler
    with no response at all (Starlette's "No response returned", logged as an unhandled error)."""
    work_task = asyncio.ensure_future(work)

    async def client_gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    listener = asyncio.ensure_future(client_gone())
    done: set = set()
    try:
        done, _ = await asyncio.wait({work_task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # The generations' close() runs here. Cancelled until they end: a cancel can be swallowed (Python
        # 3.11's wait_for, when it meets its result), and one cancel would leave the request to run on.
        await cancel_and_wait([task for task in (listener, work_task) if not task.done()])
        await asyncio.gather(listener, work_task, return_exceptions=True)  # ended: retrieves their outcomes
    if work_task in done:
        return work_task.result()
    log.info("client disconnected before its response; generation cancelled")
    return None


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
        # Each pump is cancelled until it ends (a cancel can be swallowed). Shielded and held: when the
        # client goes away, the streaming response's cancel scope cancels every await in here again, so
        # the wait may go on after this generator has ended.
        ending = asyncio.ensure_future(cancel_and_wait(tasks))
        _ENDING.add(ending)
        ending.add_done_callback(_ENDING.discard)
        await asyncio.shield(ending)


_ENDING: set[asyncio.Future] = set()  # streams' pump cancellations under way (asyncio keeps tasks weakly)


async def _stream_choices(kind: str, response_id: str, body, generations: list[Generation], started: float,
                          permit: Permit, delta: Callable[[str], dict], first: Callable[[], dict] | None,
                          consulted: Consulted | None, learn: Callable) -> AsyncIterator[dict]:
    created = now()
    usage_field = {"usage": None} if body.include_usage else {}
    report = _report_field(consulted)  # in the first chunk only

    def chunk(choices: list[dict]) -> dict:
        nonlocal report
        out = {"id": response_id, "object": kind, "created": created, "model": body.model,
               "choices": choices, **usage_field, **report}
        report = {}
        return out

    ends: list[StreamEnd] = [None] * len(generations)  # type: ignore[list-item]
    texts: list[list[str]] = [[] for _ in generations]
    try:
        if first is not None:
            yield chunk([{"index": i, **first(), "logprobs": None, "finish_reason": None}
                         for i in range(len(generations))])
        async for index, event in _merged(generations):
            texts[index].append(event.text)
            if isinstance(event, StreamEnd):
                ends[index] = event
                yield chunk([{"index": index, **delta(event.text), "logprobs": None,
                              "finish_reason": event.finish_reason}])
            elif event.text:
                yield chunk([{"index": index, **delta(event.text), "logprobs": None, "finish_reason": None}])
        _observe(ends, generations, started)
        n = getattr(body, "n", 1)
        usage = batch_usage_body([ends[i:i + n] for i in range(0, len(ends), n)])
        permit.settle(usage["total_tokens"])
        learn(consulted, [("".join(parts), end) for parts, end in zip(texts, ends)])
        if body.include_usage:
            yield {"id": response_id, "object": kind, "created": created, "model": body.model, "choices": [],
                   "usage": usage}
    except ApiError as exc:
        yield exc.body()
    finally:
        await close_all(generations)


def _chat_stream(response_id: str, body: ChatCompletionRequest, generations: list[Generation],
                 started: float, permit: Permit, consulted: Consulted | None, learn: Callable) -> AsyncIterator[dict]:
    return _stream_choices("chat.completion.chunk", response_id, body, generations, started, permit,
                           delta=_chat_delta, first=_chat_first, consulted=consulted, learn=learn)


def _completion_stream(response_id: str, body: CompletionRequest, generations: list[Generation],
                       started: float, permit: Permit, consulted: Consulted | None,
                       learn: Callable) -> AsyncIterator[dict]:
    return _stream_choices("text_completion", response_id, body, generations, started, permit,
                           delta=_completion_delta, first=None, consulted=consulted, learn=learn)


def _chat_delta(text: str) -> dict:
    return {"delta": {"content": text} if text else {}}


def _chat_first() -> dict:
    return {"delta": {"role": "assistant", "content": ""}}


def _completion_delta(text: str) -> dict:
    return {"text": text}


def _report_field(consulted: Consulted | None) -> dict:
    """The body's extension field saying what the semantic cache did (nothing when it was not asked)."""
    return {} if consulted is None else {"kite": {"semantic_cache": consulted.report()}}


def _with_report(response: Response, consulted: Consulted | None) -> Response:
    if consulted is not None:
        response.headers["X-Kite-Semantic-Cache"] = consulted.outcome
    return response


def _cached_answer(id_prefix: str, body, consulted: Consulted, permit: Permit) -> Response:
    """A hit: the entry's answer as the response a computation would have given (its usage is the one of
    the computation that produced the answer; the tenant is charged no token)."""
    entry = consulted.entry
    permit.settle(0)
    response_id = f"{id_prefix}-{uuid.uuid4().hex}"
    usage, finish_reason = entry.details["usage"], entry.details["finish_reason"]
    chat = isinstance(body, ChatCompletionRequest)
    if body.stream:
        kind = "chat.completion.chunk" if chat else "text_completion"
        created = now()
        delta = _chat_delta if chat else _completion_delta

        async def events() -> AsyncIterator[dict]:
            base = {"id": response_id, "object": kind, "created": created, "model": body.model}
            usage_field = {"usage": None} if body.include_usage else {}
            choices = [{"index": 0, **delta(entry.answer), "logprobs": None, "finish_reason": finish_reason}]
            if chat:
                yield {**base, "choices": [{"index": 0, **_chat_first(), "logprobs": None, "finish_reason": None}],
                       **usage_field, **_report_field(consulted)}
                yield {**base, "choices": choices, **usage_field}
            else:
                yield {**base, "choices": choices, **usage_field, **_report_field(consulted)}
            if body.include_usage:
                yield {**base, "choices": [], "usage": usage}

        return _with_report(_sse(events(), dict(permit.headers)), consulted)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": entry.answer}, "logprobs": None,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": entry.answer, "logprobs": None, "finish_reason": finish_reason}
    return _with_report(JSONResponse({
        "id": response_id, "object": "chat.completion" if chat else "text_completion", "created": now(),
        "model": body.model, "choices": [choice], "usage": usage, **_report_field(consulted)},
        headers=dict(permit.headers)), consulted)
