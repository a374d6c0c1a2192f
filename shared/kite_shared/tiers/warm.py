"""Warm tier: Redis (redis-py asyncio, hiredis parser), one key per block, expiring KITE_WARM_TTL_S after
the last write or hit.

Keys: see kite_shared.tiers.keys (kite:ru:v1:<model_tag>:<block_hash_hex>, no hash tags). A hit refreshes
the expiry with `EXPIRE key ttl XX` in the same round trip as the GET: XX leaves pinned blocks (stored
without expiry, via PERSIST) pinned, so readers need not know which blocks are pinned. Requires Redis >= 7.
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kite_shared.tiers.base import RemoteTier, StoredBlock
from kite_shared.tiers.keys import BlockKey, parse_redis_key, redis_key, redis_pattern

log = logging.getLogger(__name__)


class RedisTier(RemoteTier):
    name = "warm"

    def __init__(self, url: str, ttl_s: float = 3600.0, timeout_s: float = 0.25,
                 backoff_max_s: float = 30.0, initial_backoff_s: float = 0.5,
                 max_connections: int = 64, scan_count: int = 1000) -> None:
        super().__init__(timeout_s, backoff_max_s, initial_backoff_s)
        self.url = url
        self.ttl_s = max(1, int(round(ttl_s)))
        self.scan_count = scan_count
        # The tier's own timeout and backoff decide; redis-py's retries would only stretch a failure.
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=max(timeout_s, 1.0), socket_connect_timeout=max(timeout_s, 0.5),
            retry=Retry(NoBackoff(), 0), max_connections=max_connections)

    async def close(self) -> None:
        await self._redis.aclose()

    async def _get(self, key: BlockKey) -> bytes | None:
        name = redis_key(key)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.get(name)
            pipe.expire(name, self.ttl_s, xx=True)
            data, _ = await pipe.execute()
        return data

    async def _put(self, key: BlockKey, data: bytes, pinned: bool) -> None:
        await self._redis.set(redis_key(key), data, ex=None if pinned else self.ttl_s)

    async def _delete(self, keys: list[BlockKey]) -> int:
        return int(await self._redis.unlink(*[redis_key(k) for k in keys]))

    async def _exists(self, key: BlockKey) -> bool:
        return bool(await self._redis.exists(redis_key(key)))

    async def _ping(self) -> None:
        await self._redis.ping()

    async def set_pinned(self, key: BlockKey, pinned: bool) -> bool:
        """Pin (no expiry) or unpin (expiry back to the TTL); False when absent or the tier is down."""
        name = redis_key(key)
        if pinned:
            # PERSIST answers 0 both for a missing key and for one already without expiry.
            return await self._op("pin", lambda: self._persist(name), False)
        return await self._op("unpin", lambda: self._redis.expire(name, self.ttl_s), False)

    async def _persist(self, name: str) -> bool:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.persist(name)
            pipe.exists(name)
            _, exists = await pipe.execute()
        return bool(exists)

    async def _list_page(self, model_tag: str | None, cursor: object | None
                         ) -> tuple[list[StoredBlock], object | None]:
        next_cursor, names = await self._redis.scan(cursor=int(cursor or 0), match=redis_pattern(model_tag),
                                                    count=self.scan_count)
        keys = [(name, parse_redis_key(name)) for name in names]
        keys = [(name, key) for name, key in keys if key is not None]
        items: list[StoredBlock] = []
        if keys:
            async with self._redis.pipeline(transaction=False) as pipe:
                for name, _ in keys:
                    pipe.pttl(name)
                    pipe.strlen(name)
                replies = await pipe.execute()
            for i, (_, key) in enumerate(keys):
                pttl, size = replies[2 * i], replies[2 * i + 1]
                if pttl == -2:  # expired between SCAN and PTTL
                    continue
                pinned = pttl == -1
                # Every write and hit sets the expiry to the full TTL, so what has run down is idle time.
                idle = None if pinned else max(0.0, self.ttl_s - pttl / 1000.0)
                items.append(StoredBlock(key, int(size), idle, pinned))
        return items, (None if int(next_cursor) == 0 else int(next_cursor))
