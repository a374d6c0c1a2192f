"""The ru-pool's telemetry (issue 5): tier health, fill and hit rates, from `PoolService.stats()`."""

from __future__ import annotations

import asyncio
import logging

from kite_shared import subjects
from kite_shared.telemetry import PoolTelemetry

log = logging.getLogger(__name__)


def pool_telemetry(pool, instance_id: str) -> PoolTelemetry:
    stats = pool.stats()
    hits = sum(t.hits for t in stats.tiers.values())
    misses = sum(t.misses for t in stats.tiers.values())
    hot = stats.tiers.get("hot")
    capacity = pool.cfg.hot_bytes
    return PoolTelemetry(instance_id=instance_id, tiers=stats.tiers,
                         hot_fill=round(hot.bytes / capacity, 4) if hot and capacity else 0.0,
                         hit_rate=round(hits / (hits + misses), 4) if hits + misses else 0.0,
                         index_blocks=stats.counters.get("index_blocks", 0))


async def publish_loop(pool, instance_id: str, interval_s: float) -> None:
    """Every `interval_s`: PoolTelemetry on kite.v1.telemetry.ru-pool (never raises)."""
    while True:
        try:
            await pool.nc.publish(subjects.telemetry("ru-pool"), pool_telemetry(pool, instance_id).encode())
        except Exception as exc:  # reconnecting, or stats failed: the next one goes out
            log.debug("pool telemetry not sent: %s", exc)
        await asyncio.sleep(interval_s)
