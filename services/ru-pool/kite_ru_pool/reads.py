"""Reads: lookups ("how much of this chain does the pool hold, in which tier, and how much does each
worker's own cache hold?") and gets (the leading verified units of a chain: hot first, then warm and cold
read in batches, promoting what they read); and the same promotion of a block a worker read from warm or
cold itself (`promote_reported`, which worker_hits.WorkerHits calls).

Boundary: part of the coordinating layer. A lookup calls the lower layers once each (tier_io.TierIO for
the tiers up, index.BlockIndex for the prefixes, worker_caches.WorkerCaches for the workers'); a get
asks the index where each block is, reads it through tier I/O, and notes what it learned in the index,
through writes.PoolWrites when it changes what warm and cold hold (the only other part it calls: the
promotion into hot and what a read found missing). Nothing below calls back into it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kite_shared import security
from kite_shared.messages import ErrorInfo
from kite_shared.tiers import metrics
from kite_shared.tiers.keys import BlockKey, model_tag
from kite_ru_pool.background import BackgroundTasks
from kite_ru_pool.counters import Counters
from kite_ru_pool.index import COLD, HOT, WARM, BlockIndex
from kite_ru_pool.index_changes import IndexChangeLog
from kite_ru_pool.namespaces import NamespaceAudit
from kite_ru_pool.tier_io import FETCH_CONCURRENCY, TierIO
from kite_ru_pool.worker_caches import WorkerCaches
from kite_ru_pool.writes import PoolWrites

# Bound once: a hot read of 128 blocks counted each through `labels()` spent a fifth of its time
# in prometheus-client's label lookup (py-spy, issue 15).
_HOT_HITS = metrics.TIER_HITS.labels("hot")
_HOT_MISSES = metrics.TIER_MISSES.labels("hot")
_HOT_BYTES_READ = metrics.TIER_BYTES.labels("hot", "read")
_HOT_FETCH_SECONDS = metrics.TIER_FETCH_SECONDS.labels("hot")


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
class FoundBlocks:
    """What a get found: the leading verified units, in order (bytes, or views of hot files), and the
    tier each came from; `complete` is False when the budget, not a miss, ended it. `lent_files`: the hot
    files holding every unit, when the caller asked for them and each is in one (else empty)."""

    units: list[bytes | memoryview] = field(default_factory=list)
    tiers: bytes = b""
    complete: bool = True
    error: ErrorInfo | None = None
    lent_files: list[str] = field(default_factory=list)


class PoolReads:
    def __init__(self, index: BlockIndex, io: TierIO, workers: WorkerCaches, writes: PoolWrites,
                 namespaces: NamespaceAudit, changes: IndexChangeLog, counters: Counters,
                 clock: Callable[[], float], background: BackgroundTasks) -> None:
        self.index = index
        self.io = io
        self.workers = workers
        self.writes = writes
        self.namespaces = namespaces
        self.changes = changes
        self.counters = counters
        self.clock = clock
        self.background = background

    # --- lookups ------------------------------------------------------------------------------------------
    def lookup(self, model_fingerprint: str, chain: Sequence[bytes], up: int | None = None,
               include_workers: bool = True) -> LookupResult:
        """Longest prefix of `chain` held by each tier (only tiers in `up`; None: the tiers answering
        now), by any of them, and by each worker's local cache."""
        self.counters.lookups += 1
        if up is None:
            up = self.io.up_mask()
        tag = model_tag(model_fingerprint)
        if self.index.is_tag_invalidated(tag):
            return LookupResult(invalidated=True)
        hot, warm, cold, pool, letters = self.index.prefixes(tag, chain, up)
        workers = self.workers.prefix_lengths(tag, chain) if include_workers else {}
        return LookupResult(hot, warm, cold, pool, letters, workers)

    def hot_get(self, key: BlockKey, now: float) -> bytes | None:
        """The unit if hot holds it (a hit: counted, and the block's last hit moves to `now`)."""
        data = self.io.hot.get(key)
        if data is None:
            self.counters.hot_misses += 1
            return None
        self.counters.hot_hits += 1
        self.index.note_hit(key, now)
        return data

    # --- gets -----------------------------------------------------------------------------------------------
    async def get_blocks(self, model_fingerprint: str, hashes: list[bytes], budget: int,
                         tenant_tag: str = security.ANONYMOUS_TENANT_TAG, lend_files: bool = False) -> FoundBlocks:
        """Leading verified units of `hashes` (blocks of tenant `tenant_tag`) within `budget` bytes,
        promoting what it reads; with `lend_files`, also the hot files that hold them (FoundBlocks)."""
        found = await self._find(model_fingerprint, hashes, budget, tenant_tag)
        if found.units:
            self.namespaces.served(model_tag(model_fingerprint), len(found.units))
            if lend_files:
                found.lent_files = self.io.lent_paths(found.units)
        return found

    async def _find(self, model_fingerprint: str, hashes: list[bytes], budget: int,
                    tenant_tag: str) -> FoundBlocks:
        if self.index.is_tag_invalidated(model_tag(model_fingerprint)):
            return FoundBlocks(error=ErrorInfo(
                code="invalidated", message="this model fingerprint was replaced; its blocks are gone"))
        units: list[bytes | memoryview] = []
        letters = bytearray()
        total = 0
        i = 0
        keys = [BlockKey.of(model_fingerprint, h, tenant_tag) for h in hashes]
        while i < len(hashes):
            key = keys[i]
            started = time.perf_counter()
            data = self.hot_get(key, self.clock())
            if data is not None:
                _HOT_HITS.inc()
                _HOT_BYTES_READ.inc(len(data))
                _HOT_FETCH_SECONDS.observe(time.perf_counter() - started)
                found = [(data, "h")]
                stop = False
            else:
                _HOT_MISSES.inc()
                # Read the run of non-hot blocks that follows concurrently: one round trip, not N.
                batch = [hashes[i]]
                j = i + 1
                while (j < len(hashes) and len(batch) < FETCH_CONCURRENCY
                       and not self.index.tiers_of(keys[j]) & HOT):
                    batch.append(hashes[j])
                    j += 1
                results = await asyncio.gather(*(self._fetch_remote(model_fingerprint, h, tenant_tag)
                                                 for h in batch))
                found = []
                for r in results:
                    if r is None:
                        break
                    found.append(r)
                stop = len(found) < len(batch)
            for unit_bytes, letter in found:
                if len(unit_bytes) > budget:
                    self._note_read(keys[:len(units)])
                    return FoundBlocks(units=units, tiers=bytes(letters), complete=False,
                                       error=ErrorInfo(code="too_large", message=(
                                            f"a unit of {len(unit_bytes)} bytes exceeds the reply budget "
                                            f"of {budget}; read it from the tiers directly")))
                if total + len(unit_bytes) > budget:
                    self._note_read(keys[:len(units)])
                    return FoundBlocks(units=units, tiers=bytes(letters), complete=False)
                units.append(unit_bytes)
                letters += letter.encode()
                total += len(unit_bytes)
            i += len(found)
            if stop:
                break
        self._note_read(keys[:len(units)])
        return FoundBlocks(units=units, tiers=bytes(letters), complete=True)

    def _note_read(self, keys: list[BlockKey]) -> None:
        """Tell the other replicas these blocks were read (their sweeps then do not archive or expire
        them as idle); only blocks the shared tiers hold matter to them."""
        if not keys or not self.changes.enabled:
            return
        self.changes.hits([k for k in keys if self.index.tiers_of(k) & (WARM | COLD)], self.clock())

    async def promote_reported(self, model_fingerprint: str, block_hash: bytes, tenant_tag: str,
                               found_in: int = 0) -> bool:
        """A block a worker read from warm or cold itself (`found_in`: WARM or COLD, where it found it;
        0: not said), promoted as a get's read of it would be: read from warm, else cold, into hot, and
        from cold into warm too. False when nothing was read: the model is invalidated, hot holds the
        block already, or no tier has it now. Counted as a promotion only when hot took it."""
        if self.index.is_tag_invalidated(model_tag(model_fingerprint)):
            return False
        if self.index.tiers_of(BlockKey.of(model_fingerprint, block_hash, tenant_tag)) & HOT:
            return False
        return await self._fetch_remote(model_fingerprint, block_hash, tenant_tag, also=found_in) is not None

    async def _fetch_remote(self, model_fingerprint: str, block_hash: bytes,
                            tenant_tag: str, also: int = 0) -> tuple[bytes, str] | None:
        """A verified unit from warm, else cold, promoted on the way; None on a miss. `also`: tiers to
        ask even when the index does not know the block there (a worker just read it there: the
        write or rebuild that tells this replica may not have arrived yet)."""
        key = BlockKey.of(model_fingerprint, block_hash, tenant_tag)
        entry = self.index.entry(key)
        if entry is not None and entry.tenant_tag != tenant_tag:
            return None  # another tenant's block: a miss, and no reason to doubt the index
        known = 0 if entry is None else entry.tiers
        # While the index is rebuilding it may not know the block yet: ask the tiers anyway.
        try_all = self.index.rebuilding and not known
        for tier, bit, letter in ((self.io.warm, WARM, "w"), (self.io.cold, COLD, "c")):
            if tier is None or not (known & bit or try_all or also & bit):
                continue
            found = await tier.get_unit(model_fingerprint, block_hash, tenant_tag)
            if found is None:
                if known & bit and tier.up:
                    self.writes.record_missing(key, bit)  # expired, deleted or corrupt: not there any more
                continue
            _, data = found
            now = self.clock()
            self.index.note_stored(key, bit, len(data), now, last_hit=now)
            self._promote(key, data, from_bit=bit)
            return data, letter
        return None

    def _promote(self, key: BlockKey, data: bytes, from_bit: int) -> None:
        if self.writes.store_hot(key, data):
            self.counters.promotions += 1
            metrics.TIER_PROMOTIONS.inc()
        if from_bit == COLD and self.io.warm is not None and self.io.warm.up:
            self.background.spawn(self._promote_to_warm(key, data), "promotion to warm")

    async def _promote_to_warm(self, key: BlockKey, data: bytes) -> None:
        data = await self.io.stored_form(key, data, "warm", source="cold")
        if data is not None and await self.io.warm.put(key, data, pinned=self.index.is_pinned(key)):
            self.writes.record_stored(key, WARM, len(data))
            self.counters.promotions += 1
            metrics.TIER_PROMOTIONS.inc()
