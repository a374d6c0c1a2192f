"""The garbage collector in a service process: its startup heap frozen out of the collector's reach, and
its full collections timed.

Once setup has returned, the heap built so far (torch, transformers and vLLM's modules in a worker: about
720,000 objects) is frozen out of the garbage collector's reach (freeze_startup_heap), as vLLM's own API
server does: otherwise every full collection walks it on the event loop, a pause of about 0.4 s on this
2-core machine with every request in flight stopped, and CPython starts one whenever long-lived objects
have grown by a quarter. Full collections are timed in kite_gc_full_collection_seconds.

Boundary: gc only; when to freeze is the runtime's (kite_shared.service.runtime.run_service).
"""

from __future__ import annotations

import gc
import logging
import time

from prometheus_client import Histogram

log = logging.getLogger(__name__)

GC_FULL_COLLECTION_SECONDS = Histogram(
    "kite_gc_full_collection_seconds",
    "Full (generation 2) collections of Python's cyclic garbage collector: each stops every thread of the process",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))


def freeze_startup_heap(what: str) -> float:
    """Collect once, then move every object that survived into the permanent generation, which later
    collections skip (vLLM's `freeze_gc_heap`). What is frozen is still freed by reference counting; only
    a reference cycle among frozen objects is never collected, and a process's startup heap (modules,
    classes, the model's configuration) is kept for its lifetime anyway. Seconds it took."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    took = time.perf_counter() - started
    log.info("%s: froze %d objects of the startup heap out of garbage collection (%.0f ms)", what,
             gc.get_freeze_count(), took * 1e3)
    return took


class _FullCollectionTimer:
    """A `gc.callbacks` entry timing generation-2 collections into GC_FULL_COLLECTION_SECONDS (the young
    generations' collections, hundreds a second, return after one comparison)."""

    def __init__(self) -> None:
        self._started: float | None = None

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            GC_FULL_COLLECTION_SECONDS.observe(time.perf_counter() - self._started)
            self._started = None


def time_full_collections() -> None:
    """Time this process's full collections from now on (once per process)."""
    if not any(isinstance(callback, _FullCollectionTimer) for callback in gc.callbacks):
        gc.callbacks.append(_FullCollectionTimer())
