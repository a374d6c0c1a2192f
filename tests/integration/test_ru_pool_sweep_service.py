"""The ru-pool service's sweep on a larger index (issue 4): it walks the index in slices, letting other
work run in between, and the telemetry's warm/cold totals come from the last sweep instead of a walk of
their own. Real nats-server, redis-server and S3 (moto), as in test_ru_pool_service."""

from __future__ import annotations

import asyncio

from kite_ru_pool.index import COLD
from kite_ru_pool.maintenance import SWEEP_STEP_ENTRIES
from kite_ru_pool.telemetry import pool_telemetry
from kite_shared.tiers.keys import BlockKey
from tests.integration.test_ru_pool_service import env, new_fp, pools  # noqa: F401  (fixtures)


async def test_sweep_walks_the_index_in_slices_and_telemetry_reuses_its_totals(pools):  # noqa: F811
    pool = await pools.start(sweep_interval_s=3600.0)  # no sweeps but the ones this test runs
    fp = new_fp()
    n = 5 * SWEEP_STEP_ENTRIES + 1
    now = pool.clock()
    for i in range(n):  # recently hit cold-only blocks, no cold TTL: the sweep decides nothing
        pool.core.index.note_stored(BlockKey.of(fp, i.to_bytes(32, "big")), COLD, 100, now)

    turns = 0

    async def other_work() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)
    task = asyncio.create_task(other_work())
    await asyncio.sleep(0)
    turns = 0
    await pool.sweep_once()
    task.cancel()
    assert turns >= 5  # the walk let the loop run at least once per slice

    assert pool.stats(exact_totals=False).tiers["cold"].blocks == n
    pool.core.index.note_stored(BlockKey.of(fp, b"\xff" * 32), COLD, 100, now)
    assert pool.stats(exact_totals=False).tiers["cold"].blocks == n  # as of the last sweep
    assert pool.stats().tiers["cold"].blocks == n + 1  # the admin request still counts exactly
    await pool.sweep_once()
    telemetry = pool_telemetry(pool, "ru-pool-test")
    assert telemetry.tiers["cold"].blocks == n + 1 and telemetry.tiers["cold"].bytes == 100 * (n + 1)
    assert telemetry.index_blocks == n + 1
