"""Bad input against a real stack: schemathesis fuzzing of the gateway's OpenAPI schema (>= 50 examples
per operation and generation mode, zero 5xx, every error an OpenAI error object, every answer's status,
content type, headers and body as the schema documents them), plus explicit HTTP and gRPC cases: oversized
bodies, bad UTF-8, huge n, negative and absurd parameters, bad salts, bad keys, unknown models, methods a
path does not serve.

The stack runs with auth on (the fuzzer sends a valid key) and KITE_DEFAULT_MAX_TOKENS=4; generated
max_tokens values that fit the context are clamped to 4, so valid requests stay short on 2 cores (values
beyond the context are kept: they must be a 400), and positive cases name the served model.
"""

from __future__ import annotations

import json
import secrets

import grpc
import httpx
import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis import checks

from kite_cli.stack import StackOptions
from kite_shared.grpc_gen import kite_pb2, kite_pb2_grpc
from kite_shared.security import hash_api_key
from tests.fuzz_bounds import clamp_generation_length
from tests.integration.conftest import MODEL, _start

KEY = "kite-fuzz-" + secrets.token_hex(12)
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 65536
EXAMPLES = 50
# The published schema must describe what the stack really answers.
CONFORMANCE = [checks.status_code_conformance, checks.content_type_conformance,
               checks.response_headers_conformance, checks.response_schema_conformance]


@pytest.fixture(scope="module")
def fuzz_stack():
    stack = _start(StackOptions(num_workers=1, env={
        "KITE_AUTH_ENABLED": "on", "KITE_API_KEYS": f"fuzz:{hash_api_key(KEY)}",
        "KITE_DEFAULT_MAX_TOKENS": "4", "KITE_GATEWAY_MAX_BODY_BYTES": str(MAX_BODY),
        # Fuzzing tests robustness to inputs, not overload: early 503s from admission control (tested in
        # test_routing_arbitrator) would be counted as server errors here.
        "KITE_ARBITRATOR_TTFT_SLO_S": "600"}))
    yield stack
    stack.stop()


def assert_openai_error(response, status: int | None = None) -> dict:
    if status is not None:
        assert response.status_code == status, response.text[:500]
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def _clamp(case, mode) -> None:
    body = case.body
    if isinstance(body, dict) and mode == schemathesis.GenerationMode.POSITIVE and isinstance(body.get("model"), str):
        body["model"] = MODEL  # a random model name would stop every request at model_not_found
    clamp_generation_length(body)


def _fuzz(operation, mode, base_url: str) -> list[int]:
    statuses: list[int] = []

    @hypothesis.settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                         phases=[Phase.explicit, Phase.generate],
                         suppress_health_check=list(HealthCheck))
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def one(case) -> None:
        _clamp(case, mode)
        response = case.call(base_url=base_url, headers=AUTH, timeout=120)
        statuses.append(response.status_code)
        assert response.status_code < 500, (
            f"{response.status_code} for {case.as_curl_command()}: {response.text[:500]}")
        if response.status_code >= 400:
            assert_openai_error(response)
        case.validate_response(response, checks=CONFORMANCE)

    one()
    return statuses


def test_schema_documents_the_request_bodies(fuzz_stack):
    schema = httpx.get(fuzz_stack.http_url + "/openapi.json", timeout=30).json()
    for path in ("/v1/chat/completions", "/v1/completions"):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["type"] == "object" and "model" in body["required"]


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
@pytest.mark.parametrize("method, path", [("POST", "/v1/chat/completions"), ("POST", "/v1/completions")])
def test_fuzzed_bodies_never_get_a_5xx(fuzz_stack, method, path, mode):
    schema = schemathesis.openapi.from_url(fuzz_stack.http_url + "/openapi.json")
    operation = schema[path][method]
    statuses = _fuzz(operation, mode, fuzz_stack.http_url)
    assert len(statuses) >= EXAMPLES
    print(f"{method} {path} {mode.value}: statuses {sorted(statuses)}")
    if mode == schemathesis.GenerationMode.NEGATIVE:
        assert all(400 <= s < 500 for s in statuses), statuses


def test_fuzzed_get_operations(fuzz_stack):
    schema = schemathesis.openapi.from_url(fuzz_stack.http_url + "/openapi.json")
    for path in ("/v1/models", "/health", "/metrics"):
        statuses = _fuzz(schema[path]["GET"], schemathesis.GenerationMode.POSITIVE, fuzz_stack.http_url)
        assert statuses and all(s == 200 for s in statuses)


# --- explicit HTTP cases ----------------------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def post(stack, path: str = "/v1/chat/completions", headers=None, **kwargs) -> httpx.Response:
    return httpx.post(stack.http_url + path, headers={**AUTH, **(headers or {})}, timeout=60, **kwargs)


def test_oversized_bodies_are_413(fuzz_stack):
    big = dict(CHAT, messages=[{"role": "user", "content": "x" * (MAX_BODY + 10)}])
    assert_openai_error(post(fuzz_stack, json=big), 413)

    def chunks():  # no Content-Length: the limit is enforced on what arrives
        for _ in range(MAX_BODY // 1024 + 2):
            yield b" " * 1024
    assert_openai_error(post(fuzz_stack, content=chunks(), headers={"Content-Type": "application/json"}), 413)


@pytest.mark.parametrize("raw", [b'{"model": "\xff\xfe", "messages": []}', b"\xc3\x28", b"{bad json", b"[1, 2]",
                                 b'{"model": "' + MODEL.encode() + b'", "prompt": "\xed\xa0\x80"}', b"",
                                 b'{"model": "' + MODEL.encode() + b'", "prompt": "\\ud800"}', b"[" * 60000],
                         ids=["bad-utf8-model", "bad-utf8", "bad-json", "array", "surrogate-bytes", "empty",
                              "lone-surrogate-escape", "deep-nesting"])
def test_bad_utf8_and_bad_json_are_400(fuzz_stack, raw):
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert_openai_error(post(fuzz_stack, path, content=raw, headers={"Content-Type": "application/json"}), 400)


@pytest.mark.parametrize("change, param", [
    ({"n": 10**9}, "n"), ({"n": 0}, "n"), ({"n": -1}, "n"), ({"n": 9}, "n"),
    ({"max_tokens": -5}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 10**12}, None),
    ({"max_completion_tokens": 2**63}, None), ({"temperature": -1}, "temperature"),
    ({"temperature": 1e308}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 2}, "top_p"),
    ({"seed": 2**70}, "seed"), ({"seed": "x"}, "seed"), ({"stop": ["a"] * 5}, "stop"),
    ({"presence_penalty": 9}, "presence_penalty"), ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, None), ({"model": ""}, "model"),
    ({"logprobs": True}, "logprobs"), ({"stream": [1]}, "stream"),
    ({"cache_salt": 5}, "cache_salt"), ({"cache_salt": "s" * 257}, "cache_salt"), ({"cache_salt": None}, "cache_salt"),
    ({"cache_salt": ["a"]}, "cache_salt"), ({"kite": {"reuse": "maybe"}}, None),
])
def test_absurd_chat_parameters_are_400(fuzz_stack, change, param):
    err = assert_openai_error(post(fuzz_stack, json={**CHAT, **change}), 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert param in (err["param"] or "") or param in err["message"], err


@pytest.mark.parametrize("change", [
    {"prompt": []}, {"prompt": [[]]}, {"prompt": [-1, 5]}, {"prompt": [10**12]}, {"prompt": [["a"]]},
    {"prompt": ["a"] * 9}, {"prompt": "x", "n": 5, "max_tokens": 2, "best_of": 3}, {"prompt": None},
    {"prompt": "x", "echo": True}, {"prompt": "x", "cache_salt": {"a": 1}},
])
def test_absurd_completion_parameters_are_400(fuzz_stack, change):
    assert_openai_error(post(fuzz_stack, "/v1/completions", json={"model": MODEL, "max_tokens": 2, **change}), 400)


def test_unknown_model_is_404_and_wrong_methods_are_405_with_allow(fuzz_stack):
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"model": MODEL, "prompt": "x"})):
        err = assert_openai_error(post(fuzz_stack, path, json={**body, "model": "no-such-model"}), 404)
        assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error"
    for method, path, allowed in (("GET", "/v1/chat/completions", "POST"), ("DELETE", "/v1/completions", "POST"),
                                  ("POST", "/v1/models", "GET"), ("PUT", "/metrics", "GET")):
        r = httpx.request(method, fuzz_stack.http_url + path, headers=AUTH, timeout=30)
        assert_openai_error(r, 405)
        assert allowed in r.headers["allow"], (method, path, r.headers)


def test_bad_keys_are_401(fuzz_stack):
    for headers in ({"Authorization": "Bearer"}, {"Authorization": "Bearer " + "x" * 10000},
                    {"Authorization": f"Token {KEY}"}, {"Authorization": f"Bearer {KEY[:-1]}"}):
        err = assert_openai_error(post(fuzz_stack, json=CHAT, headers=headers), 401)
        assert KEY not in json.dumps(err)


def test_valid_request_still_works(fuzz_stack):
    r = post(fuzz_stack, json={**CHAT, "cache_salt": "é" * 256})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2


# --- gRPC equivalents -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def channel(fuzz_stack):
    with grpc.insecure_channel(fuzz_stack.grpc_target) as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        yield ch


def _grpc_code(channel, request_bytes: bytes, metadata=(("authorization", f"Bearer {KEY}"),)) -> grpc.StatusCode:
    call = channel.unary_stream("/kite.v1.Kite/Generate", request_serializer=lambda b: b,
                                response_deserializer=kite_pb2.GenerateResponse.FromString)
    try:
        list(call(request_bytes, timeout=60, metadata=metadata))
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("fields", [
    dict(model=MODEL, prompt="x", max_tokens=2**32 - 1), dict(model=MODEL, prompt="x", max_tokens=0),
    dict(model=MODEL, prompt="x", temperature=1e308), dict(model=MODEL, prompt="x", top_p=-1.0),
    dict(model=MODEL, prompt="x", cache_salt="s" * 257), dict(model=MODEL, prompt="x", stop=["a"] * 5),
    dict(model=MODEL, prompt_token_ids=kite_pb2.TokenIds(ids=[2**32 - 1])),
    dict(model=MODEL), dict(prompt="x"),
])
def test_grpc_absurd_fields_are_invalid_argument(channel, fields):
    assert _grpc_code(channel, kite_pb2.GenerateRequest(**fields).SerializeToString()) \
        == grpc.StatusCode.INVALID_ARGUMENT


def test_grpc_garbage_bad_utf8_oversized_and_bad_keys(channel):
    # Field 1 (model, a string) holding invalid UTF-8; and bytes that are no protobuf at all.
    for raw in (b"\x0a\x02\xff\xfe", b"\xff\xff\xff\xff", b"\x0a\x64x"):
        assert _grpc_code(channel, raw) == grpc.StatusCode.INVALID_ARGUMENT, raw
    big = kite_pb2.GenerateRequest(model=MODEL, prompt="x" * (MAX_BODY + 10)).SerializeToString()
    assert _grpc_code(channel, big) == grpc.StatusCode.RESOURCE_EXHAUSTED
    ok = kite_pb2.GenerateRequest(model=MODEL, prompt="x", max_tokens=1).SerializeToString()
    for metadata in ((), (("authorization", "Bearer nope"),), (("authorization", KEY),)):
        assert _grpc_code(channel, ok, metadata) == grpc.StatusCode.UNAUTHENTICATED
    unknown = kite_pb2.GenerateRequest(model="no-such", prompt="x").SerializeToString()
    assert _grpc_code(channel, unknown) == grpc.StatusCode.NOT_FOUND  # HTTP's 404
    assert _grpc_code(channel, ok) == grpc.StatusCode.OK
