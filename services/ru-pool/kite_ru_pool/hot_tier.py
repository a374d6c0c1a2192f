"""The hot tier's policy: what happens in the index when the hot LRU takes, serves or loses a block.

Boundary: pure and synchronous (callers pass `now`). The bytes and their LRU order live in
kite_shared.tiers.hot.HotLRU; this layer keeps the block index (index.py) in step with it and turns
evictions into demotions: a block evicted from hot that no slower tier holds is written to warm, or cold
when warm is off or down (lifecycle.Demote, carried out by the service's tier_io). Calls the index and
the LRU; used by core.PoolCore.
"""

from __future__ import annotations

from kite_shared.tiers.hot import HotLRU
from kite_shared.tiers.keys import BlockKey
from kite_ru_pool.counters import Counters
from kite_ru_pool.index import COLD, HOT, WARM, BlockIndex
from kite_ru_pool.lifecycle import Action, Demote


class HotTier:
    def __init__(self, budget_bytes: int, index: BlockIndex, counters: Counters) -> None:
        self.lru = HotLRU(budget_bytes)
        self.index = index
        self.counters = counters

    def put(self, key: BlockKey, data: bytes, now: float, depth: int | None, demote_to_warm: bool,
            demote_to_cold: bool) -> list[Action]:
        """Store in hot (a put or a promotion); returns the demotions for what that evicted."""
        if self.index.is_pinned(key):
            self.lru.pin(key)
        if self.lru.put(key, data):
            self.index.note_stored(key, HOT, len(data), now, last_hit=now, depth=depth)
        else:
            self.counters.hot_refused += 1
            self.index.note_hit(key, now)
        return self.drain_evictions(demote_to_warm, demote_to_cold)

    def get(self, key: BlockKey, now: float) -> bytes | None:
        """The unit if hot holds it (a hit: counted, and the block's last hit moves to `now`)."""
        data = self.lru.get(key)
        if data is None:
            self.counters.hot_misses += 1
            return None
        self.counters.hot_hits += 1
        self.index.note_hit(key, now)
        return data

    def drain_evictions(self, demote_to_warm: bool, demote_to_cold: bool) -> list[Action]:
        """Demotions for the evictions the LRU recorded since the last call."""
        actions: list[Action] = []
        for ev in self.lru.take_events():
            self.counters.hot_evictions += 1
            e = self.index.entry(ev.key)
            if e is None:
                continue
            e.tiers &= ~HOT
            if e.tiers & (WARM | COLD):
                continue  # a slower tier already holds it: eviction loses nothing
            if demote_to_warm:
                actions.append(Demote(ev.key, ev.data, WARM))
            elif demote_to_cold:
                actions.append(Demote(ev.key, ev.data, COLD))
            # With a demotion pending the entry stays (no tiers, so lookups skip it) to keep its size
            # and last hit; note_stored or demotion_failed settles it.
            if not actions or actions[-1].key != ev.key:
                self.index.drop_if_empty(ev.key, e)
        return actions

    def demotion_failed(self, key: BlockKey) -> None:
        e = self.index.entry(key)
        if e is not None:
            self.index.drop_if_empty(key, e)
