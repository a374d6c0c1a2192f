"""Worker caches: which blocks each worker holds in its own local KV cache, learned from its
BlockStored / BlockRemoved events, so a routing lookup can say how long a prefix each worker would reuse.

Boundary: pure and synchronous (callers pass `now`); it knows model tags and block hashes only, nothing
of the pool's tiers or tenants, and calls nothing of the pool: a lower layer. worker_events.WorkerEvents
feeds it the events, reads.PoolReads asks it for prefix lengths in `lookup`, catalog.Catalog drops the
blocks of cleared models, the replica layer exports and restores its snapshot.

The events come over core NATS, at most once: a lost event makes a worker's prefix wrong until its next
events. Each worker numbers its events (`seq`); a gap is reported to the caller (and counted), a worker
silent for a while (no event, no heartbeat) is found by `stale` and forgotten, and a worker that drains
or restarts says so (BlockRemoved(all_blocks) or a draining heartbeat). Everything here is rebuilt from
the events alone, or taken from another pool replica's snapshot (`export` / `restore`, whole workers with
their last event number, so the asker replays only the events the snapshot does not hold).

Two views of the same facts, kept in step by every change: `held` (worker -> tag -> hashes) for what is
asked per worker (removal of all its blocks, counts, snapshots), and `_holders` (tag -> hash -> the
workers holding it), so that a routing lookup walks the prompt's chain once, touching only the workers
that hold its first block: O(prefix blocks x holders), not O(workers) (issue 38: 1,000 workers' sets
probed per lookup cost 1.4 ms). A hash held by one worker maps to that worker's id itself, not to a
one-element set: most blocks have one holder, and a set costs about 200 bytes more.
"""

from __future__ import annotations

from typing import Iterable, Sequence


HASH_WIRE_BYTES = 34  # one 32-byte block hash in msgpack (2 bytes of header)
WORKER_WIRE_BYTES = 96  # a worker's id, seq, time and one model tag around its hashes, generously


class WorkerCaches:
    def __init__(self) -> None:
        self.held: dict[str, dict[str, set[bytes]]] = {}  # worker -> model tag -> block hashes
        self._seq: dict[str, int] = {}  # worker -> highest event number seen
        self._seen: dict[str, float] = {}  # worker -> unix seconds of its last event or heartbeat
        self._holders: dict[str, dict[bytes, str | set[str]]] = {}  # tag -> hash -> worker(s) holding it

    def stored(self, worker_id: str, tag: str, hashes: Iterable[bytes], seq: int, now: float) -> bool:
        """The worker loaded these blocks. True when events of this worker were lost before this one."""
        gap = self._check_seq(worker_id, seq)
        held = self.held.setdefault(worker_id, {}).setdefault(tag, set())
        holders = self._holders.setdefault(tag, {})
        for h in hashes:
            if h not in held:
                held.add(h)
                _add_holder(holders, h, worker_id)
        self._seen[worker_id] = now
        return gap

    def removed(self, worker_id: str, tag: str, hashes: Iterable[bytes], all_blocks: bool, seq: int,
                now: float) -> bool:
        """The worker dropped these blocks (every block of every model with `all_blocks`, when `tag` is
        not read). True when events of this worker were lost before this one."""
        gap = self._check_seq(worker_id, seq)
        self._seen[worker_id] = now
        if all_blocks:
            self._drop_worker(worker_id)
            return gap
        held = self.held.get(worker_id, {}).get(tag)
        if held:
            holders = self._holders.setdefault(tag, {})
            for h in hashes:
                if h in held:
                    held.discard(h)
                    _discard_holder(holders, h, worker_id)
        return gap

    def alive(self, worker_id: str, now: float) -> None:
        """A heartbeat: keeps a worker whose cache is known from being found stale."""
        if worker_id in self.held:
            self._seen[worker_id] = now

    def forget(self, worker_id: str) -> None:
        self._drop_worker(worker_id)
        self._seq.pop(worker_id, None)
        self._seen.pop(worker_id, None)

    def forget_tags(self, tags: Iterable[str]) -> None:
        """Drop every worker's blocks of these model tags (invalidated or cleared)."""
        tags = list(tags)
        for by_tag in self.held.values():
            for t in tags:
                by_tag.pop(t, None)
        for t in tags:
            self._holders.pop(t, None)

    def stale(self, now: float, after_s: float) -> list[str]:
        """Workers not heard of for `after_s` seconds, sorted."""
        return sorted(w for w, seen in self._seen.items() if now - seen >= after_s)

    def prefix_lengths(self, tag: str, chain: Sequence[bytes]) -> dict[str, int]:
        """How many leading blocks of `chain` each worker holds, for the workers holding at least the
        first one (a worker absent holds none). Walks the chain once through the inverted index, keeping
        the workers that still hold every block so far; the cost does not grow with the fleet."""
        holders = self._holders.get(tag)
        if not holders or not chain:
            return {}
        first = holders.get(chain[0])
        if first is None:
            return {}
        out: dict[str, int] = {}
        alive = {first} if first.__class__ is str else set(first)
        depth = 1
        num_blocks = len(chain)
        while depth < num_blocks:
            if len(alive) == 1:  # one worker left: its own set answers without the index's lookups
                (worker_id,) = alive
                cached = self.held[worker_id][tag]
                while depth < num_blocks and chain[depth] in cached:
                    depth += 1
                out[worker_id] = depth
                return out
            at = holders.get(chain[depth])
            if at is None:
                break
            still = ({at} if at in alive else set()) if at.__class__ is str else alive & at
            if len(still) != len(alive):
                for worker_id in alive - still:
                    out[worker_id] = depth
                if not still:
                    return out
            alive = still
            depth += 1
        for worker_id in alive:
            out[worker_id] = depth
        return out

    # --- the snapshot a joining replica asks a live one for ---------------------------------------------
    def export(self, after: str = "", max_bytes: int = 1 << 20
               ) -> tuple[list[tuple[str, int, float, dict[str, list[bytes]], bool]], bool]:
        """Whole workers in id order after `after`, as (worker id, last seq, last seen, model tag ->
        hashes, truncated), as many as `max_bytes` of hashes (HASH_WIRE_BYTES each) hold, and whether
        more workers follow. The first worker of a page always comes, cut to `max_bytes` (truncated) when
        its blocks alone are more."""
        ids = sorted(w for w in self._seen.keys() | self.held.keys() if w > after)
        page: list[tuple[str, int, float, dict[str, list[bytes]], bool]] = []
        used = 0
        for n, worker_id in enumerate(ids):
            by_tag = self.held.get(worker_id, {})
            size = sum(WORKER_WIRE_BYTES + HASH_WIRE_BYTES * len(hs) for hs in by_tag.values())
            truncated = False
            if page and used + size > max_bytes:
                return page, True
            models = {tag: list(hs) for tag, hs in by_tag.items()}
            if size > max_bytes:  # alone over a page: keep what fits
                left, truncated = max(0, max_bytes - used) // HASH_WIRE_BYTES, True
                for tag in list(models):
                    models[tag] = models[tag][:left]
                    left -= len(models[tag])
            page.append((worker_id, self._seq.get(worker_id, 0), self._seen.get(worker_id, 0.0), models,
                         truncated))
            used += size
        return page, False

    def restore(self, worker_id: str, by_tag: dict[str, Iterable[bytes]], seq: int, seen: float) -> None:
        """Take one worker's cache from a snapshot, replacing what this index had of it."""
        held = {tag: set(hashes) for tag, hashes in by_tag.items() if hashes}
        self._drop_worker(worker_id)
        if held:
            self.held[worker_id] = held
            for tag, hashes in held.items():
                holders = self._holders.setdefault(tag, {})
                for h in hashes:
                    _add_holder(holders, h, worker_id)
        if seq > 0:
            self._seq[worker_id] = seq
        self._seen[worker_id] = max(seen, self._seen.get(worker_id, 0.0))

    def num_blocks(self) -> dict[str, int]:
        """Blocks attributed to each worker's local cache (every model)."""
        return {worker_id: sum(map(len, by_tag.values())) for worker_id, by_tag in self.held.items()}

    def _drop_worker(self, worker_id: str) -> None:
        """Every block of `worker_id`, out of both views."""
        by_tag = self.held.pop(worker_id, None)
        if not by_tag:
            return
        for tag, hashes in by_tag.items():
            holders = self._holders.get(tag)
            if holders is not None:
                for h in hashes:
                    _discard_holder(holders, h, worker_id)

    def _check_seq(self, worker_id: str, seq: int) -> bool:
        if seq <= 0:
            return False  # the sender does not number its events
        last = self._seq.get(worker_id)
        self._seq[worker_id] = max(seq, last or 0)
        return last is not None and seq != last + 1 and seq > last


def _add_holder(holders: dict[bytes, str | set[str]], h: bytes, worker_id: str) -> None:
    at = holders.get(h)
    if at is None:
        holders[h] = worker_id
    elif at.__class__ is str:
        if at != worker_id:
            holders[h] = {at, worker_id}
    else:
        at.add(worker_id)


def _discard_holder(holders: dict[bytes, str | set[str]], h: bytes, worker_id: str) -> None:
    at = holders.get(h)
    if at is None:
        return
    if at.__class__ is str:
        if at == worker_id:
            del holders[h]
    else:
        at.discard(worker_id)
        if len(at) == 1:
            holders[h] = next(iter(at))
