"""Per-tenant request and token rate limits (issue 13): the token-bucket core on a fake clock, its settings,
and the HTTP and gRPC answers (429 + Retry-After, RESOURCE_EXHAUSTED + retry-after) through the real front
ends with fake services."""

from __future__ import annotations

import grpc
import pytest
from fastapi.testclient import TestClient

from kite_shared.config import ConfigError, GatewayConfig, RuPoolConfig, load
from kite_shared.grpc_gen import kite_pb2
from kite_shared.messages import StreamEnd, Usage
from kite_shared.security import hash_api_key
from kite_gateway.auth import Authenticator, parse_keys_env
from kite_gateway.errors import ApiError
from kite_gateway.grpc_api import KiteService, _Failure
from kite_gateway.http_api import create_app
from kite_gateway.rate_limit import (RateLimitExceeded, TenantLimits, TenantRateLimiter, TokenBucket,
                                     duration)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limiter(rpm: int = 0, tpm: int = 0, requests: dict | None = None, tokens: dict | None = None,
            clock: Clock | None = None) -> TenantRateLimiter:
    return TenantRateLimiter(TenantLimits(rpm, tpm), requests, tokens, default_max_tokens=100,
                             clock=clock or Clock())


# --- the bucket ----------------------------------------------------------------------------------------

def test_bucket_refills_continuously_up_to_its_capacity():
    bucket = TokenBucket(60, now=0.0)  # 1 unit per second
    bucket.take(60, 0.0)
    assert bucket.level(0.5) == pytest.approx(0.5)
    assert bucket.wait_s(3, 0.5) == pytest.approx(2.5)
    assert bucket.level(1000.0) == 60  # never above capacity
    bucket.take(100, 1000.0)  # settled usage may exceed the estimate: debt
    assert bucket.level(1000.0) == -40
    assert bucket.wait_s(1, 1000.0) == pytest.approx(41)
    assert bucket.level(999.0) == -40  # a clock stepping back neither refills nor drains


def test_zero_means_unlimited():
    lim = limiter()
    assert not lim.enabled
    for _ in range(1000):
        permit = lim.acquire("anyone", 10**9)
        assert permit.headers == {} and permit.tokens == 0


# --- requests per minute -------------------------------------------------------------------------------

def test_request_limit_refuses_with_retry_after_until_refilled_and_tenants_are_independent():
    clock = Clock()
    lim = limiter(rpm=2, clock=clock)  # a bucket of 2, one request back every 30 s
    lim.acquire("alice", 1)
    lim.acquire("alice", 1)
    with pytest.raises(RateLimitExceeded) as info:
        lim.acquire("alice", 1)
    assert info.value.limit == "requests" and info.value.per_minute == 2 and info.value.retry_after_s == 30
    assert info.value.headers["x-ratelimit-remaining-requests"] == "0"
    lim.acquire("bob", 1)  # bob's bucket is his own
    lim.acquire("bob", 1)
    clock.now += 10
    with pytest.raises(RateLimitExceeded) as info:
        lim.acquire("alice", 1)
    assert info.value.retry_after_s == 20  # seconds until enough budget, not a fixed window
    clock.now += 20
    permit = lim.acquire("alice", 1)
    assert permit.headers["x-ratelimit-limit-requests"] == "2"
    assert permit.headers["x-ratelimit-remaining-requests"] == "0"
    assert permit.headers["x-ratelimit-reset-requests"] == "1m0s"


def test_retry_after_is_a_whole_second_at_least():
    clock = Clock()
    lim = limiter(rpm=6000, clock=clock)  # 100 per second
    for _ in range(6000):
        lim.acquire("t", 1)
    clock.now += 0.001  # a tenth of a request's refill
    with pytest.raises(RateLimitExceeded) as info:
        lim.acquire("t", 1)
    assert info.value.retry_after_s == 1
    clock.now += 0.01
    lim.acquire("t", 1)


def test_overrides_replace_the_default_per_tenant():
    lim = limiter(rpm=1, requests={"vip": 0, "small": 3})
    assert lim.limits("vip") == TenantLimits(0, 0) and lim.limits("small").requests_per_minute == 3
    assert lim.limits("other").requests_per_minute == 1
    for _ in range(50):
        lim.acquire("vip", 1)
    for _ in range(3):
        lim.acquire("small", 1)
    with pytest.raises(RateLimitExceeded):
        lim.acquire("small", 1)
    lim.acquire("other", 1)
    with pytest.raises(RateLimitExceeded):
        lim.acquire("other", 1)


# --- tokens per minute ---------------------------------------------------------------------------------

def test_token_estimate_counts_prompt_characters_ids_and_completion_budgets():
    lim = limiter(tpm=1000)
    assert lim.estimate_tokens(prompt_chars=9, max_tokens=10) == 3 + 10  # ceil(9 / 4)
    assert lim.estimate_tokens(prompt_token_ids=7, max_tokens=5, choices=3) == 7 + 15
    assert lim.estimate_tokens(prompt_chars=4) == 1 + 100  # no max_tokens: the default


def test_token_limit_charges_the_estimate_then_the_measured_usage():
    clock = Clock()
    lim = limiter(tpm=600, clock=clock)  # 10 tokens per second
    permit = lim.acquire("t", 500)
    assert permit.headers["x-ratelimit-remaining-tokens"] == "100"
    with pytest.raises(RateLimitExceeded) as info:
        lim.acquire("t", 300)
    assert info.value.limit == "tokens" and info.value.retry_after_s == 20  # 200 missing at 10/s
    permit.settle(120)  # it really used 120: 380 come back
    assert lim.acquire("t", 300).headers["x-ratelimit-remaining-tokens"] == "180"
    permit.settle(0)  # settling twice changes nothing
    assert lim.acquire("t", 180).headers["x-ratelimit-remaining-tokens"] == "0"


def test_a_refused_request_gets_its_tokens_back_but_still_counts_as_a_request():
    lim = limiter(rpm=2, tpm=100)
    lim.acquire("t", 100).refund()
    permit = lim.acquire("t", 100)
    assert permit.headers["x-ratelimit-remaining-tokens"] == "0"
    assert permit.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(RateLimitExceeded) as info:
        lim.acquire("t", 1)
    assert info.value.limit == "requests"


def test_an_estimate_beyond_the_budget_waits_for_a_full_bucket_and_real_usage_becomes_debt():
    clock = Clock()
    lim = limiter(tpm=60, clock=clock)  # 1 token per second
    permit = lim.acquire("t", 1000)  # a generous max_tokens is not a lockout: charged the whole budget
    assert permit.tokens == 60
    with pytest.raises(RateLimitExceeded) as info:
        lim.acquire("t", 1000)
    assert info.value.retry_after_s == 60
    permit.settle(90)  # it used 90: 30 more than the budget, owed before anything else
    with pytest.raises(RateLimitExceeded) as info:
        lim.acquire("t", 1)
    assert info.value.retry_after_s == 31
    clock.now += 31
    lim.acquire("t", 1)


def test_both_limits_refuse_with_the_longer_wait_and_take_nothing():
    clock = Clock()
    lim = limiter(rpm=60, tpm=60, clock=clock)
    lim.acquire("t", 59)
    with pytest.raises(RateLimitExceeded) as info:
        lim.acquire("t", 10)  # the requests bucket has room, the tokens one does not
    assert info.value.limit == "tokens" and info.value.retry_after_s == 9
    assert lim.acquire("t", 1).headers["x-ratelimit-remaining-requests"] == "58"  # the refusal took nothing


def test_duration_format():
    assert [duration(s) for s in (0, 0.25, 1.5, 59.9994, 60, 361.4)] == ["0s", "0.25s", "1.5s", "59.999s",
                                                                         "1m0s", "6m1s"]


# --- settings ------------------------------------------------------------------------------------------

def test_settings_build_the_limiter_and_bad_overrides_fail_at_startup():
    cfg = load(GatewayConfig, {"KITE_GATEWAY_TENANT_REQUESTS_PER_MINUTE": "60",
                               "KITE_GATEWAY_TENANT_REQUEST_LIMITS": "acme=600, free=6",
                               "KITE_GATEWAY_TENANT_TOKENS_PER_MINUTE": "10000",
                               "KITE_GATEWAY_TENANT_TOKEN_LIMITS": "acme=0",
                               "KITE_DEFAULT_MAX_TOKENS": "256"})
    lim = TenantRateLimiter.from_config(cfg)
    assert lim.enabled and lim.default_max_tokens == 256
    assert lim.limits("acme") == TenantLimits(600, 0)
    assert lim.limits("free") == TenantLimits(6, 10000)
    assert lim.limits("anonymous") == TenantLimits(60, 10000)
    assert not TenantRateLimiter.from_config(load(GatewayConfig, {})).enabled  # the default: no limits
    for name, raw in (("KITE_GATEWAY_TENANT_REQUEST_LIMITS", "acme"),
                      ("KITE_GATEWAY_TENANT_REQUEST_LIMITS", "a=-1"),
                      ("KITE_GATEWAY_TENANT_TOKEN_LIMITS", "a=1,a=2"),
                      ("KITE_GATEWAY_TENANT_TOKEN_LIMITS", "=5"),
                      ("KITE_GATEWAY_TENANT_TOKENS_PER_MINUTE", "-1")):
        with pytest.raises(ConfigError, match=name):
            load(GatewayConfig, {name: raw})


def test_pool_quota_overrides_keep_their_format():
    assert load(RuPoolConfig, {"KITE_POOL_TENANT_QUOTAS": "a=1, b=0"}).tenant_quota_overrides() == {"a": 1, "b": 0}
    with pytest.raises(ConfigError, match=r"KITE_POOL_TENANT_QUOTAS entry 1: expected tenant=bytes"):
        load(RuPoolConfig, {"KITE_POOL_TENANT_QUOTAS": "a"})


# --- the HTTP API --------------------------------------------------------------------------------------

ALICE_KEY, BOB_KEY = "kite-alice-key", "kite-bob-key"


class FakeGeneration:
    worker_id = "worker-1"
    ttft_s = 0.01

    def __init__(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.end = StreamEnd(request_id="r", seq=0, finish_reason="stop", text="ok",
                             usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens))

    async def events(self):
        yield self.end

    async def close(self) -> None:
        pass


class FakeClient:
    """Answers every generation with a fixed usage, or refuses like an unknown model."""

    def __init__(self) -> None:
        self.opened = 0
        self.refuse: ApiError | None = None

    async def open(self, params):
        if self.refuse is not None:
            raise self.refuse
        self.opened += 1
        return FakeGeneration(prompt_tokens=10, completion_tokens=5)


@pytest.fixture
def http():
    fake = FakeClient()
    auth = Authenticator(True, parse_keys_env(f"alice:{hash_api_key(ALICE_KEY)},bob:{hash_api_key(BOB_KEY)}"))
    lim = limiter(requests={"alice": 2}, tokens={"bob": 120})
    return TestClient(create_app(lambda: fake, "m", 8, 1 << 20, auth, lim)), fake


def chat(client, key: str, **extra):
    return client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra})


def test_http_tenant_over_its_request_limit_gets_429_with_retry_after_others_are_served(http):
    client, fake = http
    for remaining in ("1", "0"):
        r = chat(client, ALICE_KEY, max_tokens=5)
        assert r.status_code == 200, r.text
        assert r.headers["x-ratelimit-limit-requests"] == "2"
        assert r.headers["x-ratelimit-remaining-requests"] == remaining
    r = chat(client, ALICE_KEY, max_tokens=5)
    assert r.status_code == 429
    assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "rate_limit_error",
                                  "param": None, "code": "rate_limit_exceeded"}}
    assert "requests per minute" in r.json()["error"]["message"]
    assert int(r.headers["retry-after"]) == 30
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    r = client.post("/v1/completions", headers={"Authorization": f"Bearer {ALICE_KEY}"},
                    json={"model": "m", "prompt": "x", "stream": True})
    assert r.status_code == 429  # streaming or not, both endpoints share the tenant's budget
    assert fake.opened == 2
    r = chat(client, BOB_KEY, max_tokens=5)  # same window, another tenant
    assert r.status_code == 200 and "x-ratelimit-limit-requests" not in r.headers


def test_http_token_limit_settles_on_usage_and_refunds_refusals(http):
    client, fake = http
    # bob: 120 tokens per minute, 2 per second (the fake clock stands still). A chat of "hi" with
    # max_tokens 100 is estimated at ceil(2 / 4) + 100 = 101 tokens; the fake reports 10 + 5 used.
    r = chat(client, BOB_KEY, max_tokens=100)
    assert r.status_code == 200 and r.headers["x-ratelimit-remaining-tokens"] == "19"
    fake.refuse = ApiError(404, "The model 'x' does not exist", code="model_not_found")
    for _ in range(3):  # settled at 15, so 105 are left; refusals downstream give their 101 back
        assert chat(client, BOB_KEY, max_tokens=100).status_code == 404
    fake.refuse = None
    r = chat(client, BOB_KEY, max_tokens=100)
    assert r.status_code == 200 and r.headers["x-ratelimit-remaining-tokens"] == "4"
    r = client.post("/v1/completions", headers={"Authorization": f"Bearer {BOB_KEY}"},
                    json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 80, "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")  # 90 left: 83 fit
    r = chat(client, BOB_KEY, max_tokens=100)  # the stream was settled at its end: 75 left
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert "tokens per minute" in r.json()["error"]["message"]
    assert r.headers["retry-after"] == "13"  # 26 tokens short at 2 per second
    assert r.headers["x-ratelimit-limit-tokens"] == "120" and r.headers["x-ratelimit-remaining-tokens"] == "75"


# --- the gRPC API --------------------------------------------------------------------------------------

class FakeContext:
    def __init__(self, key: str) -> None:
        self._metadata = (("authorization", f"Bearer {key}"),)
        self.written = []

    def invocation_metadata(self):
        return self._metadata

    def time_remaining(self):
        return 30.0

    async def write(self, response) -> None:
        self.written.append(response)


async def test_grpc_tenant_over_its_limit_is_resource_exhausted_with_retry_after():
    fake = FakeClient()
    auth = Authenticator(True, parse_keys_env(f"alice:{hash_api_key(ALICE_KEY)},bob:{hash_api_key(BOB_KEY)}"))
    service = KiteService(fake, auth, limiter(requests={"alice": 1}))  # type: ignore[arg-type]
    request = kite_pb2.GenerateRequest(model="m", prompt="hi", max_tokens=5)
    ok = FakeContext(ALICE_KEY)
    await service._generate(request, ok)
    assert ok.written[-1].end.usage.completion_tokens == 5
    with pytest.raises(_Failure) as info:
        await service._generate(request, FakeContext(ALICE_KEY))
    assert info.value.status == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(info.value.trailing_metadata()) == {"kite-error-code": "rate_limit_exceeded", "retry-after": "60"}
    await service._generate(request, FakeContext(BOB_KEY))  # another tenant, same moment: served
    assert fake.opened == 2
