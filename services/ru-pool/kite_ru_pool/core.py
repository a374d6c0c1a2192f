"""The ru-pool's pure core: one object (PoolCore) over the parts that decide, for the service and for the
fleet simulator (kite_cli.simulate). No I/O, no clock.

Boundary: every method is synchronous and takes `now` (unix seconds) from the caller; anything that
needs the network (warm/cold reads and writes) is returned as an action (lifecycle.py) for the service
to carry out, which then reports the outcome back (`note_stored`, `note_missing`). So every decision can
be tested with exact hashes, times and order.

It composes, each knowing only the layer below it:
  index.BlockIndex       where each block lives, pins, invalidation, pending purges
    tenants.Tenants      each tenant's usage and quota (kept in step by the index)
  hot_tier.HotTier       the hot LRU (kite_shared.tiers.hot) kept in step with the index; evictions
                         become demotions
  worker_caches.WorkerCaches   each worker's local cache, from its BlockStored/BlockRemoved events
  lifecycle.SweepPass    archival, lease renewal and cold expiry over the index
and does what spans them: admitting a put, quota evictions, lookups (tiers and workers at once), pins,
evictions and clears, model invalidation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from kite_shared.security import ANONYMOUS_TENANT_TAG
from kite_shared.tiers.hot import HotLRU
from kite_shared.tiers.keys import BlockKey, model_tag
from kite_ru_pool.counters import Counters
from kite_ru_pool.hot_tier import HotTier
from kite_ru_pool.namespaces import NamespaceAudit
from kite_ru_pool.index import (  # noqa: F401  (re-exported: the core's vocabulary in one import)
    ALL_TAGS, COLD, HOT, TIER_BITS, TIER_LETTER, WARM, BlockIndex, Entry, fold_totals)
from kite_ru_pool.lifecycle import (  # noqa: F401  (re-exported)
    Action, Archive, Demote, DropBlock, ExpireCold, RenewWarm, SweepPass)
from kite_ru_pool.tenants import (  # noqa: F401  (re-exported)
    QUOTA_EVICT_TO, QUOTA_RECENCY_GRAIN_S, TenantLedger, Tenants)
from kite_ru_pool.worker_caches import WorkerCaches


@dataclass(frozen=True)
class LookupResult:
    hot: int = 0
    warm: int = 0
    cold: int = 0
    pool: int = 0
    tiers: bytes = b""
    workers: dict[str, int] = field(default_factory=dict)
    invalidated: bool = False


class PoolCore:
    def __init__(self, hot_bytes: int, archive_after_s: float, warm_ttl_s: float, cold_ttl_s: float,
                 sweep_interval_s: float, has_warm: bool, has_cold: bool, tenant_quota_bytes: int = 0,
                 tenant_quotas: dict[str, int] | None = None) -> None:
        """`tenant_quota_bytes`: every tenant's quota (0: none); `tenant_quotas`: overrides by tenant
        tag (kite_shared.security.tenant_tag), 0 meaning no quota for that tenant."""
        self.counters = Counters()
        self.tenants = Tenants(tenant_quota_bytes, tenant_quotas)
        self.index = BlockIndex(self.tenants)
        self.hot_tier = HotTier(hot_bytes, self.index, self.counters)
        self.hot: HotLRU = self.hot_tier.lru
        self.workers = WorkerCaches()
        self.namespaces = NamespaceAudit()
        # Tags the arbitrator quarantined (also in index.invalidated while it lasts): kept apart from
        # invalidations by a model change, which no operator lifts.
        self.quarantined: set[str] = set()
        self.archive_after_s = archive_after_s
        self.warm_ttl_s = warm_ttl_s
        self.cold_ttl_s = cold_ttl_s
        # Renew early enough that a sweep or two running late cannot let Redis expire a wanted block.
        self.renew_margin_s = min(3 * sweep_interval_s, warm_ttl_s / 2)
        self.has_warm = has_warm
        self.has_cold = has_cold
        # Worker events kept aside while a joining replica waits for another's worker-cache snapshot
        # (hold_worker_events / install_worker_caches); None: applied as they come.
        self._held_worker_events: list[tuple[str, str, tuple]] | None = None

    # --- the parts' state, under the names callers know ----------------------------------------------
    @property
    def pending_purges(self) -> set[str]:
        """Invalidated or cleared model tags (ALL_TAGS: every one) whose storage needs purging."""
        return self.index.pending_purges

    @property
    def pending_tenant_purges(self) -> set[tuple[str, str]]:
        """(model tag or ALL_TAGS, tenant tag) of tenant clears whose storage needs purging."""
        return self.index.pending_tenant_purges

    @property
    def tenant_quota_bytes(self) -> int:
        return self.tenants.quota_bytes

    @tenant_quota_bytes.setter
    def tenant_quota_bytes(self, value: int) -> None:
        self.tenants.quota_bytes = value

    @property
    def tenant_quotas(self) -> dict[str, int]:
        return self.tenants.quotas

    # --- index ----------------------------------------------------------------------------------------
    def entry(self, key: BlockKey) -> Entry | None:
        return self.index.entry(key)

    def tiers_of(self, key: BlockKey) -> int:
        return self.index.tiers_of(key)

    def note_stored(self, key: BlockKey, tier: int, size: int, now: float,
                    last_hit: float | None = None, depth: int | None = None) -> None:
        """A tier now holds the block (written, promoted, or found by a rebuild)."""
        self.index.note_stored(key, tier, size, now, last_hit, depth)

    def note_missing(self, key: BlockKey, tier: int) -> None:
        """A tier turned out not to hold the block (expired, deleted, failed verification)."""
        stored_as = self.index.note_missing(key, tier)
        if stored_as is not None and tier == HOT:
            self.hot.delete(stored_as)

    def note_hit(self, key: BlockKey, now: float) -> None:
        self.index.note_hit(key, now)

    def note_renewed(self, key: BlockKey, now: float) -> None:
        self.index.note_renewed(key, now)

    def is_pinned(self, key: BlockKey) -> bool:
        return self.index.is_pinned(key)

    def keys_in(self, tier: int, tag: str | None = None, tenant_tag: str | None = None) -> list[BlockKey]:
        """Keys the index believes `tier` holds, of one model tag and/or tenant tag or all (sorted)."""
        return self.index.keys_in(tier, tag, tenant_tag)

    # --- tenants ----------------------------------------------------------------------------------------
    def quota_of(self, tenant_tag: str) -> int:
        """The tenant's quota in bytes; 0 = none."""
        return self.tenants.quota_of(tenant_tag)

    def tenant_usage(self, tenant_tag: str | None = None) -> dict[str, TenantLedger]:
        """Ledgers by tenant tag (of one tenant when given: an empty ledger if it stores nothing)."""
        return self.tenants.usage(tenant_tag)

    def reserve_quota(self, key: BlockKey, size: int) -> list[DropBlock] | None:
        """Make room under its tenant's quota for the new block `key` of `size` bytes (tenants.py): the
        blocks dropped (already gone from the index and hot; the caller deletes them from the tiers
        named), or None when the put must be refused."""
        index = self.index

        def candidates() -> Iterable[tuple[float, int, str, bytes, int]]:  # read only when over quota
            new = (key.model_tag, key.block_hash)
            for ident in self.tenants.ledger(key.tenant_tag).blocks:
                e = index.models[ident[0]][ident[1]]
                # not pinned, not being written by a demotion right now, not the new block itself
                if ident not in index.pins and e.tiers != 0 and ident != new:
                    yield e.last_hit, e.depth, ident[0], ident[1], e.size

        victims = self.tenants.quota_victims(key.tenant_tag, size, candidates())
        if victims is None:
            return None
        return [self._drop(tag, h, index.models[tag][h]) for tag, h in victims]

    def _drop(self, tag: str, block_hash: bytes, e: Entry) -> DropBlock:
        """Forget a block everywhere in the core; the DropBlock says what storage still holds it."""
        key = e.key(tag, block_hash)
        self.hot.delete(key)
        self.index.drop(tag, block_hash, e)
        return DropBlock(key, e.tiers & (WARM | COLD))

    def forget_tenant(self, tenant_tag: str, tag: str | None = None) -> list[DropBlock]:
        """Drop every block of a tenant (of one model tag, or all) from the index and hot, pins
        included (an admin clear); returns what the caller must delete from the tiers.

        Blocks the index does not know (a rebuild still running) are covered by a storage purge queued
        in `pending_tenant_purges`."""
        self.index.pending_tenant_purges.add((ALL_TAGS if tag is None else tag, tenant_tag))
        drops = []
        for t, h, e in self.index.tenant_blocks(tenant_tag, tag):
            key = e.key(t, h)
            self.index.unpin(key)
            self.hot.unpin(key)
            drops.append(self._drop(t, h, e))
        return drops

    # --- writes -----------------------------------------------------------------------------------------
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

    def put_hot(self, key: BlockKey, data: bytes, now: float, depth: int | None = None) -> list[Action]:
        """Store in hot (put or promotion); returns demotions for what that evicted."""
        return self.hot_tier.put(key, data, now, depth, self.has_warm, self.has_cold)

    def take_demotions(self, warm_up: bool, cold_up: bool) -> list[Action]:
        """Demotions for evictions not drained yet, given which slower tiers are up now."""
        return self.hot_tier.drain_evictions(self.has_warm and warm_up, self.has_cold and cold_up)

    def demotion_failed(self, key: BlockKey) -> None:
        """No slower tier took `key` on its way down: the pool no longer holds it."""
        self.counters.demotions_failed += 1
        self.hot_tier.demotion_failed(key)

    # --- reads ------------------------------------------------------------------------------------------
    def hot_get(self, key: BlockKey, now: float) -> bytes | None:
        return self.hot_tier.get(key, now)

    def lookup(self, model_fingerprint: str, chain: Sequence[bytes], up: int = HOT | WARM | COLD,
               include_workers: bool = True) -> LookupResult:
        """Longest prefix of `chain` held by each tier (only tiers in `up`), by any of them, and by
        each worker's local cache."""
        self.counters.lookups += 1
        tag = model_tag(model_fingerprint)
        if self.index.is_tag_invalidated(tag):
            return LookupResult(invalidated=True)
        hot, warm, cold, pool, letters = self.index.prefixes(tag, chain, up)
        workers = self.workers.prefix_lengths(tag, chain) if include_workers else {}
        return LookupResult(hot, warm, cold, pool, letters, workers)

    # --- lifecycle --------------------------------------------------------------------------------------
    def sweep(self, now: float, warm_up: bool, cold_up: bool) -> list[Action]:
        """Archival, warm lease renewal and cold TTL decisions, oldest idle first (ties by key).

        The whole index in one call; the service walks it in slices instead (`begin_sweep`)."""
        sweep = self.begin_sweep(now, warm_up, cold_up)
        sweep.step()
        return sweep.actions()

    def begin_sweep(self, now: float, warm_up: bool, cold_up: bool) -> SweepPass:
        """A sweep to run in bounded steps (`SweepPass.step`), so a large index never holds the caller
        for long; run to the end in one step it decides exactly what `sweep` does."""
        return SweepPass(self.index, self.hot, now, warm_up, cold_up, archive_after_s=self.archive_after_s,
                         renew_after_s=self.warm_ttl_s - self.renew_margin_s, cold_ttl_s=self.cold_ttl_s,
                         has_cold=self.has_cold)

    # --- pins -------------------------------------------------------------------------------------------
    def pin(self, model_fingerprint: str, chain: Iterable[bytes],
            tenant_tag: str = ANONYMOUS_TENANT_TAG) -> list[BlockKey]:
        keys = self.index.keys_of(model_fingerprint, chain, tenant_tag)
        for key in keys:
            self.restore_pin(key)
        return keys

    def restore_pin(self, key: BlockKey) -> None:
        """Pin one block; also a pin found in storage (a warm block without expiry) during a rebuild."""
        self.index.pin(key)
        self.hot.pin(key)

    def unpin(self, model_fingerprint: str, chain: Iterable[bytes],
              tenant_tag: str = ANONYMOUS_TENANT_TAG) -> list[BlockKey]:
        keys = self.index.keys_of(model_fingerprint, chain, tenant_tag)
        self.unpin_keys(keys)
        return keys

    def unpin_keys(self, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            self.index.unpin(key)
            self.hot.unpin(key)

    def evict(self, model_fingerprint: str, chain: Iterable[bytes],
              tenant_tag: str = ANONYMOUS_TENANT_TAG) -> tuple[list[BlockKey], int]:
        """Forget these blocks (an admin evict): index, hot, pins and tenant accounting. Returns their
        storage keys, which the caller deletes from every remote tier whatever the index believed (a
        rebuild may not have reached them yet), and how many of them the index held.

        Worker-local caches are not touched: a worker that still holds a block keeps reporting it."""
        keys = self.index.keys_of(model_fingerprint, chain, tenant_tag)
        held = self.drop_blocks(keys)
        self.counters.evicted += held
        return keys, held

    def drop_blocks(self, keys: Iterable[BlockKey]) -> int:
        """Forget these blocks in index, hot, pins and tenant accounting (an evict, or another replica's
        evict or quota eviction); how many of them the index held."""
        held = 0
        for key in keys:
            self.index.unpin(key)
            self.hot.unpin(key)
            e = self.index.entry(key)
            if e is None:
                self.hot.delete(key)
                continue
            held += 1
            self._drop(key.model_tag, key.block_hash, e)
        return held

    # --- models -----------------------------------------------------------------------------------------
    def is_invalidated(self, model_fingerprint: str) -> bool:
        return self.index.is_tag_invalidated(model_tag(model_fingerprint))

    def is_tag_invalidated(self, tag: str) -> bool:
        return self.index.is_tag_invalidated(tag)

    def model_fingerprint_changed(self, name: str, fingerprint: str, previous: str = "") -> list[str]:
        """Record `fingerprint` as current for `name`; returns the model tags now invalidated."""
        tags = self.index.fingerprint_changed(name, fingerprint, previous)
        for tag in tags:
            self.invalidate_tag(tag)
        self.namespaces.named(model_tag(fingerprint), name)
        if model_tag(fingerprint) in self.quarantined:  # announcing a namespace does not lift its quarantine
            self.index.invalidated.add(model_tag(fingerprint))
        return tags

    def quarantine(self, tag: str, name: str) -> bool:
        """Serve nothing of this namespace (its reused KV diverged from recomputation): drop it now, its
        storage is purged later (by the leading replica). Returns False when it was quarantined already."""
        if tag in self.quarantined:
            return False
        self.quarantined.add(tag)
        self.invalidate_tag(tag)
        self.namespaces.set_quarantined(tag, name, True)
        return True

    def lift_quarantine(self, tag: str, name: str) -> bool:
        """An operator cleared the namespace: its blocks are stored and served again as they are
        recomputed. A tag invalidated by a model change stays so (only a current fingerprint returns)."""
        if tag not in self.quarantined:
            return False
        self.quarantined.discard(tag)
        if tag in {model_tag(fp) for fp in self.index.current.values()}:
            self.index.invalidated.discard(tag)
        self.namespaces.set_quarantined(tag, name, False)
        return True

    def blocks_by_tag(self) -> dict[str, int]:
        return {tag: len(blocks) for tag, blocks in self.index.models.items()}

    def invalidate_tag(self, tag: str) -> None:
        """Never serve this tag again; drop its index and hot entries now, storage is purged later."""
        self.index.invalidated.add(tag)
        self.forget_tag(tag)

    def forget_tag(self, tag: str | None) -> int:
        """Drop index, hot and worker entries of one tag (None: all) and queue a storage purge
        (ALL_TAGS for None, which also covers blocks the index never learned about)."""
        tags, dropped = self.index.forget_tags(tag)
        for t in tags:
            self.hot.clear(t)
        self.workers.forget_tags(tags)
        self.hot.take_events()  # clear() emits none, but keep the queue consistent
        return dropped

    def models_state(self) -> tuple[dict[str, str], list[str]]:
        """The current fingerprint of each model name and the invalidated tags (for a joining replica)."""
        return dict(self.index.current), sorted(self.index.invalidated)

    def restore_models(self, current: dict[str, str], invalidated: Iterable[str]) -> None:
        """Take another replica's model state: its current fingerprints, and its invalidated tags, whose
        blocks this index drops (a rebuild may have listed some) without queueing a purge of its own (the
        leader purges)."""
        for name, fingerprint in current.items():
            self.index.current.setdefault(name, fingerprint)
        for tag in invalidated:
            if tag in self.index.invalidated:
                continue
            queued = tag in self.index.pending_purges
            self.invalidate_tag(tag)
            if not queued:
                self.index.pending_purges.discard(tag)

    def purge_done(self, tag: str) -> None:
        self.index.pending_purges.discard(tag)

    # --- worker-local caches ----------------------------------------------------------------------------
    def worker_stored(self, worker_id: str, model_fingerprint: str, hashes: Iterable[bytes],
                      seq: int, now: float) -> None:
        if self._held_worker_events is not None:
            self._held_worker_events.append(("stored", worker_id, (model_fingerprint, list(hashes), seq, now)))
            return
        tag = model_tag(model_fingerprint)
        hashes = list(hashes)
        if self.workers.stored(worker_id, tag, hashes, seq, now):
            self.counters.worker_event_gaps += 1
        for h in hashes:  # a worker holding a pool block means it was used: a hit for archival
            self.index.note_hit(BlockKey(tag, h), now)

    def worker_removed(self, worker_id: str, model_fingerprint: str, hashes: Iterable[bytes],
                       all_blocks: bool, seq: int, now: float) -> None:
        if self._held_worker_events is not None:
            self._held_worker_events.append(("removed", worker_id,
                                             (model_fingerprint, list(hashes), all_blocks, seq, now)))
            return
        tag = "" if all_blocks else model_tag(model_fingerprint)
        if self.workers.removed(worker_id, tag, hashes, all_blocks, seq, now):
            self.counters.worker_event_gaps += 1

    def forget_worker(self, worker_id: str) -> None:
        if self._held_worker_events is not None:
            self._held_worker_events.append(("forget", worker_id, ()))
            return
        self.workers.forget(worker_id)

    def num_worker_blocks(self) -> dict[str, int]:
        """Blocks the index attributes to each worker's local cache (every model)."""
        return self.workers.num_blocks()

    def worker_alive(self, worker_id: str, now: float) -> None:
        if self._held_worker_events is not None:
            self._held_worker_events.append(("alive", worker_id, (now,)))
            return
        self.workers.alive(worker_id, now)

    def hold_worker_events(self) -> None:
        """Keep worker events and heartbeats aside from now until `install_worker_caches` (a joining
        replica, while another replica's snapshot of the worker caches comes)."""
        self._held_worker_events = []

    def install_worker_caches(self, caches: Iterable[tuple[str, int, float, dict[str, list[bytes]]]]) -> int:
        """Take the workers of a snapshot (worker id, last event number, last seen, model tag -> hashes),
        then apply the events held meanwhile that the snapshot does not hold: those of workers it does
        not name, unnumbered ones, and those numbered after the snapshot's. Returns how many events were
        applied; events flow as usual from now on."""
        held, self._held_worker_events = self._held_worker_events or [], None
        snapshot_seq: dict[str, int] = {}
        for worker_id, seq, seen, by_tag in caches:
            self.workers.restore(worker_id, by_tag, seq, seen)
            snapshot_seq[worker_id] = seq
        applied = 0
        for kind, worker_id, args in held:
            if kind in ("stored", "removed"):
                seq = args[-2]
                if 0 < seq <= snapshot_seq.get(worker_id, 0):
                    continue  # in the snapshot already
                if kind == "stored":
                    self.worker_stored(worker_id, *args)
                else:
                    self.worker_removed(worker_id, *args)
            elif kind == "forget":
                self.forget_worker(worker_id)
            else:
                self.worker_alive(worker_id, *args)
            applied += 1
        return applied

    def stale_workers(self, now: float, after_s: float) -> list[str]:
        return self.workers.stale(now, after_s)

    # --- stats ------------------------------------------------------------------------------------------
    def tier_totals(self) -> dict[str, tuple[int, int]]:
        """(blocks, bytes) per tier as the index knows them (hot: exactly what the LRU holds).

        Walks the whole index (about 60 ns a block): fine for an admin request, too slow for a timer
        on a large index, which should use the totals a sweep collects (`SweepPass.tier_totals`)."""
        blocks, nbytes = self.index.tier_counts()
        return fold_totals(blocks, nbytes, (len(self.hot), self.hot.bytes_used))

    def num_blocks(self) -> int:
        return self.index.num_blocks()
