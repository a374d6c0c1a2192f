"""The HTTP API's contract (issue 13, item 9): an unknown model is 404 `model_not_found`, a 405 names the
allowed methods, and /openapi.json tells the truth: every error status with OpenAI's error object, Retry-After
where it is sent, /metrics as Prometheus text, Bearer auth only when it is on. The last test has schemathesis
check the answers of the real FastAPI app (fake services behind it) against the published schema."""

from __future__ import annotations

import grpc
import hypothesis
import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase
from schemathesis import checks

from kite_shared.messages import ErrorInfo, StreamEnd, Usage
from kite_shared.security import hash_api_key
from kite_gateway.auth import Authenticator, parse_keys_env
from kite_gateway.errors import ApiError
from kite_gateway.grpc_api import _Failure
from kite_gateway.http_api import create_app
from kite_gateway.rate_limit import TenantLimits, TenantRateLimiter

KEY = "kite-contract-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")


class FakeGeneration:
    worker_id = "worker-1"
    ttft_s = 0.01

    async def events(self):
        yield StreamEnd(request_id="r", seq=0, finish_reason="stop", text="ok",
                        usage=Usage(prompt_tokens=3, completion_tokens=2))

    async def close(self) -> None:
        pass


class FakeFleet:
    def alive(self, service: str) -> list[str]:
        return ["worker-1"]

    def models(self) -> list[str]:
        return []


class FakeClient:
    """Serves model "m" like a fingerprinter and a worker would; any other model is not found."""

    fleet = FakeFleet()

    async def open(self, params):
        if params.model != "m":
            raise ApiError.from_info(ErrorInfo(code="model_not_found", param="model",
                                               message=f"The model '{params.model}' does not exist"))
        return FakeGeneration()

    async def ping(self, service: str) -> bool:
        return True


def app(auth: bool = True, requests_per_minute: int = 0):
    authenticator = Authenticator(True, parse_keys_env(f"t:{hash_api_key(KEY)}")) if auth else None
    return create_app(lambda: FakeClient(), "m", 8, 1 << 16, authenticator,
                      TenantRateLimiter(TenantLimits(requests_per_minute, 0)))


def test_unknown_model_is_404_model_not_found_like_openai():
    client = TestClient(app())
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        r = client.post(path, headers=AUTH, json={"model": "gpt-17", **body})
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "model_not_found"
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == "model"
        assert client.post(path, headers=AUTH, json={"model": "m", **body}).status_code == 200
    failure = _Failure.from_api_error(ApiError.from_info(ErrorInfo(code="model_not_found", message="x")))
    assert failure.status == grpc.StatusCode.NOT_FOUND and failure.code == "model_not_found"


@pytest.mark.parametrize("method, path, allowed", [
    ("GET", "/v1/chat/completions", "POST"), ("PUT", "/v1/completions", "POST"), ("POST", "/v1/models", "GET"),
    ("DELETE", "/metrics", "GET"), ("POST", "/health", "GET"),
])
def test_405_names_the_allowed_methods(method, path, allowed):
    r = TestClient(app()).request(method, path, headers=AUTH)
    assert r.status_code == 405
    assert allowed in r.headers["allow"].split(", ")
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def resolve(schema: dict, node: dict) -> dict:
    ref = node.get("$ref", "")
    return schema["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else node


def test_openapi_documents_every_error_with_the_openai_error_object():
    schema = TestClient(app()).get("/openapi.json").json()
    for path in GENERATION_PATHS:
        responses = schema["paths"][path]["post"]["responses"]
        assert {"400", "401", "404", "413", "429", "503"} <= set(responses), path
        for status, response in responses.items():
            if status.startswith(("4", "5")):
                body = resolve(schema, response["content"]["application/json"]["schema"])
                error = resolve(schema, body["properties"]["error"])
                assert set(error["properties"]) == {"message", "type", "param", "code"}, (path, status)
        assert responses["429"]["headers"]["Retry-After"]["required"] is True
        assert "Retry-After" in responses["503"]["headers"]
        assert "x-ratelimit-remaining-requests" in responses["200"]["headers"]
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert schema["paths"][path]["post"]["security"] == [{"apiKey": []}]
    metrics = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert set(metrics) == {"text/plain"}, metrics  # Prometheus text, not JSON
    assert "503" in schema["paths"]["/health"]["get"]["responses"]
    assert "security" not in schema["paths"]["/health"]["get"]
    assert schema["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    # Parameters KITE refuses are declared with the only values it takes.
    chat = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat["properties"]["logprobs"]["const"] is False and chat["properties"]["n"]["maximum"] == 8


def test_without_auth_the_schema_promises_no_401_and_no_key():
    schema = TestClient(app(auth=False)).get("/openapi.json").json()
    assert "securitySchemes" not in schema.get("components", {})
    for path in GENERATION_PATHS:
        assert "401" not in schema["paths"][path]["post"]["responses"]
        assert "security" not in schema["paths"][path]["post"]


CONFORMANCE = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
               checks.response_headers_conformance, checks.response_schema_conformance]


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
def test_answers_conform_to_the_published_schema(mode):
    """Every answer (200 JSON or SSE, 400, 404, 429 from a 30 requests/minute limit, ...) is documented."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app(requests_per_minute=50))
    extra = [checks.positive_data_acceptance if mode == schemathesis.GenerationMode.POSITIVE
             else checks.negative_data_rejection]
    seen: set[int] = set()
    operations = [("POST", p) for p in GENERATION_PATHS]
    if mode == schemathesis.GenerationMode.POSITIVE:  # the GETs take no input to get wrong
        operations += [("GET", "/v1/models"), ("GET", "/health"), ("GET", "/metrics")]
    for method, path in operations:
        operation = schema[path][method]

        @hypothesis.settings(max_examples=40, deadline=None, database=None, derandomize=True,
                             phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
        def one(case) -> None:
            if mode == schemathesis.GenerationMode.POSITIVE and method == "POST":
                case.body["model"] = "m"  # served: 200s, streamed or not, are checked too
            if mode == schemathesis.GenerationMode.POSITIVE and path == "/v1/completions":
                # prompts x n <= KITE_GATEWAY_MAX_N is the one rule JSON Schema cannot say (a 400).
                body = case.body
                batch = len(body["prompt"]) if isinstance(body["prompt"], list) and not isinstance(
                    body["prompt"][0], int) else 1
                hypothesis.assume(batch * body.get("n", 1) <= 8)
            response = case.call(headers=AUTH)
            seen.add(response.status_code)
            case.validate_response(response, checks=CONFORMANCE + extra)

        one()
    if mode == schemathesis.GenerationMode.POSITIVE:
        assert {200, 429} <= seen  # the rate limit's answers were checked too


@pytest.mark.parametrize("path, fields", [
    ("/v1/completions", {"prompt": [[False]]}),  # a JSON boolean is not a token id
    ("/v1/completions", {"prompt": "x", "n": True}),
    ("/v1/completions", {"prompt": "x", "max_tokens": "4"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "false"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": True}),
])
def test_values_of_another_json_type_than_the_schema_says_are_400(path, fields):
    r = TestClient(app()).post(path, headers=AUTH, json={"model": "m", **fields})
    assert r.status_code == 400, r.text


def test_integers_written_with_a_fraction_of_zero_are_integers_as_json_schema_says():
    r = TestClient(app()).post("/v1/completions", headers=AUTH, json={"model": "m", "prompt": [[1.0, 2]], "n": 2.0})
    assert r.status_code == 200, r.text


def test_the_schema_bounds_prompts_times_n_so_no_schema_valid_batch_is_refused():
    schema = TestClient(app()).get("/openapi.json").json()
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    by_n = {b["properties"]["n"].get("const", 1): b for b in body["anyOf"]}
    assert sorted(by_n) == list(range(1, 9))
    for n, branch in by_n.items():
        if n == 1:
            continue
        batches = [v for v in branch["properties"]["prompt"]["anyOf"] if "maxItems" in v]
        assert len(batches) == 2 and {v["maxItems"] for v in batches} == {8 // n}
        prompts = [["a"] * (8 // n), [[1]] * (8 // n)]
        for prompt in prompts:  # the largest batch the schema allows for this n is accepted
            r = TestClient(app()).post("/v1/completions", headers=AUTH, json={"model": "m", "prompt": prompt, "n": n})
            assert r.status_code == 200, (n, r.text)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_count_too_large_for_any_wire_format_is_400_not_a_crash(field):
    # msgpack (the services' wire format) holds at most 64-bit integers; the bound is 2**53 - 1.
    r = TestClient(app()).post("/v1/chat/completions", headers=AUTH, json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], field: 10**30})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
