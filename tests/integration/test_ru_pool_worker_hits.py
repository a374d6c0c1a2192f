"""Promotion on the default path (issue 38): a worker's PoolLoader reads warm (a real redis-server) and cold
(a real moto S3 server) itself, reports those hits over a real nats-server (kite.v1.pool.tier_hits), and
the ru-pool promotes them into its hot tier, so that the next worker wanting the same blocks is served
from hot. With the loader's report off (`report_hits=False`) the blocks stay where they were: this test
then fails, waiting for hot."""

from __future__ import annotations

import nats
import torch

from kite_ru_pool.index import COLD, HOT, WARM
from kite_shared.recyclable_unit import decode
from kite_shared.security import ru_key, tenant_tag
from kite_shared.tiers.client import TierClient
from kite_shared.tiers.keys import BlockKey
from kite_shared.tiers.pool_client import PoolClient
from kite_worker.pool_loader import CostModel, PoolLoader
from tests.helpers import new_fp, unit_chain, wait_until_async
from tests.integration.test_ru_pool_service import SHAPE, UNIT_BYTES, client, env, pools  # noqa: F401  (fixtures)

TENANT = "acme"


def worker_loader(pool: PoolClient, tiers: TierClient, fp: str) -> PoolLoader:
    """A worker's loader as on the default path (KITE_WORKER_POOL_READ=on: warm and cold read directly),
    with a cost model that loads every block rather than compute it."""
    cost = CostModel(block_size=16, block_bytes=UNIT_BYTES, prefill_seconds_per_token=1.0)
    return PoolLoader(pool, tiers, cost, fp, SHAPE, torch.float16, mac_key=ru_key())


async def test_blocks_a_worker_read_from_warm_and_cold_are_served_from_hot_to_the_next(pools, client, env):
    fp = new_fp()
    chain = unit_chain(fp, 6, tenant=TENANT, shape=SHAPE)
    hashes = [h for h, _ in chain]
    keys = [BlockKey.of(fp, h, tenant_tag(TENANT)) for h in hashes]
    tiers = TierClient.from_config(env.tier_cfg())
    await tiers.start()
    try:
        # Where a pool's demotions and archival leave blocks: the first three in warm, the rest in cold
        # only. The pool finds them by its index rebuild at start, and holds none in memory.
        for i, (key, (_, data)) in enumerate(zip(keys, chain)):
            assert await (tiers.warm if i < 3 else tiers.cold).put(key, data)
        pool = await pools.start()
        await wait_until_async(lambda: all(pool.core.index.tiers_of(k) for k in keys), 5.0, "the rebuild indexing them")
        assert (await client.lookup(fp, hashes)).tiers == b"wwwccc"

        first = worker_loader(client, tiers, fp)
        warm_hits, cold_hits = tiers.warm.hits, tiers.cold.hits
        loaded = await first.load(hashes, num_local=0, tenant=TENANT)
        assert [h for h, _ in loaded] == hashes
        assert (tiers.warm.hits - warm_hits, tiers.cold.hits - cold_hits) == (3, 3)  # read directly
        # The report goes on its own within FLUSH_INTERVAL_S; the pool reads each block again and
        # promotes it as a get would: into hot, and a cold one into warm too.
        await wait_until_async(lambda: all(pool.core.index.tiers_of(k) & HOT for k in keys), 10.0,
                               "the blocks the worker read directly promoted into hot")
        await pool.drain_background()
        assert [pool.core.index.tiers_of(k) & (WARM | COLD) for k in keys] == [WARM] * 3 + [WARM | COLD] * 3
        assert pool.core.counters.worker_hits == 6 and pool.core.counters.promotions == 9  # 6 hot, 3 warm
        assert (await client.lookup(fp, hashes)).tiers == b"hhhhhh"

        # Another worker wanting the same blocks now: from the pool's hot tier, none from warm or cold.
        nc = await nats.connect(env.nats_url)
        try:
            second = worker_loader(PoolClient(nc, worker_id="w-second", lookup_timeout_s=2.0), tiers, fp)
            warm_hits, cold_hits = tiers.warm.hits, tiers.cold.hits
            again = await second.load(hashes, num_local=0, tenant=TENANT)
            assert [h for h, _ in again] == hashes
            assert (tiers.warm.hits - warm_hits, tiers.cold.hits - cold_hits) == (0, 0)
            assert pool.core.counters.hot_hits >= 6
            for (_, tensor), (_, data) in zip(again, chain):  # the very bytes stored (compared as bytes: NaNs)
                expected = torch.frombuffer(bytearray(decode(data, key=ru_key()).payload), dtype=torch.uint8)
                assert torch.equal(tensor.flatten().view(torch.uint8), expected)
            await second.flush_hits()
        finally:
            await nc.close()
        assert pool.core.counters.worker_hits == 6  # hot hits are not reported
    finally:
        await tiers.close()
