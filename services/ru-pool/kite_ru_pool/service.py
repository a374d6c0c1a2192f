"""The ru-pool service: builds the pool from its parts, starts and stops it.

    handlers.PoolHandlers   the Endpoint table (decode -> core / tier I/O -> reply), hand-off files
      admin.PoolAdmin       kite pool stats / clear / purge / evict / pin / unpin
      maintenance.Maintenance   index rebuild, warm resync, purges, the lifecycle sweep
        tier_io.TierIO      puts, gets, moves between tiers, verification
          core.PoolCore     the pure core (index, tenants, hot tier, worker caches, lifecycle)
    background.BackgroundTasks   the writes that run after a reply (waited for on stop)
    telemetry               PoolTelemetry and the event-loop lag probe

Boundary: wiring and lifecycle only. The subscriptions and periodic work (sweep, telemetry, lag probe,
hand-off sweep) go through a kite_shared.service.ServiceRuntime, which owns them and ends them on drain;
`stop` ends them first anyway, so the pool stops taking work before it finishes its background writes
and closes the tier clients.

One replica per deployment: the index is in this process, rebuilt from warm (Redis SCAN) and cold
(object listing) at start and after warm comes back from an outage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from nats.aio.client import Client as NATS

from kite_shared import security, subjects
from kite_shared.config import CommonConfig, RuPoolConfig, TierConfig, load
from kite_shared.messages import PoolAdminReply, PoolGetReply
from kite_shared.service import ServiceRuntime
from kite_shared.tiers import handoff
from kite_shared.tiers.client import TierClient
from kite_ru_pool.admin import PoolAdmin
from kite_ru_pool.background import BackgroundTasks
from kite_ru_pool.core import PoolCore
from kite_ru_pool.handlers import PoolHandlers
from kite_ru_pool.maintenance import Maintenance
from kite_ru_pool.telemetry import pool_telemetry, probe_loop_lag
from kite_ru_pool.tier_io import TierIO

log = logging.getLogger(__name__)

HANDOFF_SWEEP_INTERVAL_S = 10.0


class PoolService:
    def __init__(self, cfg: RuPoolConfig, tier_cfg: TierConfig, nc: NATS,
                 tiers: TierClient | None = None, clock: Callable[[], float] = time.time,
                 ru_key: bytes | None = None, instance_id: str = "ru-pool", freeze_gc: bool = False) -> None:
        """`instance_id` names its telemetry; `freeze_gc`: keep the cyclic GC off the index
        (kite_ru_pool.gc_freeze); only the pool's own process sets it, so pools started inside a test
        runner leave the runner's GC alone."""
        self.cfg = cfg
        self.instance_id = instance_id
        self.nc = nc
        # Every unit put or moved must carry a valid HMAC under the cluster key (default: this process's).
        self.ru_key = ru_key if ru_key is not None else security.ru_key()
        self.tiers = tiers if tiers is not None else TierClient.from_config(tier_cfg, ru_key=self.ru_key)
        self.warm = self.tiers.warm
        self.cold = self.tiers.cold
        self.clock = clock
        self.core = PoolCore(cfg.hot_bytes, cfg.archive_after_s, tier_cfg.warm_ttl_s, tier_cfg.cold_ttl_s,
                             cfg.sweep_interval_s, has_warm=self.warm is not None,
                             has_cold=self.cold is not None, tenant_quota_bytes=cfg.tenant_quota_bytes,
                             tenant_quotas={security.tenant_tag(name): quota
                                            for name, quota in cfg.tenant_quota_overrides().items()})
        # Same-host readers get hot blocks as files in memory rather than through NATS (tiers.handoff).
        self.host_id = handoff.host_id()
        self.handoff = handoff.open_folder(cfg.handoff_dir)
        self.background = BackgroundTasks()
        self.io = TierIO(self.core, self.tiers, self.ru_key, clock, self.background)
        self.maintenance = Maintenance(self.core, self.io, self.tiers, clock, self.background,
                                       cfg.sweep_interval_s, freeze_gc)
        self.admin = PoolAdmin(self.core, self.io, self.maintenance)
        self.handlers = PoolHandlers(self.core, self.io, self.admin, self.maintenance, nc, self.handoff,
                                     self.host_id, clock)
        self._subs: list = []
        self._tasks: list[asyncio.Task] = []

    @property
    def rebuilding(self) -> bool:
        """True until the index has learned what warm and cold hold."""
        return self.io.rebuilding

    # --- lifecycle of the service ------------------------------------------------------------------------
    async def start(self, rt: ServiceRuntime | None = None) -> None:
        """Connect the tiers, start the index rebuild, serve the handler table, start the periodic work.

        `rt` is the process's runtime (kite_ru_pool.__main__). Without one (tests, a pool inside another
        process) a runtime over `self.nc` serves and schedules the same way; the connection stays its
        owner's to close."""
        rt = rt or _runtime_over(self.nc, self.instance_id)
        await self.tiers.start()
        self.maintenance.start_rebuild()
        self._subs = await rt.serve(*self.handlers.endpoints())
        self._tasks = [
            # the sweep waits for its interval itself (or for warm coming back): back to back
            rt.every(0.0, self.maintenance.sweep_when_due, "lifecycle sweep"),
            # issue 4: how late the event loop runs (kite_pool_event_loop_lag_seconds)
            rt.every(0.0, probe_loop_lag, "event-loop lag probe"),
            # issue 5: tier health, fill and hit rates for the arbitrator, every KITE_TELEMETRY_INTERVAL_S
            rt.publish_every(self.cfg.telemetry_interval_s, subjects.telemetry("ru-pool"),
                             lambda: pool_telemetry(self, self.instance_id)),
        ]
        if self.handoff is not None:
            self._tasks.append(rt.every(HANDOFF_SWEEP_INTERVAL_S, self.handlers.sweep_handoff,
                                        "hand-off folder sweep"))

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop taking work, end the periodic work, let background writes finish (bounded), close the
        tier clients. The runtime's drain callback in the pool's process."""
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # connection already closing: nothing more to unsubscribe
                log.debug("unsubscribe failed: %r", exc)
        self._subs = []
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        unfinished = await self.background.finish(timeout_s)
        if unfinished:
            log.warning("stopped with %d background tier operations unfinished", unfinished)
        await self.tiers.close()
        if self.handoff is not None:
            self.handoff.remove()

    async def drain_background(self) -> None:
        """Wait until no background tier operation is running (tests and benchmarks)."""
        await self.background.drain()

    # --- the parts' entry points, for tests, benchmarks and the telemetry -----------------------------------
    def stats(self, tenant_tag: str | None = None, exact_totals: bool = True,
              with_tenants: bool = True) -> PoolAdminReply:
        return self.admin.stats(tenant_tag, exact_totals, with_tenants)

    def put_bytes(self, data: bytes) -> str:
        return self.io.put_bytes(data)

    async def get_blocks(self, model_fingerprint: str, hashes: list[bytes], budget: int,
                         tenant_tag: str = security.ANONYMOUS_TENANT_TAG) -> PoolGetReply:
        return await self.io.get_blocks(model_fingerprint, hashes, budget, tenant_tag)

    async def sweep_once(self) -> None:
        await self.maintenance.sweep_once()


def _runtime_over(nc: NATS, instance_id: str) -> ServiceRuntime:
    """A runtime over a connection someone else owns: it serves and runs periodic work like the process's
    own, and is never started or shut down (PoolService.stop ends what it started)."""
    rt = ServiceRuntime("ru-pool", load(CommonConfig, environ={}, instance_id=instance_id))
    rt.nc = nc
    return rt
