"""Storage tiers of recyclable units: hot (in-memory LRU, pure), warm (Redis), cold (S3 or local folder).

    hot   HotLRU            sync, pure; evictions drained with take_events()
    warm  RedisTier         async; per-op timeout, down/backoff, misses instead of exceptions
    cold  S3Tier / LocalDirTier   async (blocking calls in a thread pool); same guarantees
    TierClient              warm + cold from TierConfig; verified fetches for workers

Key scheme: kite_shared.tiers.keys. Every read that returns a unit to be used is verified
(RemoteTier.get_verified / get_unit); corrupt entries are counted, deleted and reported as misses.

The networked classes are imported lazily so pure code (the ru-pool core, hot-tier tests) can import
`kite_shared.tiers.hot` / `.keys` without pulling in redis or boto3.
"""

from __future__ import annotations

import importlib
from typing import Any

from kite_shared.tiers.health import TierHealth
from kite_shared.tiers.hot import Eviction, HotLRU
from kite_shared.tiers.keys import BlockKey, model_tag, object_key, redis_key

_LAZY = {
    "RemoteTier": "kite_shared.tiers.base", "StoredBlock": "kite_shared.tiers.base",
    "TierUnavailable": "kite_shared.tiers.base", "TierClient": "kite_shared.tiers.client",
    "LocalDirTier": "kite_shared.tiers.cold", "S3Tier": "kite_shared.tiers.cold",
    "RedisTier": "kite_shared.tiers.warm", "PoolClient": "kite_shared.tiers.pool_client",
}

__all__ = ["BlockKey", "Eviction", "HotLRU", "TierHealth", "model_tag", "object_key", "redis_key",
           *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kite_shared.tiers' has no attribute {name!r}")
