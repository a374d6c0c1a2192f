"""The warm tier on a real Redis Cluster (3 primaries, AUTH in the URL; fixture `redis_cluster` in
tests/conftest.py): keys spread over every node, verified round trips, paged listing across nodes, TTL and
pins, deletes across slots, and the ru-pool rebuilding its index from the cluster."""

from __future__ import annotations

import asyncio
import hashlib

import nats
import pytest
from redis.exceptions import RedisClusterException

from kite_ru_pool.service import PoolService
from kite_shared.config import RuPoolConfig, TierConfig, load
from kite_shared.messages import PoolAdminRequest
from kite_shared.security import ru_key
from kite_shared.tiers.base import TierUnavailable
from kite_shared.tiers.client import TierClient
from kite_shared.tiers.keys import BlockKey, model_tag, redis_key
from kite_shared.tiers.pool_client import PoolClient
from kite_shared.tiers.warm import RedisTier, _ClusterCursor
from tests.helpers import new_fp, unit_chain, wait_until_async

RU_KEY = hashlib.sha256(b"redis-cluster-test-ru-key").digest()
SCAN_COUNT = 50
N_UNITS = 300  # > 3 nodes x SCAN_COUNT: every node needs several SCAN pages


async def bounded(coros, limit: int = 16) -> list:
    """Run concurrently, at most `limit` at a time (the tier's client holds at most 64 connections a node
    and answers MaxConnectionsError beyond that, which marks the tier down)."""
    sem = asyncio.Semaphore(limit)

    async def one(coro):
        async with sem:
            return await coro

    return await asyncio.gather(*(one(c) for c in coros))


async def put_all(tier: RedisTier, fp: str, units: list[tuple[bytes, bytes]], pinned: bool = False) -> None:
    assert all(await bounded(tier.put(BlockKey.of(fp, h), d, pinned=pinned) for h, d in units))


@pytest.fixture
async def ctier(redis_cluster):
    redis_cluster.flush()
    tier = RedisTier(redis_cluster.url, ttl_s=30, timeout_s=1.0, scan_count=SCAN_COUNT, cluster=True)
    tier.ru_key = RU_KEY
    yield tier
    await tier.close()


def node_sizes(redis_cluster) -> list[int]:
    sizes = []
    for port in redis_cluster.ports:
        with redis_cluster.node(port) as r:
            sizes.append(r.dbsize())
    return sizes


async def test_units_spread_over_every_node_and_read_back_verified(ctier, redis_cluster):
    fp = new_fp()
    units = unit_chain(fp, N_UNITS, key=RU_KEY)
    assert await ctier.ping()
    await put_all(ctier, fp, units)
    sizes = node_sizes(redis_cluster)
    assert sum(sizes) == N_UNITS and all(n > 0 for n in sizes), sizes  # no hash tags: every node holds keys
    with redis_cluster.client() as rc:  # each key sits in the slot its name hashes to, on that slot's owner
        for h, _ in units[:20]:
            name = redis_key(BlockKey.of(fp, h))
            owner = rc.get_node_from_key(name)
            with redis_cluster.node(owner.port) as r:
                assert r.cluster("COUNTKEYSINSLOT", rc.keyslot(name)) >= 1 and r.exists(name)
    found = await bounded(ctier.get_verified(fp, h) for h, _ in units)
    assert found == [d for _, d in units]
    assert all([await ctier.exists(BlockKey.of(fp, h)) for h, _ in units[:10]])
    assert ctier.hits == N_UNITS and ctier.misses == 0 and ctier.up
    # A unit without the cluster key's MAC is a counted, deleted miss, on a cluster as anywhere.
    h, forged = unit_chain(new_fp(), 1, key=b"\x01" * 32)[0]
    await ctier.put(BlockKey.of(fp, h), forged)
    assert await ctier.get_verified(fp, h) is None
    assert ctier.integrity_failures == 1 and not await ctier.exists(BlockKey.of(fp, h))


async def test_listing_pages_through_every_node_and_returns_each_key_once(ctier, redis_cluster):
    fp, other = new_fp(), new_fp()
    units = unit_chain(fp, N_UNITS, key=RU_KEY)
    others = unit_chain(other, 40, key=RU_KEY)
    await put_all(ctier, fp, units)
    await put_all(ctier, other, others)
    pages = 0
    list_page = ctier._list_page

    async def counting(model_tag, cursor):
        nonlocal pages
        pages += 1
        return await list_page(model_tag, cursor)

    ctier._list_page = counting
    listed = [s async for s in ctier.iter_keys()]
    assert len(listed) == N_UNITS + 40  # exactly once each: no key twice, none missing
    sizes = {BlockKey.of(f, h): len(d) for f, us in ((fp, units), (other, others)) for h, d in us}
    assert {s.key: s.size for s in listed} == sizes
    assert all(not s.pinned and 0 <= s.idle_s < 5 for s in listed)
    assert pages > len(redis_cluster.ports)  # several SCAN pages per node, and every node was scanned
    only = [s async for s in ctier.iter_keys(model_tag(other))]
    assert sorted(s.key for s in only) == sorted(BlockKey.of(other, h) for h, _ in others)
    assert [s async for s in ctier.iter_keys("f" * 16)] == []


async def test_listing_refuses_to_continue_when_the_primaries_changed(ctier, redis_cluster, caplog):
    """A cursor remembers the primaries it started with; another set (failover, node added or removed)
    fails the listing instead of silently missing keys. Simulated: the first page's cursor is rewritten
    as if the cluster had had one more primary when the listing started."""
    await put_all(ctier, new_fp(), unit_chain(new_fp(), 5, key=RU_KEY))
    real = ctier._list_page

    async def topology_changed(tag, cursor):
        items, cursor = await real(tag, cursor)
        assert isinstance(cursor, _ClusterCursor)
        assert cursor.nodes == tuple(sorted(f"127.0.0.1:{p}" for p in redis_cluster.ports))
        ctier._list_page = real
        return items, cursor._replace(nodes=cursor.nodes + ("127.0.0.1:1",))

    ctier._list_page = topology_changed
    with pytest.raises(TierUnavailable):
        _ = [s async for s in ctier.iter_keys()]
    assert "Redis Cluster primaries changed during listing" in caplog.text


async def test_delete_many_spans_slots_and_nodes(ctier, redis_cluster):
    fp = new_fp()
    units = unit_chain(fp, N_UNITS, key=RU_KEY)
    await put_all(ctier, fp, units)
    doomed = [BlockKey.of(fp, h) for h, _ in units[:200]]
    with redis_cluster.client() as rc:
        owners = {rc.get_node_from_key(redis_key(k)).port for k in doomed}
        slots = {rc.keyslot(redis_key(k)) for k in doomed}
    assert len(owners) == 3 and len(slots) > 100  # one UNLINK could never take these in one call
    absent = BlockKey.of(fp, b"\x09" * 32)
    assert await ctier.delete_many(doomed + [absent]) == 200
    assert await ctier.delete_many(doomed) == 0
    assert sum(node_sizes(redis_cluster)) == N_UNITS - 200
    assert {s.key async for s in ctier.iter_keys()} == {BlockKey.of(fp, h) for h, _ in units[200:]}
    assert await ctier.delete(BlockKey.of(fp, units[250][0]))
    assert await ctier.get_verified(fp, units[250][0]) is None and ctier.up


async def test_a_batched_read_spans_the_nodes_and_refreshes_the_hits_expiry(ctier, redis_cluster):
    fp = new_fp()
    units = unit_chain(fp, 12, key=RU_KEY)  # several keys, so several slots and nodes: one MGET per slot
    await put_all(ctier, fp, units[:9])
    await put_all(ctier, fp, units[9:], pinned=True)
    with redis_cluster.client() as rc:
        for h, _ in units[:9]:
            rc.pexpire(redis_key(BlockKey.of(fp, h)), 5_000)
        found = await ctier.get_units(fp, [h for h, _ in units] + [b"\x07" * 32])
        assert [f is not None and f[1] for f in found] == [d for _, d in units] + [False]
        await wait_until_async(lambda: min(rc.pttl(redis_key(BlockKey.of(fp, h))) for h, _ in units[:9]), 5,
                               "the batched hits to restart their TTLs", done=lambda ttl_ms: ttl_ms > 25_000,
                               interval_s=0.01)
        assert all(rc.pttl(redis_key(BlockKey.of(fp, h))) == -1 for h, _ in units[9:])
    assert ctier.up


async def test_ttl_is_refreshed_on_hit_and_pins_have_none(ctier, redis_cluster):
    fp = new_fp()
    units = unit_chain(fp, 12, key=RU_KEY)  # several keys, so several nodes
    plain, pinned = units[:6], units[6:]
    await put_all(ctier, fp, plain)
    await put_all(ctier, fp, pinned, pinned=True)
    with redis_cluster.client() as rc:
        for h, _ in plain:
            name = redis_key(BlockKey.of(fp, h))
            assert 0 < rc.pttl(name) <= 30_000
            rc.pexpire(name, 5_000)
        for h, d in plain:
            assert await ctier.get_verified(fp, h) == d
            assert rc.pttl(redis_key(BlockKey.of(fp, h))) > 25_000  # the hit restarted the TTL
        for h, d in pinned:
            assert await ctier.get_verified(fp, h) == d
            assert rc.pttl(redis_key(BlockKey.of(fp, h))) == -1  # EXPIRE XX left the pin alone
        for h, _ in plain:
            key = BlockKey.of(fp, h)
            assert await ctier.set_pinned(key, True) and rc.pttl(redis_key(key)) == -1
        for h, _ in plain[:3]:
            key = BlockKey.of(fp, h)
            assert await ctier.set_pinned(key, False) and 0 < rc.pttl(redis_key(key)) <= 30_000
    assert not await ctier.set_pinned(BlockKey.of(fp, b"\x07" * 32), True)
    assert not await ctier.set_pinned(BlockKey.of(fp, b"\x07" * 32), False)
    listed = {s.key: s for s in [s async for s in ctier.iter_keys()]}
    assert len(listed) == 12
    unpinned = {BlockKey.of(fp, h) for h, _ in plain[:3]}
    for key, item in listed.items():
        assert item.pinned == (key not in unpinned)
        assert (item.idle_s is None) == item.pinned


async def test_wrong_password_is_a_down_tier_and_listing_says_so(redis_cluster):
    tier = RedisTier(f"redis://:wrong@127.0.0.1:{redis_cluster.ports[1]}/0", timeout_s=1.0, cluster=True)
    try:
        assert not await tier.ping()
        assert not tier.up
    finally:
        await tier.close()
    tier = RedisTier(f"redis://127.0.0.1:{redis_cluster.ports[1]}/0", timeout_s=1.0, cluster=True,
                     initial_backoff_s=0.01)
    try:
        with pytest.raises(TierUnavailable):
            _ = [s async for s in tier.iter_keys()]
    finally:
        await tier.close()


def test_cluster_mode_refuses_a_database_number():
    with pytest.raises(RedisClusterException, match="db"):
        RedisTier("redis://127.0.0.1:6379/3", cluster=True)


async def test_ru_pool_rebuilds_its_index_from_the_cluster_and_clears_it(redis_cluster, nats_server,
                                                                        tmp_path):
    """The ru-pool (in-process, real NATS) writes through to the cluster; a fresh pool indexes every block
    from the cluster's SCAN (one listing over all primaries), serves them, and a clear deletes them all."""
    redis_cluster.flush()
    tier_cfg = load(TierConfig, environ={"KITE_REDIS_URL": redis_cluster.url, "KITE_REDIS_CLUSTER": "on",
                                         "KITE_COLD_DIR": str(tmp_path / "cold"),
                                         "KITE_TIER_TIMEOUT_S": "2.0"})
    pool_cfg = load(RuPoolConfig, environ={}, hot_bytes=1 << 22, metrics_port=0, archive_after_s=3600.0,
                    sweep_interval_s=0.1)
    fp = new_fp()
    units = unit_chain(fp, 40, key=ru_key())  # the pool verifies with this process's cluster key
    hashes = [h for h, _ in units]
    nc = await nats.connect(nats_server.url)
    client = PoolClient(nc, worker_id="w-cluster", lookup_timeout_s=2.0)
    pools: list[PoolService] = []

    async def start_pool() -> PoolService:
        pool = PoolService(pool_cfg, tier_cfg, await nats.connect(nats_server.url))
        pools.append(pool)
        await pool.start()
        await wait_until_async(lambda: not pool.rebuilding, 10.0, "index rebuild")
        # The first command also discovers the cluster's slots; on a loaded machine that can pass the tier
        # timeout, and the pool then indexes warm at the tier's recovery (a backoff later), not at start.
        await wait_until_async(lambda: pool.warm is not None and pool.warm.up, 10.0, "warm tier up")
        return pool

    async def stop_pool(pool: PoolService) -> None:
        pools.remove(pool)
        await pool.stop()
        await pool.nc.close()

    try:
        pool = await start_pool()
        assert pool.warm is not None and pool.warm.cluster and pool.warm.up
        for _, data in units:
            assert await client.put(data)
        await nc.flush()
        await wait_until_async(lambda: all(pool.core.index.tiers_of(BlockKey.of(fp, h)) for h in hashes), 10.0,
                               "puts")
        await pool.drain_background()
        assert sum(node_sizes(redis_cluster)) == 40 and all(n > 0 for n in node_sizes(redis_cluster))
        await stop_pool(pool)
        pool = await start_pool()  # fresh index: everything it knows comes from the cluster listing
        # Indexed at start, or at the tier's recovery when the first command timed out.
        r = await wait_until_async(lambda: client.lookup(fp, hashes), 10.0, "the 40 blocks indexed in warm",
                                   done=lambda r: (r.hot, r.warm, r.pool) == (0, 40, 40), interval_s=0.1)
        assert (r.hot, r.warm, r.pool) == (0, 40, 40)
        assert await client.get(fp, hashes) == [d for _, d in units]
        reply = await client.admin(PoolAdminRequest(op="clear", model_fingerprint=fp))
        assert reply.ok and reply.affected == 40
        assert sum(node_sizes(redis_cluster)) == 0
    finally:
        for pool in list(pools):
            await stop_pool(pool)
        await nc.close()


async def test_tier_client_from_config_builds_a_cluster_client(redis_cluster):
    # A generous timeout: the first command also discovers the cluster's slots, which on a loaded 2-core
    # machine can pass the default 0.25 s (the tier would then be down for one backoff, and this test red).
    cfg = load(TierConfig, environ={"KITE_REDIS_URL": redis_cluster.url, "KITE_REDIS_CLUSTER": "yes",
                                    "KITE_TIER_TIMEOUT_S": "2"})
    client = TierClient.from_config(cfg, with_cold=False, ru_key=RU_KEY)
    try:
        await client.start()
        assert client.warm is not None and client.warm.cluster and client.warm.up
        assert len(client.warm._redis.get_primaries()) == 3
    finally:
        await client.close()
