"""Workers writing new blocks into warm themselves (KITE_WORKER_POOL_WRITE_PATH=direct,
kite_shared.tiers.unit_writer), over a real nats-server, redis-server and ru-pool: the units land in Redis
under the keys the pool's own write-through uses, the pool indexes them from one small notice per batch
(never receiving their bytes), quotas and invalidations hold as for puts, and another worker loads them
verified. Units a lossy warm codec must transcode, and units warm will not take, still go by puts."""

from __future__ import annotations

import nats
import pytest
import torch

from kite_ru_pool.index import HOT, WARM
from kite_shared import subjects
from kite_shared.messages import PoolAdminRequest, UnitsWritten
from kite_shared.recyclable_unit import decode
from kite_shared.security import ru_key, tenant_tag
from kite_shared.tiers.client import TierClient
from kite_shared.tiers.keys import BlockKey, redis_key
from kite_shared.tiers.pool_client import PoolClient
from kite_shared.tiers.unit_writer import DirectToWarm, PoolPut, unit_writer
from kite_worker.pool_loader import CostModel, PoolLoader
from tests.helpers import new_fp, unit_chain, wait_until_async
from tests.integration.test_ru_pool_service import SHAPE, UNIT_BYTES, client, env, pools  # noqa: F401  (fixtures)

TENANT = "acme"


class Notices:
    """Every UnitsWritten notice on the bus, as the pool receives them."""

    def __init__(self) -> None:
        self.received: list[UnitsWritten] = []

    async def start(self, url: str) -> "Notices":
        self.nc = await nats.connect(url)

        async def on(msg) -> None:
            self.received.append(UnitsWritten.decode(msg.data))
        await self.nc.subscribe(subjects.POOL_UNITS_WRITTEN, cb=on)
        await self.nc.flush()
        return self


@pytest.fixture
async def tiers(env):
    t = TierClient.from_config(env.tier_cfg(), with_cold=False)
    await t.start()
    yield t
    await t.close()


async def test_units_written_directly_are_indexed_from_one_notice_and_load_verified(pools, client, env, tiers):
    pool = await pools.start()
    notices = await Notices().start(env.nats_url)
    fp = new_fp()
    chain = unit_chain(fp, 6, tenant=TENANT, shape=SHAPE)
    keys = [BlockKey.of(fp, h, tenant_tag(TENANT)) for h, _ in chain]
    writer = unit_writer("direct", client, tiers.warm, ru_key())
    assert isinstance(writer, DirectToWarm)
    for _, data in chain:
        assert await writer.put(data)
    await writer.flush()
    await client.nc.flush()
    # In Redis under the pool's own keys, byte for byte, before the pool heard of them.
    stored = env.redis().mget([redis_key(k) for k in keys])
    assert stored == [data for _, data in chain]
    await wait_until_async(lambda: all(pool.core.index.tiers_of(k) == WARM for k in keys), 5.0,
                           "the pool indexing the notice")
    await wait_until_async(lambda: notices.received, 5.0, "the notice")
    assert len(notices.received) == 1  # one notice for the batch, naming each unit's bytes and depth
    notice = notices.received[0]
    assert notice.block_hashes == [h for h, _ in chain] and notice.depths == list(range(6))
    assert notice.sizes == [UNIT_BYTES] * 6 and notice.tenant_tag == tenant_tag(TENANT)
    assert (writer.num_direct, writer.num_put) == (6, 0)
    assert pool.core.counters.puts == 6 and pool.core.counters.refused_corrupt == 0
    assert not any(pool.core.index.tiers_of(k) & HOT for k in keys)  # the bytes never reached the pool
    ledger = pool.core.tenants.usage(tenant_tag(TENANT))[tenant_tag(TENANT)]
    assert (ledger.num_blocks, ledger.num_bytes) == (6, 6 * UNIT_BYTES)
    assert (await client.lookup(fp, [h for h, _ in chain])).tiers == b"wwwwww"

    # Another worker loads them from warm, verified, the very bytes written.
    cost = CostModel(block_size=16, block_bytes=UNIT_BYTES, prefill_seconds_per_token=1.0)
    loader = PoolLoader(client, tiers, cost, fp, SHAPE, torch.float16, mac_key=ru_key())
    loaded = await loader.load([h for h, _ in chain], num_local=0, tenant=TENANT)
    assert [h for h, _ in loaded] == [h for h, _ in chain]
    for (_, tensor), (_, data) in zip(loaded, chain):
        expected = torch.frombuffer(bytearray(decode(data, key=ru_key()).payload), dtype=torch.uint8)
        assert torch.equal(tensor.flatten().view(torch.uint8), expected)

    # Without a flush, the notice goes NOTICE_DELAY_S after the first unit waiting (a save that ends).
    later = unit_chain(fp, 8, tenant=TENANT, shape=SHAPE)[6:]
    for _, data in later:
        assert await writer.put(data)
    later_keys = [BlockKey.of(fp, h, tenant_tag(TENANT)) for h, _ in later]
    await wait_until_async(lambda: all(pool.core.index.tiers_of(k) == WARM for k in later_keys), 5.0,
                           "the timed notice indexed")
    assert len(notices.received) == 2 and notices.received[1].depths == [6, 7]

    # Written again (a second worker computed the same blocks): duplicates, counted once.
    for _, data in chain[:2]:
        assert await writer.put(data)
    await writer.flush()
    await wait_until_async(lambda: pool.core.counters.duplicates == 2, 5.0, "the duplicates")
    ledger = pool.core.tenants.usage(tenant_tag(TENANT))[tenant_tag(TENANT)]
    assert (ledger.num_blocks, ledger.num_bytes) == (8, 8 * UNIT_BYTES)


async def test_what_the_pool_refuses_is_deleted_from_warm_again(pools, client, env, tiers):
    pool = await pools.start(tenant_quota_bytes=3 * UNIT_BYTES)
    fp = new_fp()
    chain = unit_chain(fp, 5, tenant=TENANT, shape=SHAPE)
    keys = [BlockKey.of(fp, h, tenant_tag(TENANT)) for h, _ in chain]
    writer = DirectToWarm(client, tiers.warm, ru_key())
    # One more than the quota holds, in one notice (one instant to the pool's recency grain): the tenant is
    # brought to 90% of its quota, dropping its deepest blocks first (2, then 1), from warm too.
    for _, data in chain[:4]:
        assert await writer.put(data)
    await writer.flush()
    await wait_until_async(lambda: pool.core.index.tiers_of(keys[3]), 5.0, "the fourth block indexed")
    await pool.drain_background()
    assert [pool.core.index.tiers_of(k) for k in keys[:4]] == [WARM, 0, 0, WARM]
    assert [env.redis().exists(redis_key(k)) for k in keys[:4]] == [1, 0, 0, 1]
    assert pool.core.tenants.usage(tenant_tag(TENANT))[tenant_tag(TENANT)].num_bytes == 2 * UNIT_BYTES

    # With every block pinned and the quota full, a new block is refused, and deleted from warm again.
    assert await writer.put(chain[1][1])
    await writer.flush()
    await wait_until_async(lambda: pool.core.index.tiers_of(keys[1]), 5.0, "block 1 indexed again")
    reply = await client.admin(PoolAdminRequest(op="pin", model_fingerprint=fp,
                                                block_hashes=[h for h, _ in chain[:4]], tenant=TENANT))
    assert reply.ok and reply.affected == 3
    assert await writer.put(chain[4][1])
    await writer.flush()
    await wait_until_async(lambda: pool.core.tenants.usage(tenant_tag(TENANT))[tenant_tag(TENANT)].quota_refused == 1,
                           5.0, "the refusal")
    await pool.drain_background()
    assert pool.core.index.tiers_of(keys[4]) == 0 and env.redis().exists(redis_key(keys[4])) == 0
    # A pinned block written again (SET gives it the TTL back) is made persistent again by the pool.
    assert env.redis().ttl(redis_key(keys[1])) == -1
    assert await writer.put(chain[1][1])
    assert env.redis().ttl(redis_key(keys[1])) > 0
    await writer.flush()
    await wait_until_async(lambda: env.redis().ttl(redis_key(keys[1])) == -1, 5.0, "the pin restored")

    # An invalidated model: the pool deletes what a stale worker still writes.
    other = new_fp()
    name = "model-direct"
    await client.model_fingerprint_changed(name, other)
    await client.model_fingerprint_changed(name, new_fp())
    await client.nc.flush()
    await wait_until_async(lambda: pool.core.catalog.is_invalidated(other), 5.0, "the invalidation")
    stale_hash, stale = unit_chain(other, 1, tenant=TENANT, shape=SHAPE)[0]
    assert await writer.put(stale)
    await writer.flush()
    await wait_until_async(lambda: pool.core.counters.refused_invalidated == 1, 5.0, "the refusal")
    await pool.drain_background()
    assert env.redis().exists(redis_key(BlockKey.of(other, stale_hash, tenant_tag(TENANT)))) == 0


async def test_lossy_warm_units_and_units_warm_refuses_go_by_puts(pools, client, env, tiers):
    pool = await pools.start()
    fp = new_fp()
    writer = DirectToWarm(client, tiers.warm, ru_key())
    lossy = unit_chain(fp, 2, shape=SHAPE, warm_codec="int8")  # the pool transcodes it for warm
    for _, data in lossy:
        assert await writer.put(data)
    assert (writer.num_direct, writer.num_put) == (0, 2)
    await client.nc.flush()
    await wait_until_async(lambda: all(pool.core.index.tiers_of(BlockKey.of(fp, h)) & HOT for h, _ in lossy), 5.0,
                           "the puts in hot")

    env.redis().config_set("maxmemory", 1)  # a full Redis refuses writes (OOM): the unit goes by a put
    env.redis().config_set("maxmemory-policy", "noeviction")
    try:
        fp2 = new_fp()
        (h, data), = unit_chain(fp2, 1, shape=SHAPE)
        assert await writer.put(data)
        assert writer.num_put == 3
        await client.nc.flush()
        await wait_until_async(lambda: pool.core.index.tiers_of(BlockKey.of(fp2, h)) & HOT, 5.0, "the put in hot")
    finally:
        env.redis().config_set("maxmemory", 0)


def test_without_a_warm_tier_the_direct_path_puts(env):
    assert isinstance(unit_writer("direct", PoolClient(None), None, ru_key()), PoolPut)
    with pytest.raises(ValueError, match="unknown pool write path"):
        unit_writer("sideways", PoolClient(None), None, ru_key())

