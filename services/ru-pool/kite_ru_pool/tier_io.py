"""Tier I/O: the bytes of the pool's three tiers. The hot tier (kite_shared.tiers.hot.HotLRU, and the hot
files same-host readers map when the pool has a hand-off folder), warm (RedisTier) and cold
(S3Tier/LocalDirTier) behind kite_shared.tiers.client.TierClient; the verification of what enters the
pool and of units copied between tiers; the transcoding of a unit into the lossier codec it names for warm
or cold (`stored_form`, kite_shared.tier_codecs); which tiers answer now.

Boundary: a lower layer, beside the index (index.py) and under the coordinating parts (reads, writes,
catalog, maintenance, admin), which call `hot`, `warm` and `cold` and the methods below. It knows what
each tier holds and answers, never what the pool believes it holds: it calls nothing of the pool, only
kite_shared. No call waits on a slow tier longer than that tier's timeout; warm/cold failures only mark
the tier down (kite_shared.tiers.base) and come back as misses. A tier coming back up is an event the
maintenance drains (`warm_back`), not a call into it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kite_shared import kv_codec, recyclable_unit
from kite_shared.tiers import metrics
from kite_shared.tiers.client import TierClient
from kite_shared.tiers.handoff import HotFiles
from kite_shared.tiers.hot import HotLRU
from kite_shared.tiers.keys import BlockKey, model_tag
from kite_ru_pool.background import BackgroundTasks
from kite_ru_pool.counters import Counters
from kite_ru_pool.index import COLD, HOT, WARM

log = logging.getLogger(__name__)

FETCH_CONCURRENCY = 8  # warm/cold operations one caller (a get, a sweep) runs at once


class TierIO:
    def __init__(self, hot_bytes: int, tiers: TierClient, ru_key: bytes, counters: Counters,
                 background: BackgroundTasks, has_warm: bool, has_cold: bool,
                 hot_files: HotFiles | None = None) -> None:
        """`has_warm` / `has_cold`: the pool has that tier, through its client here or, without one, in
        the caller's hands (the fleet simulator's warm tier): demotions and archival count on it."""
        self.hot = HotLRU(hot_bytes)
        # Units entering hot move into files same-host readers map (None: in process memory only).
        self.hot_files = hot_files
        self.tiers = tiers
        self.warm = tiers.warm
        self.cold = tiers.cold
        self.has_warm = has_warm
        self.has_cold = has_cold
        self.ru_key = ru_key  # every unit put or moved must carry a valid HMAC under this cluster key
        self.counters = counters
        self.background = background
        # Set each time warm comes back up; the maintenance clears it when it plans the resync.
        self.warm_back = asyncio.Event()
        if self.warm is not None:
            self.warm.on_recover(self.warm_back.set)

    def up_mask(self) -> int:
        """The tiers answering now, as a bit set for lookups (a tier held by the caller counts as up)."""
        mask = HOT
        if self.has_warm and (self.warm is None or self.warm.up):
            mask |= WARM
        if self.has_cold and (self.cold is None or self.cold.up):
            mask |= COLD
        return mask

    # --- verification ---------------------------------------------------------------------------------
    def verify_put(self, data: bytes) -> recyclable_unit.RecyclableUnit | None:
        """The unit a put carries, verified (format, MAC, payload tag); None, counted, when it is not one."""
        try:
            return recyclable_unit.decode(data, key=self.ru_key)
        except recyclable_unit.RUError as exc:
            self.counters.refused_corrupt += 1
            if isinstance(exc, recyclable_unit.RUAuthError):
                metrics.TIER_INTEGRITY_FAILURES.labels("hot").inc()
            log.warning("refused a put: not an intact recyclable unit (%s: %s)", type(exc).__name__, exc)
            return None

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
            self.counters.transcode_refused += 1
            metrics.TIER_TRANSCODE_REFUSALS.inc()
            log.warning("block %s is stored in %s as it is, not in %s: %s", key.short(), tier, wanted, exc)
            return data
        metrics.TIER_TRANSCODE_SECONDS.observe(time.perf_counter() - started)
        metrics.TIER_TRANSCODES.labels(tier, wanted).inc()
        self.counters.transcoded += 1
        return transcoded

    # --- hot files --------------------------------------------------------------------------------------
    def into_hot_file(self, key: BlockKey, data: bytes | memoryview) -> None:
        """Move a unit hot has just taken into a hot file same-host readers can map, in the background
        (a put must not wait for it: about 1 ms per 369 KB unit on a loaded 2-core machine); nothing
        when the pool has no hot files or the unit is in one already."""
        if self.hot_files is not None and not isinstance(data, memoryview):
            self.background.spawn(self._into_hot_file(key, data), "hot file")

    async def _into_hot_file(self, key: BlockKey, data: bytes) -> None:
        """Written on a thread, then swapped in unless hot has let go of those bytes meanwhile (evicted,
        replaced: the file goes)."""
        path = await asyncio.to_thread(self.hot_files.write, data)
        view = None if path is None else self.hot_files.map(path)
        if view is not None:
            self.hot.swap(key, data, view)

    def lent_paths(self, units: list[bytes | memoryview]) -> list[str]:
        """The hot files holding these units, to lend a same-host reader; [] unless every one is in one."""
        if self.hot_files is None:
            return []
        paths = [self.hot_files.lent_path(data) for data in units]
        return [] if None in paths else paths

    # --- warm and cold ------------------------------------------------------------------------------------
    async def delete_everywhere(self, keys: list[BlockKey]) -> list[str]:
        """Delete these blocks from every remote tier (one round trip per tier; missing keys are no
        error); returns the names of the tiers that were down (they keep their copies)."""
        down = []
        for tier in self.tiers.tiers:
            await tier.delete_many(keys)
            if not tier.up:
                down.append(tier.name)
        return down

    async def ping_down(self) -> None:
        """Probe the tiers that are down (one that answers is up again)."""
        for tier in self.tiers.tiers:
            if not tier.up:
                await tier.ping()
