"""Index changes: what one ru-pool replica tells the others so that every replica's index says the same
about the shared tiers (docs/ru-pool.md, "Replicas").

Boundary: a record the coordinating parts add to, synchronous, no I/O, calling nothing. `IndexChangeLog`
records, in order, the changes this replica made to what warm and cold hold (writes, promotions,
demotions, archival, renewals, expiry, deletions), to pins, and the clears, invalidations and finished
purges; writes, reads, maintenance and admin add to it where they make the change. It groups consecutive
changes of one kind (one operation on blocks of one model and tenant) and hands them out as batches
(`take`) for the replica layer (replicas.py) to publish as messages.PoolIndexChanges; `pending` tells that
layer there is something to send (an event it waits on: the log never calls it). The other side,
applying a batch from another replica, is catalog.Catalog.apply_changes.

What is never sent: the hot tier (each replica's own memory), index rebuilds from the tier listings (each
replica lists for itself), worker caches (every replica hears the workers' events itself) and model
fingerprint changes (every replica hears those too).
"""

from __future__ import annotations

import asyncio
from typing import Iterable

from kite_shared.messages import IndexChange
from kite_shared.tiers.keys import BlockKey
from kite_ru_pool.index import ALL_TAGS, COLD, WARM

TIER_NAME = {WARM: "warm", COLD: "cold"}
TIER_BIT = {"warm": WARM, "cold": COLD}
MAX_HASHES_PER_MESSAGE = 8192  # about 400 KB of hashes, sizes and times: under NATS's 1 MiB default


class IndexChangeLog:
    """The changes this replica made, not sent yet, grouped in order (module docstring).

    Disabled (`enabled=False`: a pool without replicas, such as the unit tests' bus-less pool) it records
    nothing. `pending` is set when a change arrives in an empty log and cleared by `take` (the replica
    layer sends a few milliseconds after it is set)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.pending = asyncio.Event()
        self._groups: list[dict] = []

    def __len__(self) -> int:
        return len(self._groups)

    # --- what a replica changed -------------------------------------------------------------------------
    def stored(self, key: BlockKey, tier: int, size: int, last_hit: float, depth: int | None = None) -> None:
        """`tier` (WARM or COLD) now holds the block."""
        g = self._group("stored", key.model_tag, key.tenant_tag, TIER_NAME[tier])
        if g is not None:
            g["block_hashes"].append(key.block_hash)
            g["sizes"].append(size)
            g["depths"].append(-1 if depth is None else depth)
            g["last_hits"].append(last_hit)

    def missing(self, key: BlockKey, tier: int) -> None:
        """`tier` (WARM or COLD) no longer holds the block."""
        self._blocks("missing", [key], tier=TIER_NAME[tier])

    def renewed(self, key: BlockKey, at: float) -> None:
        self._blocks("renewed", [key], at=at)

    def hits(self, keys: Iterable[BlockKey], at: float) -> None:
        self._blocks("hit", keys, at=at)

    def dropped(self, keys: Iterable[BlockKey]) -> None:
        """Forgotten everywhere, pins included (evict, quota eviction)."""
        self._blocks("dropped", keys)

    def pinned(self, keys: Iterable[BlockKey]) -> None:
        self._blocks("pinned", keys)

    def unpinned(self, keys: Iterable[BlockKey]) -> None:
        self._blocks("unpinned", keys)

    def cleared(self, tag: str | None, tenant_tag: str | None = None) -> None:
        """Every block of model tag `tag` (None: all) [of one tenant] forgotten; a storage purge queued."""
        self._group("cleared", ALL_TAGS if tag is None else tag, tenant_tag or "", merge=False)

    def invalidated(self, tag: str) -> None:
        self._group("invalidated", tag, "", merge=False)

    def purged(self, tag: str, tenant_tag: str | None = None) -> None:
        """The storage purge of `tag` (ALL_TAGS: every model) [of one tenant] is done."""
        self._group("purged", tag, tenant_tag or "", merge=False)

    # --- sending ------------------------------------------------------------------------------------------
    def take(self, max_hashes: int = MAX_HASHES_PER_MESSAGE) -> list[list[IndexChange]]:
        """Everything recorded, as batches (one message each) of at most `max_hashes` block hashes; a
        group larger than that is cut over several batches, in order. The log is empty afterwards."""
        groups, self._groups = self._groups, []
        self.pending.clear()
        batches: list[list[IndexChange]] = []
        batch: list[IndexChange] = []
        room = max_hashes
        for g in groups:
            hashes = g["block_hashes"]
            start = 0
            while True:
                if room <= 0 and batch:
                    batches.append(batch)
                    batch, room = [], max_hashes
                end = start + room if hashes else start
                piece = {k: (v[start:end] if isinstance(v, list) else v) for k, v in g.items()}
                batch.append(IndexChange(**piece))
                room -= max(1, len(piece["block_hashes"]))
                start = end
                if start >= len(hashes):
                    break
        if batch:
            batches.append(batch)
        return batches

    def _blocks(self, op: str, keys: Iterable[BlockKey], tier: str = "", at: float = 0.0) -> None:
        if not self.enabled:
            return
        for key in keys:
            g = self._group(op, key.model_tag, key.tenant_tag, tier, at)
            g["block_hashes"].append(key.block_hash)

    def _group(self, op: str, tag: str, tenant_tag: str, tier: str = "", at: float = 0.0,
               merge: bool = True) -> dict | None:
        """The group to add blocks to: the last one when it is the same operation on the same model,
        tenant and tier, else a new one."""
        if not self.enabled:
            return None
        if merge and self._groups:
            last = self._groups[-1]
            if (last["op"], last["model_tag"], last["tenant_tag"], last["tier"]) == (op, tag, tenant_tag, tier):
                last["at"] = max(last["at"], at)
                return last
        g = {"op": op, "tier": tier, "model_tag": tag, "tenant_tag": tenant_tag, "block_hashes": [],
             "sizes": [], "depths": [], "last_hits": [], "at": at}
        self._groups.append(g)
        self.pending.set()
        return g

