"""Warm tier: Redis (redis-py asyncio, hiredis parser), one key per block, expiring KITE_WARM_TTL_S after
the last write or hit.

Keys: see kite_shared.tiers.keys (kite:ru:v2:<model_tag>:<tenant_tag>:<block_hash_hex>, no hash tags).
A hit refreshes the expiry with `EXPIRE key ttl XX`, in the same round trip as a single GET, or, for a
batch, once its units are verified (`_touch_later`: one pipeline, as a task of its own): XX leaves pinned blocks
(stored without expiry, via PERSIST) pinned, so readers need not know which blocks are pinned.
Requires Redis >= 7.

Redis Cluster (KITE_REDIS_CLUSTER, `cluster=True`): the URL names one seed node; redis-py's
`RedisCluster` discovers the others and routes every key to the primary owning its slot. Every operation
touches one key (or one key's pipeline: GET+EXPIRE, PERSIST+EXISTS), except UNLINK and MGET of many keys,
which redis-py's cluster client splits into one command per slot (pipelined per node; `mget_nonatomic`
for MGET, since a cluster refuses one MGET across slots), and listing: SCAN only
walks the node it is sent to, so `_list_page` scans the primaries one after the other with a cursor of
(primaries at the start, index of the one being scanned, its SCAN cursor). A listing fails (the tier's
`TierUnavailable`) rather than silently skip keys if the set of primaries changes under it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, NamedTuple, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kite_shared.tiers.base import RemoteTier, StoredBlock
from kite_shared.tiers.keys import BlockKey, parse_redis_key, redis_key, redis_pattern

log = logging.getLogger(__name__)
R = TypeVar("R")
# Keys per MGET of a batched read: 16 SmolLM2 blocks are 5.9 MB. Eight replies of 6 MB are received and
# parsed faster than one of 47 MB (bench_data_plane.py: 1.1-1.6x); 32 keys measured no better.
READ_BATCH_KEYS = 16


class _ClusterCursor(NamedTuple):
    """Where a cluster listing stands: the primaries found at its start (sorted names), which one is
    being scanned, and that node's own SCAN cursor."""

    nodes: tuple[str, ...]
    index: int
    node_cursor: int


def redis_client(url: str, cluster: bool, socket_timeout_s: float, connect_timeout_s: float,
                 max_connections: int = 64) -> aioredis.Redis | RedisCluster:
    """A client of KITE_REDIS_URL (AUTH and TLS in the URL) that never retries: its caller's timeout and
    backoff decide, and redis-py's retries would only stretch a failure. Cluster: the URL is a seed node
    (db 0 only), max_connections is per node, and MOVED/ASK redirects are still followed (routing, not
    retries)."""
    client_cls = RedisCluster if cluster else aioredis.Redis
    return client_cls.from_url(url, socket_timeout=socket_timeout_s, socket_connect_timeout=connect_timeout_s,
                               retry=Retry(NoBackoff(), 0), max_connections=max_connections)


class RedisTier(RemoteTier):
    name = "warm"

    def __init__(self, url: str, ttl_s: float = 3600.0, timeout_s: float = 0.25,
                 backoff_max_s: float = 30.0, initial_backoff_s: float = 0.5,
                 max_connections: int = 64, scan_count: int = 1000, cluster: bool = False) -> None:
        super().__init__(timeout_s, backoff_max_s, initial_backoff_s)
        self.url = url
        self.ttl_s = max(1, int(round(ttl_s)))
        self.scan_count = scan_count
        self.cluster = cluster
        self._refreshing: set[asyncio.Task] = set()  # expiry refreshes after batched reads (_touch_later)
        # The socket timeout is a backstop: the tier's own deadlines (`_op`) end a slow operation first. It
        # is the longer one, so a write is not cut at a socket read before its own deadline.
        self._redis = redis_client(url, cluster, self.background_timeout_s, max(timeout_s, 0.5), max_connections)

    async def close(self) -> None:
        # Let the expiry refreshes in flight finish on the connection, for at most the tier's timeout: a
        # stop must not wait on Redis.
        late = await self.settle(self.timeout_s)
        for task in late:
            task.cancel()
        await self._redis.aclose()

    async def settle(self, timeout_s: float | None = None) -> set[asyncio.Task]:
        """Wait until the expiry refreshes in flight have ended (a benchmark times reads without them
        spilling into the next measurement); those still running after `timeout_s`."""
        if not self._refreshing:
            return set()
        _, late = await asyncio.wait(set(self._refreshing), timeout=timeout_s)
        return late

    async def _op(self, what: str, fn: Callable[[], Awaitable[R]], *args: Any, **kwargs: Any) -> R:
        if isinstance(self._redis, RedisCluster):
            cluster, inner = self._redis, fn

            async def fn() -> R:
                # Discover the cluster before the command. redis-py 8.1 routes a keyed command that
                # starts while the first discovery is still running as keyless (to a random node):
                # MOVED storms, then a reinitialisation that drops every in-flight connection.
                await cluster.initialize()  # no-op once connected
                return await inner()
        return await super()._op(what, fn, *args, **kwargs)

    async def _get(self, key: BlockKey) -> bytes | None:
        name = redis_key(key)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.get(name)
            pipe.expire(name, self.ttl_s, xx=True)
            data, _ = await pipe.execute()
        return data

    async def _read_batches(self, keys: list[BlockKey]) -> AsyncIterator[tuple[int, list[bytes | None]]]:
        """MGETs of READ_BATCH_KEYS keys, one after the other on one connection (on a cluster, redis-py's
        `mget_nonatomic`: one MGET per slot, pipelined per node), each part handed to the caller as it
        arrives (what arrived before a deadline still counts). Measured on this machine, 128 blocks of
        369 KB, verified, against one bare MGET of all the keys: one GET + EXPIRE pipeline 0.71x (256
        commands' framing and replies cost more than the bytes), one MGET then verification on the loop
        0.64-0.89x, these MGETs then the batch verified a share per core 0.77-0.88x
        (`RemoteTier.get_units`); the eight MGETs in one pipeline (one round trip) were slower than one
        after the other in the same runs (0.76-0.83x against 0.85-0.90x)."""
        names = [redis_key(key) for key in keys]
        for start in range(0, len(names), READ_BATCH_KEYS):
            part = names[start:start + READ_BATCH_KEYS]
            if isinstance(self._redis, RedisCluster):
                values = await self._redis.mget_nonatomic(part)
            else:
                values = await self._redis.mget(part)
            yield start, values

    def _touch_later(self, keys: list[BlockKey]) -> None:
        """Reset these keys' expiry to the TTL (XX: pinned keys, without expiry, stay so) in one pipeline,
        as a task of its own. A refresh that fails is logged and marks the tier down like any operation;
        a refresh lost to a crash costs the block at most one TTL of life."""
        async def pipelined() -> None:
            async with self._redis.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.expire(redis_key(key), self.ttl_s, xx=True)
                await pipe.execute()

        task = asyncio.create_task(self._op("refresh expiry", pipelined, None))
        self._refreshing.add(task)  # a reference until done: the loop keeps only weak ones
        task.add_done_callback(self._refreshing.discard)

    async def _put(self, key: BlockKey, data: bytes, pinned: bool) -> None:
        await self._redis.set(redis_key(key), data, ex=None if pinned else self.ttl_s)

    async def _delete(self, keys: list[BlockKey]) -> int:
        return int(await self._redis.unlink(*[redis_key(k) for k in keys]))

    async def _exists(self, key: BlockKey) -> bool:
        return bool(await self._redis.exists(redis_key(key)))

    async def _ping(self) -> None:
        if isinstance(self._redis, RedisCluster):
            # Up means every shard answers (a probe of the default node alone would not see a dead shard).
            await self._redis.ping(target_nodes=RedisCluster.PRIMARIES)
        else:
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
        if self.cluster:
            return await self._list_cluster_page(model_tag, cursor)
        next_cursor, names = await self._redis.scan(cursor=int(cursor or 0), match=redis_pattern(model_tag),
                                                    count=self.scan_count)
        items = await self._describe(names)
        return items, (None if int(next_cursor) == 0 else int(next_cursor))

    async def _list_cluster_page(self, model_tag: str | None, cursor: object | None
                                 ) -> tuple[list[StoredBlock], _ClusterCursor | None]:
        """One SCAN step on one primary; the next page continues that primary, then the next one."""
        cluster = self._redis
        assert isinstance(cluster, RedisCluster)
        await cluster.initialize()  # no-op unless never connected or reset by an error
        primaries = tuple(sorted(node.name for node in cluster.get_primaries()))
        if cursor is None:
            if not primaries:
                raise RuntimeError("Redis Cluster has no primaries")
            cursor = _ClusterCursor(primaries, 0, 0)
        assert isinstance(cursor, _ClusterCursor)
        if primaries != cursor.nodes:
            # A failover or a resharding: keys may have moved to a node already scanned (or not yet
            # known), so this listing cannot promise to be complete.
            raise RuntimeError(f"Redis Cluster primaries changed during listing: {list(cursor.nodes)} -> "
                               f"{list(primaries)}")
        node = cluster.get_node(node_name=cursor.nodes[cursor.index])
        cursors, names = await cluster.scan(cursor=cursor.node_cursor, match=redis_pattern(model_tag),
                                            count=self.scan_count, target_nodes=node)
        items = await self._describe(names)
        node_cursor = int(cursors[node.name])
        if node_cursor != 0:
            return items, cursor._replace(node_cursor=node_cursor)
        if cursor.index + 1 < len(cursor.nodes):
            return items, cursor._replace(index=cursor.index + 1, node_cursor=0)
        return items, None

    async def _describe(self, names: list[bytes]) -> list[StoredBlock]:
        """Size, idle time and pin of the listed names (one pipeline; a cluster splits it per node)."""
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
        return items
