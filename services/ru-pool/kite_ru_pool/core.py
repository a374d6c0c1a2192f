"""The ru-pool's core: its parts, built and wired once, without NATS. The service (service.py) serves it
through the handler table and the replica layer; the fleet simulator (kite_cli.simulate) drives its
synchronous methods directly, with `now` from its own clock.

Boundary: construction only; PoolCore has no behaviour of its own, and each part calls only those listed
after it here, so a request walks down once (docs/ru-pool.md, "Code"):

  coordinating layer (decides; each part calls the ones below it, never back up)
    worker_hits.WorkerHits      the workers' own warm and cold hits, promoted through reads
    reads.PoolReads             lookups and gets
    maintenance.Maintenance     index rebuild, warm resync, purges, the lifecycle sweep, leadership
    writes.PoolWrites           puts: admission, quota, hot, write-through, demotions; the record of
                                what warm and cold hold (index + change log)
    catalog.Catalog             pins, drops, clears, model invalidation, quarantine, others' changes
    worker_events.WorkerEvents  the workers' cache events, held while a snapshot comes
  lower layers (never call any part above them)
    index.BlockIndex            where each block lives; tenants.Tenants, its ledgers, below it
    tier_io.TierIO              the bytes of the hot, warm and cold tiers
    worker_caches.WorkerCaches  each worker's local cache
  records any part adds to: counters.Counters, namespaces.NamespaceAudit,
    index_changes.IndexChangeLog, background.BackgroundTasks
"""

from __future__ import annotations

import time
from typing import Callable

from kite_shared.tiers.client import TierClient
from kite_shared.tiers.handoff import HotFiles
from kite_ru_pool.background import BackgroundTasks
from kite_ru_pool.catalog import Catalog
from kite_ru_pool.counters import Counters
from kite_ru_pool.index import BlockIndex
from kite_ru_pool.index_changes import IndexChangeLog
from kite_ru_pool.maintenance import Maintenance
from kite_ru_pool.namespaces import NamespaceAudit
from kite_ru_pool.reads import PoolReads
from kite_ru_pool.tenants import Tenants
from kite_ru_pool.tier_io import TierIO
from kite_ru_pool.worker_caches import WorkerCaches
from kite_ru_pool.worker_events import WorkerEvents
from kite_ru_pool.worker_hits import WorkerHits
from kite_ru_pool.writes import PoolWrites


class PoolCore:
    def __init__(self, hot_bytes: int, archive_after_s: float, warm_ttl_s: float, cold_ttl_s: float,
                 sweep_interval_s: float, has_warm: bool, has_cold: bool, tenant_quota_bytes: int = 0,
                 tenant_quotas: dict[str, int] | None = None, *, tiers: TierClient | None = None,
                 ru_key: bytes = b"", clock: Callable[[], float] = time.time,
                 changes: IndexChangeLog | None = None, hot_files: HotFiles | None = None,
                 freeze_gc: bool = False) -> None:
        """`has_warm` / `has_cold`: the pool has that tier (`tiers` holds its client; without one, the
        caller carries out the writes, as the fleet simulator does). `tenant_quota_bytes`: every
        tenant's quota (0: none); `tenant_quotas`: overrides by tenant tag (kite_shared.security.
        tenant_tag), 0 meaning no quota for that tenant. `ru_key`: the cluster key every unit put or moved
        must be signed with. `changes`: the log of what this replica changes in warm and cold, for the
        other replicas (default: a disabled one). `freeze_gc`: see maintenance.Maintenance."""
        tiers = tiers if tiers is not None else TierClient(None, None)
        self.clock = clock
        self.counters = Counters()
        self.namespaces = NamespaceAudit()
        self.background = BackgroundTasks()
        self.changes = changes if changes is not None else IndexChangeLog(enabled=False)
        self.tenants = Tenants(tenant_quota_bytes, tenant_quotas)
        self.index = BlockIndex(self.tenants)
        self.io = TierIO(hot_bytes, tiers, ru_key, self.counters, self.background, has_warm, has_cold,
                         hot_files)
        self.workers = WorkerCaches()
        self.worker_events = WorkerEvents(self.workers, self.index, self.counters)
        self.catalog = Catalog(self.index, self.io, self.workers, self.namespaces, self.counters)
        self.writes = PoolWrites(self.index, self.tenants, self.io, self.catalog, self.changes, self.counters,
                                 clock, self.background)
        self.reads = PoolReads(self.index, self.io, self.workers, self.writes, self.namespaces, self.changes,
                               self.counters, clock, self.background)
        self.worker_hits = WorkerHits(self.index, self.reads, self.counters, self.background)
        self.maintenance = Maintenance(self.index, self.io, self.writes, self.catalog, self.worker_events,
                                       self.workers, self.changes, self.counters, clock, self.background,
                                       archive_after_s=archive_after_s, warm_ttl_s=warm_ttl_s,
                                       cold_ttl_s=cold_ttl_s, sweep_interval_s=sweep_interval_s,
                                       freeze_gc=freeze_gc)
