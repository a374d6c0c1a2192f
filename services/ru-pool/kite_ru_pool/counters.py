"""The ru-pool's counters (`kite pool stats`, `PoolTelemetry`): one plain record that the coordinating
parts (reads, writes, catalog, worker_events, maintenance), tier I/O and the replica layer add to.

Boundary: a leaf; it imports nothing and decides nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Counters:
    puts: int = 0
    duplicates: int = 0
    refused_invalidated: int = 0
    refused_corrupt: int = 0
    hot_hits: int = 0
    hot_misses: int = 0
    hot_evictions: int = 0
    hot_refused: int = 0  # puts that did not fit (everything left is pinned)
    promotions: int = 0
    demotions: int = 0
    demotions_failed: int = 0  # blocks on their way down (or written through) that no slower tier took: lost
    transcoded: int = 0  # units re-encoded into a lossier tier's codec on their way down
    transcode_refused: int = 0  # ... that had no form in it (non-finite values): stored as they were
    archived: int = 0
    warm_renewed: int = 0
    cold_expired: int = 0
    lookups: int = 0
    worker_hits: int = 0  # blocks workers reported reading from warm or cold themselves (TierHits)
    worker_hits_dropped: int = 0  # ... not promoted: the promotion queue was full (worker_hits.MAX_WAITING)
    worker_event_gaps: int = 0
    purged: int = 0
    warm_writes_dropped: int = 0
    evicted: int = 0  # blocks the index held that an admin evict removed
    # replicas (docs/ru-pool.md, "Replicas")
    sweeps: int = 0  # lifecycle sweeps this replica carried out as the leader
    index_changes_sent: int = 0  # PoolIndexChanges messages published to the other replicas
    index_changes_applied: int = 0  # ... received from them and applied
    index_change_gaps: int = 0  # messages of another replica lost (its seq jumped): warm is re-listed
