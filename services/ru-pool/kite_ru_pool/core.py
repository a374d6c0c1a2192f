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
    again; its blocks are listed for a background purge until the purge succeeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from kite_shared.tiers.hot import HotLRU
from kite_shared.tiers.keys import BlockKey, model_tag

HOT, WARM, COLD = 1, 2, 4
TIER_BITS = {"hot": HOT, "warm": WARM, "cold": COLD}
TIER_LETTER = {HOT: b"h", WARM: b"w", COLD: b"c"}
ALL_TAGS = "*"  # pending_purges entry meaning every block of every model

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


Action = Demote | Archive | RenewWarm | ExpireCold


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


class PoolCore:
    def __init__(self, hot_bytes: int, archive_after_s: float, warm_ttl_s: float, cold_ttl_s: float,
                 sweep_interval_s: float, has_warm: bool, has_cold: bool) -> None:
        self.hot = HotLRU(hot_bytes)
        self.archive_after_s = archive_after_s
        self.warm_ttl_s = warm_ttl_s
        self.cold_ttl_s = cold_ttl_s
        # Renew early enough that a sweep or two running late cannot let Redis expire a wanted block.
        self.renew_margin_s = min(3 * sweep_interval_s, warm_ttl_s / 2)
        self.has_warm = has_warm
        self.has_cold = has_cold
        self.counters = Counters()
        self._models: dict[str, dict[bytes, Entry]] = {}
        self._pins: set[BlockKey] = set()
        self._names: dict[str, str] = {}  # model name -> current fingerprint
        self._invalidated: set[str] = set()  # model tags never served again
        self.pending_purges: set[str] = set()  # invalidated or cleared tags whose storage needs purging
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
            e = models[key.block_hash] = Entry()
        return e

    def _drop_if_empty(self, key: BlockKey, e: Entry) -> None:
        if e.tiers == 0:
            models = self._models.get(key.model_tag)
            if models is not None:
                models.pop(key.block_hash, None)
                if not models:
                    del self._models[key.model_tag]

    def note_stored(self, key: BlockKey, tier: int, size: int, now: float,
                    last_hit: float | None = None) -> None:
        """A tier now holds the block (written, promoted, or found by a rebuild)."""
        e = self._ensure(key)
        e.tiers |= tier
        e.size = size or e.size
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
            self.hot.delete(key)
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
        return key in self._pins

    def keys_in(self, tier: int, tag: str | None = None) -> list[BlockKey]:
        """Keys the index believes `tier` holds (sorted, for deterministic purges and tests)."""
        out = []
        for t, models in self._models.items():
            if tag is not None and t != tag:
                continue
            out.extend(BlockKey(t, h) for h, e in models.items() if e.tiers & tier)
        return sorted(out)

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

    def put_hot(self, key: BlockKey, data: bytes, now: float) -> list[Action]:
        """Store in hot (put or promotion); returns demotions for what that evicted."""
        if key in self._pins:
            self.hot.pin(key)
        if self.hot.put(key, data):
            self.note_stored(key, HOT, len(data), now, last_hit=now)
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
        """Archival, warm lease renewal and cold TTL decisions, oldest idle first (ties by key)."""
        candidates: list[tuple[float, BlockKey, Entry]] = []
        for tag, models in self._models.items():
            if tag in self._invalidated:
                continue  # the purge handles these
            for h, e in models.items():
                candidates.append((e.last_hit, BlockKey(tag, h), e))
        candidates.sort(key=lambda c: (c[0], c[1]))
        actions: list[Action] = []
        for last_hit, key, e in candidates:
            if key in self._pins:
                continue
            idle = now - last_hit
            if e.tiers & WARM and warm_up:
                if idle >= self.archive_after_s and self.has_cold and cold_up:
                    actions.append(Archive(key, bool(e.tiers & COLD)))
                elif now - e.warm_touch >= self.warm_ttl_s - self.renew_margin_s:
                    actions.append(RenewWarm(key))
            elif (e.tiers == COLD and cold_up and self.cold_ttl_s > 0 and idle >= self.cold_ttl_s):
                actions.append(ExpireCold(key))
        return actions

    # --- pins -------------------------------------------------------------------------------------
    def pin(self, model_fingerprint: str, chain: Iterable[bytes]) -> list[BlockKey]:
        keys = [BlockKey.of(model_fingerprint, h) for h in chain]
        for key in keys:
            self._pins.add(key)
            self.hot.pin(key)
        return keys

    def restore_pin(self, key: BlockKey) -> None:
        """A pin found in storage (a warm block without expiry) during an index rebuild."""
        self._pins.add(key)
        self.hot.pin(key)

    def unpin(self, model_fingerprint: str, chain: Iterable[bytes]) -> list[BlockKey]:
        keys = [BlockKey.of(model_fingerprint, h) for h in chain]
        for key in keys:
            self._pins.discard(key)
            self.hot.unpin(key)
        return keys

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
            dropped += len(self._models.pop(t, {}))
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
        """(blocks, bytes) per tier as the index knows them."""
        totals = {"hot": [0, 0], "warm": [0, 0], "cold": [0, 0]}
        for models in self._models.values():
            for e in models.values():
                for name, bit in TIER_BITS.items():
                    if e.tiers & bit:
                        totals[name][0] += 1
                        totals[name][1] += e.size
        totals["hot"] = [len(self.hot), self.hot.bytes_used]  # exact
        return {k: (v[0], v[1]) for k, v in totals.items()}

    def num_blocks(self) -> int:
        return sum(len(m) for m in self._models.values())
