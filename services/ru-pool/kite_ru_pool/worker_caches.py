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

    def stored(self, worker_id: str, tag: str, hashes: Iterable[bytes], seq: int, now: float) -> bool:
        """The worker loaded these blocks. True when events of this worker were lost before this one."""
        gap = self._check_seq(worker_id, seq)
        self.held.setdefault(worker_id, {}).setdefault(tag, set()).update(hashes)
        self._seen[worker_id] = now
        return gap

    def removed(self, worker_id: str, tag: str, hashes: Iterable[bytes], all_blocks: bool, seq: int,
                now: float) -> bool:
        """The worker dropped these blocks (every block of every model with `all_blocks`, when `tag` is
        not read). True when events of this worker were lost before this one."""
        gap = self._check_seq(worker_id, seq)
        self._seen[worker_id] = now
        if all_blocks:
            self.held.pop(worker_id, None)
            return gap
        held = self.held.get(worker_id, {}).get(tag)
        if held:
            held.difference_update(hashes)
        return gap

    def alive(self, worker_id: str, now: float) -> None:
        """A heartbeat: keeps a worker whose cache is known from being found stale."""
        if worker_id in self.held:
            self._seen[worker_id] = now

    def forget(self, worker_id: str) -> None:
        self.held.pop(worker_id, None)
        self._seq.pop(worker_id, None)
        self._seen.pop(worker_id, None)

    def forget_tags(self, tags: Iterable[str]) -> None:
        """Drop every worker's blocks of these model tags (invalidated or cleared)."""
        tags = list(tags)
        for by_tag in self.held.values():
            for t in tags:
                by_tag.pop(t, None)

    def stale(self, now: float, after_s: float) -> list[str]:
        """Workers not heard of for `after_s` seconds, sorted."""
        return sorted(w for w, seen in self._seen.items() if now - seen >= after_s)

    def prefix_lengths(self, tag: str, chain: Sequence[bytes]) -> dict[str, int]:
        """How many leading blocks of `chain` each known worker holds."""
        workers: dict[str, int] = {}
        for worker_id, by_tag in self.held.items():
            cached = by_tag.get(tag)
            count = 0
            if cached:
                for h in chain:
                    if h not in cached:
                        break
                    count += 1
            workers[worker_id] = count
        return workers

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
        if held:
            self.held[worker_id] = held
        else:
            self.held.pop(worker_id, None)
        if seq > 0:
            self._seq[worker_id] = seq
        self._seen[worker_id] = max(seen, self._seen.get(worker_id, 0.0))

    def num_blocks(self) -> dict[str, int]:
        """Blocks attributed to each worker's local cache (every model)."""
        return {worker_id: sum(map(len, by_tag.values())) for worker_id, by_tag in self.held.items()}

    def _check_seq(self, worker_id: str, seq: int) -> bool:
        if seq <= 0:
            return False  # the sender does not number its events
        last = self._seq.get(worker_id)
        self._seq[worker_id] = max(seq, last or 0)
        return last is not None and seq != last + 1 and seq > last
