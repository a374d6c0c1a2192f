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

from kite_shared.tiers.hot import HotLRU
from kite_shared.tiers.keys import BlockKey
from kite_ru_pool.lifecycle import Archive, ExpireCold, RenewWarm, Action
from tests.unit.ru_pool_oracle.index import COLD, WARM, BlockIndex, Entry, fold_totals


class SweepPass:
    """One lifecycle sweep (the module's rules) walked in bounded steps; pure and deterministic.

    `step(n)` examines at most n index entries and returns True once every entry has been examined;
    `actions()` then lists the decisions, oldest idle first (ties by key), as `Maintenance.sweep`. The
    walk covers the model tags and, per tag, the block hashes present when it reaches that tag (one
    snapshot of the tag's keys, a C-speed copy); each entry is judged from its state at the step that
    examines it, with the pass's `now`. So between steps the index may change: an entry dropped or
    invalidated meanwhile is skipped, one added after its tag's snapshot waits for the next sweep, and
    a pin or hit that lands after its entry was examined applies from the next sweep (the service
    re-checks nothing: a renewal or archival of a block hit a moment ago is harmless). Run in one step
    (`step()` with no limit) the result is exactly `Maintenance.sweep`'s.

    The pass also counts blocks and bytes per tier over the entries it examined (`tier_totals`), so a
    service can report warm/cold totals without another walk of the index.
    """

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
        self._tags = [t for t in index.models if t not in index.invalidated]
        self._next_tag = 0
        self._tag = ""
        self._models: dict[bytes, Entry] | None = None
        self._hashes: list[bytes] = []
        self._pos = 0
        self._found: list[tuple[float, BlockKey, Action]] = []
        self._blocks = [0] * 8  # by tier bit set
        self._bytes = [0] * 8

    @property
    def done(self) -> bool:
        return self._models is None and self._next_tag >= len(self._tags)

    def step(self, max_entries: int | None = None) -> bool:
        """Examine up to `max_entries` more entries (all that are left when None); True when done."""
        index = self.index
        budget = max_entries if max_entries is not None else -1
        while budget != 0:
            if self._models is None:
                if self._next_tag >= len(self._tags):
                    return True
                self._tag = self._tags[self._next_tag]
                self._next_tag += 1
                models = index.models.get(self._tag)
                if models is None or self._tag in index.invalidated:
                    continue
                self._models, self._hashes, self._pos = models, list(models), 0
            if index.models.get(self._tag) is not self._models or self._tag in index.invalidated:
                self._models = None  # cleared or invalidated since the snapshot: the purge handles it
                continue
            end = len(self._hashes) if budget < 0 else min(len(self._hashes), self._pos + budget)
            self._examine(self._hashes, self._pos, end)
            if budget > 0:
                budget -= end - self._pos
            self.examined += end - self._pos
            self._pos = end
            if end >= len(self._hashes):
                self._models, self._hashes = None, []
        return self.done

    def _examine(self, hashes: list[bytes], start: int, end: int) -> None:
        now, tag = self.now, self._tag
        get = self._models.get
        pins = self.index.pins
        found = self._found
        blocks, nbytes = self._blocks, self._bytes
        warm_up = self.warm_up
        can_archive = self.has_cold and self.cold_up
        archive_after = self.archive_after_s
        renew_after = self.renew_after_s
        can_expire = self.cold_up and self.cold_ttl_s > 0
        cold_ttl = self.cold_ttl_s
        for i in range(start, end):
            h = hashes[i]
            e = get(h)
            if e is None:
                continue  # dropped since the snapshot
            t = e.tiers
            blocks[t] += 1
            nbytes[t] += e.size
            if t & WARM and warm_up:
                if now - e.last_hit >= archive_after and can_archive:
                    kind = Archive
                elif now - e.warm_touch >= renew_after:
                    kind = RenewWarm
                else:
                    continue
            elif t == COLD and can_expire and now - e.last_hit >= cold_ttl:
                kind = ExpireCold
            else:
                continue
            if (tag, h) in pins:
                continue
            key = e.key(tag, h)
            action = Archive(key, bool(t & COLD)) if kind is Archive else kind(key)
            found.append((e.last_hit, key, action))

    def actions(self) -> list[Action]:
        """The decisions so far, oldest idle first (ties by key)."""
        self._found.sort()  # (last hit, key, action): keys are unique, so actions are never compared
        return [c[2] for c in self._found]

    def tier_totals(self) -> dict[str, tuple[int, int]]:
        """(blocks, bytes) per tier over the entries examined (hot: the LRU now, exact)."""
        return fold_totals(self._blocks, self._bytes, (len(self.hot), self.hot.bytes_used))
