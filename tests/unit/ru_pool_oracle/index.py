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

Layout: model tag -> block hash -> Entry. Lookups walk a chain with one dict probe per block, so a
128-block chain costs tens of microseconds. Everything in the entries can be rebuilt from the tiers' key
listings (tier, size, owner, idle time, pinned), which is what a restarting pool does; what cannot is the
hot tier (gone with the process), the current fingerprints and the invalidated tags (both learned from
ModelFingerprintChanged events), and the last hits of hot-only blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from kite_shared.security import ANONYMOUS_TENANT_TAG
from kite_shared.tiers.keys import BlockKey, model_tag
from tests.unit.ru_pool_oracle.tenants import Tenants

HOT, WARM, COLD = 1, 2, 4
TIER_BITS = {"hot": HOT, "warm": WARM, "cold": COLD}
TIER_LETTER = {HOT: b"h", WARM: b"w", COLD: b"c"}
ALL_TAGS = "*"  # pending_purges entry meaning every block of every model

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
    tiers: int = 0  # bit set of HOT | WARM | COLD
    size: int = 0  # bytes of the encoded unit
    last_hit: float = 0.0  # unix seconds of the last put or hit
    warm_touch: float = 0.0  # unix seconds the warm TTL was last set (write, renewal)
    tenant_tag: str = ANONYMOUS_TENANT_TAG  # the owner; with (model tag, hash) it makes the storage key
    depth: int = 0  # block index in its chain, when known (from the put); 0 after a rebuild

    def key(self, tag: str, block_hash: bytes) -> BlockKey:
        return BlockKey(tag, block_hash, self.tenant_tag)


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
        self.models: dict[str, dict[bytes, Entry]] = {}
        self.pins: set[tuple[str, bytes]] = set()  # (model tag, block hash)
        self.invalidated: set[str] = set()  # model tags never served again
        self.pending_purges: set[str] = set()  # invalidated or cleared tags whose storage needs purging
        # (model tag or ALL_TAGS, tenant tag) of tenant clears whose storage needs purging
        self.pending_tenant_purges: set[tuple[str, str]] = set()
        self.current: dict[str, str] = {}  # model name -> current fingerprint
        # True while a rebuild from the tiers' listings runs (maintenance.py): stored blocks it has not
        # reached yet are missing here, so reads ask the tiers for blocks this index does not know.
        self.rebuilding = False

    # --- where blocks live ---------------------------------------------------------------------------
    def entry(self, key: BlockKey) -> Entry | None:
        models = self.models.get(key.model_tag)
        return None if models is None else models.get(key.block_hash)

    def tiers_of(self, key: BlockKey) -> int:
        e = self.entry(key)
        return 0 if e is None else e.tiers

    def _ensure(self, key: BlockKey) -> Entry:
        models = self.models.setdefault(key.model_tag, {})
        e = models.get(key.block_hash)
        if e is None:
            e = models[key.block_hash] = Entry(tenant_tag=key.tenant_tag)
            self.tenants.added(key.tenant_tag, (key.model_tag, key.block_hash))
        return e

    def note_stored(self, key: BlockKey, tier: int, size: int, now: float,
                    last_hit: float | None = None, depth: int | None = None) -> None:
        """A tier now holds the block (written, promoted, or found by a rebuild)."""
        e = self._ensure(key)
        if depth is not None:
            e.depth = depth
        e.tiers |= tier
        if size and size != e.size:
            self.tenants.resized(e.tenant_tag, size - e.size)
            e.size = size
        if last_hit is not None:
            e.last_hit = max(e.last_hit, last_hit)
        elif e.last_hit == 0.0:
            e.last_hit = now
        if tier == WARM:
            e.warm_touch = now

    def note_missing(self, key: BlockKey, tier: int) -> BlockKey | None:
        """A tier turned out not to hold the block; returns the block's storage key (its owner as the
        index knows it), None when the index did not know the block."""
        e = self.entry(key)
        if e is None:
            return None
        e.tiers &= ~tier
        self.drop_if_empty(key)
        return e.key(key.model_tag, key.block_hash)

    def note_evicted(self, key: BlockKey) -> int | None:
        """Hot let the block go (an LRU eviction); returns the tiers still holding it, None when the
        index does not know the block. An entry left with no tier stays (a demotion may be pending: it
        keeps the size and last hit, and lookups skip it) until `note_stored` or `drop_if_empty`."""
        e = self.entry(key)
        if e is None:
            return None
        e.tiers &= ~HOT
        return e.tiers

    def note_hit(self, key: BlockKey, now: float) -> None:
        e = self.entry(key)
        if e is not None:
            e.last_hit = max(e.last_hit, now)

    def note_renewed(self, key: BlockKey, now: float) -> None:
        e = self.entry(key)
        if e is not None:
            e.warm_touch = now

    def drop_if_empty(self, key: BlockKey) -> None:
        """Forget the entry once no tier holds it (an entry with a demotion pending keeps none a while)."""
        models = self.models.get(key.model_tag)
        e = None if models is None else models.get(key.block_hash)
        if e is not None and e.tiers == 0:
            del models[key.block_hash]
            self.tenants.removed(e.tenant_tag, (key.model_tag, key.block_hash), e.size)
            if not models:
                del self.models[key.model_tag]

    def drop(self, tag: str, block_hash: bytes) -> Entry:
        """Forget a block the index holds, whatever tiers hold it; returns its entry as it was."""
        models = self.models[tag]
        e = models.pop(block_hash)
        if not models:
            del self.models[tag]
        self.tenants.removed(e.tenant_tag, (tag, block_hash), e.size)
        return e

    def keys_of(self, model_fingerprint: str, chain: Iterable[bytes], tenant_tag: str) -> list[BlockKey]:
        """Storage keys of a chain: the owner the index knows, else `tenant_tag` (a pin may come first)."""
        keys = []
        for h in chain:
            key = BlockKey.of(model_fingerprint, h, tenant_tag)
            e = self.entry(key)
            keys.append(key if e is None else e.key(key.model_tag, key.block_hash))
        return keys

    def keys_in(self, tier: int, tag: str | None = None, tenant_tag: str | None = None) -> list[BlockKey]:
        """Keys the index believes `tier` holds, of one model tag and/or tenant tag or all (sorted, for
        deterministic purges and tests)."""
        out = []
        for t, models in self.models.items():
            if tag is not None and t != tag:
                continue
            out.extend(e.key(t, h) for h, e in models.items()
                       if e.tiers & tier and (tenant_tag is None or e.tenant_tag == tenant_tag))
        return sorted(out)

    def tenant_blocks(self, tenant_tag: str, tag: str | None = None) -> list[tuple[str, bytes, Entry]]:
        """The tenant's blocks (of one model tag, or all) as (tag, hash, entry), sorted."""
        ledger = self.tenants.ledgers.get(tenant_tag)
        if ledger is None:
            return []
        return [(t, h, self.models[t][h]) for t, h in sorted(ledger.blocks) if tag is None or t == tag]

    def evictable(self, tenant_tag: str, new: BlockKey) -> Iterator[tuple[float, int, str, bytes, int]]:
        """The tenant's blocks a quota may evict for the put of `new`, as tenants.Tenants.quota_victims
        reads them (last hit, depth, model tag, block hash, size): not pinned, not being written by a
        demotion right now, not `new` itself. Lazy: walked only when the tenant is over its quota."""
        ident_new = (new.model_tag, new.block_hash)
        for ident in self.tenants.ledger(tenant_tag).blocks:
            e = self.models[ident[0]][ident[1]]
            if ident not in self.pins and e.tiers != 0 and ident != ident_new:
                yield e.last_hit, e.depth, ident[0], ident[1], e.size

    # --- lookups -------------------------------------------------------------------------------------
    def prefixes(self, tag: str, chain: Sequence[bytes], up: int) -> tuple[int, int, int, int, bytes]:
        """Longest prefix of `chain` each tier holds (only tiers in `up`) and any of them holds, and the
        letter of the cheapest tier of each block of the latter: (hot, warm, cold, pool, letters)."""
        # Every tier's prefix is a prefix of the pool's, so walk the chain once (dict probes only) up
        # to the first block the index does not know, then do the rest with C-speed bytes ops: keep only
        # the tiers that are up, cut at the first block none of them holds, and find each tier's first
        # gap. The loop is the lookup's hottest Python (128 blocks a lookup in the bench), so it does
        # the least per block: `map` probes the dict, masking is one translate afterwards.
        bits = bytearray()
        append = bits.append
        for e in map(self.models.get(tag, {}).get, chain):
            if e is None:
                break
            append(e.tiers)
        held = bytes(bits.translate(_ONLY_UP[up & _ALL_TIERS]))
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
        tags = list(self.models) if tag is None else [tag]
        dropped = 0
        for t in tags:
            models = self.models.pop(t, {})
            for h, e in models.items():
                self.tenants.removed(e.tenant_tag, (t, h), e.size)
            dropped += len(models)
        self.pending_purges.add(ALL_TAGS if tag is None else tag)
        return tags, dropped

    # --- stats ---------------------------------------------------------------------------------------
    def tier_counts(self) -> tuple[list[int], list[int]]:
        """Blocks and bytes by tier bit set (0..7): a walk of the whole index (about 60 ns a block)."""
        blocks = [0] * 8
        nbytes = [0] * 8
        for models in self.models.values():
            for e in models.values():
                t = e.tiers
                blocks[t] += 1
                nbytes[t] += e.size
        return blocks, nbytes

    def num_blocks(self) -> int:
        return sum(len(m) for m in self.models.values())
