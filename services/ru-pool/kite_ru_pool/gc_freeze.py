"""Keep Python's cyclic garbage collector from walking the ru-pool's block index (issue 4).

The pool holds small objects per block (the hot LRU's keys, the worker caches' entries; before issue 38
also the index's Entry and tenant-ledger tuple, where its arrays, hashes and slot numbers now are not
tracked by the collector at all) that never form reference cycles and live for hours: exactly what a
full (generation 2) collection walks for nothing.
It walks them on the event loop, 10-15 ms per 100,000 tracked objects on a 2-core VM, and CPython
runs one whenever a quarter more objects have survived since the last: with a large index that is a
stall of tens to hundreds of milliseconds for every request in flight, at unpredictable moments.

So the service runs one full collection itself after the index rebuild and `gc.freeze()`s what
survives (later collections skip frozen objects), and does it again after a sweep whenever the index
has grown by a quarter (at least `min_growth` blocks) since the last freeze: each such collection only
walks what was added since, at a moment the service chose. Frozen objects are still freed by reference
counting when the index drops them; only a reference cycle that forms among frozen objects later is
never collected (the collection just before each freeze leaves no garbage behind, and freezes are
rare: at most one per quarter of growth).

Only the service process turns this on (`kite_ru_pool.__main__`); pools started inside a test process
leave the test runner's GC alone.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


class IndexGcFreezer:
    def __init__(self, enabled: bool, min_growth: int = 20_000, growth: float = 0.25) -> None:
        self.enabled = enabled
        self.min_growth = min_growth
        self.growth = growth
        self.frozen_at: int | None = None  # index size at the last freeze (lowered as the index shrinks)

    def due(self, blocks: int) -> bool:
        if not self.enabled:
            return False
        if self.frozen_at is None:
            return True
        self.frozen_at = min(self.frozen_at, blocks)
        return blocks - self.frozen_at >= max(self.min_growth, self.growth * self.frozen_at)

    def freeze(self, blocks: int) -> float:
        """Collect everything, then freeze the survivors; seconds it took (0.0 when turned off)."""
        if not self.enabled:
            return 0.0
        started = time.perf_counter()
        gc.collect()
        gc.freeze()
        self.frozen_at = blocks
        took = time.perf_counter() - started
        log.info("index of %d blocks: GC collected and froze %d objects in %.1f ms", blocks,
                 gc.get_freeze_count(), took * 1e3)
        return took

    def maybe_freeze(self, blocks: int) -> float:
        return self.freeze(blocks) if self.due(blocks) else 0.0
