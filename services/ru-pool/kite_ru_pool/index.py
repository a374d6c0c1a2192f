"""The block index: where each block lives (hot, warm, cold), its size, owner, depth and last hit; which
blocks are pinned; which model fingerprints are current and which are invalidated; and the storage purges
that invalidations and clears leave to do.

Boundary: a lower layer, pure structure in the manner of SGLang's radix cache: synchronous, no clock
(callers pass `now`, unix seconds), no I/O, no events of its own and no calls into the pool's other
parts. It records what the coordinating parts tell it the tiers did (`note_stored`, the one place a
block becomes stored; `note_missing`, `note_evicted`, `drop`) and answers where blocks are (`entry`,
`prefixes`, `keys_in`, `evictable`); deciding what to move is theirs (reads, writes, catalog,
maintenance, with lifecycle.SweepPass). One layer below it: tenants.Tenants, whose ledgers it keeps in
step with its entries (a block counts for its owner from the first tier that holds it until the last
one lets it go). The hot tier's bytes are not here: tier_io.TierIO's LRU holds them, and writes.py keeps
the two in step.

Layout (issue 38): model tag -> TagStore: block hash -> slot, and parallel arrays by slot (tiers, size,
last hit, warm touch, depth, owner's number in the interned tenant tags), about 180 bytes a block at 10^6
blocks where an Entry object per block and a ledger tuple took about 400. Lookups probe a chain's slots
and read their tiers with C-speed loops (about 10 us for 128 blocks). Everything in the entries can be
rebuilt from the tiers' key listings (tier, size, owner, idle time, pinned), which is what a restarting
pool does; what cannot is the hot tier (gone with the process), the current fingerprints and the
invalidated tags (both learned from ModelFingerprintChanged events), and the last hits of hot-only
blocks.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from operator import itemgetter
from typing import Iterable, Iterator, Sequence

from kite_shared.security import ANONYMOUS_TENANT_TAG
from kite_shared.tiers.keys import BlockKey, model_tag
from kite_ru_pool.tenants import Tenants

HOT, WARM, COLD = 1, 2, 4
TIER_BITS = {"hot": HOT, "warm": WARM, "cold": COLD}
TIER_LETTER = {HOT: b"h", WARM: b"w", COLD: b"c"}
ALL_TAGS = "*"  # pending_purges entry meaning every block of every model
FREE = 0xFF  # the tiers of a slot no block holds (TagStore)

# bytes.translate tables over tier bit sets (0..7): 1 where the set holds the tier, and the letter of
# the cheapest tier in the set.
_HAS_TIER = tuple(bytes(1 if v & bit else 0 for v in range(256)) for bit in (HOT, WARM, COLD))
_CHEAPEST = bytes((b"h" if v & HOT else b"w" if v & WARM else b"c" if v & COLD else b"-")[0]
                  for v in range(256))
# ... and, for each set of tiers that are up, the tier bit set masked to those (indexed by `up & ALL`;
# entries hold no other bits).
_ALL_TIERS = HOT | WARM | COLD
_ONLY_UP = tuple(bytes(v & up for v in range(256)) for up in range(_ALL_TIERS + 1))


def _first_gap(held: bytes, table: bytes) -> int:
    gap = held.translate(table).find(0)
    return len(held) if gap < 0 else gap


@dataclass(slots=True)
class Entry:
    """One block's record as the index holds it (a copy: `BlockIndex.entry`, `drop`, `tenant_blocks`)."""

    tiers: int = 0  # bit set of HOT | WARM | COLD
    size: int = 0  # bytes of the encoded unit
    last_hit: float = 0.0  # unix seconds of the last put or hit
    warm_touch: float = 0.0  # unix seconds the warm TTL was last set (write, renewal)
    tenant_tag: str = ANONYMOUS_TENANT_TAG  # the owner; with (model tag, hash) it makes the storage key
    depth: int = 0  # block index in its chain, when known (from the put); 0 after a rebuild

    def key(self, tag: str, block_hash: bytes) -> BlockKey:
        return BlockKey(tag, block_hash, self.tenant_tag)


class TagStore:
    """One model tag's entries as parallel arrays, one slot per block (issue 38): a block costs its
    dict slot, its hash, its slot number and 45 bytes of arrays, where an Entry object with its own
    floats, ints and tenant string cost about 330.

    Slots are taken in order of arrival, as a dict orders its keys, so a sweep walking the slots meets
    the blocks in the order the old index's copy of the keys had. A dropped block leaves a free slot;
    the sweep closes the gaps as it walks (lifecycle.SweepPass, when over a quarter of the slots are
    free), moving each block down without changing that order. While a pass walks the tag (`walker`),
    a block dropped and stored again before the pass reached its slot takes that slot back (`dropped`),
    so the pass examines it as the old index's pass did."""

    __slots__ = ("slots", "hashes", "tiers", "size", "last_hit", "warm_touch", "depth", "tenant", "walker",
                 "walk_pos", "dropped")

    def __init__(self) -> None:
        self.slots: dict[bytes, int] = {}  # block hash -> slot
        self.hashes: list[bytes | None] = []  # slot -> block hash (None: free)
        self.tiers = array("B")  # tier bit set; FREE in a free slot
        self.size = array("q")
        self.last_hit = array("d")
        self.warm_touch = array("d")
        self.depth = array("q")
        self.tenant = array("I")  # the owner's number in BlockIndex.tenant_tags
        self.walker = 0  # serial of the sweep pass walking this tag now (lifecycle.SweepPass); 0: none
        self.walk_pos = 0  # the first slot that pass has not walked yet
        self.dropped: dict[bytes, int] = {}  # block hash -> its slot, of blocks dropped while walked

    def __len__(self) -> int:
        return len(self.slots)

    def add(self, block_hash: bytes, tenant: int) -> int:
        s = self.dropped.pop(block_hash, None) if self.walker else None
        if s is not None and s >= self.walk_pos and self.tiers[s] == FREE:
            self.hashes[s] = block_hash
            self.tiers[s] = 0
            self.size[s] = 0
            self.last_hit[s] = 0.0
            self.warm_touch[s] = 0.0
            self.depth[s] = 0
            self.tenant[s] = tenant
        else:
            s = len(self.hashes)
            self.hashes.append(block_hash)
            self.tiers.append(0)
            self.size.append(0)
            self.last_hit.append(0.0)
            self.warm_touch.append(0.0)
            self.depth.append(0)
            self.tenant.append(tenant)
        self.slots[block_hash] = s
        return s

    def release(self, block_hash: bytes) -> int:
        s = self.slots.pop(block_hash)
        self.hashes[s] = None
        self.tiers[s] = FREE
        if self.walker:
            self.dropped[block_hash] = s
        return s

    def move(self, src: int, dst: int) -> None:
        """Move the block in slot `src` to the free slot `dst` (a sweep closing gaps)."""
        h = self.hashes[src]
        self.hashes[dst], self.hashes[src] = h, None
        self.tiers[dst], self.tiers[src] = self.tiers[src], FREE
        self.size[dst] = self.size[src]
        self.last_hit[dst] = self.last_hit[src]
        self.warm_touch[dst] = self.warm_touch[src]
        self.depth[dst] = self.depth[src]
        self.tenant[dst] = self.tenant[src]
        self.slots[h] = dst

    def pack_from(self, dst: int, src: int) -> None:
        """Move the blocks in slots `src`... down to `dst`..., in order, and let the slots past them go
        (a sweep that closed the gaps below `dst`, at the end of its walk of the tag)."""
        for s in range(src, len(self.hashes)):
            if self.tiers[s] != FREE:
                if s != dst:
                    self.move(s, dst)
                dst += 1
        for column in (self.hashes, self.tiers, self.size, self.last_hit, self.warm_touch, self.depth,
                       self.tenant):
            del column[dst:]

    def slots_of(self, tenant: int) -> Iterator[int]:
        """The slots the tenant owns (a C-speed search of the owner column, so a small tenant's blocks
        are found without a Python step per block of the others)."""
        column = self.tenant.tobytes()
        pattern = array("I", [tenant]).tobytes()
        width = len(pattern)
        tiers = self.tiers
        i = column.find(pattern)
        while i >= 0:
            if i % width:
                i = column.find(pattern, i + 1)  # straddles two slots
                continue
            s = i // width
            if tiers[s] != FREE:
                yield s
            i = column.find(pattern, i + width)


class EntryRef:
    """A live view of one slot (`BlockIndex.models`, for tests and tools that read or set an entry's
    fields in place); it reads whatever the slot holds, so keep it no longer than the block."""

    __slots__ = ("_store", "_slot", "_tenant_tags")

    def __init__(self, store: TagStore, slot: int, tenant_tags: list[str]) -> None:
        self._store, self._slot, self._tenant_tags = store, slot, tenant_tags

    tiers = property(lambda self: self._store.tiers[self._slot],
                     lambda self, v: self._store.tiers.__setitem__(self._slot, v))
    size = property(lambda self: self._store.size[self._slot],
                    lambda self, v: self._store.size.__setitem__(self._slot, v))
    last_hit = property(lambda self: self._store.last_hit[self._slot],
                        lambda self, v: self._store.last_hit.__setitem__(self._slot, v))
    warm_touch = property(lambda self: self._store.warm_touch[self._slot],
                          lambda self, v: self._store.warm_touch.__setitem__(self._slot, v))
    depth = property(lambda self: self._store.depth[self._slot],
                     lambda self, v: self._store.depth.__setitem__(self._slot, v))
    tenant_tag = property(lambda self: self._tenant_tags[self._store.tenant[self._slot]])

    def key(self, tag: str, block_hash: bytes) -> BlockKey:
        return BlockKey(tag, block_hash, self.tenant_tag)


class _TagView(Mapping):
    def __init__(self, store: TagStore, tenant_tags: list[str]) -> None:
        self._store, self._tenant_tags = store, tenant_tags

    def __getitem__(self, block_hash: bytes) -> EntryRef:
        return EntryRef(self._store, self._store.slots[block_hash], self._tenant_tags)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._store.slots)

    def __len__(self) -> int:
        return len(self._store.slots)


class _ModelsView(Mapping):
    def __init__(self, index: "BlockIndex") -> None:
        self._index = index

    def __getitem__(self, tag: str) -> _TagView:
        return _TagView(self._index.stores[tag], self._index.tenant_tags)

    def __iter__(self) -> Iterator[str]:
        return iter(self._index.stores)

    def __len__(self) -> int:
        return len(self._index.stores)


def fold_totals(blocks: list[int], nbytes: list[int], hot: tuple[int, int]) -> dict[str, tuple[int, int]]:
    """Per-tier (blocks, bytes) from counts by tier bit set; hot given as the LRU's own (exact) figures."""
    totals = {name: (sum(blocks[t] for t in range(8) if t & bit), sum(nbytes[t] for t in range(8) if t & bit))
              for name, bit in TIER_BITS.items()}
    totals["hot"] = hot
    return totals


class BlockIndex:
    def __init__(self, tenants: Tenants) -> None:
        self.tenants = tenants
        # Read by the layers above (the core, the sweep); changed only through the methods below.
        self.stores: dict[str, TagStore] = {}  # model tag -> its entries
        self.tenant_tags: list[str] = []  # owners, interned: a slot keeps the number, not the string
        self._tenant_numbers: dict[str, int] = {}
        self.pins: set[tuple[str, bytes]] = set()  # (model tag, block hash)
        self.invalidated: set[str] = set()  # model tags never served again
        self.pending_purges: set[str] = set()  # invalidated or cleared tags whose storage needs purging
        # (model tag or ALL_TAGS, tenant tag) of tenant clears whose storage needs purging
        self.pending_tenant_purges: set[tuple[str, str]] = set()
        self.current: dict[str, str] = {}  # model name -> current fingerprint
        # True while a rebuild from the tiers' listings runs (maintenance.py): stored blocks it has not
        # reached yet are missing here, so reads ask the tiers for blocks this index does not know.
        self.rebuilding = False

    @property
    def models(self) -> Mapping[str, Mapping[bytes, EntryRef]]:
        """model tag -> block hash -> a live view of the entry (for tests and tools; the pool's parts use
        the methods below)."""
        return _ModelsView(self)

    def _tenant_number(self, tenant_tag: str) -> int:
        n = self._tenant_numbers.get(tenant_tag)
        if n is None:
            n = self._tenant_numbers[tenant_tag] = len(self.tenant_tags)
            self.tenant_tags.append(tenant_tag)
        return n

    def _copy(self, store: TagStore, s: int) -> Entry:
        return Entry(store.tiers[s], store.size[s], store.last_hit[s], store.warm_touch[s],
                     self.tenant_tags[store.tenant[s]], store.depth[s])

    # --- where blocks live ---------------------------------------------------------------------------
    def entry(self, key: BlockKey) -> Entry | None:
        """A copy of the block's entry (None: not indexed)."""
        store = self.stores.get(key.model_tag)
        s = None if store is None else store.slots.get(key.block_hash)
        return None if s is None else self._copy(store, s)

    def tiers_of(self, key: BlockKey) -> int:
        store = self.stores.get(key.model_tag)
        s = None if store is None else store.slots.get(key.block_hash)
        return 0 if s is None else store.tiers[s]

    def _slot(self, key: BlockKey) -> tuple[TagStore, int] | tuple[None, None]:
        store = self.stores.get(key.model_tag)
        s = None if store is None else store.slots.get(key.block_hash)
        return (None, None) if s is None else (store, s)

    def note_stored(self, key: BlockKey, tier: int, size: int, now: float,
                    last_hit: float | None = None, depth: int | None = None) -> None:
        """A tier now holds the block (written, promoted, or found by a rebuild)."""
        store = self.stores.get(key.model_tag)
        if store is None:
            store = self.stores[key.model_tag] = TagStore()
        s = store.slots.get(key.block_hash)
        if s is None:
            s = store.add(key.block_hash, self._tenant_number(key.tenant_tag))
            self.tenants.added(key.tenant_tag)
        if depth is not None:
            store.depth[s] = depth
        store.tiers[s] |= tier
        old_size = store.size[s]
        if size and size != old_size:
            self.tenants.resized(self.tenant_tags[store.tenant[s]], size - old_size)
            store.size[s] = size
        if last_hit is not None:
            store.last_hit[s] = max(store.last_hit[s], last_hit)
        elif store.last_hit[s] == 0.0:
            store.last_hit[s] = now
        if tier == WARM:
            store.warm_touch[s] = now

    def note_missing(self, key: BlockKey, tier: int) -> BlockKey | None:
        """A tier turned out not to hold the block; returns the block's storage key (its owner as the
        index knows it), None when the index did not know the block."""
        store, s = self._slot(key)
        if store is None:
            return None
        owner = self.tenant_tags[store.tenant[s]]
        store.tiers[s] &= ~tier
        self.drop_if_empty(key)
        return BlockKey(key.model_tag, key.block_hash, owner)

    def note_evicted(self, key: BlockKey) -> int | None:
        """Hot let the block go (an LRU eviction); returns the tiers still holding it, None when the
        index does not know the block. An entry left with no tier stays (a demotion may be pending: it
        keeps the size and last hit, and lookups skip it) until `note_stored` or `drop_if_empty`."""
        store, s = self._slot(key)
        if store is None:
            return None
        store.tiers[s] &= ~HOT
        return store.tiers[s]

    def note_hit(self, key: BlockKey, now: float) -> None:
        store, s = self._slot(key)
        if store is not None:
            store.last_hit[s] = max(store.last_hit[s], now)

    def note_renewed(self, key: BlockKey, now: float) -> None:
        store, s = self._slot(key)
        if store is not None:
            store.warm_touch[s] = now

    def drop_if_empty(self, key: BlockKey) -> None:
        """Forget the entry once no tier holds it (an entry with a demotion pending keeps none a while)."""
        store, s = self._slot(key)
        if store is not None and store.tiers[s] == 0:
            self._release(key.model_tag, store, key.block_hash)

    def _release(self, tag: str, store: TagStore, block_hash: bytes) -> Entry:
        s = store.slots[block_hash]
        e = self._copy(store, s)
        store.release(block_hash)
        if not store.slots:
            del self.stores[tag]
        self.tenants.removed(e.tenant_tag, None, e.size)
        return e

    def drop(self, tag: str, block_hash: bytes) -> Entry:
        """Forget a block the index holds, whatever tiers hold it; returns its entry as it was."""
        return self._release(tag, self.stores[tag], block_hash)

    def keys_of(self, model_fingerprint: str, chain: Iterable[bytes], tenant_tag: str) -> list[BlockKey]:
        """Storage keys of a chain: the owner the index knows, else `tenant_tag` (a pin may come first)."""
        keys = []
        for h in chain:
            key = BlockKey.of(model_fingerprint, h, tenant_tag)
            store, s = self._slot(key)
            keys.append(key if store is None else
                        BlockKey(key.model_tag, key.block_hash, self.tenant_tags[store.tenant[s]]))
        return keys

    def keys_in(self, tier: int, tag: str | None = None, tenant_tag: str | None = None) -> list[BlockKey]:
        """Keys the index believes `tier` holds, of one model tag and/or tenant tag or all (sorted, for
        deterministic purges and tests)."""
        out = []
        names = self.tenant_tags
        only = None if tenant_tag is None else self._tenant_numbers.get(tenant_tag, -1)
        for t, store in self.stores.items():
            if tag is not None and t != tag:
                continue
            hashes, owners = store.hashes, store.tenant
            out.extend(BlockKey(t, hashes[s], names[owners[s]]) for s, bits in enumerate(store.tiers)
                       if bits & tier and bits != FREE and (only is None or owners[s] == only))
        return sorted(out)

    def tenant_blocks(self, tenant_tag: str, tag: str | None = None) -> list[tuple[str, bytes, Entry]]:
        """The tenant's blocks (of one model tag, or all) as (tag, hash, entry copy), sorted."""
        n = self._tenant_numbers.get(tenant_tag)
        if n is None:
            return []
        out = []
        for t, store in self.stores.items():
            if tag is None or t == tag:
                out.extend((t, store.hashes[s], self._copy(store, s)) for s in store.slots_of(n))
        out.sort(key=lambda b: (b[0], b[1]))
        return out

    def evictable(self, tenant_tag: str, new: BlockKey) -> Iterator[tuple[float, int, str, bytes, int]]:
        """The tenant's blocks a quota may evict for the put of `new`, as tenants.Tenants.quota_victims
        reads them (last hit, depth, model tag, block hash, size): not pinned, not being written by a
        demotion right now, not `new` itself. Lazy: walked only when the tenant is over its quota."""
        n = self._tenant_numbers.get(tenant_tag)
        if n is None:
            return
        pins = self.pins
        for t, store in list(self.stores.items()):
            hashes, tiers = store.hashes, store.tiers
            for s in store.slots_of(n):
                h = hashes[s]
                if tiers[s] != 0 and (t, h) not in pins and (t != new.model_tag or h != new.block_hash):
                    yield store.last_hit[s], store.depth[s], t, h, store.size[s]

    # --- lookups -------------------------------------------------------------------------------------
    def prefixes(self, tag: str, chain: Sequence[bytes], up: int) -> tuple[int, int, int, int, bytes]:
        """Longest prefix of `chain` each tier holds (only tiers in `up`) and any of them holds, and the
        letter of the cheapest tier of each block of the latter: (hot, warm, cold, pool, letters)."""
        # Every tier's prefix is a prefix of the pool's, so probe the chain's slots, cut at the first
        # block the index does not know, read their tiers, keep only the tiers that are up, cut at the
        # first block none of them holds, and find each tier's first gap: all C-speed loops (`map`,
        # `list.index`, bytes ops), no Python step per block (128 blocks a lookup in the bench).
        store = self.stores.get(tag)
        if store is None:
            held = b""
        else:
            slots = list(map(store.slots.get, chain))
            try:
                del slots[slots.index(None):]
            except ValueError:
                pass  # every block known
            if len(slots) > 1:
                held = bytes(itemgetter(*slots)(store.tiers))  # (twice as fast as a map of __getitem__)
            else:
                held = bytes(store.tiers[s] for s in slots)
            held = held.translate(_ONLY_UP[up & _ALL_TIERS])
        gap = held.find(0)
        if gap >= 0:
            held = held[:gap]
        hot, warm, cold = (_first_gap(held, table) for table in _HAS_TIER)
        return hot, warm, cold, len(held), held.translate(_CHEAPEST)

    # --- pins ----------------------------------------------------------------------------------------
    def is_pinned(self, key: BlockKey) -> bool:
        return (key.model_tag, key.block_hash) in self.pins

    def pin(self, key: BlockKey) -> None:
        self.pins.add((key.model_tag, key.block_hash))

    def unpin(self, key: BlockKey) -> None:
        self.pins.discard((key.model_tag, key.block_hash))

    # --- models: current fingerprints, invalidation, purges ------------------------------------------
    def is_tag_invalidated(self, tag: str) -> bool:
        return tag in self.invalidated

    def fingerprint_changed(self, name: str, fingerprint: str, previous: str = "") -> list[str]:
        """Record `fingerprint` as current for `name`; returns the model tags it replaces (for the caller
        to invalidate)."""
        new_tag = model_tag(fingerprint)
        self.invalidated.discard(new_tag)  # rolling back to earlier weights makes them valid again
        self.pending_purges.discard(new_tag)
        old = {fp for fp in (self.current.get(name, ""), previous) if fp}
        self.current[name] = fingerprint
        return sorted({model_tag(fp) for fp in old} - {new_tag})

    def forget_tags(self, tag: str | None) -> tuple[list[str], int]:
        """Drop the entries of one tag (None: all) and queue a storage purge (ALL_TAGS for None, which
        also covers blocks the index never learned about); returns the tags dropped and how many
        blocks."""
        tags = list(self.stores) if tag is None else [tag]
        dropped = 0
        for t in tags:
            store = self.stores.pop(t, None)
            if store is None:
                continue
            by_owner: dict[int, list[int]] = {}  # owner -> [blocks, bytes]
            for s in store.slots.values():
                tally = by_owner.setdefault(store.tenant[s], [0, 0])
                tally[0] += 1
                tally[1] += store.size[s]
            for owner, (num_blocks, num_bytes) in by_owner.items():
                self.tenants.released(self.tenant_tags[owner], num_blocks, num_bytes)
            dropped += len(store)
        self.pending_purges.add(ALL_TAGS if tag is None else tag)
        return tags, dropped

    # --- stats ---------------------------------------------------------------------------------------
    def blocks_by_tag(self) -> dict[str, int]:
        return {tag: len(store) for tag, store in self.stores.items()}

    def tier_counts(self) -> tuple[list[int], list[int]]:
        """Blocks and bytes by tier bit set (0..7): a walk of the whole index (about 60 ns a block)."""
        blocks = [0] * (FREE + 1)  # free slots counted apart, dropped below
        nbytes = [0] * (FREE + 1)
        for store in self.stores.values():
            for t, size in zip(store.tiers, store.size):
                blocks[t] += 1
                nbytes[t] += size
        return blocks[:8], nbytes[:8]

    def num_blocks(self) -> int:
        return sum(len(store) for store in self.stores.values())
