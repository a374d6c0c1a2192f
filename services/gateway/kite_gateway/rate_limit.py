"""Per-tenant request and token rate limits (issue 13): token buckets, pure (no network, injectable clock).

Each tenant has up to two buckets, one for generation requests and one for tokens. A bucket holds one
minute's budget (KITE_GATEWAY_TENANT_REQUESTS_PER_MINUTE / _TOKENS_PER_MINUTE, or the tenant's override),
so a quiet tenant may spend a minute's worth at once, as OpenAI's limits allow, and refills continuously
at limit / 60 per second. 0 means no limit and keeps no bucket.

Tokens cannot be counted exactly at admission (the gateway does not tokenize), so `acquire` charges an
estimate: prompt characters / 4 (OpenAI's rule of thumb), or the number of prompt token ids when the client
sent ids, plus max_tokens (or KITE_DEFAULT_MAX_TOKENS) per choice. When the request ends, `Permit.settle`
replaces the estimate with the measured usage (prompt + completion tokens); a request refused downstream
before anything was computed gives its tokens back (`Permit.refund`); one that fails or is abandoned
mid-stream keeps the estimate (what it used is not known). A request whose estimate exceeds the
whole per-minute budget is admitted only when the bucket is full and charged no more than the budget, and
settling its real usage can take the bucket below zero: a tenant never stays locked out by a generous
max_tokens, and one that really used more waits longer afterwards.

Buckets live in one gateway process: with N gateway replicas behind a load balancer that does not pin
tenants, a tenant can get up to N times its limit.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from kite_shared.config import GatewayConfig

CHARS_PER_TOKEN = 4
REQUESTS, TOKENS = "requests", "tokens"
_EPSILON = 1e-9  # float noise must not turn an exact wait of 2 s into a Retry-After of 3


class TokenBucket:
    """`capacity` units, refilled continuously at `capacity / period_s` per second, never above capacity.

    The level may go below zero (a settled request that used more than its estimate): the debt is repaid
    by the refill before anything else is admitted.
    """

    def __init__(self, capacity: float, now: float, period_s: float = 60.0) -> None:
        if capacity <= 0:
            raise ValueError("a bucket needs a positive capacity")
        self.capacity = float(capacity)
        self.rate = self.capacity / period_s
        self._level = self.capacity
        self._at = now

    def level(self, now: float) -> float:
        if now > self._at:  # a clock that steps back must not drain the bucket
            self._level = min(self.capacity, self._level + (now - self._at) * self.rate)
            self._at = now
        return self._level

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until `amount` units are available (0: now); `amount` is at most the capacity."""
        missing = min(amount, self.capacity) - self.level(now)
        return max(0.0, missing / self.rate)

    def take(self, amount: float, now: float) -> None:
        self._level = self.level(now) - amount

    def give(self, amount: float, now: float) -> None:
        self._level = min(self.capacity, self.level(now) + amount)

    def full_in_s(self, now: float) -> float:
        return (self.capacity - self.level(now)) / self.rate


@dataclass(frozen=True)
class TenantLimits:
    requests_per_minute: int = 0  # 0: no limit
    tokens_per_minute: int = 0


class RateLimitExceeded(Exception):
    """A tenant is over its request or token rate: refuse now, retry after `retry_after_s` seconds."""

    def __init__(self, tenant: str, limit: str, per_minute: int, retry_after_s: int,
                 headers: dict[str, str]) -> None:
        self.tenant = tenant
        self.limit = limit  # REQUESTS or TOKENS: the bucket that refused (the later to refill if both)
        self.per_minute = per_minute
        self.retry_after_s = retry_after_s
        self.headers = headers
        super().__init__(f"Rate limit reached for tenant {tenant} on {limit} per minute: limit {per_minute}. "
                         f"Please try again in {retry_after_s}s.")


@dataclass
class Permit:
    """What one admitted request was charged; settle or refund it once the outcome is known."""

    limiter: "TenantRateLimiter"
    tenant: str
    tokens: int  # charged to the token bucket (0 when the tenant has no token limit)
    headers: dict[str, str] = field(default_factory=dict)  # x-ratelimit-* as of admission
    _done: bool = False

    def settle(self, used_tokens: int) -> None:
        """Replace the admission estimate with the measured usage."""
        if not self._done:
            self._done = True
            self.limiter._adjust(self.tenant, self.tokens - used_tokens)

    def refund(self) -> None:
        """Nothing was computed (refused downstream): the tokens go back; the request still counts."""
        if not self._done:
            self._done = True
            self.limiter._adjust(self.tenant, self.tokens)


class TenantRateLimiter:
    def __init__(self, default: TenantLimits = TenantLimits(), request_overrides: Mapping[str, int] | None = None,
                 token_overrides: Mapping[str, int] | None = None, default_max_tokens: int = 1024,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.default = default
        self.request_overrides = dict(request_overrides or {})
        self.token_overrides = dict(token_overrides or {})
        self.default_max_tokens = default_max_tokens
        self._clock = clock
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    @classmethod
    def from_config(cls, cfg: GatewayConfig, clock: Callable[[], float] = time.monotonic) -> "TenantRateLimiter":
        return cls(TenantLimits(cfg.tenant_requests_per_minute, cfg.tenant_tokens_per_minute),
                   cfg.tenant_request_overrides(), cfg.tenant_token_overrides(), cfg.default_max_tokens, clock)

    @property
    def enabled(self) -> bool:
        return bool(self.default.requests_per_minute or self.default.tokens_per_minute
                    or any(self.request_overrides.values()) or any(self.token_overrides.values()))

    def limits(self, tenant: str) -> TenantLimits:
        return TenantLimits(self.request_overrides.get(tenant, self.default.requests_per_minute),
                            self.token_overrides.get(tenant, self.default.tokens_per_minute))

    def estimate_tokens(self, prompt_chars: int = 0, prompt_token_ids: int = 0, max_tokens: int | None = None,
                        choices: int = 1) -> int:
        """Admission estimate of one prompt's tokens: its prompt plus `choices` completion budgets."""
        completion = max_tokens if max_tokens is not None else self.default_max_tokens
        return -(-prompt_chars // CHARS_PER_TOKEN) + prompt_token_ids + choices * completion

    def _bucket(self, tenant: str, kind: str, per_minute: int, now: float) -> TokenBucket | None:
        if per_minute <= 0:
            return None
        bucket = self._buckets.get((tenant, kind))
        if bucket is None:
            bucket = self._buckets[(tenant, kind)] = TokenBucket(per_minute, now)
        return bucket

    def acquire(self, tenant: str, tokens: int) -> Permit:
        """Charge one request and `tokens` to `tenant`, or raise RateLimitExceeded and charge nothing."""
        now = self._clock()
        limits = self.limits(tenant)
        requests = self._bucket(tenant, REQUESTS, limits.requests_per_minute, now)
        token_bucket = self._bucket(tenant, TOKENS, limits.tokens_per_minute, now)
        charge = min(tokens, limits.tokens_per_minute) if token_bucket is not None else 0
        waits = {}
        if requests is not None:
            waits[REQUESTS] = requests.wait_s(1, now)
        if token_bucket is not None:
            waits[TOKENS] = token_bucket.wait_s(charge, now)
        limit, wait = max(waits.items(), key=lambda kv: kv[1], default=(REQUESTS, 0.0))
        if wait > _EPSILON:
            per_minute = limits.requests_per_minute if limit == REQUESTS else limits.tokens_per_minute
            raise RateLimitExceeded(tenant, limit, per_minute, max(1, math.ceil(wait - _EPSILON)),
                                    self._headers(requests, token_bucket, now))
        if requests is not None:
            requests.take(1, now)
        if token_bucket is not None:
            token_bucket.take(charge, now)
        return Permit(self, tenant, charge, self._headers(requests, token_bucket, now))

    def _adjust(self, tenant: str, tokens: float) -> None:
        bucket = self._buckets.get((tenant, TOKENS))
        if bucket is None or not tokens:
            return
        now = self._clock()
        if tokens > 0:
            bucket.give(tokens, now)
        else:
            bucket.take(-tokens, now)

    @staticmethod
    def _headers(requests: TokenBucket | None, tokens: TokenBucket | None, now: float) -> dict[str, str]:
        """OpenAI's x-ratelimit-* response headers for the limits that apply."""
        headers = {}
        for kind, bucket in ((REQUESTS, requests), (TOKENS, tokens)):
            if bucket is not None:
                headers[f"x-ratelimit-limit-{kind}"] = str(int(bucket.capacity))
                headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(bucket.level(now) + _EPSILON)))
                headers[f"x-ratelimit-reset-{kind}"] = duration(bucket.full_in_s(now))
        return headers


def duration(seconds: float) -> str:
    """A duration the way OpenAI's x-ratelimit-reset-* headers write it: `0s`, `1.5s`, `6m0s`."""
    seconds = max(0.0, seconds)
    if seconds >= 60:
        minutes, rest = divmod(round(seconds), 60)
        return f"{minutes}m{rest}s"
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"
