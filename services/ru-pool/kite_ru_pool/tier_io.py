"""Tier I/O: carries the core's decisions out on the hot, warm and cold tiers and reports the outcomes
back to it. Puts (verify, admit, quota, hot, write-through), gets (hot, then warm and cold read in
batches, promoting what it reads), demotions, deletions of dropped blocks, pins in storage, and the
verification of units copied between tiers. A unit written to warm or cold goes in the codec it names for
that tier (`stored_form`: transcoded on a thread when that codec is lossy; kite_shared.tier_codecs).

Boundary: calls the pure core (core.PoolCore), the tier clients (kite_shared.tiers: RedisTier,
S3Tier/LocalDirTier behind TierClient) and, when the pool has a hand-off folder, its hot files
(kite_shared.tiers.handoff.HotFiles: what enters hot moves into a file of its own, written on a thread
right after, which same-host readers map); knows nothing of NATS or messages.
Every change it makes to what warm and cold hold is also recorded in the index change log
(index_changes.IndexChangeLog), which the replica layer sends to the other replicas.
No call waits on a slow tier longer than that tier's timeout, and writes run as background tasks
(background.py), so a put returns as soon as the unit is verified and in the hot tier. Warm/cold failures
only mark the tier down (kite_shared.tiers.base): the pool keeps answering, with misses for that tier.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from kite_shared import kv_codec, recyclable_unit, security
from kite_shared.messages import ErrorInfo
from kite_shared.tiers import metrics
from kite_shared.tiers.client import TierClient
from kite_shared.tiers.handoff import HotFiles
from kite_shared.tiers.keys import BlockKey, model_tag
from kite_ru_pool.background import BackgroundTasks
from kite_ru_pool.core import COLD, HOT, WARM, Demote, DropBlock, PoolCore
from kite_ru_pool.index_changes import IndexChangeLog

log = logging.getLogger(__name__)
# Bound once: a hot read of 128 blocks counted each through `labels()` spent a fifth of its time
# in prometheus-client's label lookup (py-spy, issue 15).
_HOT_HITS = metrics.TIER_HITS.labels("hot")
_HOT_MISSES = metrics.TIER_MISSES.labels("hot")
_HOT_BYTES_READ = metrics.TIER_BYTES.labels("hot", "read")
_HOT_FETCH_SECONDS = metrics.TIER_FETCH_SECONDS.labels("hot")

MAX_PENDING_WARM_WRITES = 256  # beyond this, write-through is skipped (demotion on eviction covers it)
FETCH_CONCURRENCY = 8  # warm/cold reads one get runs at once


@dataclass
class FoundBlocks:
    """What a get found: the leading verified units, in order (bytes, or views of hot files), and the
    tier each came from; `complete` is False when the budget, not a miss, ended it."""

    units: list[bytes | memoryview] = field(default_factory=list)
    tiers: bytes = b""
    complete: bool = True
    error: ErrorInfo | None = None


class TierIO:
    def __init__(self, core: PoolCore, tiers: TierClient, ru_key: bytes, clock: Callable[[], float],
                 background: BackgroundTasks, changes: IndexChangeLog | None = None,
                 hot_files: HotFiles | None = None) -> None:
        self.core = core
        # Units entering hot move into files same-host readers map (None: in process memory only).
        self.hot_files = hot_files
        # What this replica changes in warm and cold, for the other replicas (none: a disabled log).
        self.changes = changes if changes is not None else IndexChangeLog(enabled=False)
        self.tiers = tiers
        self.warm = tiers.warm
        self.cold = tiers.cold
        self.ru_key = ru_key  # every unit put or moved must carry a valid HMAC under this cluster key
        self.clock = clock
        self.background = background
        # True while the index is being rebuilt from the tiers' listings (maintenance sets it): reads
        # then ask the tiers for blocks the index does not know yet.
        self.rebuilding = False
        self._pending_warm_writes = 0
        self._writing: set[BlockKey] = set()  # write-throughs in flight
        self._dropped_while_writing: set[BlockKey] = set()  # ... whose block was dropped meanwhile

    def up_mask(self) -> int:
        """The tiers answering now, as a bit set for lookups."""
        mask = HOT
        if self.warm is not None and self.warm.up:
            mask |= WARM
        if self.cold is not None and self.cold.up:
            mask |= COLD
        return mask

    # --- put ------------------------------------------------------------------------------------------
    def put_bytes(self, data: bytes) -> str:
        """Verify and store one encoded unit; returns the core's decision, "corrupt" or "over_quota"."""
        try:
            unit = recyclable_unit.decode(data, key=self.ru_key)
        except recyclable_unit.RUError as exc:
            self.core.counters.refused_corrupt += 1
            if isinstance(exc, recyclable_unit.RUAuthError):
                metrics.TIER_INTEGRITY_FAILURES.labels("hot").inc()
            log.warning("refused a put: not an intact recyclable unit (%s: %s)", type(exc).__name__, exc)
            return "corrupt"
        key = BlockKey.of(unit.model_fingerprint, unit.block_hash, unit.tenant_tag)
        decision = self.core.admit_put(key)
        if decision != "store":
            return decision
        drops = self.core.reserve_quota(key, len(data))
        if drops is None:
            metrics.POOL_QUOTA_REFUSED.inc()
            log.info("refused a put of tenant %s: its pinned blocks fill its quota of %d bytes",
                     key.tenant_tag, self.core.quota_of(key.tenant_tag))
            return "over_quota"
        if drops:
            metrics.POOL_QUOTA_EVICTIONS.inc(len(drops))
            self.changes.dropped(drop.key for drop in drops)
            for drop in drops:
                self.drop_stored(drop)
        data = bytes(data)
        self.put_hot(key, data, depth=unit.block_index)
        if self.warm is not None:
            if self._pending_warm_writes >= MAX_PENDING_WARM_WRITES:
                self.core.counters.warm_writes_dropped += 1
            else:
                self._pending_warm_writes += 1
                self.background.spawn(self._write_through(key, data, unit.block_index), "warm write-through")
        elif not self.core.tiers_of(key) & HOT and self.cold is not None:
            self.background.spawn(self.demote(Demote(key, data, COLD)), "cold write")
        return decision

    async def _write_through(self, key: BlockKey, data: bytes, depth: int) -> None:
        self._writing.add(key)
        try:
            data = await self.stored_form(key, data, "warm")
            if data is None:
                return
            if await self.warm.put(key, data, pinned=self.core.is_pinned(key)):
                if key in self._dropped_while_writing:
                    await self.warm.delete(key)  # a quota eviction or clear took it meanwhile
                    return
                self.note_stored(key, WARM, len(data), depth=depth)
            elif not self.core.tiers_of(key) and self.cold is not None:
                # Neither hot (did not fit) nor warm (down) holds it: keep it in cold rather than lose it.
                await self.demote(Demote(key, data, COLD))
        finally:
            self._pending_warm_writes -= 1
            self._writing.discard(key)
            self._dropped_while_writing.discard(key)

    # --- get ------------------------------------------------------------------------------------------
    async def get_blocks(self, model_fingerprint: str, hashes: list[bytes], budget: int,
                         tenant_tag: str = security.ANONYMOUS_TENANT_TAG) -> FoundBlocks:
        """Leading verified units of `hashes` (blocks of tenant `tenant_tag`) within `budget` bytes,
        promoting what it reads."""
        if self.core.is_invalidated(model_fingerprint):
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
            data = self.core.hot_get(key, self.clock())
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
                       and not self.core.tiers_of(keys[j]) & HOT):
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
        self.changes.hits([k for k in keys if self.core.tiers_of(k) & (WARM | COLD)], self.clock())

    async def _fetch_remote(self, model_fingerprint: str, block_hash: bytes,
                            tenant_tag: str) -> tuple[bytes, str] | None:
        """A verified unit from warm, else cold, promoted on the way; None on a miss."""
        key = BlockKey.of(model_fingerprint, block_hash, tenant_tag)
        entry = self.core.entry(key)
        if entry is not None and entry.tenant_tag != tenant_tag:
            return None  # another tenant's block: a miss, and no reason to doubt the index
        known = 0 if entry is None else entry.tiers
        # While the index is rebuilding it may not know the block yet: ask the tiers anyway.
        try_all = self.rebuilding and not known
        for tier, bit, letter in ((self.warm, WARM, "w"), (self.cold, COLD, "c")):
            if tier is None or not (known & bit or try_all):
                continue
            found = await tier.get_unit(model_fingerprint, block_hash, tenant_tag)
            if found is None:
                if known & bit and tier.up:
                    self.note_missing(key, bit)  # expired, deleted or corrupt: not there any more
                continue
            _, data = found
            now = self.clock()
            self.core.note_stored(key, bit, len(data), now, last_hit=now)
            self._promote(key, data, from_bit=bit)
            return data, letter
        return None

    def _promote(self, key: BlockKey, data: bytes, from_bit: int) -> None:
        if self.put_hot(key, data):
            self.core.counters.promotions += 1
            metrics.TIER_PROMOTIONS.inc()
        if from_bit == COLD and self.warm is not None and self.warm.up:
            self.background.spawn(self._promote_to_warm(key, data), "promotion to warm")

    async def _promote_to_warm(self, key: BlockKey, data: bytes) -> None:
        data = await self.stored_form(key, data, "warm", source="cold")
        if data is not None and await self.warm.put(key, data, pinned=self.core.is_pinned(key)):
            self.note_stored(key, WARM, len(data))
            self.core.counters.promotions += 1
            metrics.TIER_PROMOTIONS.inc()

    # --- moves between tiers --------------------------------------------------------------------------
    def put_hot(self, key: BlockKey, data: bytes | memoryview, depth: int | None = None) -> bool:
        """Put into hot through the core (as a hot file when the pool has them), counting evictions and
        starting the demotions they need."""
        before = self.core.counters.hot_evictions
        actions = self.core.put_hot(key, data, self.clock(), depth)
        evicted = self.core.counters.hot_evictions - before
        if evicted:
            metrics.TIER_EVICTIONS.labels("hot").inc(evicted)
        for action in actions:
            self.background.spawn(self.demote(action), "demotion")
        stored = bool(self.core.tiers_of(key) & HOT)
        if stored:
            metrics.TIER_BYTES.labels("hot", "write").inc(len(data))
            if self.hot_files is not None and not isinstance(data, memoryview):
                self.background.spawn(self._into_hot_file(key, data), "hot file")
        return stored

    async def _into_hot_file(self, key: BlockKey, data: bytes) -> None:
        """Move a unit the hot tier holds into a hot file same-host readers can map: written on a thread
        (a put must not wait for it: about 1 ms per 369 KB unit on a loaded 2-core machine), then
        swapped in unless hot has let go of those bytes meanwhile (evicted, replaced: the file goes)."""
        path = await asyncio.to_thread(self.hot_files.write, data)
        view = None if path is None else self.hot_files.map(path)
        if view is not None:
            self.core.hot.swap(key, data, view)

    async def demote(self, action: Demote) -> None:
        now = self.clock()
        order = [(self.warm, WARM), (self.cold, COLD)] if action.tier == WARM else [(self.cold, COLD)]
        for tier, bit in order:
            if tier is None:
                continue
            data = await self.stored_form(action.key, action.data, tier.name)
            if data is None:
                break
            if await tier.put(action.key, data, pinned=self.core.is_pinned(action.key)):
                self.note_stored(action.key, bit, len(data), now)
                self.core.counters.demotions += 1
                metrics.TIER_DEMOTIONS.inc()
                return
        log.debug("demotion of %s failed: no slower tier took it", action.key.short())
        self.core.demotion_failed(action.key)

    async def stored_form(self, key: BlockKey, data: bytes | memoryview, tier: str,
                          source: str = "hot") -> bytes | memoryview | None:
        """`data` as `tier` ("warm" or "cold") stores it: the same bytes, or the unit transcoded into the
        lossy codec it names for that tier (verified and signed again, on a thread; docs/benchmarks.md,
        "KV codecs", gives the cost). A unit the codec has no form for (non-finite values) is stored as it
        is, counted: exact KV is valid in any namespace. None when the unit does not verify (an
        integrity failure of `source`, the tier it was read from): `tier` is not written then."""
        try:
            codec, warm_codec, cold_codec = recyclable_unit.stored_codecs(data)
            wanted = warm_codec if tier == "warm" else cold_codec
            if not wanted or wanted == codec:
                return data
            started = time.perf_counter()
            transcoded = await asyncio.to_thread(kv_codec.transcode, data, wanted, self.ru_key)
        except recyclable_unit.RUError as exc:
            metrics.TIER_INTEGRITY_FAILURES.labels(source).inc()
            log.warning("block %s was not written to %s: it does not verify (%s: %s)", key.short(), tier,
                        type(exc).__name__, exc)
            return None
        except kv_codec.CodecError as exc:
            self.core.counters.transcode_refused += 1
            metrics.TIER_TRANSCODE_REFUSALS.inc()
            log.warning("block %s is stored in %s as it is, not in %s: %s", key.short(), tier, wanted, exc)
            return data
        metrics.TIER_TRANSCODE_SECONDS.observe(time.perf_counter() - started)
        metrics.TIER_TRANSCODES.labels(tier, wanted).inc()
        self.core.counters.transcoded += 1
        return transcoded

    def drop_stored(self, drop: DropBlock) -> asyncio.Task:
        """Delete a block the core just dropped (quota, tenant clear) from the tiers that held it, and
        from warm too if a write-through of it is still running."""
        if drop.key in self._writing:
            self._dropped_while_writing.add(drop.key)

        async def delete() -> None:
            for tier, bit in ((self.warm, WARM), (self.cold, COLD)):
                if tier is not None and drop.tiers & bit:
                    await tier.delete(drop.key)  # a tier that is down keeps it until TTL or a rebuild
        return self.background.spawn(delete(), "deletion of a dropped block")

    async def delete_everywhere(self, keys: list[BlockKey]) -> list[str]:
        """Delete these blocks from every remote tier, whatever the index believes, and from what a
        write-through in flight writes; returns the names of the tiers that were down (they keep their
        copies until their TTL, a later delete, or a rebuild indexes them)."""
        self._dropped_while_writing.update(key for key in keys if key in self._writing)
        down = []
        for tier in self.tiers.tiers:
            await tier.delete_many(keys)  # one round trip per tier; missing keys are no error
            if not tier.up:
                down.append(tier.name)
        return down

    async def pin_storage(self, model_fingerprint: str, key: BlockKey, block_hash: bytes) -> int:
        """Make a pinned block survive restarts and expiry: keep it in warm without TTL (and hot).
        1 when the pool holds the block, else 0."""
        tiers = self.core.tiers_of(key)
        if not tiers:
            return 0
        if self.warm is None:
            return 1
        if tiers & WARM:
            if await self.warm.set_pinned(key, True):
                return 1
            if not self.warm.up:
                return 1
            self.note_missing(key, WARM)
            tiers = self.core.tiers_of(key)
        data = self.core.hot.peek(key)
        if data is None and tiers & COLD:
            found = await self.cold.get_unit(model_fingerprint, block_hash, key.tenant_tag)
            if found is not None:
                data = found[1]
                self.put_hot(key, data)
        if data is not None:
            data = await self.stored_form(key, data, "warm", source="hot" if tiers & HOT else "cold")
        if data is not None and await self.warm.put(key, data, pinned=True):
            self.note_stored(key, WARM, len(data))
        return 1 if self.core.tiers_of(key) else 0

    async def unpin_storage(self, key: BlockKey) -> int:
        """Give an unpinned block its warm TTL back; 1 when the pool holds the block, else 0."""
        if self.warm is not None and self.core.tiers_of(key) & WARM:
            if await self.warm.set_pinned(key, False):
                self.note_renewed(key)
        return int(bool(self.core.tiers_of(key)))

    # --- the index, as every replica's is kept ---------------------------------------------------------
    def note_stored(self, key: BlockKey, tier: int, size: int, now: float | None = None,
                    last_hit: float | None = None, depth: int | None = None) -> None:
        """A shared tier (WARM or COLD) now holds the block: in this index, and for the other replicas."""
        now = self.clock() if now is None else now
        self.core.note_stored(key, tier, size, now, last_hit=last_hit, depth=depth)
        e = self.core.entry(key)
        if e is not None:
            self.changes.stored(key, tier, size, e.last_hit, e.depth if depth is None else depth)

    def note_missing(self, key: BlockKey, tier: int) -> None:
        """A shared tier (WARM or COLD) turned out not to hold the block."""
        self.core.note_missing(key, tier)
        self.changes.missing(key, tier)

    def note_renewed(self, key: BlockKey) -> None:
        now = self.clock()
        self.core.note_renewed(key, now)
        self.changes.renewed(key, now)

    # --- verification ---------------------------------------------------------------------------------
    def intact(self, key: BlockKey, data: bytes, tier: str) -> bool:
        """Verify bytes read for copying between tiers (the full fingerprint is unknown: check the tag)."""
        try:
            unit = recyclable_unit.decode(data, expected_hash=key.block_hash, key=self.ru_key)
            if model_tag(unit.model_fingerprint) != key.model_tag:
                raise recyclable_unit.RUKeyMismatchError("unit belongs to another model tag")
        except recyclable_unit.RUError as exc:
            metrics.TIER_INTEGRITY_FAILURES.labels(tier).inc()
            t = self.warm if tier == "warm" else self.cold
            if t is not None:
                t.integrity_failures += 1
            log.warning("%s tier: block %s failed verification while moving it (%s); deleted",
                        tier, key.short(), exc)
            return False
        return True
