"""Lifecycle decisions: the actions the coordinating parts decide and then carry out, and the sweep that
decides archival, warm lease renewal and cold expiry over the block index.

Boundary: pure and deterministic (the sweep takes `now`), a helper of the coordinating layer: it reads
the block index (index.py) and the hot LRU's totals and changes neither, and calls nothing. writes.py
decides demotions and drops and carries them out, maintenance.py carries out the sweep's actions; both
record the outcome in the index (`record_stored`, `record_missing`).

Rules (all times from the last hit, where a put or a worker reporting it loaded the block counts as a
hit):
  * promotion: a warm or cold hit is copied to hot (and a cold hit to warm) - done by reads.py;
  * demotion: a block evicted from hot that no slower tier holds is written to warm (cold if warm is
    off or down) - decided by writes.py;
  * archival: a warm block idle >= archive_after_s is copied to cold (if cold lacks it) and removed
    from warm;
  * renewal: the warm TTL is a lease, not the retention policy: the pool renews warm blocks it still
    wants before Redis would expire them, so a warm block lives until archival; if the pool stops for
    longer than the TTL, Redis cleans up by itself;
  * cold TTL: a block held only in cold and idle >= cold_ttl_s (when > 0) is deleted;
  * pins: pinned blocks are never evicted from hot, archived or expired (warm stores them without TTL);
  * invalidated model tags are not swept: their blocks wait for the purge;
  * sweeps: `Maintenance.sweep` decides over the whole index at once; the service walks it in bounded
    slices (`Maintenance.begin_sweep`, `SweepPass`), judging each entry when its slice runs, so one sweep
    never holds the event loop for long (issue 4).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Iterator

from kite_shared.tiers.hot import HotLRU
from kite_shared.tiers.keys import BlockKey
from kite_ru_pool.index import COLD, FREE, WARM, BlockIndex, TagStore, fold_totals


@dataclass(frozen=True)
class Demote:
    """Write `data` (evicted from hot) to `tier` (WARM or COLD)."""

    key: BlockKey
    data: bytes
    tier: int


@dataclass(frozen=True)
class Archive:
    """Copy the block from warm to cold (unless `cold_has_it`) and then delete it from warm."""

    key: BlockKey
    cold_has_it: bool


@dataclass(frozen=True)
class RenewWarm:
    """Reset the warm TTL of a block the pool still wants in warm."""

    key: BlockKey


@dataclass(frozen=True)
class ExpireCold:
    """Delete a cold-only block idle past the cold TTL."""

    key: BlockKey


@dataclass(frozen=True)
class DropBlock:
    """Delete the block from `tiers` (a bit set of WARM | COLD); the index and hot already forgot it
    (catalog.Catalog.drop)."""

    key: BlockKey
    tiers: int


Action = Demote | Archive | RenewWarm | ExpireCold | DropBlock


# A decision as a pass keeps it until it is taken: (last hit, model tag, hash, tenant tag, what), atoms
# only, so sorting by it orders as (last hit, key) and the collector untracks it at its first young
# collection: 10^5 decisions held as objects (a key, an action) made the full collections that a
# sweep's allocations trigger walk them all, 50-90 ms at 10^6 blocks (issue 38).
_Found = tuple[float, str, bytes, str, int]
_ARCHIVE, _ARCHIVE_COLD_HAS_IT, _RENEW, _EXPIRE = range(4)


def _action(found: _Found) -> Action:
    _, tag, h, tenant, code = found
    key = BlockKey(tag, h, tenant)
    if code == _RENEW:
        return RenewWarm(key)
    if code == _EXPIRE:
        return ExpireCold(key)
    return Archive(key, code == _ARCHIVE_COLD_HAS_IT)


COMPACT_FREE_FRACTION = 0.25  # a pass closes a tag's gaps when more of its slots than this are free
MAX_WALK_PER_ENTRY = 64  # slots (free ones included) a sweep step walks at most per entry of its budget


class SweepPass:
    """One lifecycle sweep (the module's rules) walked in bounded steps; pure and deterministic.

    `step(n)` examines at most n index entries and returns True once every entry has been examined;
    `actions()` then lists the decisions, oldest idle first (ties by key), as `Maintenance.sweep`, and
    `ordered_actions()` hands the same list out lazily, so a caller can take it a slice at a time. The
    walk covers the model tags and, per tag, the slots (index.TagStore) present when it reaches that tag
    (it notes where they end: nothing is copied); each entry is judged from its state at the step that
    examines it, with the pass's `now`. So between steps the index may change: an entry dropped or
    invalidated meanwhile is skipped, one added after the pass reached its tag waits for the next sweep
    (a block dropped and stored again meanwhile is examined where it was, as in a copy of the keys:
    TagStore), and a pin or hit that lands after its entry was examined applies from
    the next sweep (the service re-checks nothing: a renewal or archival of a block hit a moment ago is
    harmless). Run in one step (`step()` with no limit) the result is exactly `Maintenance.sweep`'s.
    One pass walks a tag at a time: a pass whose tag another pass has reached since leaves the rest of
    that tag to the other (the service runs one pass at a time).

    A pass over a tag whose slots are more than COMPACT_FREE_FRACTION free closes the gaps as it walks
    (TagStore), so free slots cost at most the drops since the last sweep.

    Each step sorts what it found (at most n decisions), and `ordered_actions` merges those runs, so no
    call sorts the whole sweep's decisions at once (issue 38: at 10^6 blocks no call holds the caller
    10 ms). Steps skip the slots of a tag that were free when the pass reached it at no charge to `n`,
    but walk at most MAX_WALK_PER_ENTRY * n slots.

    The pass also counts blocks and bytes per tier over the entries it examined (`tier_totals`), so a
    service can report warm/cold totals without another walk of the index.
    """

    _serials = itertools.count(1)

    def __init__(self, index: BlockIndex, hot: HotLRU, now: float, warm_up: bool, cold_up: bool, *,
                 archive_after_s: float, renew_after_s: float, cold_ttl_s: float, has_cold: bool) -> None:
        """`renew_after_s`: how long after its last write or renewal a warm block's lease is renewed."""
        self.index = index
        self.hot = hot
        self.now = now
        self.warm_up = warm_up
        self.cold_up = cold_up
        self.archive_after_s = archive_after_s
        self.renew_after_s = renew_after_s
        self.cold_ttl_s = cold_ttl_s
        self.has_cold = has_cold
        self.examined = 0
        self._serial = next(SweepPass._serials)
        self._tags = [t for t in index.stores if t not in index.invalidated]
        self._next_tag = 0
        self._tag = ""
        self._store: TagStore | None = None
        self._end = 0  # the tag's slots when the pass reached it
        self._compact = False  # whether this walk closes the tag's gaps (TagStore)
        self._packed = 0  # then: where the next block examined moves to
        self._pos = 0
        self._runs: list[list[_Found]] = []  # each step's decisions, sorted
        self._blocks = [0] * 8  # by tier bit set
        self._bytes = [0] * 8

    @property
    def done(self) -> bool:
        return self._store is None and self._next_tag >= len(self._tags)

    def step(self, max_entries: int | None = None) -> bool:
        """Examine up to `max_entries` more entries (all that are left when None); True when done."""
        index = self.index
        budget = max_entries if max_entries is not None else -1
        walk = MAX_WALK_PER_ENTRY * max_entries if max_entries is not None else -1
        found: list[_Found] = []
        while budget != 0 and walk != 0:
            if self._store is None:
                if self._next_tag >= len(self._tags):
                    break
                self._tag = self._tags[self._next_tag]
                self._next_tag += 1
                store = index.stores.get(self._tag)
                if store is None or self._tag in index.invalidated:
                    continue
                self._store, self._end, self._pos, self._packed = store, len(store.hashes), 0, 0
                num_free = len(store.hashes) - len(store.slots)
                self._compact = num_free > COMPACT_FREE_FRACTION * len(store.hashes)
                store.walker, store.walk_pos, store.dropped = self._serial, 0, {}
            store = self._store
            if index.stores.get(self._tag) is not store or self._tag in index.invalidated:
                self._leave()  # cleared or invalidated since the pass reached it: the purge handles it
                continue
            if store.walker != self._serial:
                self._store = None  # another pass walks (and may be moving) the tag now: its business
                continue
            end = self._end if walk < 0 else min(self._end, self._pos + walk)
            pos, examined = self._examine(store, self._pos, end, budget, found)
            if budget > 0:
                budget -= examined
            if walk > 0:
                walk -= pos - self._pos
            self.examined += examined
            self._pos = store.walk_pos = pos
            if pos >= self._end:
                if self._compact:
                    store.pack_from(self._packed, self._end)  # and the blocks added meanwhile
                self._leave()
        if found:
            found.sort()  # by last hit, then key (unique: the codes are never compared)
            self._runs.append(found)
        return self.done

    def _leave(self) -> None:
        store = self._store
        if store is not None and store.walker == self._serial:
            store.walker, store.walk_pos, store.dropped = 0, 0, {}
        self._store = None

    def _examine(self, store: TagStore, start: int, end: int, budget: int,
                 found: list[_Found]) -> tuple[int, int]:
        """Judge the entries in slots [start, end), stopping after `budget` of them (< 0: no limit);
        returns where it stopped and how many it examined. A block dropped since the pass reached the
        tag counts as examined (it was there to examine, as in a copy of the tag's keys); a slot that
        was free already does not."""
        now, tag = self.now, self._tag
        tenant_tags = self.index.tenant_tags
        pins = self.index.pins
        blocks, nbytes = self._blocks, self._bytes
        warm_up = self.warm_up
        can_archive = self.has_cold and self.cold_up
        archive_after = self.archive_after_s
        renew_after = self.renew_after_s
        can_expire = self.cold_up and self.cold_ttl_s > 0
        cold_ttl = self.cold_ttl_s
        tiers, sizes, last_hits, touches = store.tiers, store.size, store.last_hit, store.warm_touch
        hashes, owners = store.hashes, store.tenant
        dropped_since: set[int] | None = None  # slots of blocks dropped since the pass reached the tag
        compact, packed = self._compact, self._packed
        examined = 0
        i = start
        while i < end:
            t = tiers[i]
            if t == FREE:  # free before the pass reached the tag (no charge), or dropped since
                if dropped_since is None:
                    dropped_since = set(store.dropped.values())
                if i in dropped_since:
                    if examined == budget:
                        break
                    examined += 1
                i += 1
                continue
            if examined == budget:
                break
            s = i
            i += 1
            if compact:
                if packed != s:
                    store.move(s, packed)
                    s = packed
                packed += 1
                self._packed = packed
            examined += 1
            blocks[t] += 1
            nbytes[t] += sizes[s]
            if t & WARM and warm_up:
                if now - last_hits[s] >= archive_after and can_archive:
                    kind = Archive
                elif now - touches[s] >= renew_after:
                    kind = RenewWarm
                else:
                    continue
            elif t == COLD and can_expire and now - last_hits[s] >= cold_ttl:
                kind = ExpireCold
            else:
                continue
            h = hashes[s]
            if (tag, h) in pins:
                continue
            code = (_ARCHIVE_COLD_HAS_IT if t & COLD else _ARCHIVE) if kind is Archive else \
                _RENEW if kind is RenewWarm else _EXPIRE
            found.append((last_hits[s], tag, h, tenant_tags[owners[s]], code))
        return i, examined

    def ordered_actions(self) -> Iterator[Action]:
        """The decisions so far, oldest idle first (ties by key), merged lazily from the steps' runs."""
        return map(_action, heapq.merge(*self._runs))

    def actions(self) -> list[Action]:
        """The decisions so far, oldest idle first (ties by key)."""
        if len(self._runs) > 1:
            self._runs = [list(heapq.merge(*self._runs))]
        return list(map(_action, self._runs[0])) if self._runs else []

    def tier_totals(self) -> dict[str, tuple[int, int]]:
        """(blocks, bytes) per tier over the entries examined (hot: the LRU now, exact)."""
        return fold_totals(self._blocks, self._bytes, (len(self.hot), self.hot.bytes_used))
