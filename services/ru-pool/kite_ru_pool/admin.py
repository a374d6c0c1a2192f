"""Admin: the operations of `kite pool` (PoolAdminRequest on kite.v1.pool.admin): stats, clear, purge,
evict, pin and unpin; and the stats that the telemetry reports too.

Boundary: the top of the coordinating layer, entered from the handler table (and `stats` from the
service's telemetry). It calls catalog.Catalog for what to forget or pin, writes.PoolWrites and
tier_io.TierIO for what that means in storage, maintenance.Maintenance for storage purges, the last
sweep's totals and whether this replica leads, and reads the replica layer's peers.Peers (how many
replicas; whether this one serves) for `stats`; none of them calls it. Refuses a request it cannot act on
by raising kite_shared.endpoints.Refusal (the handler table turns it into the reply); knows nothing of
NATS.

With replicas, an admin request is carried out by the replica that receives it (storage deletions and
purges included) and its effect on the index (clear, purge, evict, pin, unpin) is recorded in the index
change log for the others (docs/ru-pool.md, "Replicas"). `stats` is this replica's view: the shared
index, its own hot tier and counters, and how many replicas it sees.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from kite_shared import security
from kite_shared.endpoints import Refusal
from kite_shared.messages import ErrorInfo, PoolAdminReply, PoolAdminRequest, TenantUsage, TierStats
from kite_shared.tiers.keys import model_tag
from kite_shared.tiers.keys import BlockKey
from kite_ru_pool.core import PoolCore
from kite_ru_pool.index import COLD, HOT, WARM
from kite_ru_pool.peers import Peers

log = logging.getLogger(__name__)

MAX_TENANTS_IN_STATS = 1000  # the largest tenants by bytes; keeps an all-tenant stats reply far under max_payload


class PoolAdmin:
    def __init__(self, core: PoolCore, peers: Peers | None = None) -> None:
        """`peers`: the replica layer's view of the other replicas, whose counters `stats` adds (replicas,
        leader, serving); None for a pool without one."""
        self.core = core
        self.index = core.index
        self.io = core.io
        self.catalog = core.catalog
        self.writes = core.writes
        self.maintenance = core.maintenance
        self.changes = core.changes
        self.peers = peers

    async def handle(self, req: PoolAdminRequest) -> PoolAdminReply:
        tenant_tag = security.tenant_tag(req.tenant) if req.tenant else None
        if req.op == "stats":
            return self.stats(tenant_tag)
        if req.op in ("pin", "unpin", "evict", "purge") and not req.model_fingerprint:
            raise Refusal(ErrorInfo(code="bad_request", message=f"{req.op} needs model_fingerprint",
                                    param="model_fingerprint"))
        if req.op == "clear":
            return await self._clear(req, tenant_tag)
        if req.op == "purge":
            tag = model_tag(req.model_fingerprint)
            affected = len(self.index.keys_in(HOT | WARM | COLD, tag))
            self.catalog.invalidate_tag(tag)
            self.changes.invalidated(tag)
            await self.maintenance.purge_pending()
            return PoolAdminReply(ok=True, affected=affected)
        owner = tenant_tag or security.ANONYMOUS_TENANT_TAG
        if req.op == "evict":
            return await self._evict(req, owner)
        if req.op == "pin":
            keys = self.catalog.pin(req.model_fingerprint, req.block_hashes, owner)
            self.changes.pinned(keys)
            affected = 0
            for key, h in zip(keys, req.block_hashes):
                affected += await self._pin_storage(req.model_fingerprint, key, h)
            return PoolAdminReply(ok=True, affected=affected)
        keys = self.catalog.unpin(req.model_fingerprint, req.block_hashes, owner)
        self.changes.unpinned(keys)
        affected = 0
        for key in keys:
            affected += await self._unpin_storage(key)
        return PoolAdminReply(ok=True, affected=affected)

    async def _clear(self, req: PoolAdminRequest, tenant_tag: str | None) -> PoolAdminReply:
        tag = model_tag(req.model_fingerprint) if req.model_fingerprint else None
        self.changes.cleared(tag, tenant_tag)
        if tenant_tag is None:
            affected = self.catalog.forget_tag(tag)
        else:
            drops = self.catalog.forget_tenant(tenant_tag, tag)
            await asyncio.gather(*(self.writes.drop_stored(d) for d in drops), return_exceptions=True)
            affected = len(drops)
        await self.maintenance.purge_pending()
        return PoolAdminReply(ok=True, affected=affected)

    async def _evict(self, req: PoolAdminRequest, tenant_tag: str) -> PoolAdminReply:
        """Forget the blocks in the core (index, hot, pins, tenant ledger), then delete them from warm
        and cold whatever the index believed (a rebuild may not have indexed them yet; a write-through
        in flight deletes what it writes). `affected` counts the blocks the index held."""
        keys, held = self.catalog.evict(req.model_fingerprint, req.block_hashes, tenant_tag)
        self.changes.dropped(keys)
        down = await self.writes.delete_everywhere(keys)
        if down:  # a down tier keeps its copies until its TTL, a later evict, or a rebuild indexes them
            log.warning("evict of %d blocks: %s down, its copies were not deleted", len(keys),
                        ", ".join(down))
            return PoolAdminReply(ok=False, affected=held, error=ErrorInfo(
                code="tier_unavailable", message=f"tier(s) down, copies left there: {', '.join(down)}"))
        log.info("evicted %d blocks (%d indexed) of model %s", len(keys), held,
                 model_tag(req.model_fingerprint))
        return PoolAdminReply(ok=True, affected=held)

    async def _pin_storage(self, model_fingerprint: str, key: BlockKey, block_hash: bytes) -> int:
        """Make a pinned block survive restarts and expiry: keep it in warm without TTL (and hot).
        1 when the pool holds the block, else 0."""
        index, io = self.index, self.io
        tiers = index.tiers_of(key)
        if not tiers:
            return 0
        if io.warm is None:
            return 1
        if tiers & WARM:
            if await io.warm.set_pinned(key, True):
                return 1
            if not io.warm.up:
                return 1
            self.writes.record_missing(key, WARM)
            tiers = index.tiers_of(key)
        data = io.hot.peek(key)
        if data is None and tiers & COLD:
            found = await io.cold.get_unit(model_fingerprint, block_hash, key.tenant_tag)
            if found is not None:
                data = found[1]
                self.writes.store_hot(key, data)
        if data is not None:
            data = await io.stored_form(key, data, "warm", source="hot" if tiers & HOT else "cold")
        if data is not None and await io.warm.put(key, data, pinned=True):
            self.writes.record_stored(key, WARM, len(data))
        return 1 if index.tiers_of(key) else 0

    async def _unpin_storage(self, key: BlockKey) -> int:
        """Give an unpinned block its warm TTL back; 1 when the pool holds the block, else 0."""
        if self.io.warm is not None and self.index.tiers_of(key) & WARM:
            if await self.io.warm.set_pinned(key, False):
                self.writes.record_renewed(key)
        return int(bool(self.index.tiers_of(key)))

    def stats(self, tenant_tag: str | None = None, exact_totals: bool = True,
              with_tenants: bool = True) -> PoolAdminReply:
        """Tier and counter stats, and tenant usage (of `tenant_tag` only, when given).

        Warm and cold blocks/bytes walk the whole index; with `exact_totals=False` (the telemetry
        timer) they are the last sweep's count instead, or one walk's, kept until the next sweep.
        `with_tenants=False` (the telemetry timer too) leaves out the per-tenant usage."""
        core = self.core
        totals = self.maintenance.tier_totals() if exact_totals else self.maintenance.totals_as_of_last_sweep()
        c = core.counters

        def tier_stats(name: str, hits: int, misses: int, up: bool, integrity: int) -> TierStats:
            blocks, nbytes = totals[name]
            rate = hits / (hits + misses) if hits + misses else 0.0
            return TierStats(up=up, blocks=blocks, bytes=nbytes, hits=hits, misses=misses,
                             hit_rate=round(rate, 4), integrity_failures=integrity)

        tiers = {"hot": tier_stats("hot", c.hot_hits, c.hot_misses, True, 0)}
        for name, tier in (("warm", self.io.warm), ("cold", self.io.cold)):
            if tier is not None:
                tiers[name] = tier_stats(name, tier.hits, tier.misses, tier.up, tier.integrity_failures)
        counters = dataclasses.asdict(c)
        counters["rebuilding"] = int(self.index.rebuilding)
        counters["index_blocks"] = self.index.num_blocks()
        counters["worker_blocks"] = sum(core.workers.num_blocks().values())
        counters["pending_purges"] = len(self.index.pending_purges) + len(self.index.pending_tenant_purges)
        if self.peers is not None:
            counters.update(replicas=self.peers.num_replicas(), leader=int(self.maintenance.leading()),
                            serving=int(self.peers.serving))
        ledgers = core.tenants.usage(tenant_tag) if with_tenants else {}
        if with_tenants:
            counters["tenants"] = len(ledgers)
        largest = sorted(ledgers.items(), key=lambda item: -item[1].num_bytes)[:MAX_TENANTS_IN_STATS]
        tenants = {t: TenantUsage(blocks=ledger.num_blocks, bytes=ledger.num_bytes,
                                  quota_bytes=core.tenants.quota_of(t), quota_evictions=ledger.quota_evictions,
                                  quota_refused=ledger.quota_refused)
                   for t, ledger in largest}
        return PoolAdminReply(ok=True, tiers=tiers, counters=counters, tenants=tenants,
                              namespaces=core.namespaces.stats(self.catalog.blocks_by_tag()) if with_tenants else {})
