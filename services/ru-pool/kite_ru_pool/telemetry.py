"""The ru-pool's telemetry (issue 5): tier health, fill and hit rates, from `PoolService.stats()`; and
the event-loop lag probe (issue 4) behind `kite_pool_event_loop_lag_seconds`."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import Histogram

from kite_shared import subjects
from kite_shared.messages import PoolTelemetry

log = logging.getLogger(__name__)

# Every handler shares one event loop, so anything that holds it (a long synchronous walk, a full GC
# pass) delays every request by as much. The probe sleeps LOOP_LAG_PROBE_S and records how late it
# wakes: 100 wake-ups a second, about 1% of a core on an otherwise idle pool (2-vCPU VM). A stall
# shorter than the interval is caught with probability (stall / interval); longer ones always are.
LOOP_LAG_PROBE_S = 0.01
EVENT_LOOP_LAG = Histogram(
    "kite_pool_event_loop_lag_seconds",
    "How late the ru-pool's event loop woke a timer (probe every 10 ms): every request waiting then "
    "was delayed by about as much.",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0))


def pool_telemetry(pool, instance_id: str) -> PoolTelemetry:
    # Warm/cold block counts as of the last sweep: an exact count walks the whole index (docs/ru-pool.md).
    stats = pool.stats(exact_totals=False, with_tenants=False)
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


async def loop_lag_probe(interval_s: float = LOOP_LAG_PROBE_S, observe=EVENT_LOOP_LAG.observe) -> None:
    """Sleep `interval_s` again and again, observing how late each wake-up was (runs until cancelled)."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        observe(max(0.0, loop.time() - due))
