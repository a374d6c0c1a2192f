"""The catalog: what the pool keeps about its blocks beyond where their bytes are, and the changes to it
that no put or get makes. Pins; dropping blocks (an admin evict, a quota eviction, a tenant's clear);
forgetting a model's blocks (a clear, an invalidation by a new fingerprint, an arbitrator's quarantine)
and the storage purges that leaves queued; the current fingerprints; the namespaces' audit; and another
replica's index changes applied here (`apply_changes`).

Boundary: part of the coordinating layer, synchronous (callers pass `now`). It changes the index
(index.BlockIndex), the hot tier (tier_io.TierIO's LRU) and the worker caches (worker_caches) together,
so they never disagree, and calls nothing above them nor any other coordinating part: the deletions in
warm and cold that a drop or a clear calls for are returned (DropBlock, the queued purges) for the caller
to carry out (writes.PoolWrites, maintenance.Maintenance).
"""

from __future__ import annotations

from typing import Iterable

from kite_shared.messages import IndexChange
from kite_shared.security import ANONYMOUS_TENANT_TAG
from kite_shared.tiers.keys import BlockKey, model_tag
from kite_ru_pool.counters import Counters
from kite_ru_pool.index import ALL_TAGS, COLD, WARM, BlockIndex
from kite_ru_pool.index_changes import TIER_BIT
from kite_ru_pool.lifecycle import DropBlock
from kite_ru_pool.namespaces import NamespaceAudit
from kite_ru_pool.tier_io import TierIO
from kite_ru_pool.worker_caches import WorkerCaches


class Catalog:
    def __init__(self, index: BlockIndex, io: TierIO, workers: WorkerCaches, namespaces: NamespaceAudit,
                 counters: Counters) -> None:
        self.index = index
        self.hot = io.hot
        self.workers = workers
        self.namespaces = namespaces
        self.counters = counters
        # Tags the arbitrator quarantined (also in index.invalidated while it lasts): kept apart from
        # invalidations by a model change, which no operator lifts.
        self.quarantined: set[str] = set()

    # --- pins ---------------------------------------------------------------------------------------------
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

    # --- dropping blocks ------------------------------------------------------------------------------------
    def drop(self, tag: str, block_hash: bytes) -> DropBlock:
        """Forget a block the index holds, in the index and hot; the DropBlock says what storage still
        holds it."""
        e = self.index.drop(tag, block_hash)
        key = e.key(tag, block_hash)
        self.hot.delete(key)
        return DropBlock(key, e.tiers & (WARM | COLD))

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
            if self.index.entry(key) is None:
                self.hot.delete(key)
                continue
            held += 1
            self.drop(key.model_tag, key.block_hash)
        return held

    def forget_tenant(self, tenant_tag: str, tag: str | None = None) -> list[DropBlock]:
        """Drop every block of a tenant (of one model tag, or all) from the index and hot, pins
        included (an admin clear); returns what the caller must delete from the tiers.

        Blocks the index does not know (a rebuild still running) are covered by a storage purge queued
        in the index's `pending_tenant_purges`."""
        self.index.pending_tenant_purges.add((ALL_TAGS if tag is None else tag, tenant_tag))
        drops = []
        for t, h, e in self.index.tenant_blocks(tenant_tag, tag):
            key = e.key(t, h)
            self.index.unpin(key)
            self.hot.unpin(key)
            drops.append(self.drop(t, h))
        return drops

    # --- models ---------------------------------------------------------------------------------------------
    def is_invalidated(self, model_fingerprint: str) -> bool:
        return self.index.is_tag_invalidated(model_tag(model_fingerprint))

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

    def shadow_checked(self, model_fingerprint: str, namespace: str, diverged: bool) -> None:
        """A worker's shadow check of reused KV against recomputation, for the namespace's audit."""
        self.namespaces.shadow_checked(model_tag(model_fingerprint), namespace, diverged)

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

    def purge_done(self, tag: str, tenant_tag: str | None = None) -> None:
        """The storage purge of `tag` (ALL_TAGS: every model) [of one tenant] is done."""
        if tenant_tag is None:
            self.index.pending_purges.discard(tag)
        else:
            self.index.pending_tenant_purges.discard((tag, tenant_tag))

    def blocks_by_tag(self) -> dict[str, int]:
        return self.index.blocks_by_tag()

    # --- another replica's changes -----------------------------------------------------------------------------
    def apply_changes(self, changes: Iterable[IndexChange], now: float) -> None:
        """Apply another replica's index changes (index_changes.IndexChangeLog, on the wire as
        messages.PoolIndexChanges) here, in order.

        Blocks of a model tag this replica holds invalidated are not indexed (its purge deletes them); hits
        and renewals of blocks it does not know change nothing; a clear queues the same storage purge as on
        the sender, and the sender's `purged` settles it."""
        index = self.index
        for c in changes:
            tag = c.model_tag
            tenant = c.tenant_tag or None
            if c.op == "cleared":
                if tenant is None:
                    self.forget_tag(None if tag == ALL_TAGS else tag)
                else:
                    self.forget_tenant(tenant, None if tag == ALL_TAGS else tag)
                continue
            if c.op == "invalidated":
                self.invalidate_tag(tag)
                continue
            if c.op == "purged":
                self.purge_done(tag, tenant)
                continue
            keys = [BlockKey(tag, h, c.tenant_tag or ANONYMOUS_TENANT_TAG) for h in c.block_hashes]
            if c.op == "stored":
                if index.is_tag_invalidated(tag):
                    continue
                bit = TIER_BIT[c.tier]
                for i, key in enumerate(keys):
                    depth = c.depths[i] if i < len(c.depths) and c.depths[i] >= 0 else None
                    last_hit = c.last_hits[i] if i < len(c.last_hits) else None
                    size = c.sizes[i] if i < len(c.sizes) else 0
                    index.note_stored(key, bit, size, now, last_hit=last_hit, depth=depth)
            elif c.op == "missing":
                bit = TIER_BIT[c.tier]
                for key in keys:
                    index.note_missing(key, bit)
            elif c.op == "renewed":
                for key in keys:
                    index.note_renewed(key, c.at)
            elif c.op == "hit":
                for key in keys:
                    index.note_hit(key, c.at)
            elif c.op == "dropped":
                self.drop_blocks(keys)
            elif c.op == "pinned":
                for key in keys:
                    self.restore_pin(key)
            elif c.op == "unpinned":
                self.unpin_keys(keys)
