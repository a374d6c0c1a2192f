"""ru-pool reads (kite_ru_pool.reads) over the pool's parts: longest-prefix lookups per tier, only the
tiers that are up, one model's blocks only, and their speed. Gets: test_ru_pool_handlers.py (hot-only,
no bus), test_ru_pool_layering.py (hot and cold) and tests/integration/test_ru_pool_{service,tiers}.py."""

import time

from kite_ru_pool.core import PoolCore
from kite_ru_pool.index import COLD, HOT, WARM
from kite_shared.tiers.keys import BlockKey

FP = "11" * 32
FP2 = "22" * 32
CHAIN = [bytes([i]) * 32 for i in range(1, 9)]  # 8 blocks


def core(**kw) -> PoolCore:
    args = dict(hot_bytes=1 << 20, archive_after_s=100.0, warm_ttl_s=60.0, cold_ttl_s=1000.0,
                sweep_interval_s=1.0, has_warm=True, has_cold=True)
    args.update(kw)
    return PoolCore(**args)


def store(c: PoolCore, i: int, tier: int, fp: str = FP) -> None:
    c.index.note_stored(BlockKey.of(fp, CHAIN[i]), tier, 100, now=0.0)


def test_prefix_per_tier_counts_leading_blocks_in_that_tier_only():
    c = core()
    for i in range(5):
        store(c, i, WARM)
    for i in range(3):
        store(c, i, HOT)
    store(c, 3, COLD)
    store(c, 6, COLD)  # after a gap (block 5 is nowhere): not part of any prefix
    store(c, 0, COLD)
    r = c.reads.lookup(FP, CHAIN)
    assert (r.hot, r.warm, r.cold, r.pool) == (3, 5, 1, 5)
    assert r.tiers == b"hhhww"  # cheapest tier of each block of the pool prefix
    assert not r.invalidated


def test_tiers_that_are_down_are_left_out():
    c = core()
    for i in range(4):
        store(c, i, WARM)
    store(c, 0, HOT)
    r = c.reads.lookup(FP, CHAIN, up=HOT | COLD)
    assert (r.hot, r.warm, r.cold, r.pool) == (1, 0, 0, 1)
    assert r.tiers == b"h"


def test_other_models_blocks_do_not_count():
    c = core()
    for i in range(4):
        store(c, i, WARM, fp=FP2)
    r = c.reads.lookup(FP, CHAIN)
    assert (r.hot, r.warm, r.cold, r.pool) == (0, 0, 0, 0)
    assert c.reads.lookup(FP2, CHAIN).warm == 4


def test_lookup_of_128_blocks_is_fast():
    c = core()
    chain = [i.to_bytes(32, "big") for i in range(128)]
    for h in chain:
        c.index.note_stored(BlockKey.of(FP, h), WARM | HOT, 369_000, now=0.0)
    for w in range(8):
        c.worker_events.stored(f"w{w}", FP, chain[:64], seq=0, now=0.0)
    started = time.perf_counter()
    for _ in range(200):
        r = c.reads.lookup(FP, chain)
    per_lookup = (time.perf_counter() - started) / 200
    assert r.pool == 128 and r.workers["w0"] == 64
    assert per_lookup < 0.0005, per_lookup  # the whole budget is 2 ms p99 including NATS
