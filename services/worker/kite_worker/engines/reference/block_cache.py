"""The worker-local hot cache of KV blocks: an LRU keyed by block hash with a byte budget.

Shared by every request on the worker. A pure data structure (no I/O, no threads of its own): callers
hold it from one thread (the engine loop). Stored/removed events accumulate for the caller to drain with
`take_events()` and publish (the ru-pool's global index learns from them), SGLang radix-cache style.
Each block remembers the model fingerprint (base or adapter) it was computed under, for its events.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

import torch

from kite_shared.fingerprint import BlockHash


@dataclass(frozen=True)
class CacheEvent:
    kind: Literal["stored", "removed"]
    block_hash: BlockHash
    model_fingerprint: str  # hex root of the model (base or adapter) the block belongs to


class BlockCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self._blocks: OrderedDict[BlockHash, torch.Tensor] = OrderedDict()
        self._fingerprints: dict[BlockHash, str] = {}
        self._events: list[CacheEvent] = []
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    def longest_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """Number of leading blocks of `hashes` present (a chain is only usable up to its first gap)."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def get_prefix(self, hashes: Sequence[BlockHash]) -> list[torch.Tensor]:
        """The blocks for `hashes` (all must be present), marked most recently used."""
        blocks = []
        for h in hashes:
            self._blocks.move_to_end(h)
            blocks.append(self._blocks[h])
        return blocks

    def put(self, block_hash: BlockHash, block: torch.Tensor, model_fingerprint: str = "") -> bool:
        """Insert a block; returns False when it was already present or can never fit. The fingerprint is
        kept only when given (the fleet simulator serves one model and keeps 10^7 blocks)."""
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return False
        size = block.numel() * block.element_size()
        if size > self.capacity_bytes:
            return False
        while self.num_bytes + size > self.capacity_bytes:
            old_hash, old = self._blocks.popitem(last=False)
            self.num_bytes -= old.numel() * old.element_size()
            self.num_evictions += 1
            self._events.append(CacheEvent("removed", old_hash, self._fingerprints.pop(old_hash, "")))
        self._blocks[block_hash] = block
        if model_fingerprint:
            self._fingerprints[block_hash] = model_fingerprint
        self.num_bytes += size
        self._events.append(CacheEvent("stored", block_hash, model_fingerprint))
        return True

    def drop_model(self, model_fingerprint: str) -> int:
        """Remove every block of one model fingerprint (a quarantined namespace); returns how many."""
        doomed = [h for h, fp in self._fingerprints.items() if fp == model_fingerprint]
        for h in doomed:
            block = self._blocks.pop(h)
            self.num_bytes -= block.numel() * block.element_size()
            del self._fingerprints[h]
            self._events.append(CacheEvent("removed", h, model_fingerprint))
        return len(doomed)

    def clear(self) -> None:
        for h in self._blocks:
            self._events.append(CacheEvent("removed", h, self._fingerprints.get(h, "")))
        self._blocks.clear()
        self._fingerprints.clear()
        self.num_bytes = 0

    def take_events(self) -> list[CacheEvent]:
        events, self._events = self._events, []
        return events

    def keys(self) -> Iterable[BlockHash]:
        return self._blocks.keys()
