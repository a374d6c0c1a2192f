"""ru-pool maintenance (kite_ru_pool.maintenance) without tiers or a bus: leadership as the replica layer
reports it, and what wakes a sweep before its interval (the lease taken, warm back up). The rebuild, the
resync, purges and the sweep's actions over real tiers: tests/integration/test_ru_pool_{service,
sweep_service,tiers}.py; leadership among replica processes: tests/integration/test_ru_pool_replicas.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from kite_ru_pool.core import PoolCore


def core() -> PoolCore:
    return PoolCore(hot_bytes=1 << 20, archive_after_s=100.0, warm_ttl_s=60.0, cold_ttl_s=0.0,
                    sweep_interval_s=60.0, has_warm=False, has_cold=False)


def test_a_pool_leads_alone_and_then_as_long_as_the_replica_layer_says_it_holds_the_lease():
    maintenance = core().maintenance
    assert maintenance.leading()  # no replica layer: nobody else could run the maintenance
    maintenance.lead(0.0)  # a replica layer that has not taken the lease
    assert not maintenance.leading()
    maintenance.lead(time.monotonic() + 60.0)
    assert maintenance.leading()
    maintenance.lead(time.monotonic() - 0.001)  # renewed a lease ago and not since: no longer
    assert not maintenance.leading()


async def test_a_sweep_comes_before_its_interval_when_woken_or_when_warm_comes_back():
    pool = core()
    maintenance = pool.maintenance
    maintenance.wake()  # the replica layer took the lease
    await asyncio.wait_for(maintenance.sweep_when_due(), 5.0)
    assert pool.counters.sweeps == 1
    pool.io.warm_back.set()  # what the warm tier's client does when it answers again
    await asyncio.wait_for(maintenance.sweep_when_due(), 5.0)
    assert pool.counters.sweeps == 2 and not pool.io.warm_back.is_set()  # the sweep took it in
    sweep = asyncio.create_task(maintenance.sweep_when_due())
    await asyncio.sleep(0.05)
    assert not sweep.done()  # nothing to wake it: it waits for its interval
    sweep.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sweep
