"""The gRPC API (kite.v1.Kite), driven by the generated stub.

Two setups:
  * the real stack (`kite_stack`: nats-server, fingerprinter, worker with the real model, gateway): answers,
    inputs, validation and health as a client sees them;
  * the gateway's gRPC server over a real NATS with scripted fingerprinter/worker replies: the failure
    paths a healthy stack cannot be made to take on demand (refusals, mid-stream errors, silent workers,
    deadlines, client cancellation reaching the workers).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import nats
import pytest
import pytest_asyncio

from kite_cli.local_servers import free_port, start_nats
from kite_shared import subjects
from kite_shared.config import GatewayConfig, load
from kite_shared.grpc_gen import kite_pb2, kite_pb2_grpc
from kite_shared.messages import (Admission, Cancel, ErrorInfo, GenerateRequest, Heartbeat, Pong, StreamEnd,
                                  StreamError, TokenChunk, Usage)
from kite_gateway.fleet import Fleet
from kite_gateway.generation import GenerationClient
from kite_gateway.grpc_api import KiteService, start_grpc_server
from kite_shared.security import tenant_cache_salt
from tests.helpers import wait_until_async

QUESTION = kite_pb2.ChatMessages(
    messages=[kite_pb2.Message(role="user", content="What is the capital of France?")])
CALL_TIMEOUT_S = 120


def _trailers(exc: grpc.RpcError) -> dict[str, str]:
    return {k: v for k, v in (exc.trailing_metadata() or ())}


def _split(responses: list[kite_pb2.GenerateResponse]) -> tuple[list[kite_pb2.Chunk], kite_pb2.End]:
    """(chunks, end), checking the stream's shape: chunks only, then exactly one End, last."""
    assert responses, "the stream was empty"
    kinds = [r.WhichOneof("event") for r in responses]
    assert kinds[-1] == "end" and kinds.count("end") == 1, kinds
    assert None not in kinds
    return [r.chunk for r in responses[:-1]], responses[-1].end


# --- the real stack -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stub(kite_stack):
    channel = grpc.insecure_channel(kite_stack.grpc_target)
    try:
        grpc.channel_ready_future(channel).result(timeout=30)
    except grpc.FutureTimeoutError:
        channel.close()
        pytest.fail(f"the gateway's gRPC server is not listening on {kite_stack.grpc_target} "
                    "(is KITE_GATEWAY_GRPC_PORT 0 in the stack's env?)")
    yield kite_pb2_grpc.KiteStub(channel)
    channel.close()


def _generate(stub, **fields) -> tuple[list[kite_pb2.Chunk], kite_pb2.End]:
    return _split(list(stub.Generate(kite_pb2.GenerateRequest(**fields), timeout=CALL_TIMEOUT_S)))


def _invalid(stub, **fields) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(kite_pb2.GenerateRequest(**fields), timeout=CALL_TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value


def test_greedy_chat_streams_chunks_then_end_with_usage(kite_stack, stub):
    chunks, end = _generate(stub, model=kite_stack.model, messages=QUESTION, temperature=0, max_tokens=20)
    text = "".join(c.text for c in chunks)
    assert "Paris" in text
    assert sum(1 for c in chunks if c.text) >= 3
    assert end.finish_reason in ("stop", "length")
    assert end.usage.prompt_tokens > 0 and 0 < end.usage.completion_tokens <= 20
    assert 0 <= end.usage.cached_tokens <= end.usage.prompt_tokens
    token_ids = [t for c in chunks for t in c.token_ids]
    # The end-of-sequence token counts as generated but is not sent.
    assert end.usage.completion_tokens - len(token_ids) in (0, 1)


def test_grpc_text_equals_http_text(kite_stack, stub):
    chunks, end = _generate(stub, model=kite_stack.model, messages=QUESTION, temperature=0, max_tokens=25)
    r = httpx.post(kite_stack.http_url + "/v1/chat/completions", timeout=CALL_TIMEOUT_S, json={
        "model": kite_stack.model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0, "max_tokens": 25})
    assert r.status_code == 200, r.text
    assert "".join(c.text for c in chunks) == r.json()["choices"][0]["message"]["content"]
    assert end.usage.completion_tokens == r.json()["usage"]["completion_tokens"]
    assert not end.HasField("semantic_cache")  # reported only when asked for


def test_semantic_cache_off_in_the_deployment_is_a_bypass(kite_stack, stub):
    chunks, end = _generate(stub, model=kite_stack.model, messages=QUESTION, temperature=0, max_tokens=5,
                            semantic_cache=True)
    assert "".join(c.text for c in chunks) and end.semantic_cache.outcome == "bypass"
    assert "KITE_SEMANTIC_CACHE_TENANTS" in end.semantic_cache.reason


def test_prompt_string_and_token_id_inputs(kite_stack, stub):
    chunks, end = _generate(stub, model=kite_stack.model, prompt="The capital of France is", temperature=0,
                            max_tokens=8)
    assert "".join(c.text for c in chunks).strip()
    assert end.usage.prompt_tokens > 0 and 0 < end.usage.completion_tokens <= 8
    ids = [t for c in chunks for t in c.token_ids]
    chunks, end = _generate(stub, model=kite_stack.model, prompt_token_ids=kite_pb2.TokenIds(ids=ids),
                            temperature=0, max_tokens=3)
    assert end.usage.prompt_tokens == len(ids)
    assert end.usage.completion_tokens >= 1


def test_max_tokens_ends_with_length(kite_stack, stub):
    chunks, end = _generate(stub, model=kite_stack.model, prompt="Count: 1, 2, 3,", temperature=0, max_tokens=3)
    assert end.finish_reason == "length" and end.usage.completion_tokens == 3
    assert len([t for c in chunks for t in c.token_ids]) == 3


def test_seeded_sampling_is_reproducible(kite_stack, stub):
    fields = dict(model=kite_stack.model, messages=QUESTION, temperature=0.9, top_p=0.9, seed=-1234, max_tokens=12)
    a, _ = _generate(stub, **fields)
    b, _ = _generate(stub, **fields)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


def test_invalid_temperature_is_invalid_argument(kite_stack, stub):
    err = _invalid(stub, model=kite_stack.model, messages=QUESTION, temperature=2.5)
    assert "temperature" in err.details()
    assert _trailers(err)["kite-error-code"] == "invalid_value"


def test_unknown_model_is_not_found_and_too_long_is_invalid_argument(kite_stack, stub):
    with pytest.raises(grpc.RpcError) as info:  # HTTP's 404
        list(stub.Generate(kite_pb2.GenerateRequest(model="gpt-17", messages=QUESTION), timeout=CALL_TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert _trailers(info.value)["kite-error-code"] == "model_not_found"
    err = _invalid(stub, model=kite_stack.model, messages=QUESTION, max_tokens=100_000)
    assert _trailers(err)["kite-error-code"] == "context_length_exceeded"
    # The gateway still serves after refusals.
    _, end = _generate(stub, model=kite_stack.model, messages=QUESTION, temperature=0, max_tokens=3)
    assert end.usage.completion_tokens > 0


def test_cancelled_stream_leaves_the_stack_serving(kite_stack, stub):
    call = stub.Generate(kite_pb2.GenerateRequest(model=kite_stack.model, prompt="Once upon a time",
                                                  temperature=0, max_tokens=500), timeout=CALL_TIMEOUT_S)
    first = next(call)
    assert first.WhichOneof("event") == "chunk"
    call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    _, end = _generate(stub, model=kite_stack.model, messages=QUESTION, temperature=0, max_tokens=3)
    assert end.usage.completion_tokens > 0


def test_health_is_serving(stub):
    health = stub.Health(kite_pb2.HealthRequest(), timeout=10)
    assert health.status == kite_pb2.HealthResponse.SERVING
    assert health.live_workers >= 1 and health.detail == ""


# --- scripted services over real NATS ----------------------------------------------------------------------
# The scripted fingerprinter reads its scenario from the prompt:
#   "ok"              accept; two chunks, then an end that releases its own last text
#   "forever"         accept; a chunk every 20 ms until the request is cancelled
#   "fail:<code>"     accept; two chunks, then a stream error with <code>
#   "silent"          accept; never send anything (the gateway's stream idle timeout fires)
#   "refuse:<code>"   refuse admission with <code>

WORKER_ID = "scripted-worker"
IDLE_TIMEOUT_S = 0.5


class Scripted:
    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []
        self.cancelled: set[str] = set()
        self.tasks: set[asyncio.Task] = set()
        self.pings: dict[str, object] = {}
        self.nc = None

    async def on_fingerprint(self, msg) -> None:
        request = GenerateRequest.decode(msg.data)
        self.requests.append(request)
        scenario = request.prompt or "ok"
        if scenario.startswith("refuse:"):
            code = scenario.split(":", 1)[1]
            refusal = Admission(accepted=False, error=ErrorInfo(code=code, message=f"scripted {code}"))
            await msg.respond(refusal.encode())
            return
        await msg.respond(Admission(accepted=True, worker_id=WORKER_ID, prompt_tokens=3).encode())
        task = asyncio.create_task(self.stream(request, scenario))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def stream(self, request: GenerateRequest, scenario: str) -> None:
        subject, rid = request.stream_subject, request.request_id

        async def send(event) -> None:
            await self.nc.publish(subject, event.encode())

        if scenario == "silent":
            return
        if scenario == "forever":
            deadline = time.monotonic() + 30
            seq = 0
            while rid not in self.cancelled and time.monotonic() < deadline:
                await send(TokenChunk(request_id=rid, seq=seq, token_ids=[seq % 50], text="x"))
                seq += 1
                await asyncio.sleep(0.02)
            return
        await send(TokenChunk(request_id=rid, seq=0, token_ids=[10], text="Hel"))
        await send(TokenChunk(request_id=rid, seq=1, token_ids=[11], text="lo"))
        if scenario.startswith("fail:"):
            code = scenario.split(":", 1)[1]
            await send(StreamError(request_id=rid, seq=2, error=ErrorInfo(code=code, message=f"scripted {code}")))
            return
        await send(StreamEnd(request_id=rid, seq=2, finish_reason="stop", text="!", token_ids=[12],
                             usage=Usage(prompt_tokens=3, completion_tokens=3, cached_tokens=2)))

    async def on_cancel(self, msg) -> None:
        self.cancelled.add(Cancel.decode(msg.data).request_id)

    async def answer_pings(self, service: str) -> None:
        async def pong(msg) -> None:
            await msg.respond(Pong(service=service, instance_id=f"scripted-{service}", uptime_s=1.0).encode())

        self.pings[service] = await self.nc.subscribe(subjects.ping(service), cb=pong)

    async def stop_pings(self, service: str) -> None:
        await self.pings.pop(service).unsubscribe()

    async def wait_cancelled(self, request_id: str, timeout_s: float = 5.0) -> None:
        await wait_until_async(lambda: request_id in self.cancelled, timeout_s,
                               f"a cancel of {request_id} to reach the workers", interval_s=0.01)


@pytest_asyncio.fixture(scope="module")
async def scripted(nats_server):
    script = Scripted()
    script.nc = await nats.connect(nats_server.url)
    await script.nc.subscribe(subjects.FINGERPRINT, cb=script.on_fingerprint)
    await script.nc.subscribe(subjects.WORKER_CANCEL, cb=script.on_cancel)
    await script.answer_pings("fingerprinter")
    await script.answer_pings("worker")
    await script.nc.flush()

    gateway_nc = await nats.connect(nats_server.url)
    fleet = Fleet(dead_after_s=3600)
    fleet.observe(Heartbeat(service="worker", instance_id=WORKER_ID, started_at=time.time(), sent_at=time.time()))
    client = GenerationClient(nc=gateway_nc, fleet=fleet, gateway_id="grpctest", admit_timeout_s=2.0,
                              stream_idle_timeout_s=IDLE_TIMEOUT_S)
    cfg = load(GatewayConfig, host="127.0.0.1", grpc_port=free_port(), max_body_bytes=1 << 20)
    server = await start_grpc_server(client, cfg)
    script.client = client
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{cfg.grpc_port}")
    script.stub = kite_pb2_grpc.KiteStub(channel)
    yield script
    await channel.close()
    await server.stop(grace=1)
    for task in list(script.tasks):
        task.cancel()
    await gateway_nc.close()
    await script.nc.close()


async def _scripted_call(script: Scripted, prompt: str, timeout: float = 10.0, **fields):
    """(responses before the end of the call, the error it ended with or None)."""
    request = kite_pb2.GenerateRequest(model="m", prompt=prompt, **fields)
    responses = []
    try:
        async for response in script.stub.Generate(request, timeout=timeout):
            responses.append(response)
    except grpc.aio.AioRpcError as exc:
        return responses, exc
    return responses, None


async def test_scripted_stream_releases_end_text_as_a_chunk(scripted):
    responses, error = await _scripted_call(scripted, "ok")
    assert error is None
    chunks, end = _split(responses)
    assert [(c.text, list(c.token_ids)) for c in chunks] == [("Hel", [10]), ("lo", [11]), ("!", [12])]
    assert end.finish_reason == "stop"
    assert (end.usage.prompt_tokens, end.usage.completion_tokens, end.usage.cached_tokens) == (3, 3, 2)
    # A finished stream is not cancelled.
    await asyncio.sleep(0.2)
    assert scripted.requests[-1].request_id not in scripted.cancelled


async def test_request_fields_reach_the_services(scripted):
    request = kite_pb2.GenerateRequest(
        model="m", messages=kite_pb2.ChatMessages(messages=[kite_pb2.Message(role="developer", content="Be brief."),
                                                            kite_pb2.Message(role="user", content="Hi")]),
        max_tokens=7, top_p=0.5, seed=-5, stop=["\n", "END"], disable_reuse=True, cache_salt="tenant-a")
    responses = [r async for r in scripted.stub.Generate(request, timeout=10)]
    _split(responses)
    seen = scripted.requests[-1]
    assert [(m.role, m.content) for m in seen.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert seen.prompt is None and seen.prompt_token_ids is None
    s = seen.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop) == (7, 1.0, 0.5, -5 % 2**63, ["\n", "END"])
    # The salt services see is derived from the tenant (auth off here: "anonymous") and the client's salt.
    assert seen.reuse is False and seen.cache_salt == tenant_cache_salt("anonymous", "tenant-a")

    await _scripted_call(scripted, "ok", temperature=0.0)
    s = scripted.requests[-1].sampling
    # An explicit 0 is greedy, not "unset"; reuse stays on by default.
    assert (s.temperature, s.max_tokens, s.seed) == (0.0, None, None) and scripted.requests[-1].reuse is True


@pytest.mark.parametrize("fields, param", [
    (dict(prompt="x"), "model"),
    (dict(model="m"), "one of messages, prompt or prompt_token_ids"),
    (dict(model="m", messages=kite_pb2.ChatMessages()), "messages"),
    (dict(model="m", messages=kite_pb2.ChatMessages(messages=[kite_pb2.Message(role="robot", content="x")])),
     "messages[0].role"),
    (dict(model="m", prompt_token_ids=kite_pb2.TokenIds()), "prompt_token_ids"),
    (dict(model="m", prompt="x", temperature=-0.1), "temperature"),
    (dict(model="m", prompt="x", temperature=float("nan")), "temperature"),
    (dict(model="m", prompt="x", top_p=0.0), "top_p"),
    (dict(model="m", prompt="x", top_p=1.5), "top_p"),
    (dict(model="m", prompt="x", max_tokens=0), "max_tokens"),
    (dict(model="m", prompt="x", stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(model="m", prompt="x", cache_salt="s" * 257), "cache_salt"),
])
async def test_bad_fields_are_invalid_argument_before_any_service(scripted, fields, param):
    before = len(scripted.requests)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        [r async for r in scripted.stub.Generate(kite_pb2.GenerateRequest(**fields), timeout=10)]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(param), info.value.details()
    assert _trailers(info.value)["kite-error-code"] == "invalid_value"
    assert len(scripted.requests) == before


@pytest.mark.parametrize("code, status, retry", [
    ("model_not_found", grpc.StatusCode.NOT_FOUND, False),
    ("context_length_exceeded", grpc.StatusCode.INVALID_ARGUMENT, False),
    ("no_worker", grpc.StatusCode.UNAVAILABLE, True),
    ("overloaded", grpc.StatusCode.UNAVAILABLE, True),
    ("internal_error", grpc.StatusCode.INTERNAL, False),
    ("never_heard_of_it", grpc.StatusCode.INTERNAL, False),
])
async def test_refusals_map_to_status_codes(scripted, code, status, retry):
    responses, error = await _scripted_call(scripted, f"refuse:{code}")
    assert responses == [] and error is not None
    assert error.code() == status and error.details() == f"scripted {code}"
    trailers = _trailers(error)
    assert trailers["kite-error-code"] == code
    assert ("retry-after" in trailers) == retry


async def test_no_fingerprinter_is_unavailable_and_not_serving():
    empty_nats = start_nats()  # nobody subscribed: every request is answered "no responders" at once
    try:
        nc = await nats.connect(empty_nats.url)
        client = GenerationClient(nc=nc, fleet=Fleet(dead_after_s=1), gateway_id="lonely",
                                  admit_timeout_s=2.0, stream_idle_timeout_s=1.0)
        cfg = load(GatewayConfig, host="127.0.0.1", grpc_port=free_port())
        server = await start_grpc_server(client, cfg)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{cfg.grpc_port}") as channel:
                stub = kite_pb2_grpc.KiteStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    [r async for r in stub.Generate(kite_pb2.GenerateRequest(model="m", prompt="ok"), timeout=10)]
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                assert _trailers(info.value)["kite-error-code"] == "no_fingerprinter"
                assert _trailers(info.value)["retry-after"] == "1"
                health = await stub.Health(kite_pb2.HealthRequest(), timeout=10)
                assert health.status == kite_pb2.HealthResponse.NOT_SERVING and health.live_workers == 0
        finally:
            await server.stop(grace=1)
            await nc.close()
    finally:
        empty_nats.stop()


@pytest.mark.parametrize("code, status", [
    ("worker_lost", grpc.StatusCode.UNAVAILABLE),
    ("internal_error", grpc.StatusCode.INTERNAL),
])
async def test_error_after_chunks_ends_the_call_with_its_status(scripted, code, status):
    responses, error = await _scripted_call(scripted, f"fail:{code}")
    assert [r.chunk.text for r in responses] == ["Hel", "lo"]
    assert error is not None and error.code() == status
    assert _trailers(error)["kite-error-code"] == code


async def test_silent_worker_is_deadline_exceeded(scripted):
    started = time.monotonic()
    responses, error = await _scripted_call(scripted, "silent", timeout=30)
    assert responses == [] and error is not None
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _trailers(error)["kite-error-code"] == "stream_timeout"
    assert time.monotonic() - started < 10


async def test_client_deadline_stops_the_generation(scripted):
    started = time.monotonic()
    responses, error = await _scripted_call(scripted, "forever", timeout=0.5)
    assert error is not None and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert responses, "chunks sent before the deadline arrive"
    assert time.monotonic() - started < 5
    await scripted.wait_cancelled(scripted.requests[-1].request_id)


class _Aborted(Exception):
    pass


class _DeadlineContext:
    """The parts of grpc.aio.ServicerContext that Generate uses, with a deadline but no gRPC core that
    would cancel the handler when it passes: the handler must end the call by itself."""

    def __init__(self, remaining_s: float) -> None:
        self.remaining_s = remaining_s
        self.written: list[kite_pb2.GenerateResponse] = []

    def time_remaining(self) -> float:
        return self.remaining_s

    async def write(self, response: kite_pb2.GenerateResponse) -> None:
        self.written.append(response)

    async def abort(self, code, details, trailing_metadata=()):
        raise _Aborted(code, details, dict(trailing_metadata))


async def test_handler_enforces_the_deadline_itself(scripted):
    context = _DeadlineContext(remaining_s=0.3)
    started = time.monotonic()
    with pytest.raises(_Aborted) as info:
        await KiteService(scripted.client).Generate(kite_pb2.GenerateRequest(model="m", prompt="forever"),
                                                    context)
    code, _, trailers = info.value.args
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and trailers["kite-error-code"] == "deadline_exceeded"
    assert context.written and time.monotonic() - started < 3
    await scripted.wait_cancelled(scripted.requests[-1].request_id)


class _CancelLosingGeneration:
    """A generation whose stream loses one cancellation, as nats-py's next_msg can on Python 3.11 when a
    message arrives in the instant the deadline's cancel does (wait_for returns the message)."""

    closed = False

    async def events(self):
        lost = False
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if lost:
                    raise
                lost = True
            yield TokenChunk(request_id="r", seq=0, token_ids=[1], text="x")

    async def close(self) -> None:
        self.closed = True


class _CancelLosingClient:
    def __init__(self) -> None:
        self.generation = _CancelLosingGeneration()

    async def open(self, params):
        return self.generation


async def test_the_deadline_holds_when_a_cancellation_is_lost():
    client = _CancelLosingClient()
    context = _DeadlineContext(remaining_s=0.3)
    with pytest.raises(_Aborted) as info:
        await asyncio.wait_for(KiteService(client).Generate(  # type: ignore[arg-type]
            kite_pb2.GenerateRequest(model="m", prompt="forever"), context), 5)
    assert info.value.args[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert client.generation.closed


async def test_client_cancel_reaches_the_workers(scripted):
    call = scripted.stub.Generate(kite_pb2.GenerateRequest(model="m", prompt="forever"), timeout=30)
    first = await call.read()
    assert first.chunk.text == "x"
    request_id = scripted.requests[-1].request_id
    assert request_id not in scripted.cancelled
    call.cancel()
    await scripted.wait_cancelled(request_id)


async def test_oversized_request_is_refused(scripted):
    responses, error = await _scripted_call(scripted, "p" * (2 << 20))
    assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_health_follows_the_services(scripted):
    health = await scripted.stub.Health(kite_pb2.HealthRequest(), timeout=10)
    assert health.status == kite_pb2.HealthResponse.SERVING and health.live_workers == 1
    await scripted.stop_pings("worker")
    try:
        health = await scripted.stub.Health(kite_pb2.HealthRequest(), timeout=10)
        assert health.status == kite_pb2.HealthResponse.NOT_SERVING
        assert "worker" in health.detail
    finally:
        await scripted.answer_pings("worker")
    await scripted.stop_pings("fingerprinter")
    try:
        health = await scripted.stub.Health(kite_pb2.HealthRequest(), timeout=10)
        assert health.status == kite_pb2.HealthResponse.NOT_SERVING
        assert "fingerprinter" in health.detail
    finally:
        await scripted.answer_pings("fingerprinter")


async def test_port_clash_fails_the_start():
    taken = load(GatewayConfig, host="127.0.0.1", grpc_port=free_port())
    first = await start_grpc_server(None, taken)  # type: ignore[arg-type]  (never called)
    try:
        with pytest.raises(RuntimeError, match="could not bind"):
            await start_grpc_server(None, taken)  # type: ignore[arg-type]
    finally:
        await first.stop(grace=0)
