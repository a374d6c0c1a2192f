"""Writes: what enters the pool and how it moves down. A put (verify, admit, make room under the tenant's
quota, store in hot, write through to warm), a worker's notice of units it wrote into warm itself (admit,
make room, index), the hot tier kept in step with the index (what hot takes is
indexed; what it evicts is demoted to warm, or cold when warm is off or down), the demotions' writes,
the deletions of dropped blocks, and the record of every change this replica makes to what warm and cold
hold: in the index, and in the change log for the other replicas (`record_stored`, `record_missing`,
`record_renewed`).

Boundary: part of the coordinating layer. It decides, and calls only the lower layers (index.BlockIndex
with its tenants.Tenants, tier_io.TierIO, the change log) and catalog.Catalog (to drop a quota's
victims); reads.py (promotions), maintenance.py (archival, renewals, resyncs) and admin.py (pins in
storage) call it, never the reverse. `admit_put`, `reserve_quota` and `put_hot` are pure and take `now`
(the fleet simulator drives them); `put_bytes` returns as soon as the unit is verified and in the hot
tier: writes run as background tasks (background.py), none waits on a slow tier longer than its timeout.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from kite_shared.tiers import metrics
from kite_shared.tiers.keys import BlockKey
from kite_ru_pool.background import BackgroundTasks
from kite_ru_pool.catalog import Catalog
from kite_ru_pool.counters import Counters
from kite_ru_pool.index import COLD, HOT, WARM, BlockIndex
from kite_ru_pool.index_changes import IndexChangeLog
from kite_ru_pool.lifecycle import Action, Demote, DropBlock
from kite_ru_pool.tenants import Tenants
from kite_ru_pool.tier_io import TierIO

log = logging.getLogger(__name__)

MAX_PENDING_WARM_WRITES = 256  # beyond this, write-through is skipped (demotion on eviction covers it)


class PoolWrites:
    def __init__(self, index: BlockIndex, tenants: Tenants, io: TierIO, catalog: Catalog,
                 changes: IndexChangeLog, counters: Counters, clock: Callable[[], float],
                 background: BackgroundTasks) -> None:
        self.index = index
        self.tenants = tenants
        self.io = io
        self.catalog = catalog
        # What this replica changes in warm and cold, for the other replicas (a disabled log: none).
        self.changes = changes
        self.counters = counters
        self.clock = clock
        self.background = background
        self._pending_warm_writes = 0
        self._writing: set[BlockKey] = set()  # write-throughs in flight
        self._dropped_while_writing: set[BlockKey] = set()  # ... whose block was dropped meanwhile

    # --- decisions (pure) -------------------------------------------------------------------------------
    def admit_put(self, key: BlockKey) -> str:
        """Decide what to do with an incoming unit: "store", "duplicate" or "invalidated"."""
        if self.index.is_tag_invalidated(key.model_tag):
            self.counters.refused_invalidated += 1
            return "invalidated"
        if self.index.tiers_of(key):
            self.counters.duplicates += 1
            return "duplicate"
        self.counters.puts += 1
        return "store"

    def reserve_quota(self, key: BlockKey, size: int) -> list[DropBlock] | None:
        """Make room under its tenant's quota for the new block `key` of `size` bytes (tenants.py): the
        blocks dropped (already gone from the index and hot; the caller deletes them from the tiers
        named), or None when the put must be refused."""
        victims = self.tenants.quota_victims(key.tenant_tag, size, self.index.evictable(key.tenant_tag, key))
        if victims is None:
            return None
        return [self.catalog.drop(tag, h) for tag, h in victims]

    def put_hot(self, key: BlockKey, data: bytes | memoryview, now: float,
                depth: int | None = None) -> list[Action]:
        """Store in hot (a put or a promotion), indexed as hot when it fits (a hit when it does not);
        returns the demotions for what that evicted."""
        hot = self.io.hot
        if self.index.is_pinned(key):
            hot.pin(key)
        if hot.put(key, data):
            self.index.note_stored(key, HOT, len(data), now, last_hit=now, depth=depth)
        else:
            self.counters.hot_refused += 1
            self.index.note_hit(key, now)
        return self._demotions()

    def _demotions(self) -> list[Action]:
        """Demotions for the evictions hot recorded since the last call: a block no slower tier holds
        goes to warm, or to cold when the pool has no warm tier."""
        actions: list[Action] = []
        for ev in self.io.hot.take_events():
            self.counters.hot_evictions += 1
            left = self.index.note_evicted(ev.key)
            if left is None or left & (WARM | COLD):
                continue  # unknown, or a slower tier already holds it: eviction loses nothing
            if self.io.has_warm:
                actions.append(Demote(ev.key, ev.data, WARM))
            elif self.io.has_cold:
                actions.append(Demote(ev.key, ev.data, COLD))
            else:
                self.index.drop_if_empty(ev.key)
        return actions

    def demotion_failed(self, key: BlockKey) -> None:
        """No slower tier took `key` on its way down: the pool no longer holds it."""
        self.counters.demotions_failed += 1
        self.index.drop_if_empty(key)

    # --- a put ---------------------------------------------------------------------------------------------
    def put_bytes(self, data: bytes) -> str:
        """Verify and store one encoded unit; returns the decision: "store", "duplicate", "invalidated",
        "corrupt" or "over_quota"."""
        unit = self.io.verify_put(data)
        if unit is None:
            return "corrupt"
        key = BlockKey.of(unit.model_fingerprint, unit.block_hash, unit.tenant_tag)
        decision = self._admit_with_room(key, len(data))
        if decision != "store":
            return decision
        data = bytes(data)
        self.store_hot(key, data, depth=unit.block_index)
        if self.io.warm is not None:
            if self._pending_warm_writes >= MAX_PENDING_WARM_WRITES:
                self.counters.warm_writes_dropped += 1
            else:
                self._pending_warm_writes += 1
                self.background.spawn(self._write_through(key, data, unit.block_index), "warm write-through")
        elif not self.index.tiers_of(key) & HOT and self.io.cold is not None:
            self.background.spawn(self.demote(Demote(key, data, COLD)), "cold write")
        return decision

    def _admit_with_room(self, key: BlockKey, size: int) -> str:
        """`admit_put`, then room under the tenant's quota for a block to store (its victims dropped and
        deleted); "over_quota" when its pinned blocks leave none."""
        decision = self.admit_put(key)
        if decision != "store":
            return decision
        drops = self.reserve_quota(key, size)
        if drops is None:
            metrics.POOL_QUOTA_REFUSED.inc()
            log.info("refused a block of tenant %s: its pinned blocks fill its quota of %d bytes",
                     key.tenant_tag, self.tenants.quota_of(key.tenant_tag))
            return "over_quota"
        if drops:
            metrics.POOL_QUOTA_EVICTIONS.inc(len(drops))
            self.changes.dropped(drop.key for drop in drops)
            for drop in drops:
                self.drop_stored(drop)
        return "store"

    # --- units a worker wrote into warm itself -----------------------------------------------------------
    def units_written(self, keys: list[BlockKey], sizes: list[int], depths: list[int]) -> list[str]:
        """A worker wrote these units into warm itself (messages.UnitsWritten): each is admitted as a put
        would be (a duplicate is only indexed as in warm too) and recorded as stored there, for this
        index and the other replicas'; the decision of each is returned. What the rules refuse
        (an invalidated model, a quota its pinned blocks fill) is deleted from warm again, in the
        background. Neither verified nor copied into hot: the unit never passes through this process
        (a reader verifies every unit it loads; a block read from warm is promoted by the readers'
        reports, worker_hits.py)."""
        decisions = []
        for key, size, depth in zip(keys, sizes, depths):
            decision = self._admit_with_room(key, size)
            decisions.append(decision)
            if decision in ("store", "duplicate"):
                self.record_stored(key, WARM, size, depth=depth)
                if self.index.is_pinned(key) and self.io.warm is not None:
                    self.background.spawn(self.io.warm.set_pinned(key, True), "pin of a block written to warm")
            elif self.io.warm is not None:
                self.background.spawn(self.io.warm.delete(key), "deletion of a refused block written to warm")
        return decisions

    def store_hot(self, key: BlockKey, data: bytes | memoryview, depth: int | None = None) -> bool:
        """`put_hot` now, counting its evictions and starting the demotions they need; what hot took
        moves into a hot file. True when hot holds the block."""
        before = self.counters.hot_evictions
        actions = self.put_hot(key, data, self.clock(), depth)
        evicted = self.counters.hot_evictions - before
        if evicted:
            metrics.TIER_EVICTIONS.labels("hot").inc(evicted)
        for action in actions:
            self.background.spawn(self.demote(action), "demotion")
        stored = bool(self.index.tiers_of(key) & HOT)
        if stored:
            metrics.TIER_BYTES.labels("hot", "write").inc(len(data))
            self.io.into_hot_file(key, data)
        return stored

    async def _write_through(self, key: BlockKey, data: bytes, depth: int) -> None:
        self._writing.add(key)
        try:
            data = await self.io.stored_form(key, data, "warm")
            if data is None:
                return
            if await self.io.warm.put(key, data, pinned=self.index.is_pinned(key)):
                if key in self._dropped_while_writing:
                    await self.io.warm.delete(key)  # a quota eviction or clear took it meanwhile
                    return
                self.record_stored(key, WARM, len(data), depth=depth)
            elif not self.index.tiers_of(key) and self.io.cold is not None:
                # Neither hot (did not fit) nor warm (down) holds it: keep it in cold rather than lose it.
                await self.demote(Demote(key, data, COLD))
        finally:
            self._pending_warm_writes -= 1
            self._writing.discard(key)
            self._dropped_while_writing.discard(key)

    async def demote(self, action: Demote) -> None:
        now = self.clock()
        io = self.io
        order = [(io.warm, WARM), (io.cold, COLD)] if action.tier == WARM else [(io.cold, COLD)]
        for tier, bit in order:
            if tier is None:
                continue
            data = await io.stored_form(action.key, action.data, tier.name)
            if data is None:
                break
            if await tier.put(action.key, data, pinned=self.index.is_pinned(action.key)):
                self.record_stored(action.key, bit, len(data), now)
                self.counters.demotions += 1
                metrics.TIER_DEMOTIONS.inc()
                return
        log.debug("demotion of %s failed: no slower tier took it", action.key.short())
        self.demotion_failed(action.key)

    # --- deletions ---------------------------------------------------------------------------------------
    def drop_stored(self, drop: DropBlock) -> asyncio.Task:
        """Delete a block the catalog just dropped (quota, tenant clear) from the tiers that held it, and
        from warm too if a write-through of it is still running."""
        if drop.key in self._writing:
            self._dropped_while_writing.add(drop.key)

        async def delete() -> None:
            for tier, bit in ((self.io.warm, WARM), (self.io.cold, COLD)):
                if tier is not None and drop.tiers & bit:
                    await tier.delete(drop.key)  # a tier that is down keeps it until TTL or a rebuild
        return self.background.spawn(delete(), "deletion of a dropped block")

    async def delete_everywhere(self, keys: list[BlockKey]) -> list[str]:
        """Delete these blocks from every remote tier, whatever the index believes, and from what a
        write-through in flight writes; returns the names of the tiers that were down (they keep their
        copies until their TTL, a later delete, or a rebuild indexes them)."""
        self._dropped_while_writing.update(key for key in keys if key in self._writing)
        return await self.io.delete_everywhere(keys)

    # --- the record of what warm and cold hold, as every replica's index keeps it ---------------------------
    def record_stored(self, key: BlockKey, tier: int, size: int, now: float | None = None,
                      last_hit: float | None = None, depth: int | None = None) -> None:
        """This replica wrote the block to a shared tier (WARM or COLD): the index notes it, and the
        change log tells the other replicas."""
        now = self.clock() if now is None else now
        self.index.note_stored(key, tier, size, now, last_hit=last_hit, depth=depth)
        e = self.index.entry(key)
        if e is not None:
            self.changes.stored(key, tier, size, e.last_hit, e.depth if depth is None else depth)

    def record_missing(self, key: BlockKey, tier: int) -> None:
        """This replica found a shared tier (WARM or COLD) without the block, or deleted it there."""
        self.index.note_missing(key, tier)
        self.changes.missing(key, tier)

    def record_renewed(self, key: BlockKey) -> None:
        """This replica renewed the block's warm lease."""
        now = self.clock()
        self.index.note_renewed(key, now)
        self.changes.renewed(key, now)
