"""Hot tier: an in-memory LRU of encoded recyclable units under a byte budget. Pure: no I/O, no clock.

Evictions are not acted on here; they are recorded as `Eviction` events that the owner drains with
`take_events()` (SGLang-style) and turns into demotions (hot -> warm). Pinned keys are never evicted;
a pin may be set before the block arrives. When the unpinned entries cannot make room, `put` refuses
rather than exceed the budget.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator

from kite_shared.tiers.keys import BlockKey


@dataclass(frozen=True)
class Eviction:
    key: BlockKey
    data: bytes  # the evicted unit, so the owner can demote it without another read


class HotLRU:
    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.budget_bytes = budget_bytes
        self.bytes_used = 0
        self._entries: OrderedDict[BlockKey, bytes] = OrderedDict()  # LRU first, MRU last
        self._pinned: set[BlockKey] = set()
        self._events: list[Eviction] = []

    def __len__(self) -> int:
        return len(self._entries)

    def contains(self, key: BlockKey) -> bool:
        return key in self._entries

    __contains__ = contains

    def get(self, key: BlockKey) -> bytes | None:
        """The unit, marked most recently used; None when absent."""
        data = self._entries.get(key)
        if data is not None:
            self._entries.move_to_end(key)
        return data

    def peek(self, key: BlockKey) -> bytes | None:
        """The unit without touching its recency."""
        return self._entries.get(key)

    def put(self, key: BlockKey, data: bytes) -> bool:
        """Store (or replace) `key` as most recently used; False when it cannot fit in the budget."""
        size = len(data)
        old = self._entries.get(key)
        reclaim = len(old) if old is not None else 0
        if size > self.budget_bytes:
            return False
        need = self.bytes_used - reclaim + size - self.budget_bytes
        if need > 0:
            victims: list[BlockKey] = []
            freed = 0
            for candidate, value in self._entries.items():  # LRU first
                if candidate == key or candidate in self._pinned:
                    continue
                victims.append(candidate)
                freed += len(value)
                if freed >= need:
                    break
            if freed < need:
                return False
            for victim in victims:
                value = self._entries.pop(victim)
                self.bytes_used -= len(value)
                self._events.append(Eviction(victim, value))
        if old is not None:
            self.bytes_used -= reclaim
        self._entries[key] = data
        self._entries.move_to_end(key)
        self.bytes_used += size
        return True

    def swap(self, key: BlockKey, old: bytes, new: bytes) -> bool:
        """Hold `new` (the same unit in another form: its bytes moved into a file) instead of `old`,
        keeping its recency; only while `key` still holds that very `old` object (not a newer unit, not
        after an eviction). Sizes must match: the budget counts them once."""
        if len(new) != len(old):
            raise ValueError("swap needs the same unit: the sizes differ")
        if self._entries.get(key) is not old:
            return False
        self._entries[key] = new
        return True

    def delete(self, key: BlockKey) -> bool:
        """Remove `key` (not an eviction: no event). Its pin, if any, stays."""
        data = self._entries.pop(key, None)
        if data is None:
            return False
        self.bytes_used -= len(data)
        return True

    def clear(self, model_tag: str | None = None) -> int:
        """Remove every entry, or every entry of one model tag; returns how many. No events."""
        doomed = [k for k in self._entries if model_tag is None or k.model_tag == model_tag]
        for key in doomed:
            self.delete(key)
        return len(doomed)

    def pin(self, key: BlockKey) -> None:
        self._pinned.add(key)

    def unpin(self, key: BlockKey) -> None:
        self._pinned.discard(key)

    def is_pinned(self, key: BlockKey) -> bool:
        return key in self._pinned

    def keys(self) -> Iterator[BlockKey]:
        """Keys from least to most recently used (a snapshot: safe to mutate while iterating)."""
        return iter(list(self._entries))

    def take_events(self) -> list[Eviction]:
        """Evictions since the last call, oldest first; the internal list is emptied."""
        events, self._events = self._events, []
        return events
