"""Worker events: what the workers say about their own local caches (BlockStored / BlockRemoved,
heartbeats, a drain), applied to the worker-cache index, and kept aside while a joining replica waits for
another replica's snapshot of it (`hold`, `install`).

Boundary: part of the coordinating layer, synchronous (callers pass `now`). It calls only lower layers:
worker_caches.WorkerCaches (each worker's blocks) and index.BlockIndex (a worker holding a pool block
means the block was used: a hit for the lifecycle), and counts event gaps. The handlers feed it the
events, the replica layer the snapshot, the maintenance the silent workers to forget.
"""

from __future__ import annotations

from typing import Iterable

from kite_shared.tiers.keys import BlockKey, model_tag
from kite_ru_pool.counters import Counters
from kite_ru_pool.index import BlockIndex
from kite_ru_pool.worker_caches import WorkerCaches


class WorkerEvents:
    def __init__(self, workers: WorkerCaches, index: BlockIndex, counters: Counters) -> None:
        self.workers = workers
        self.index = index
        self.counters = counters
        # Worker events kept aside while a joining replica waits for another's worker-cache snapshot
        # (hold / install); None: applied as they come.
        self._held: list[tuple[str, str, tuple]] | None = None

    def stored(self, worker_id: str, model_fingerprint: str, hashes: Iterable[bytes], seq: int,
               now: float) -> None:
        if self._held is not None:
            self._held.append(("stored", worker_id, (model_fingerprint, list(hashes), seq, now)))
            return
        tag = model_tag(model_fingerprint)
        hashes = list(hashes)
        if self.workers.stored(worker_id, tag, hashes, seq, now):
            self.counters.worker_event_gaps += 1
        for h in hashes:  # a worker holding a pool block means it was used: a hit for archival
            self.index.note_hit(BlockKey(tag, h), now)

    def removed(self, worker_id: str, model_fingerprint: str, hashes: Iterable[bytes], all_blocks: bool,
                seq: int, now: float) -> None:
        if self._held is not None:
            self._held.append(("removed", worker_id, (model_fingerprint, list(hashes), all_blocks, seq, now)))
            return
        tag = "" if all_blocks else model_tag(model_fingerprint)
        if self.workers.removed(worker_id, tag, hashes, all_blocks, seq, now):
            self.counters.worker_event_gaps += 1

    def forget(self, worker_id: str) -> None:
        """The worker drains or went silent: its local cache is no longer known."""
        if self._held is not None:
            self._held.append(("forget", worker_id, ()))
            return
        self.workers.forget(worker_id)

    def alive(self, worker_id: str, now: float) -> None:
        if self._held is not None:
            self._held.append(("alive", worker_id, (now,)))
            return
        self.workers.alive(worker_id, now)

    def hold(self) -> None:
        """Keep worker events and heartbeats aside from now until `install` (a joining replica, while
        another replica's snapshot of the worker caches comes)."""
        self._held = []

    def install(self, caches: Iterable[tuple[str, int, float, dict[str, list[bytes]]]]) -> int:
        """Take the workers of a snapshot (worker id, last event number, last seen, model tag -> hashes),
        then apply the events held meanwhile that the snapshot does not hold: those of workers it does
        not name, unnumbered ones, and those numbered after the snapshot's. Returns how many events were
        applied; events flow as usual from now on."""
        held, self._held = self._held or [], None
        snapshot_seq: dict[str, int] = {}
        for worker_id, seq, seen, by_tag in caches:
            self.workers.restore(worker_id, by_tag, seq, seen)
            snapshot_seq[worker_id] = seq
        applied = 0
        for kind, worker_id, args in held:
            if kind in ("stored", "removed"):
                seq = args[-2]
                if 0 < seq <= snapshot_seq.get(worker_id, 0):
                    continue  # in the snapshot already
                if kind == "stored":
                    self.stored(worker_id, *args)
                else:
                    self.removed(worker_id, *args)
            elif kind == "forget":
                self.forget(worker_id)
            else:
                self.alive(worker_id, *args)
            applied += 1
        return applied
