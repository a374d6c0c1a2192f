"""Authentication and tenant isolation through a real stack (nats-server, redis-server, the five services
as processes) with KITE_AUTH_ENABLED on, two tenants, and an explicit cluster secret:

- the same tenant reuses its KV (cached_tokens > 0 the second time), another tenant with the same prompt
  does not (cached_tokens == 0), over HTTP and gRPC;
- missing or wrong keys: 401 OpenAI error objects over HTTP, UNAUTHENTICATED over gRPC;
- the worker's units carry a valid HMAC under the cluster secret (the ru-pool refuses none);
- per-tenant rate limits: a tenant over its request or token rate gets 429 + Retry-After (gRPC
  RESOURCE_EXHAUSTED + retry-after) while another tenant's requests in the same minute are served;
- no key and no secret ever appears in any log of the stack (checked last).
"""

from __future__ import annotations

import secrets
import subprocess
import tempfile
from pathlib import Path

import grpc
import httpx
import nats
import pytest

from kite_cli.local_servers import _launch, find_binary, free_port
from kite_cli.stack import StackOptions
from kite_shared.config import CommonConfig, load
from kite_shared.grpc_gen import kite_pb2, kite_pb2_grpc
from kite_shared.messages import PoolAdminRequest
from kite_shared.security import hash_api_key
from kite_shared.service import connect_nats
from kite_shared.tiers.pool_client import PoolClient
from tests.helpers import wait_until_async
from tests.integration.conftest import MODEL, _start

ALICE_KEY = "kite-alice-" + secrets.token_hex(12)
BOB_KEY = "kite-bob-" + secrets.token_hex(12)
CAROL_KEY = "kite-carol-" + secrets.token_hex(12)  # 2 requests per minute
DAVE_KEY = "kite-dave-" + secrets.token_hex(12)  # 100 tokens per minute
WRONG_KEY = "kite-wrong-" + secrets.token_hex(12)
CLUSTER_SECRET = "cluster-" + secrets.token_hex(16)
# Long enough for several full 16-token blocks, unique per run so no earlier cache can answer.
PROMPT = ("Tenant isolation check " + secrets.token_hex(4) + ": list three facts about the river Seine, "
          "the city of Paris and the Eiffel tower, one sentence each, in plain English.")
MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def secure_stack():
    stack = _start(StackOptions(num_workers=1, env={
        "KITE_AUTH_ENABLED": "on",
        "KITE_API_KEYS": f"alice:{hash_api_key(ALICE_KEY)},bob:{hash_api_key(BOB_KEY)},"
                         f"carol:{hash_api_key(CAROL_KEY)},dave:{hash_api_key(DAVE_KEY)}",
        # Every tenant gets the default, far above what these tests send; carol and dave are overridden.
        "KITE_GATEWAY_TENANT_REQUESTS_PER_MINUTE": "600",
        "KITE_GATEWAY_TENANT_REQUEST_LIMITS": "carol=2",
        "KITE_GATEWAY_TENANT_TOKEN_LIMITS": "dave=100",
        "KITE_CLUSTER_SECRET": CLUSTER_SECRET,
        "KITE_LOG_LEVEL": "DEBUG",
    }))
    yield stack
    stack.stop()


def chat(stack, key: str | None, **extra) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(stack.http_url + "/v1/chat/completions", headers=headers, timeout=120, json={
        "model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 4, **extra})


def cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def grpc_cached(stack, key: str) -> int:
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = kite_pb2_grpc.KiteStub(channel)
        request = kite_pb2.GenerateRequest(
            model=MODEL, max_tokens=4, temperature=0.0,
            messages=kite_pb2.ChatMessages(messages=[kite_pb2.Message(role="user", content=PROMPT)]))
        responses = list(stub.Generate(request, timeout=120, metadata=(("authorization", f"Bearer {key}"),)))
    return responses[-1].end.usage.cached_tokens


def test_same_tenant_reuses_another_tenant_does_not(secure_stack):
    first = chat(secure_stack, ALICE_KEY)
    assert cached(first) == 0
    assert cached(chat(secure_stack, ALICE_KEY)) > 0  # same tenant: its blocks are reused
    assert cached(chat(secure_stack, BOB_KEY)) == 0  # same prompt, other tenant: nothing shared
    assert cached(chat(secure_stack, BOB_KEY)) > 0  # ... but bob reuses his own
    # A client salt narrows sharing inside a tenant, and cannot reach another tenant's blocks.
    assert cached(chat(secure_stack, ALICE_KEY, cache_salt="project-x")) == 0
    assert cached(chat(secure_stack, BOB_KEY, cache_salt="alice")) == 0
    # The tenant, not the protocol, decides: gRPC with alice's key reuses what HTTP computed for alice.
    assert grpc_cached(secure_stack, ALICE_KEY) > 0


@pytest.mark.parametrize("headers", [{}, {"Authorization": f"Bearer {WRONG_KEY}"},
                                     {"Authorization": ALICE_KEY}])
def test_missing_or_wrong_key_is_401(secure_stack, headers):
    for method, path in (("post", "/v1/chat/completions"), ("post", "/v1/completions"), ("get", "/v1/models")):
        r = httpx.request(method, secure_stack.http_url + path, headers=headers, timeout=30,
                          json={"model": MODEL, "prompt": "x"} if method == "post" else None)
        assert r.status_code == 401, (path, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["code"] in ("invalid_api_key", "missing_api_key")
    assert httpx.get(secure_stack.http_url + "/health", timeout=30).status_code == 200
    r = httpx.get(secure_stack.http_url + "/v1/models", headers={"Authorization": f"Bearer {BOB_KEY}"}, timeout=30)
    assert r.status_code == 200


@pytest.mark.parametrize("metadata", [(), (("authorization", f"Bearer {WRONG_KEY}"),)])
def test_grpc_without_a_valid_key_is_unauthenticated(secure_stack, metadata):
    with grpc.insecure_channel(secure_stack.grpc_target) as channel:
        stub = kite_pb2_grpc.KiteStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(kite_pb2.GenerateRequest(model=MODEL, prompt="hi"), timeout=30, metadata=metadata))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = stub.Health(kite_pb2.HealthRequest(), timeout=30)
        assert health.status == kite_pb2.HealthResponse.SERVING


def assert_rate_limited(response: httpx.Response, limit: str) -> int:
    assert response.status_code == 429, response.text
    assert response.json() == {"error": {"message": response.json()["error"]["message"], "type": "rate_limit_error",
                                         "param": None, "code": "rate_limit_exceeded"}}
    assert f"{limit} per minute" in response.json()["error"]["message"]
    retry_after = int(response.headers["retry-after"])
    assert retry_after >= 1
    return retry_after


def test_tenant_over_its_request_rate_gets_429_and_other_tenants_are_served(secure_stack):
    for remaining in ("1", "0"):
        r = chat(secure_stack, CAROL_KEY)
        assert r.status_code == 200, r.text
        assert r.headers["x-ratelimit-limit-requests"] == "2"
        assert r.headers["x-ratelimit-remaining-requests"] == remaining
    # A bucket of 2 refilled at one request per 30 s: the third request within the minute waits for that.
    assert assert_rate_limited(chat(secure_stack, CAROL_KEY), "requests") <= 30
    # The same minute, another tenant: served, under the default limit.
    r = chat(secure_stack, BOB_KEY)
    assert r.status_code == 200 and r.headers["x-ratelimit-limit-requests"] == "600"
    # gRPC shares carol's budget.
    with grpc.insecure_channel(secure_stack.grpc_target) as channel:
        stub = kite_pb2_grpc.KiteStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(kite_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=1), timeout=60,
                               metadata=(("authorization", f"Bearer {CAROL_KEY}"),)))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = dict(info.value.trailing_metadata())
    assert trailers["kite-error-code"] == "rate_limit_exceeded" and 1 <= int(trailers["retry-after"]) <= 30
    assert grpc_cached(secure_stack, BOB_KEY) >= 0  # bob's gRPC call is served meanwhile


def test_tenant_over_its_token_rate_gets_429_and_other_tenants_are_served(secure_stack):
    def complete(key: str) -> httpx.Response:
        # 30 prompt token ids + exactly 20 generated tokens: 50 tokens, estimated and measured alike.
        return httpx.post(secure_stack.http_url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                          timeout=120, json={"model": MODEL, "prompt": list(range(1000, 1030)), "max_tokens": 20,
                                             "temperature": 0, "kite": {"ignore_eos": True}})

    first = complete(DAVE_KEY)
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["total_tokens"] == 50
    assert first.headers["x-ratelimit-limit-tokens"] == "100"
    assert first.headers["x-ratelimit-remaining-tokens"] == "50"
    assert complete(DAVE_KEY).status_code == 200  # 50 left, plus what refilled meanwhile
    # 100 tokens per minute refill at 1.67 per second: the third 50 are about 30 s away.
    assert 10 <= assert_rate_limited(complete(DAVE_KEY), "tokens") <= 30
    assert complete(ALICE_KEY).status_code == 200  # another tenant, same minute


async def test_worker_units_carry_a_valid_mac(secure_stack):
    nc = await nats.connect(secure_stack.nats.url)
    try:
        # (Before: 50 tries 0.2 s apart.) A stats request that times out is None: not yet.
        stats = await wait_until_async(lambda: PoolClient(nc).admin(PoolAdminRequest(op="stats"), timeout_s=10), 10,
                                       "a worker's units put into the ru-pool",
                                       done=lambda s: s is not None and s.counters.get("puts", 0) > 0, interval_s=0.2)
        assert stats is not None and stats.counters["puts"] > 0
        assert stats.counters["refused_corrupt"] == 0
    finally:
        await nc.close()


async def test_nats_token_auth_and_no_token_in_errors(tmp_path):
    binary = find_binary("nats-server")
    if binary is None:
        pytest.skip("nats-server not installed")
    token = "nats-token-" + secrets.token_hex(8)
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="kite-nats-auth-"))
    conf = workdir / "nats.conf"
    conf.write_text(f'listen: 127.0.0.1:{port}\nauthorization {{ token: "{token}" }}\n')
    server = _launch("nats-server", [binary, "-c", str(conf)], port, workdir, tmp_path / "nats.log")
    try:
        url = f"nats://127.0.0.1:{port}"
        nc = await connect_nats(url, "t", load(CommonConfig, {"KITE_NATS_TOKEN": token}))
        assert nc.is_connected
        await nc.close()
        with pytest.raises(Exception) as info:
            await nats.connect(url, token="wrong-" + token, max_reconnect_attempts=0, connect_timeout=2,
                               allow_reconnect=False)
        assert token not in str(info.value)
    finally:
        server.stop()


def test_zz_no_key_or_secret_in_any_log(secure_stack):
    """Runs last in this module: every request above (good, bad and missing keys) has been logged."""
    chat(secure_stack, WRONG_KEY)
    logs = {p.name: p.read_bytes() for p in secure_stack.log_dir.glob("*.log")}
    assert any(name.startswith("gateway") for name in logs) and any(name.startswith("worker") for name in logs)
    assert sum(len(data) for data in logs.values()) > 0
    for needle in (ALICE_KEY, BOB_KEY, CAROL_KEY, DAVE_KEY, WRONG_KEY, CLUSTER_SECRET):
        for name, data in logs.items():
            assert needle.encode() not in data, f"{name} contains a secret"
    # Nor anything a `ps` of the stack would print besides the environment (argv carries no secret).
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert CLUSTER_SECRET not in out and ALICE_KEY not in out
