"""The ru-pool sweep walked in slices (lifecycle.SweepPass, issue 4): same decisions as one whole-index pass,
bounded work per step, defined behaviour when the index changes between steps; the tier totals; the GC
freeze policy and the event-loop lag probe."""

from __future__ import annotations

import asyncio
import gc
import random
import time

import pytest

from kite_ru_pool.core import PoolCore
from kite_ru_pool.index import COLD, HOT, TIER_BITS, WARM
from kite_ru_pool.lifecycle import Archive, ExpireCold, RenewWarm
from kite_ru_pool.gc_freeze import IndexGcFreezer
from kite_ru_pool.telemetry import loop_lag_probe
from kite_shared.tiers.keys import BlockKey
from tests.helpers import wait_until_async

FPS = ["33" * 32, "44" * 32, "55" * 32]


def key(i: int, fp: str = FPS[0]) -> BlockKey:
    return BlockKey.of(fp, i.to_bytes(4, "big") * 8)


def core(**kw) -> PoolCore:
    args = dict(hot_bytes=1 << 30, archive_after_s=100.0, warm_ttl_s=60.0, cold_ttl_s=1000.0,
                sweep_interval_s=5.0, has_warm=True, has_cold=True)
    args.update(kw)
    return PoolCore(**args)


def reference_sweep(c: PoolCore, now: float, warm_up: bool, cold_up: bool) -> list:
    """The sweep as it was before issue 4 (sort every entry, then decide): the specification."""
    candidates = []
    for tag, models in c.index.models.items():
        if c.index.is_tag_invalidated(tag):
            continue
        for h, e in models.items():
            candidates.append((e.last_hit, e.key(tag, h), e))
    candidates.sort(key=lambda x: (x[0], x[1]))
    actions = []
    for last_hit, k, e in candidates:
        if c.index.is_pinned(k):
            continue
        idle = now - last_hit
        if e.tiers & WARM and warm_up:
            if idle >= c.maintenance.archive_after_s and c.io.has_cold and cold_up:
                actions.append(Archive(k, bool(e.tiers & COLD)))
            elif now - e.warm_touch >= c.maintenance.warm_ttl_s - c.maintenance.renew_margin_s:
                actions.append(RenewWarm(k))
        elif e.tiers == COLD and cold_up and c.maintenance.cold_ttl_s > 0 and idle >= c.maintenance.cold_ttl_s:
            actions.append(ExpireCold(k))
    return actions


def reference_totals(c: PoolCore) -> dict[str, tuple[int, int]]:
    totals = {name: [0, 0] for name in TIER_BITS}
    for models in c.index.models.values():
        for e in models.values():
            for name, bit in TIER_BITS.items():
                if e.tiers & bit:
                    totals[name][0] += 1
                    totals[name][1] += e.size
    totals["hot"] = [len(c.io.hot), c.io.hot.bytes_used]
    return {k: (v[0], v[1]) for k, v in totals.items()}


def random_core(rng: random.Random, n: int, **kw) -> PoolCore:
    c = core(**kw)
    for i in range(n):
        fp = rng.choice(FPS)
        k = key(i, fp)
        choice = rng.random()
        if choice < 0.2:
            c.writes.put_hot(k, bytes(rng.randint(1, 50)), now=rng.choice([0.0, 500.0, 900.0]))
        tiers = rng.choice([WARM, COLD, WARM | COLD, WARM, COLD])
        # coarse times, so many entries tie on last hit and order falls to the key
        c.index.note_stored(k, tiers, rng.randint(1, 100), now=float(rng.randrange(0, 1000, 50)),
                      last_hit=float(rng.randrange(0, 1000, 100)))
        if rng.random() < 0.05:
            c.catalog.pin(fp, [k.block_hash])
    return c


@pytest.mark.parametrize("seed", range(6))
def test_sliced_sweep_decides_exactly_what_the_whole_index_sweep_did(seed):
    rng = random.Random(seed)
    c = random_core(rng, 600)
    if seed % 2:
        c.catalog.invalidate_tag(key(0, FPS[1]).model_tag)  # invalidated tags are the purge's business
    for now in (50.0, 700.0, 1500.0, 3000.0):
        for warm_up, cold_up in ((True, True), (True, False), (False, True)):
            expected = reference_sweep(c, now, warm_up, cold_up)
            assert c.maintenance.sweep(now, warm_up, cold_up) == expected
            for step in (1, 7, 64, 599, 10_000):
                sweep = c.maintenance.begin_sweep(now, warm_up, cold_up)
                steps = 1
                while not sweep.step(step):
                    steps += 1
                assert sweep.actions() == expected, (now, warm_up, cold_up, step)
                assert sweep.examined == c.index.num_blocks()
                assert steps >= -(-c.index.num_blocks() // step)  # never more than `step` entries at once
                assert sweep.tier_totals() == c.maintenance.tier_totals()
    assert any(isinstance(a, Archive) for a in c.maintenance.sweep(3000.0, True, True))


def test_step_examines_at_most_the_budget_and_reports_done():
    c = core()
    for i in range(10):
        c.index.note_stored(key(i), WARM, 1, now=0.0)
    sweep = c.maintenance.begin_sweep(45.0, True, True)
    assert not sweep.step(4) and sweep.examined == 4
    assert not sweep.step(4) and sweep.examined == 8
    assert sweep.step(4) and sweep.examined == 10 and sweep.done
    assert sweep.step(4) and sweep.examined == 10  # nothing left: stays done
    assert sweep.actions() == [RenewWarm(key(i)) for i in range(10)]


def test_empty_index_sweeps_in_one_step():
    c = core()
    sweep = c.maintenance.begin_sweep(10.0, True, True)
    assert sweep.step(1) and sweep.actions() == []
    assert sweep.tier_totals() == {"hot": (0, 0), "warm": (0, 0), "cold": (0, 0)}


def test_index_changes_between_steps():
    c = core(warm_ttl_s=10_000.0)  # no lease renewals in this test
    for i in range(6):
        c.index.note_stored(key(i), WARM, 10, now=0.0)  # all idle past archival at t=200
    c.index.note_stored(key(100, FPS[1]), WARM, 10, now=0.0)
    sweep = c.maintenance.begin_sweep(200.0, True, True)
    assert not sweep.step(2)  # 0 and 1 examined (insertion order)
    c.index.note_missing(key(2), WARM)  # dropped before it was examined: skipped
    c.index.note_hit(key(3), now=150.0)  # hit before it was examined: not idle enough any more
    c.index.note_hit(key(0), now=150.0)  # hit after it was examined: archived anyway (next sweep sees it)
    c.catalog.pin(FPS[0], [key(4).block_hash])  # pinned before it was examined: kept
    c.index.note_stored(key(6), WARM, 10, now=0.0)  # added after the tag's snapshot: next sweep
    c.catalog.invalidate_tag(key(100, FPS[1]).model_tag)  # invalidated before its tag was reached: skipped
    while not sweep.step(2):
        pass
    assert sweep.actions() == [Archive(key(0), cold_has_it=False), Archive(key(1), cold_has_it=False),
                               Archive(key(5), cold_has_it=False)]
    assert c.maintenance.sweep(200.0, True, True) == [
        Archive(key(1), cold_has_it=False), Archive(key(5), cold_has_it=False), Archive(key(6), cold_has_it=False)]


def test_a_tag_cleared_and_refilled_mid_pass_is_left_to_the_next_sweep():
    c = core()
    for i in range(4):
        c.index.note_stored(key(i), WARM, 10, now=0.0)
    sweep = c.maintenance.begin_sweep(200.0, True, True)
    assert not sweep.step(1)
    c.catalog.forget_tag(key(0).model_tag)  # an admin clear: the old entries are gone
    c.index.note_stored(key(9), WARM, 10, now=0.0)  # and a new put makes a new dict for the tag
    assert sweep.step(100)
    assert sweep.actions() == [Archive(key(0), cold_has_it=False)]  # only what it examined before


def test_tier_totals_count_each_tier_a_block_is_in():
    c = random_core(random.Random(42), 300)
    c.index.note_stored(key(1000), WARM, 7, now=1.0)
    c.writes.put_hot(key(1001), b"x" * 9, now=1.0)
    assert c.maintenance.tier_totals() == reference_totals(c)
    totals = c.maintenance.tier_totals()
    assert totals["hot"] == (len(c.io.hot), c.io.hot.bytes_used)
    assert set(totals) == {"hot", "warm", "cold"} and totals["warm"][0] > 0 and totals["cold"][0] > 0


def test_sweep_totals_follow_what_the_pass_examined():
    c = core()
    c.index.note_stored(key(1), WARM, 10, now=0.0)
    c.index.note_stored(key(2), COLD, 20, now=0.0)
    c.writes.put_hot(key(3), b"h" * 5, now=0.0)
    sweep = c.maintenance.begin_sweep(1.0, True, True)
    assert sweep.step()
    assert sweep.tier_totals() == {"hot": (1, 5), "warm": (1, 10), "cold": (1, 20)}
    assert sweep.tier_totals() == c.maintenance.tier_totals()
    assert HOT == TIER_BITS["hot"]


def test_gc_freezer_freezes_after_the_rebuild_and_after_a_quarter_of_growth():
    off = IndexGcFreezer(enabled=False)
    assert not off.due(10**6) and off.freeze(10**6) == 0.0 and off.frozen_at is None
    f = IndexGcFreezer(enabled=True, min_growth=100, growth=0.25)
    assert f.due(0)  # never frozen: the first call (after the rebuild) freezes
    before = gc.get_freeze_count()
    try:
        f.freeze(1000)
        assert f.frozen_at == 1000 and gc.get_freeze_count() >= before
        assert not f.due(1249)  # a quarter of 1000 is 250
        assert f.due(1250)
        f.freeze(1250)
        assert not f.due(1300)
        assert not f.due(200)  # shrinking lowers the mark ...
        assert f.frozen_at == 200
        assert not f.due(299) and f.due(300)  # ... and min_growth applies below 400
        assert f.maybe_freeze(300) >= 0.0 and f.frozen_at == 300
        assert f.maybe_freeze(301) == 0.0 and f.frozen_at == 300
    finally:
        gc.unfreeze()  # give the test runner its objects back


async def test_loop_lag_probe_sees_a_blocked_loop():
    # Waits by sample counts, not fixed sleeps: on a loaded machine a 5 ms probe may take far longer
    # than 5 ms to come round, and only the blocked loop's sample is what this test is about.
    seen: list[float] = []
    probe = asyncio.create_task(loop_lag_probe(0.005, seen.append))

    async def until_samples(count: int) -> None:
        await wait_until_async(lambda: len(seen), 10.0, f"the probe to take {count} samples",
                               done=lambda taken: taken >= count, interval_s=0.005)

    await until_samples(2)
    quiet = len(seen)
    time.sleep(0.06)  # hold the loop as a long synchronous walk would
    await until_samples(quiet + 1)
    probe.cancel()
    with pytest.raises(asyncio.CancelledError):
        await probe
    assert all(v >= 0.0 for v in seen)
    assert max(seen[quiet:]) >= 0.04
