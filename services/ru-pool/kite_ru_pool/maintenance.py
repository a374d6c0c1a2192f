"""Maintenance: the work the pool does on its own, not asked by a request. The index rebuild from the
warm and cold listings at start, the warm resync after a Redis outage, storage purges of invalidated or
cleared blocks, forgetting silent workers, and the lifecycle sweep (archival warm -> cold, warm lease
renewal, cold expiry; decided by lifecycle.SweepPass) with the GC freeze that follows the index's growth.

Boundary: part of the coordinating layer. It calls the lower layers (index.BlockIndex, tier_io.TierIO:
listings, copies, deletions, verification of what it moves; worker_caches) and, below it in the same
layer, writes.PoolWrites (the record of what it changes in warm and cold), catalog.Catalog (pins found in
storage, purges done) and worker_events.WorkerEvents (forgetting silent workers); nothing it calls calls
it back. The service runs `sweep_when_due` again and again through its runtime (kite_shared.service), and
the rebuild and purges run in the background (background.py).

The index is rebuildable: a fresh pool (or one whose Redis came back empty) learns every stored block from
the tiers' key listings (size, owner, idle time, pin), so nothing here depends on the process that wrote
the blocks.

Replicas (docs/ru-pool.md, "Replicas"): the work on the shared tiers (archival, renewal, cold expiry,
purges, the warm re-listing after an outage) is the leader's only. Leadership is this module's state
(`leading`): the replica layer, which holds the lease over NATS, reports each renewal here (`lead`) and
wakes the sweep (`wake`, `changes_lost`); this module never calls it. What the leader changes goes to the
other replicas through the index change log (writes.PoolWrites' record_* methods). Every replica, leader
or not, rebuilds its own index at start, probes its own tier clients, forgets silent workers from its own
worker-cache index, rewrites its own hot blocks that warm lost, and walks its index at each sweep for the
telemetry's totals.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from kite_shared.tiers import metrics
from kite_shared.tiers.base import RemoteTier, TierUnavailable
from kite_shared.tiers.keys import BlockKey
from kite_ru_pool.background import BackgroundTasks
from kite_ru_pool.catalog import Catalog
from kite_ru_pool.counters import Counters
from kite_ru_pool.gc_freeze import IndexGcFreezer
from kite_ru_pool.index import ALL_TAGS, COLD, HOT, WARM, BlockIndex, fold_totals
from kite_ru_pool.index_changes import IndexChangeLog
from kite_ru_pool.lifecycle import Action, Archive, ExpireCold, RenewWarm, SweepPass
from kite_ru_pool.tier_io import FETCH_CONCURRENCY, TierIO
from kite_ru_pool.worker_caches import WorkerCaches
from kite_ru_pool.worker_events import WorkerEvents
from kite_ru_pool.writes import PoolWrites

log = logging.getLogger(__name__)

WORKER_FORGET_AFTER_S = 30.0  # a worker silent this long (no heartbeat, no events) is presumed gone
SWEEP_STEP_ENTRIES = 1000  # index entries a sweep examines per event-loop turn (0.2-0.5 ms, 2 vCPU)
SWEEP_ACTIONS_PER_TURN = 64  # decisions one carrier of a sweep carries out at most per event-loop turn


class Maintenance:
    def __init__(self, index: BlockIndex, io: TierIO, writes: PoolWrites, catalog: Catalog,
                 worker_events: WorkerEvents, workers: WorkerCaches, changes: IndexChangeLog,
                 counters: Counters, clock: Callable[[], float], background: BackgroundTasks, *,
                 archive_after_s: float, warm_ttl_s: float, cold_ttl_s: float, sweep_interval_s: float,
                 freeze_gc: bool = False) -> None:
        """`freeze_gc`: keep the cyclic GC off the index (gc_freeze); only the pool's own process sets
        it, so pools started inside a test runner leave the runner's GC alone."""
        self.index = index
        self.io = io
        self.writes = writes
        self.catalog = catalog
        self.worker_events = worker_events
        self.workers = workers
        self.changes = changes
        self.counters = counters
        self.warm = io.warm
        self.cold = io.cold
        self.clock = clock
        self.background = background
        self.archive_after_s = archive_after_s
        self.warm_ttl_s = warm_ttl_s
        self.cold_ttl_s = cold_ttl_s
        # Renew early enough that a sweep or two running late cannot let Redis expire a wanted block.
        self.renew_margin_s = min(3 * sweep_interval_s, warm_ttl_s / 2)
        self.sweep_interval_s = sweep_interval_s
        self.gc = IndexGcFreezer(enabled=freeze_gc)
        self._swept_totals: dict[str, tuple[int, int]] | None = None
        self._warm_resync = asyncio.Event()
        self._relist_warm = False  # changes of another replica were lost: list warm even as a follower
        self.rebuilt = asyncio.Event()  # set once the start's index rebuild has ended
        self._wake = asyncio.Event()  # a sweep now rather than at the end of the interval
        # time.monotonic() until which this replica holds the maintenance lease (`lead`); a lone pool,
        # which never hears of a lease, always leads.
        self._lead_until: float | None = None

    # --- leadership -------------------------------------------------------------------------------------
    def leading(self) -> bool:
        """Whether this replica runs the maintenance on the shared tiers now: it holds the lease and
        renewed it within the lease's length (always, for a pool without a replica layer)."""
        return self._lead_until is None or time.monotonic() < self._lead_until

    def lead(self, until: float) -> None:
        """The replica layer's word on the lease: held until `until` (time.monotonic()), 0.0: not held."""
        self._lead_until = until

    def wake(self) -> None:
        """Sweep now rather than at the end of the interval (this replica just took the lease)."""
        self._wake.set()

    def changes_lost(self) -> None:
        """Another replica's changes were lost on the way: re-list warm at the next sweep (leader or not)."""
        self._relist_warm = True
        self._warm_resync.set()
        self._wake.set()

    # --- the index rebuild ------------------------------------------------------------------------------
    def start_rebuild(self) -> None:
        """Index what warm and cold hold, in the background; reads consult the tiers meanwhile."""
        self.index.rebuilding = True

        async def rebuild() -> None:
            await self._rebuild()
            self.gc.freeze(self.index.num_blocks())
        self.background.spawn(rebuild(), "index rebuild")

    async def _rebuild(self) -> None:
        started = time.perf_counter()
        self.rebuilt.clear()
        try:
            counts = {}
            for tier, bit in ((self.warm, WARM), (self.cold, COLD)):
                if tier is None:
                    continue
                counts[tier.name] = await self._index_tier(tier, bit)
            log.info("index rebuilt in %.2f s: %s", time.perf_counter() - started,
                     ", ".join(f"{n} {c if c >= 0 else 'unavailable'}" for n, c in counts.items()))
        finally:
            self.index.rebuilding = False
            self.rebuilt.set()

    async def _index_tier(self, tier: RemoteTier, bit: int) -> int:
        """Add what `tier` holds to the index; -1 when it could not be listed (retried on recovery)."""
        now = self.clock()
        count = 0
        try:
            async for item in tier.iter_keys():
                if self.index.is_tag_invalidated(item.key.model_tag):
                    continue
                last_hit = now - item.idle_s if item.idle_s is not None else now
                self.index.note_stored(item.key, bit, item.size, now, last_hit=last_hit)
                if item.pinned:
                    self.catalog.restore_pin(item.key)
                count += 1
        except TierUnavailable as exc:
            log.warning("%s tier not indexed (%s); will index it when it is back", tier.name, exc)
            if bit == WARM:
                self._warm_resync.set()
            return -1
        return count

    async def _resync_warm(self, relist: bool = True) -> None:
        """After a warm outage: forget warm copies that are gone (e.g. Redis restarted empty) and index
        what is there (`relist`: the leader, which tells the other replicas what changed; a replica that
        lost changes, for itself), then write this replica's own hot blocks that warm lacks (the
        write-through backlog)."""
        index = self.index
        present: set[BlockKey] = set()
        lost: list[BlockKey] = []
        if relist:
            now = self.clock()
            shared = self.leading()
            note_stored = self.writes.record_stored if shared else index.note_stored
            try:
                async for item in self.warm.iter_keys():
                    present.add(item.key)
                    if not index.tiers_of(item.key) & WARM and not index.is_tag_invalidated(item.key.model_tag):
                        last_hit = now - item.idle_s if item.idle_s is not None else now
                        note_stored(item.key, WARM, item.size, now, last_hit=last_hit)
            except TierUnavailable as exc:
                log.warning("warm resync interrupted (%s); retrying when warm is back", exc)
                self._warm_resync.set()
                return
            lost = [k for k in index.keys_in(WARM) if k not in present]
            for key in lost:
                if shared:
                    self.writes.record_missing(key, WARM)
                else:
                    index.note_missing(key, WARM)
        backlog = [k for k in index.keys_in(HOT) if not index.tiers_of(k) & WARM]
        for key in backlog:
            data = self.io.hot.peek(key)
            if data is not None and await self.warm.put(key, data, pinned=index.is_pinned(key)):
                self.writes.record_stored(key, WARM, len(data))
        if relist:
            log.info("warm resync: %d blocks present, %d forgotten, %d rewritten from hot",
                     len(present), len(lost), len(backlog))
        elif backlog:
            log.info("warm back: %d blocks rewritten from hot", len(backlog))

    # --- purges -------------------------------------------------------------------------------------------
    def purge_in_background(self) -> None:
        self.background.spawn(self.purge_pending(), "purge of invalidated models")

    async def purge_pending(self) -> None:
        """Delete from storage what invalidations and clears queued (by listing, so blocks the index
        never learned about go too); a purge a tier could not finish stays queued for the next sweep."""
        for tag in sorted(self.index.pending_purges):
            what = "every model" if tag == ALL_TAGS else f"model {tag}"
            if await self._purge_listed(None if tag == ALL_TAGS else tag, None, what):
                self.catalog.purge_done(tag)
                self.changes.purged(tag)
        for tag, tenant in sorted(self.index.pending_tenant_purges):
            what = f"tenant {tenant}" + ("" if tag == ALL_TAGS else f", model {tag}")
            if await self._purge_listed(None if tag == ALL_TAGS else tag, tenant, what):
                self.catalog.purge_done(tag, tenant)
                self.changes.purged(tag, tenant)

    async def _purge_listed(self, tag: str | None, tenant_tag: str | None, what: str) -> bool:
        complete = True
        deleted = 0
        for tier in self.io.tiers.tiers:
            try:
                keys = [item.key async for item in tier.iter_keys(tag)
                        if tenant_tag is None or item.key.tenant_tag == tenant_tag]
            except TierUnavailable as exc:
                log.warning("purge of %s on %s postponed: %s", what, tier.name, exc)
                complete = False
                continue
            n = await tier.delete_many(keys)
            deleted += n
            if n < len(keys) and not tier.up:
                complete = False
        self.counters.purged += deleted
        if complete:
            log.info("purged %d stored blocks of %s", deleted, what)
        return complete

    # --- the sweep ----------------------------------------------------------------------------------------
    async def sweep_when_due(self) -> None:
        """Wait for the sweep interval (or a wake-up: warm came back, this replica took the lease, changes
        were lost), then sweep once. The service runs this back to back through its runtime, which logs a
        failed sweep and goes on."""
        woken = [asyncio.ensure_future(self._wake.wait()), asyncio.ensure_future(self.io.warm_back.wait())]
        try:
            await asyncio.wait(woken, timeout=self.sweep_interval_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in woken:
                waiter.cancel()
        self._wake.clear()
        await self.sweep_once()

    async def sweep_once(self) -> None:
        """Probe down tiers, resync warm after an outage, purge, forget silent workers, then archive /
        renew / expire. A replica that does not lead does the first, the backlog part of the resync, the
        forgetting and the walk (for its totals), and leaves the shared tiers to the leader."""
        leading = self.leading()
        await self.io.ping_down()
        if self.io.warm_back.is_set():  # warm came back (during the pings, or since the last sweep)
            self.io.warm_back.clear()
            self._warm_resync.set()
        if self._warm_resync.is_set() and self.warm is not None and self.warm.up and not self.index.rebuilding:
            self._warm_resync.clear()
            relist, self._relist_warm = leading or self._relist_warm, False
            await self._resync_warm(relist)
        if leading:
            await self.purge_pending()
        now = self.clock()
        for worker_id in self.workers.stale(now, WORKER_FORGET_AFTER_S):
            log.info("forgetting the local cache of worker %s: silent for %.0f s", worker_id,
                     WORKER_FORGET_AFTER_S)
            self.worker_events.forget(worker_id)
        warm_up = self.warm is not None and self.warm.up
        cold_up = self.cold is not None and self.cold.up
        # Walk the index SWEEP_STEP_ENTRIES at a time, letting lookups run in between (lifecycle.SweepPass).
        sweep = self.begin_sweep(now, warm_up, cold_up)
        while not sweep.step(SWEEP_STEP_ENTRIES):
            await asyncio.sleep(0)
        self._swept_totals = sweep.tier_totals()
        if not self.index.rebuilding:
            self.gc.maybe_freeze(self.index.num_blocks())
        if not leading or not self.leading():  # (the lease may have gone during the walk)
            return
        self.counters.sweeps += 1
        # FETCH_CONCURRENCY carriers take the decisions in order from the pass's lazy merge: the order
        # and concurrency of a semaphore over one task per decision, without sorting every decision or
        # making a task for each in one go (at 10^6 blocks either held the event loop, issue 38).
        pending = sweep.ordered_actions()

        async def carry() -> None:
            for n, action in enumerate(pending, 1):
                await self._carry_out(action)
                if n % SWEEP_ACTIONS_PER_TURN == 0:
                    await asyncio.sleep(0)  # tier calls that answer at once would never let go
        await asyncio.gather(*(carry() for _ in range(FETCH_CONCURRENCY)))

    def sweep(self, now: float, warm_up: bool, cold_up: bool) -> list[Action]:
        """Archival, warm lease renewal and cold TTL decisions, oldest idle first (ties by key).

        The whole index in one call; the service walks it in slices instead (`begin_sweep`)."""
        sweep = self.begin_sweep(now, warm_up, cold_up)
        sweep.step()
        return sweep.actions()

    def begin_sweep(self, now: float, warm_up: bool, cold_up: bool) -> SweepPass:
        """A sweep to run in bounded steps (`SweepPass.step`), so a large index never holds the caller
        for long; run to the end in one step it decides exactly what `sweep` does."""
        return SweepPass(self.index, self.io.hot, now, warm_up, cold_up, archive_after_s=self.archive_after_s,
                         renew_after_s=self.warm_ttl_s - self.renew_margin_s, cold_ttl_s=self.cold_ttl_s,
                         has_cold=self.io.has_cold)

    def tier_totals(self) -> dict[str, tuple[int, int]]:
        """(blocks, bytes) per tier as the index knows them (hot: exactly what the LRU holds).

        Walks the whole index (about 60 ns a block): fine for an admin request, too slow for a timer
        on a large index, which should use the totals a sweep collects (`totals_as_of_last_sweep`)."""
        blocks, nbytes = self.index.tier_counts()
        return fold_totals(blocks, nbytes, (len(self.io.hot), self.io.hot.bytes_used))

    def totals_as_of_last_sweep(self) -> dict[str, tuple[int, int]]:
        """(blocks, bytes) per tier as the last sweep counted them (one walk of the index now if none ran
        yet, kept until the next sweep); hot exact."""
        if self._swept_totals is None:
            self._swept_totals = self.tier_totals()
        return dict(self._swept_totals, hot=(len(self.io.hot), self.io.hot.bytes_used))

    # --- carrying out the sweep's decisions ------------------------------------------------------------------
    async def _carry_out(self, action: Archive | RenewWarm | ExpireCold) -> None:
        if isinstance(action, RenewWarm):
            await self._renew(action.key)
        elif isinstance(action, ExpireCold):
            await self._expire(action.key)
        else:
            await self._archive(action)

    async def _renew(self, key: BlockKey) -> None:
        if await self.warm.set_pinned(key, False):  # EXPIRE key ttl: the lease restarts
            self.writes.record_renewed(key)
            self.counters.warm_renewed += 1
        elif self.warm.up:
            self.writes.record_missing(key, WARM)

    async def _expire(self, key: BlockKey) -> None:
        if await self.cold.delete(key) or self.cold.up:
            self.writes.record_missing(key, COLD)
            self.counters.cold_expired += 1
            metrics.TIER_EVICTIONS.labels("cold").inc()

    async def _archive(self, action: Archive) -> None:
        """Warm -> cold, then delete from warm only once cold surely has it."""
        key = action.key
        if not action.cold_has_it:
            data = await self.warm.get(key)
            if data is None:
                if self.warm.up:
                    self.writes.record_missing(key, WARM)
                return
            if not self.io.intact(key, data, "warm"):
                await self.warm.delete(key)
                self.writes.record_missing(key, WARM)
                return
            data = await self.io.stored_form(key, data, "cold", source="warm")
            if data is None:
                return  # does not verify (counted): stays in warm, retried next sweep
            if not await self.cold.put(key, data):
                return  # cold down: stays in warm, retried next sweep
            self.writes.record_stored(key, COLD, len(data))
        if await self.warm.delete(key) or self.warm.up:
            self.writes.record_missing(key, WARM)
            self.counters.archived += 1
            metrics.TIER_EVICTIONS.labels("warm").inc()
            metrics.TIER_DEMOTIONS.inc()
