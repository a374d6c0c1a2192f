"""The ru-pool's pure core: global block index, hot tier, lifecycle decisions. No I/O, no clock.

Boundaries: every method is synchronous and takes `now` (unix seconds) from the caller; anything that
needs the network (warm/cold reads and writes) is returned as an action for the service layer to carry
out, which then reports the outcome back (`note_stored`, `note_missing`). So every decision here can be
tested with exact hashes, times and order.

Index: model tag -> block hash -> Entry (which tiers hold the block, its size, last hit, pins). Lookups
walk a chain with one dict probe per block per tier, so a 128-block chain costs tens of microseconds.
Worker-local caches (learned from BlockStored/BlockRemoved) are indexed the same way, per worker.

Lifecycle rules (all times from the last hit, where a put or a worker reporting it loaded the block
counts as a hit):
  * promotion: a warm or cold hit is copied to hot (and a cold hit to warm) - done by the service;
  * demotion: a block evicted from hot that no slower tier holds is written to warm (cold if warm is
    off or down);
  * archival: a warm block idle >= archive_after_s is copied to cold (if cold lacks it) and removed
    from warm;
  * renewal: the warm TTL is a lease, not the retention policy: the pool renews warm blocks it still
    wants before Redis would expire them, so a warm block lives until archival; if the pool stops for
    longer than the TTL, Redis cleans up by itself;
  * cold TTL: a block held only in cold and idle >= cold_ttl_s (when > 0) is deleted;
  * pins: pinned blocks are never evicted from hot, archived or expired (warm stores them without TTL);
  * invalidation: a model tag replaced by a new fingerprint (or purged) is never looked up or served
    again; its blocks are listed for a background purge until the purge succeeds;
  * sweeps: `sweep` decides over the whole index at once; the service walks it in bounded slices
    (`begin_sweep`, `SweepPass`), judging each entry when its slice runs, so one sweep never holds the
    event loop for long (issue 4).

Tenants: every block belongs to the tenant whose request computed it (its storage key and RU header
name the tenant tag). The core keeps a ledger per tenant: its blocks and bytes, each block counted once
whatever tiers hold it (so the figure survives promotion and demotion, and a rebuild from key listings
restores it). Quotas (`tenant_quota_bytes`, per-tenant overrides) are enforced on put by
`reserve_quota`: when the new block would take the tenant over its quota, the tenant's own least
recently hit unpinned blocks are dropped from every tier until the tenant, new block included, is at or
under QUOTA_EVICT_TO of its quota - evicting a little below the line means a tenant at its quota pays
one sort per ~10% of its quota, not one per put. Recency is compared at QUOTA_RECENCY_GRAIN_S, and among
blocks equally recent the deepest (highest block index) go first, then by key: a chain is put or hit
head to tail within milliseconds, and dropping its tail first (as vLLM's free queue does) leaves a
shorter prefix that still hits, where dropping its head would strand the rest. If pinned blocks leave no room, or
the block alone is larger than the quota, the put is refused. Only a tenant's own blocks are ever
evicted for it: one tenant's traffic cannot push another's blocks out of warm or cold (the hot tier
remains one shared LRU). Blocks already being written (a demotion in flight) are not eviction
candidates. A quota lowered below what a tenant holds takes effect at that tenant's next put.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from kite_shared.security import ANONYMOUS_TENANT_TAG
from kite_shared.tiers.hot import HotLRU
from kite_shared.tiers.keys import BlockKey, model_tag

HOT, WARM, COLD = 1, 2, 4
TIER_BITS = {"hot": HOT, "warm": WARM, "cold": COLD}
TIER_LETTER = {HOT: b"h", WARM: b"w", COLD: b"c"}
ALL_TAGS = "*"  # pending_purges entry meaning every block of every model
QUOTA_EVICT_TO = 0.9  # a tenant over its quota is brought down to this fraction of it (docstring)
QUOTA_RECENCY_GRAIN_S = 1.0  # last hits closer than this count as equally recent for quota evictions

# bytes.translate tables over tier bit sets (0..7): 1 where the set holds the tier, and the letter of
# the cheapest tier in the set.
_HAS_TIER = tuple(bytes(1 if v & bit else 0 for v in range(256)) for bit in (HOT, WARM, COLD))
_CHEAPEST = bytes((b"h" if v & HOT else b"w" if v & WARM else b"c" if v & COLD else b"-")[0]
                  for v in range(256))


def _first_gap(held: bytes, table: bytes) -> int:
    gap = held.translate(table).find(0)
    return len(held) if gap < 0 else gap


@dataclass(slots=True)
class Entry:
    tiers: int = 0  # bit set of HOT | WARM | COLD
    size: int = 0  # bytes of the encoded unit
    last_hit: float = 0.0  # unix seconds of the last put or hit
    warm_touch: float = 0.0  # unix seconds the warm TTL was last set (write, renewal)
    tenant_tag: str = ANONYMOUS_TENANT_TAG  # the owner; with (model tag, hash) it makes the storage key
    depth: int = 0  # block index in its chain, when known (from the put); 0 after a rebuild

    def key(self, tag: str, block_hash: bytes) -> BlockKey:
        return BlockKey(tag, block_hash, self.tenant_tag)


@dataclass
class TenantLedger:
    """One tenant's blocks in the pool (index identities) and their total encoded size."""

    num_bytes: int = 0
    blocks: set[tuple[str, bytes]] = field(default_factory=set)  # (model tag, block hash)
    quota_evictions: int = 0  # blocks dropped to keep the tenant under its quota
    quota_refused: int = 0  # puts refused: pinned blocks left no room, or the block exceeds the quota


@dataclass(frozen=True)
class Demote:
    """Write `data` (evicted from hot) to `tier` (WARM or COLD)."""

    key: BlockKey
    data: bytes
    tier: int


@dataclass(frozen=True)
class Archive:
    """Copy the block from warm to cold (unless `cold_has_it`) and then delete it from warm."""

    key: BlockKey
    cold_has_it: bool


@dataclass(frozen=True)
class RenewWarm:
    """Reset the warm TTL of a block the pool still wants in warm."""

    key: BlockKey


@dataclass(frozen=True)
class ExpireCold:
    """Delete a cold-only block idle past the cold TTL."""

    key: BlockKey


@dataclass(frozen=True)
class DropBlock:
    """Delete the block from `tiers` (a bit set of WARM | COLD); the index and hot already forgot it."""

    key: BlockKey
    tiers: int


Action = Demote | Archive | RenewWarm | ExpireCold | DropBlock


@dataclass(frozen=True)
class LookupResult:
    hot: int = 0
    warm: int = 0
    cold: int = 0
    pool: int = 0
    tiers: bytes = b""
    workers: dict[str, int] = field(default_factory=dict)
    invalidated: bool = False


@dataclass
class Counters:
    puts: int = 0
    duplicates: int = 0
    refused_invalidated: int = 0
    refused_corrupt: int = 0
    hot_hits: int = 0
    hot_misses: int = 0
    hot_evictions: int = 0
    hot_refused: int = 0  # puts that did not fit (everything left is pinned)
    promotions: int = 0
    demotions: int = 0
    archived: int = 0
    warm_renewed: int = 0
    cold_expired: int = 0
    lookups: int = 0
    worker_event_gaps: int = 0
    purged: int = 0
    warm_writes_dropped: int = 0
    evicted: int = 0  # blocks the index held that an admin evict removed


class PoolCore:
    def __init__(self, hot_bytes: int, archive_after_s: float, warm_ttl_s: float, cold_ttl_s: float,
                 sweep_interval_s: float, has_warm: bool, has_cold: bool, tenant_quota_bytes: int = 0,
                 tenant_quotas: dict[str, int] | None = None) -> None:
        """`tenant_quota_bytes`: every tenant's quota (0: none); `tenant_quotas`: overrides by tenant
        tag (kite_shared.security.tenant_tag), 0 meaning no quota for that tenant."""
        self.hot = HotLRU(hot_bytes)
        self.tenant_quota_bytes = tenant_quota_bytes
        self.tenant_quotas = dict(tenant_quotas or {})
        self._ledgers: dict[str, TenantLedger] = {}
        self.archive_after_s = archive_after_s
        self.warm_ttl_s = warm_ttl_s
        self.cold_ttl_s = cold_ttl_s
        # Renew early enough that a sweep or two running late cannot let Redis expire a wanted block.
        self.renew_margin_s = min(3 * sweep_interval_s, warm_ttl_s / 2)
        self.has_warm = has_warm
        self.has_cold = has_cold
        self.counters = Counters()
        self._models: dict[str, dict[bytes, Entry]] = {}
        self._pins: set[tuple[str, bytes]] = set()  # (model tag, block hash)
        self._names: dict[str, str] = {}  # model name -> current fingerprint
        self._invalidated: set[str] = set()  # model tags never served again
        self.pending_purges: set[str] = set()  # invalidated or cleared tags whose storage needs purging
        # (model tag or ALL_TAGS, tenant tag) of tenant clears whose storage needs purging
        self.pending_tenant_purges: set[tuple[str, str]] = set()
        self._workers: dict[str, dict[str, set[bytes]]] = {}  # worker -> tag -> hashes
        self._worker_seq: dict[str, int] = {}
        self._worker_seen: dict[str, float] = {}

    # --- index primitives -------------------------------------------------------------------------
    def entry(self, key: BlockKey) -> Entry | None:
        models = self._models.get(key.model_tag)
        return None if models is None else models.get(key.block_hash)

    def tiers_of(self, key: BlockKey) -> int:
        e = self.entry(key)
        return 0 if e is None else e.tiers

    def _ensure(self, key: BlockKey) -> Entry:
        models = self._models.setdefault(key.model_tag, {})
        e = models.get(key.block_hash)
        if e is None:
            e = models[key.block_hash] = Entry(tenant_tag=key.tenant_tag)
            self._ledger(key.tenant_tag).blocks.add((key.model_tag, key.block_hash))
        return e

    def _ledger(self, tenant_tag: str) -> TenantLedger:
        ledger = self._ledgers.get(tenant_tag)
        if ledger is None:
            ledger = self._ledgers[tenant_tag] = TenantLedger()
        return ledger

    def _unaccount(self, tag: str, block_hash: bytes, e: Entry) -> None:
        ledger = self._ledgers.get(e.tenant_tag)
        if ledger is not None:
            ledger.blocks.discard((tag, block_hash))
            ledger.num_bytes -= e.size

    def _drop_if_empty(self, key: BlockKey, e: Entry) -> None:
        if e.tiers == 0:
            models = self._models.get(key.model_tag)
            if models is not None and models.get(key.block_hash) is e:
                del models[key.block_hash]
                self._unaccount(key.model_tag, key.block_hash, e)
                if not models:
                    del self._models[key.model_tag]

    def note_stored(self, key: BlockKey, tier: int, size: int, now: float,
                    last_hit: float | None = None, depth: int | None = None) -> None:
        """A tier now holds the block (written, promoted, or found by a rebuild)."""
        e = self._ensure(key)
        if depth is not None:
            e.depth = depth
        e.tiers |= tier
        if size and size != e.size:
            self._ledger(e.tenant_tag).num_bytes += size - e.size
            e.size = size
        if last_hit is not None:
            e.last_hit = max(e.last_hit, last_hit)
        elif e.last_hit == 0.0:
            e.last_hit = now
        if tier == WARM:
            e.warm_touch = now

    def note_missing(self, key: BlockKey, tier: int) -> None:
        """A tier turned out not to hold the block (expired, deleted, failed verification)."""
        e = self.entry(key)
        if e is None:
            return
        e.tiers &= ~tier
        if tier == HOT:
            self.hot.delete(e.key(key.model_tag, key.block_hash))
        self._drop_if_empty(key, e)

    def note_hit(self, key: BlockKey, now: float) -> None:
        e = self.entry(key)
        if e is not None:
            e.last_hit = max(e.last_hit, now)

    def note_renewed(self, key: BlockKey, now: float) -> None:
        e = self.entry(key)
        if e is not None:
            e.warm_touch = now

    def is_pinned(self, key: BlockKey) -> bool:
        return (key.model_tag, key.block_hash) in self._pins

    def keys_in(self, tier: int, tag: str | None = None, tenant_tag: str | None = None) -> list[BlockKey]:
        """Keys the index believes `tier` holds, of one model tag and/or tenant tag or all (sorted, for
        deterministic purges and tests)."""
        out = []
        for t, models in self._models.items():
            if tag is not None and t != tag:
                continue
            out.extend(e.key(t, h) for h, e in models.items()
                       if e.tiers & tier and (tenant_tag is None or e.tenant_tag == tenant_tag))
        return sorted(out)

    # --- tenants ----------------------------------------------------------------------------------
    def quota_of(self, tenant_tag: str) -> int:
        """The tenant's quota in bytes; 0 = none."""
        return self.tenant_quotas.get(tenant_tag, self.tenant_quota_bytes)

    def tenant_usage(self, tenant_tag: str | None = None) -> dict[str, TenantLedger]:
        """Ledgers by tenant tag (of one tenant when given: an empty ledger if it stores nothing)."""
        if tenant_tag is not None:
            return {tenant_tag: self._ledgers.get(tenant_tag) or TenantLedger()}
        return {t: ledger for t, ledger in sorted(self._ledgers.items()) if ledger.blocks
                or ledger.quota_evictions or ledger.quota_refused}

    def reserve_quota(self, key: BlockKey, size: int) -> list[DropBlock] | None:
        """Make room under its tenant's quota for the new block `key` of `size` bytes (module
        docstring): the blocks dropped (already gone from the index and hot; the caller deletes them
        from the tiers named), or None when the put must be refused."""
        quota = self.quota_of(key.tenant_tag)
        if quota <= 0:
            return []
        ledger = self._ledger(key.tenant_tag)
        must_free = ledger.num_bytes + size - quota
        if must_free <= 0:
            return []
        candidates = []
        for ident in ledger.blocks:
            tag, h = ident
            e = self._models[tag][h]
            if ident in self._pins or e.tiers == 0 or ident == (key.model_tag, key.block_hash):
                continue  # pinned, or a demotion is writing it right now
            candidates.append((e.last_hit // QUOTA_RECENCY_GRAIN_S, -e.depth, tag, h, e))
        if size > quota or sum(c[-1].size for c in candidates) < must_free:
            ledger.quota_refused += 1
            return None
        want_free = max(must_free, ledger.num_bytes + size - int(quota * QUOTA_EVICT_TO))
        candidates.sort(key=lambda c: c[:4])
        drops: list[DropBlock] = []
        freed = 0
        for *_, tag, h, e in candidates:
            if freed >= want_free:
                break
            freed += e.size
            drops.append(self._drop(tag, h, e))
        ledger.quota_evictions += len(drops)
        return drops

    def _drop(self, tag: str, block_hash: bytes, e: Entry) -> DropBlock:
        """Forget a block everywhere in the core; the DropBlock says what storage still holds it."""
        key = e.key(tag, block_hash)
        self.hot.delete(key)
        models = self._models[tag]
        del models[block_hash]
        if not models:
            del self._models[tag]
        self._unaccount(tag, block_hash, e)
        return DropBlock(key, e.tiers & (WARM | COLD))

    def forget_tenant(self, tenant_tag: str, tag: str | None = None) -> list[DropBlock]:
        """Drop every block of a tenant (of one model tag, or all) from the index and hot, pins
        included (an admin clear); returns what the caller must delete from the tiers.

        Blocks the index does not know (a rebuild still running) are covered by a storage purge queued
        in `pending_tenant_purges`."""
        self.pending_tenant_purges.add((ALL_TAGS if tag is None else tag, tenant_tag))
        ledger = self._ledgers.get(tenant_tag)
        if ledger is None:
            return []
        drops = []
        for t, h in sorted(ledger.blocks):
            if tag is None or t == tag:
                e = self._models[t][h]
                self._pins.discard((t, h))
                self.hot.unpin(e.key(t, h))
                drops.append(self._drop(t, h, e))
        return drops

    # --- writes -----------------------------------------------------------------------------------
    def admit_put(self, key: BlockKey) -> str:
        """Decide what to do with an incoming unit: "store", "duplicate" or "invalidated"."""
        if key.model_tag in self._invalidated:
            self.counters.refused_invalidated += 1
            return "invalidated"
        if self.tiers_of(key):
            self.counters.duplicates += 1
            return "duplicate"
        self.counters.puts += 1
        return "store"

    def put_hot(self, key: BlockKey, data: bytes, now: float, depth: int | None = None) -> list[Action]:
        """Store in hot (put or promotion); returns demotions for what that evicted."""
        if self.is_pinned(key):
            self.hot.pin(key)
        if self.hot.put(key, data):
            self.note_stored(key, HOT, len(data), now, last_hit=now, depth=depth)
        else:
            self.counters.hot_refused += 1
            e = self.entry(key)
            if e is not None:
                e.last_hit = max(e.last_hit, now)
        return self._drain_evictions(up_warm=self.has_warm, up_cold=self.has_cold)

    def _drain_evictions(self, up_warm: bool, up_cold: bool) -> list[Action]:
        actions: list[Action] = []
        for ev in self.hot.take_events():
            self.counters.hot_evictions += 1
            e = self.entry(ev.key)
            if e is None:
                continue
            e.tiers &= ~HOT
            if e.tiers & (WARM | COLD):
                continue  # a slower tier already holds it: eviction loses nothing
            if up_warm:
                actions.append(Demote(ev.key, ev.data, WARM))
            elif up_cold:
                actions.append(Demote(ev.key, ev.data, COLD))
            # With a demotion pending the entry stays (no tiers, so lookups skip it) to keep its size
            # and last hit; note_stored or demotion_failed settles it.
            if not actions or actions[-1].key != ev.key:
                self._drop_if_empty(ev.key, e)
        return actions

    def take_demotions(self, warm_up: bool, cold_up: bool) -> list[Action]:
        """Demotions for evictions not drained yet, given which slower tiers are up now."""
        return self._drain_evictions(self.has_warm and warm_up, self.has_cold and cold_up)

    def demotion_failed(self, key: BlockKey) -> None:
        e = self.entry(key)
        if e is not None:
            self._drop_if_empty(key, e)

    # --- reads ------------------------------------------------------------------------------------
    def hot_get(self, key: BlockKey, now: float) -> bytes | None:
        data = self.hot.get(key)
        if data is None:
            self.counters.hot_misses += 1
            return None
        self.counters.hot_hits += 1
        self.note_hit(key, now)
        return data

    def lookup(self, model_fingerprint: str, chain: Sequence[bytes], up: int = HOT | WARM | COLD,
               include_workers: bool = True) -> LookupResult:
        """Longest prefix of `chain` held by each tier (only tiers in `up`), by any of them, and by
        each worker's local cache."""
        self.counters.lookups += 1
        tag = model_tag(model_fingerprint)
        if tag in self._invalidated:
            return LookupResult(invalidated=True)
        entries = self._models.get(tag, {})
        # Every tier's prefix is a prefix of the pool's, so walk the chain once (dict probes only) up
        # to the first block no tier holds, then find each tier's first gap with C-speed bytes ops.
        bits = bytearray()
        get = entries.get
        for h in chain:
            e = get(h)
            t = e.tiers & up if e is not None else 0
            if not t:
                break
            bits.append(t)
        pool = len(bits)
        held = bytes(bits)
        hot, warm, cold = (_first_gap(held, table) for table in _HAS_TIER)
        letters = held.translate(_CHEAPEST)
        workers: dict[str, int] = {}
        if include_workers:
            for worker_id, tags in self._workers.items():
                cached = tags.get(tag)
                count = 0
                if cached:
                    for h in chain:
                        if h not in cached:
                            break
                        count += 1
                workers[worker_id] = count
        return LookupResult(hot, warm, cold, pool, letters, workers)

    # --- lifecycle --------------------------------------------------------------------------------
    def sweep(self, now: float, warm_up: bool, cold_up: bool) -> list[Action]:
        """Archival, warm lease renewal and cold TTL decisions, oldest idle first (ties by key).

        The whole index in one call; the service walks it in slices instead (`begin_sweep`)."""
        sweep = self.begin_sweep(now, warm_up, cold_up)
        sweep.step()
        return sweep.actions()

    def begin_sweep(self, now: float, warm_up: bool, cold_up: bool) -> "SweepPass":
        """A sweep to run in bounded steps (`SweepPass.step`), so a large index never holds the caller
        for long; run to the end in one step it decides exactly what `sweep` does."""
        return SweepPass(self, now, warm_up, cold_up)

    # --- pins -------------------------------------------------------------------------------------
    def _keys_of(self, model_fingerprint: str, chain: Iterable[bytes], tenant_tag: str) -> list[BlockKey]:
        """Storage keys of a chain: the owner the index knows, else `tenant_tag` (a pin may come first)."""
        keys = []
        for h in chain:
            key = BlockKey.of(model_fingerprint, h, tenant_tag)
            e = self.entry(key)
            keys.append(key if e is None else e.key(key.model_tag, key.block_hash))
        return keys

    def pin(self, model_fingerprint: str, chain: Iterable[bytes],
            tenant_tag: str = ANONYMOUS_TENANT_TAG) -> list[BlockKey]:
        keys = self._keys_of(model_fingerprint, chain, tenant_tag)
        for key in keys:
            self._pins.add((key.model_tag, key.block_hash))
            self.hot.pin(key)
        return keys

    def restore_pin(self, key: BlockKey) -> None:
        """A pin found in storage (a warm block without expiry) during an index rebuild."""
        self._pins.add((key.model_tag, key.block_hash))
        self.hot.pin(key)

    def unpin(self, model_fingerprint: str, chain: Iterable[bytes],
              tenant_tag: str = ANONYMOUS_TENANT_TAG) -> list[BlockKey]:
        keys = self._keys_of(model_fingerprint, chain, tenant_tag)
        for key in keys:
            self._pins.discard((key.model_tag, key.block_hash))
            self.hot.unpin(key)
        return keys

    def evict(self, model_fingerprint: str, chain: Iterable[bytes],
              tenant_tag: str = ANONYMOUS_TENANT_TAG) -> tuple[list[BlockKey], int]:
        """Forget these blocks (an admin evict): index, hot, pins and tenant accounting. Returns their
        storage keys, which the caller deletes from every remote tier whatever the index believed (a
        rebuild may not have reached them yet), and how many of them the index held.

        Worker-local caches are not touched: a worker that still holds a block keeps reporting it."""
        keys = self._keys_of(model_fingerprint, chain, tenant_tag)
        held = 0
        for key in keys:
            self._pins.discard((key.model_tag, key.block_hash))
            self.hot.unpin(key)
            e = self.entry(key)
            if e is None:
                self.hot.delete(key)
                continue
            held += 1
            self._drop(key.model_tag, key.block_hash, e)
        self.counters.evicted += held
        return keys, held

    # --- models -----------------------------------------------------------------------------------
    def is_invalidated(self, model_fingerprint: str) -> bool:
        return model_tag(model_fingerprint) in self._invalidated

    def is_tag_invalidated(self, tag: str) -> bool:
        return tag in self._invalidated

    def model_fingerprint_changed(self, name: str, fingerprint: str, previous: str = "") -> list[str]:
        """Record `fingerprint` as current for `name`; returns the model tags now invalidated."""
        new_tag = model_tag(fingerprint)
        self._invalidated.discard(new_tag)  # rolling back to earlier weights makes them valid again
        self.pending_purges.discard(new_tag)
        old = {fp for fp in (self._names.get(name, ""), previous) if fp}
        self._names[name] = fingerprint
        tags = sorted({model_tag(fp) for fp in old} - {new_tag})
        for tag in tags:
            self.invalidate_tag(tag)
        return tags

    def invalidate_tag(self, tag: str) -> None:
        """Never serve this tag again; drop its index and hot entries now, storage is purged later."""
        self._invalidated.add(tag)
        self.forget_tag(tag)

    def forget_tag(self, tag: str | None) -> int:
        """Drop index, hot and worker entries of one tag (None: all) and queue a storage purge
        (ALL_TAGS for None, which also covers blocks the index never learned about)."""
        tags = list(self._models) if tag is None else [tag]
        dropped = 0
        for t in tags:
            models = self._models.pop(t, {})
            for h, e in models.items():
                self._unaccount(t, h, e)
            dropped += len(models)
            self.hot.clear(t)
        self.pending_purges.add(ALL_TAGS if tag is None else tag)
        for held in self._workers.values():
            for t in tags:
                held.pop(t, None)
        self.hot.take_events()  # clear() emits none, but keep the queue consistent
        return dropped

    def purge_done(self, tag: str) -> None:
        self.pending_purges.discard(tag)

    # --- worker-local caches ----------------------------------------------------------------------
    def worker_stored(self, worker_id: str, model_fingerprint: str, hashes: Iterable[bytes],
                      seq: int, now: float) -> None:
        self._check_seq(worker_id, seq)
        tag = model_tag(model_fingerprint)
        hashes = list(hashes)
        self._workers.setdefault(worker_id, {}).setdefault(tag, set()).update(hashes)
        self._worker_seen[worker_id] = now
        for h in hashes:  # a worker holding a pool block means it was used: a hit for archival
            self.note_hit(BlockKey(tag, h), now)

    def worker_removed(self, worker_id: str, model_fingerprint: str, hashes: Iterable[bytes],
                       all_blocks: bool, seq: int, now: float) -> None:
        self._check_seq(worker_id, seq)
        self._worker_seen[worker_id] = now
        if all_blocks:
            self._workers.pop(worker_id, None)
            return
        held = self._workers.get(worker_id, {}).get(model_tag(model_fingerprint))
        if held:
            held.difference_update(hashes)

    def forget_worker(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
        self._worker_seq.pop(worker_id, None)
        self._worker_seen.pop(worker_id, None)

    def num_worker_blocks(self) -> dict[str, int]:
        """Blocks the index attributes to each worker's local cache (every model)."""
        return {worker_id: sum(map(len, tags.values())) for worker_id, tags in self._workers.items()}

    def worker_alive(self, worker_id: str, now: float) -> None:
        if worker_id in self._workers:
            self._worker_seen[worker_id] = now

    def stale_workers(self, now: float, after_s: float) -> list[str]:
        return sorted(w for w, seen in self._worker_seen.items() if now - seen >= after_s)

    def _check_seq(self, worker_id: str, seq: int) -> None:
        if seq <= 0:
            return  # the sender does not number its events
        last = self._worker_seq.get(worker_id)
        if last is not None and seq != last + 1 and seq > last:
            self.counters.worker_event_gaps += 1
        self._worker_seq[worker_id] = max(seq, last or 0)

    # --- stats ------------------------------------------------------------------------------------
    def tier_totals(self) -> dict[str, tuple[int, int]]:
        """(blocks, bytes) per tier as the index knows them (hot: exactly what the LRU holds).

        Walks the whole index (about 60 ns a block): fine for an admin request, too slow for a timer
        on a large index, which should use the totals a sweep collects (`SweepPass.tier_totals`)."""
        blocks = [0] * 8  # by tier bit set
        nbytes = [0] * 8
        for models in self._models.values():
            for e in models.values():
                t = e.tiers
                blocks[t] += 1
                nbytes[t] += e.size
        return _fold_totals(blocks, nbytes, self.hot)

    def num_blocks(self) -> int:
        return sum(len(m) for m in self._models.values())


def _fold_totals(blocks: list[int], nbytes: list[int], hot: HotLRU) -> dict[str, tuple[int, int]]:
    """Per-tier (blocks, bytes) from counts by tier bit set; hot from the LRU itself (exact)."""
    totals = {name: (sum(blocks[t] for t in range(8) if t & bit), sum(nbytes[t] for t in range(8) if t & bit))
              for name, bit in TIER_BITS.items()}
    totals["hot"] = (len(hot), hot.bytes_used)
    return totals


class SweepPass:
    """One lifecycle sweep (`PoolCore.sweep` rules) walked in bounded steps; pure and deterministic.

    `step(n)` examines at most n index entries and returns True once every entry has been examined;
    `actions()` then lists the decisions, oldest idle first (ties by key), as `PoolCore.sweep`. The
    walk covers the model tags and, per tag, the block hashes present when it reaches that tag (one
    snapshot of the tag's keys, a C-speed copy); each entry is judged from its state at the step that
    examines it, with the pass's `now`. So between steps the index may change: an entry dropped or
    invalidated meanwhile is skipped, one added after its tag's snapshot waits for the next sweep, and
    a pin or hit that lands after its entry was examined applies from the next sweep (the service
    re-checks nothing: a renewal or archival of a block hit a moment ago is harmless). Run in one step
    (`step()` with no limit) the result is exactly `PoolCore.sweep`'s.

    The pass also counts blocks and bytes per tier over the entries it examined (`tier_totals`), so a
    service can report warm/cold totals without another walk of the index.
    """

    def __init__(self, core: PoolCore, now: float, warm_up: bool, cold_up: bool) -> None:
        self.core = core
        self.now = now
        self.warm_up = warm_up
        self.cold_up = cold_up
        self.examined = 0
        self._tags = [t for t in core._models if t not in core._invalidated]
        self._next_tag = 0
        self._tag = ""
        self._models: dict[bytes, Entry] | None = None
        self._hashes: list[bytes] = []
        self._pos = 0
        self._found: list[tuple[float, BlockKey, Action]] = []
        self._blocks = [0] * 8  # by tier bit set
        self._bytes = [0] * 8

    @property
    def done(self) -> bool:
        return self._models is None and self._next_tag >= len(self._tags)

    def step(self, max_entries: int | None = None) -> bool:
        """Examine up to `max_entries` more entries (all that are left when None); True when done."""
        core = self.core
        budget = max_entries if max_entries is not None else -1
        while budget != 0:
            if self._models is None:
                if self._next_tag >= len(self._tags):
                    return True
                self._tag = self._tags[self._next_tag]
                self._next_tag += 1
                models = core._models.get(self._tag)
                if models is None or self._tag in core._invalidated:
                    continue
                self._models, self._hashes, self._pos = models, list(models), 0
            if core._models.get(self._tag) is not self._models or self._tag in core._invalidated:
                self._models = None  # cleared or invalidated since the snapshot: the purge handles it
                continue
            end = len(self._hashes) if budget < 0 else min(len(self._hashes), self._pos + budget)
            self._examine(self._hashes, self._pos, end)
            if budget > 0:
                budget -= end - self._pos
            self.examined += end - self._pos
            self._pos = end
            if end >= len(self._hashes):
                self._models, self._hashes = None, []
        return self.done

    def _examine(self, hashes: list[bytes], start: int, end: int) -> None:
        core, now, tag = self.core, self.now, self._tag
        get = self._models.get
        pins = core._pins
        found = self._found
        blocks, nbytes = self._blocks, self._bytes
        warm_up = self.warm_up
        can_archive = core.has_cold and self.cold_up
        archive_after = core.archive_after_s
        renew_after = core.warm_ttl_s - core.renew_margin_s
        can_expire = self.cold_up and core.cold_ttl_s > 0
        cold_ttl = core.cold_ttl_s
        for i in range(start, end):
            h = hashes[i]
            e = get(h)
            if e is None:
                continue  # dropped since the snapshot
            t = e.tiers
            blocks[t] += 1
            nbytes[t] += e.size
            if t & WARM and warm_up:
                if now - e.last_hit >= archive_after and can_archive:
                    kind = Archive
                elif now - e.warm_touch >= renew_after:
                    kind = RenewWarm
                else:
                    continue
            elif t == COLD and can_expire and now - e.last_hit >= cold_ttl:
                kind = ExpireCold
            else:
                continue
            if (tag, h) in pins:
                continue
            key = e.key(tag, h)
            action = Archive(key, bool(t & COLD)) if kind is Archive else kind(key)
            found.append((e.last_hit, key, action))

    def actions(self) -> list[Action]:
        """The decisions so far, oldest idle first (ties by key)."""
        self._found.sort()  # (last hit, key, action): keys are unique, so actions are never compared
        return [c[2] for c in self._found]

    def tier_totals(self) -> dict[str, tuple[int, int]]:
        """(blocks, bytes) per tier over the entries examined (hot: the LRU now, exact)."""
        return _fold_totals(self._blocks, self._bytes, self.core.hot)
