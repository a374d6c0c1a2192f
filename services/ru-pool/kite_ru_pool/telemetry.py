"""The ru-pool's telemetry (issue 5): tier health, fill and hit rates, from `PoolService.stats()`; and
the event-loop lag probe (issue 4) behind `kite_pool_event_loop_lag_seconds`.

Boundary: builds messages and observes a histogram; publishing and scheduling are the service runtime's
(kite_shared.service: `publish_every`, `every`), started by service.PoolService.start.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from prometheus_client import Histogram

from kite_shared.endpoints import run_every
from kite_shared.messages import PoolTelemetry

# Every handler shares one event loop, so anything that holds it (a long synchronous walk, a full GC
# pass) delays every request by as much. The probe sleeps LOOP_LAG_PROBE_S and records how late it
# wakes. A stall longer than the interval is always caught, a shorter one with probability
# (stall / interval). 10 wake-ups a second: a 10 ms probe (100 a second) was most of an idle pool's CPU,
# 15.7 ms a second on this 2-vCPU machine class (issue 38), for stalls the pool's benchmarks measure anyway.
LOOP_LAG_PROBE_S = 0.1
EVENT_LOOP_LAG = Histogram(
    "kite_pool_event_loop_lag_seconds",
    "How late the ru-pool's event loop woke a timer (probe every 100 ms): every request waiting then "
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


async def probe_loop_lag(interval_s: float = LOOP_LAG_PROBE_S,
                         observe: Callable[[float], None] = EVENT_LOOP_LAG.observe) -> None:
    """One probe: sleep `interval_s` and observe how late the wake-up was. The service runs probes back
    to back through its runtime (`rt.every(0, probe_loop_lag, ...)`)."""
    loop = asyncio.get_running_loop()
    due = loop.time() + interval_s
    await asyncio.sleep(interval_s)
    observe(max(0.0, loop.time() - due))


async def loop_lag_probe(interval_s: float = LOOP_LAG_PROBE_S,
                         observe: Callable[[float], None] = EVENT_LOOP_LAG.observe) -> None:
    """Probes back to back until cancelled, as the service runs them."""
    await run_every(0.0, lambda: probe_loop_lag(interval_s, observe), "event-loop lag probe")
