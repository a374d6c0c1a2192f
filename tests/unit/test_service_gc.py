"""What every service does with Python's cyclic garbage collector (kite_shared.service): its startup heap
frozen out of later collections, and full collections timed."""

from __future__ import annotations

import gc
import weakref

from kite_shared.service import GC_FULL_COLLECTION_SECONDS, freeze_startup_heap, time_full_collections


class _Node:
    pass


def _timed_full_collections() -> float:
    return next(sample.value for metric in GC_FULL_COLLECTION_SECONDS.collect() for sample in metric.samples
                if sample.name.endswith("_count"))


def test_full_collections_are_timed_once_each_and_young_ones_not_at_all():
    time_full_collections()
    time_full_collections()  # a second call installs no second timer
    timers = [c for c in gc.callbacks if type(c).__name__ == "_FullCollectionTimer"]
    assert len(timers) == 1
    before = _timed_full_collections()
    gc.collect(0)
    gc.collect(1)
    assert _timed_full_collections() == before
    gc.collect()
    assert _timed_full_collections() == before + 1


def test_the_frozen_heap_is_skipped_by_collections_and_still_freed_by_reference_counting():
    cycle, plain = _Node(), _Node()
    cycle.self = cycle
    cycle_ref, plain_ref = weakref.ref(cycle), weakref.ref(plain)
    frozen_before = gc.get_freeze_count()
    assert freeze_startup_heap("test") >= 0.0
    assert gc.get_freeze_count() > frozen_before
    del cycle, plain
    assert plain_ref() is None  # reference counting frees a frozen object at once
    gc.collect()
    assert cycle_ref() is not None  # a cycle frozen is never collected: startup objects live for good anyway
    later = _Node()
    later.self = later
    later_ref = weakref.ref(later)
    del later
    gc.collect()
    assert later_ref() is None  # what is built after the freeze is collected as before
