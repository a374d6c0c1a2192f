"""The workers' tier hits in the ru-pool (kite_ru_pool.worker_hits): the pure plan (each block once, none
hot already, bounded) and the promotions it queues, over the pool's real parts with a cold tier in a folder
and no bus: a reported block ends up hot by the get's own promotion path, at most PROMOTION_READS reads at
once, nothing beyond MAX_WAITING, nothing of an invalidated model. Over real NATS, Redis and S3 with a
worker's PoolLoader: tests/integration/test_ru_pool_worker_hits.py."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from kite_ru_pool.core import PoolCore
from kite_ru_pool.index import COLD, HOT
from kite_ru_pool.worker_hits import MAX_WAITING, PROMOTION_READS, Reported, plan_promotions
from kite_shared.recyclable_unit import RecyclableUnit
from kite_shared.security import ANONYMOUS_TENANT_TAG
from kite_shared.tiers.client import TierClient
from kite_shared.tiers.cold import LocalDirTier
from kite_shared.tiers.keys import BlockKey, model_tag

KEY = b"k" * 32
FP = "66" * 32
NOW = 1000.0
T = ANONYMOUS_TENANT_TAG


def block(i: int, fp: str = FP, tenant: str = T) -> Reported:
    return Reported(fp, i.to_bytes(32, "big"), tenant, COLD)


# --- the plan (pure) ------------------------------------------------------------------------------------------

def test_the_bounds_are_the_documented_ones():
    assert (MAX_WAITING, PROMOTION_READS) == (1024, 8)


def test_each_block_is_planned_once_and_none_that_is_hot():
    hot = {block(1)}
    queued = {block(2)[:3]}
    reported = [block(0), block(1), block(2), block(0), block(3), block(0, fp="77" * 32), block(0, tenant="f" * 16)]
    plan = plan_promotions(reported, lambda b: b in hot, queued, room=100)
    assert plan.wanted == [block(0), block(3), block(0, fp="77" * 32), block(0, tenant="f" * 16)]
    assert (plan.num_hot, plan.num_queued, plan.num_dropped) == (1, 2, 0)  # block 2 queued, block 0 twice


def test_beyond_the_room_blocks_are_dropped_and_counted():
    plan = plan_promotions([block(i) for i in range(5)], lambda b: b == block(0), set(), room=2)
    assert plan.wanted == [block(1), block(2)] and (plan.num_hot, plan.num_dropped) == (1, 2)
    assert plan_promotions([block(0)], lambda b: False, set(), room=0).num_dropped == 1


# --- the promotions, over the pool's parts ---------------------------------------------------------------------

def unit(i: int) -> tuple[bytes, bytes]:
    h = hashlib.sha256(FP.encode() + bytes([i])).digest()
    u = RecyclableUnit(block_hash=h, parent_hash=b"\0" * 32, model_fingerprint=FP, block_index=i, num_tokens=16,
                       codec="fp16", shape=(1, 2, 1, 16, 1), payload=bytes(range(64)))
    return h, u.encode(key=KEY)


class GatedCold(LocalDirTier):
    """A cold tier in a folder whose reads wait for `gate`, counting how many wait at once."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.gate = asyncio.Event()
        self.reading = 0
        self.most_reading = 0

    async def get_unit(self, *args, **kwargs):
        self.reading += 1
        self.most_reading = max(self.most_reading, self.reading)
        try:
            await self.gate.wait()
            return await super().get_unit(*args, **kwargs)
        finally:
            self.reading -= 1


@pytest.fixture
async def pool(tmp_path: Path):
    """A pool with room for 64 units in hot, over a cold tier in a folder holding units 0..63 (indexed as
    cold only, as archival leaves them)."""
    cold = GatedCold(tmp_path / "cold")
    cold.ru_key = KEY
    tiers = TierClient(None, cold)
    size = len(unit(0)[1])
    core = PoolCore(hot_bytes=64 * size, archive_after_s=100.0, warm_ttl_s=60.0, cold_ttl_s=0.0,
                    sweep_interval_s=1.0, has_warm=False, has_cold=True, tiers=tiers, ru_key=KEY, clock=lambda: NOW)
    for i in range(64):
        h, data = unit(i)
        assert await cold.put(BlockKey.of(FP, h), data)
        core.index.note_stored(BlockKey.of(FP, h), COLD, len(data), NOW)
    yield core, cold
    cold.gate.set()
    await core.background.drain()
    await tiers.close()


async def test_a_reported_cold_block_is_promoted_into_hot_and_then_skipped(pool):
    core, cold = pool
    cold.gate.set()
    hashes = [unit(i)[0] for i in range(3)]
    plan = core.worker_hits.reported(FP, T, hashes, b"ccc")
    assert len(plan.wanted) == 3
    await core.background.drain()
    assert [core.index.tiers_of(BlockKey.of(FP, h)) for h in hashes] == [COLD | HOT] * 3
    assert core.io.hot.peek(BlockKey.of(FP, hashes[0])) is not None
    assert core.counters.promotions == 3 and core.counters.worker_hits == 3
    assert core.worker_hits.num_queued == 0
    again = core.worker_hits.reported(FP, T, hashes, b"ccc")  # hot now: nothing to read
    assert again.wanted == [] and again.num_hot == 3
    assert core.reads.lookup(FP, hashes).tiers == b"hhh"  # the next request reads them from hot


async def test_promotions_read_at_most_eight_at_once_and_queue_at_most_max_waiting(pool):
    core, cold = pool
    core.worker_hits.max_waiting = 20
    hashes = [unit(i)[0] for i in range(30)]
    plan = core.worker_hits.reported(FP, T, hashes, b"c" * 30)
    assert len(plan.wanted) == 20 and plan.num_dropped == 10 and core.counters.worker_hits_dropped == 10
    for _ in range(10):
        await asyncio.sleep(0)
    assert cold.reading == PROMOTION_READS
    assert core.worker_hits.reported(FP, T, hashes[:20], b"c" * 20).num_queued == 20  # waiting already: once
    cold.gate.set()
    await core.background.drain()
    assert cold.most_reading == PROMOTION_READS
    assert sum(bool(core.index.tiers_of(BlockKey.of(FP, h)) & HOT) for h in hashes) == 20
    assert core.worker_hits.num_queued == 0
    # room again: the dropped ones are taken when reported again
    assert len(core.worker_hits.reported(FP, T, hashes[20:], b"c" * 10).wanted) == 10


async def test_nothing_is_read_for_an_invalidated_model_or_a_block_no_tier_has(pool):
    core, cold = pool
    cold.gate.set()
    core.catalog.invalidate_tag(model_tag(FP))
    core.worker_hits.reported(FP, T, [unit(0)[0]], b"c")
    core.worker_hits.reported("77" * 32, T, [b"\1" * 32], b"w")  # unknown, and no warm tier to ask
    await core.background.drain()
    assert core.counters.promotions == 0 and cold.most_reading == 0


async def test_a_block_the_index_does_not_know_yet_is_read_where_the_worker_found_it(pool):
    """Another replica's archival not heard yet: the worker's word is enough to ask that tier."""
    core, cold = pool
    cold.gate.set()
    h, data = unit(100)
    assert await cold.put(BlockKey.of(FP, h), data)
    assert core.index.tiers_of(BlockKey.of(FP, h)) == 0
    core.worker_hits.reported(FP, T, [h], b"c")
    await core.background.drain()
    assert core.index.tiers_of(BlockKey.of(FP, h)) == COLD | HOT  # no warm tier here to copy it to
