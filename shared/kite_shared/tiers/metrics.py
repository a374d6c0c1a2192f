"""Prometheus metrics of the tiers, shared by the ru-pool and by workers reading warm/cold directly.

Defined once at import (prometheus-client refuses duplicate names in one registry). `tier` is one of
hot, warm, cold; `direction` is read or write.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

TIER_HITS = Counter("kite_tier_hits_total", "Block reads answered by a tier.", ["tier"])
TIER_MISSES = Counter("kite_tier_misses_total",
                      "Block reads a tier could not answer (absent, down, timed out or corrupt).", ["tier"])
TIER_BYTES = Counter("kite_tier_bytes_total", "Bytes of encoded units moved to or from a tier.",
                     ["tier", "direction"])
TIER_EVICTIONS = Counter("kite_tier_evictions_total",
                         "Blocks a tier dropped to make room or by age (LRU, archival, TTL).", ["tier"])
TIER_PROMOTIONS = Counter("kite_tier_promotions_total", "Blocks copied to a faster tier on a hit.")
TIER_DEMOTIONS = Counter("kite_tier_demotions_total",
                         "Blocks moved to a slower tier (hot eviction to warm, archival warm to cold).")
TIER_INTEGRITY_FAILURES = Counter(
    "kite_tier_integrity_failures_total",
    "Stored units that failed verification (checksum, format, or not the block asked for); each was "
    "deleted and treated as a miss.", ["tier"])
TIER_TRANSCODES = Counter(
    "kite_tier_transcodes_total",
    "Units the ru-pool re-encoded into a tier's lossy codec on their way down (kite_shared.tier_codecs).",
    ["tier", "codec"])
TIER_TRANSCODE_REFUSALS = Counter(
    "kite_tier_transcode_refusals_total",
    "Units with no form in their tier's lossy codec (non-finite values), stored losslessly instead.")
TIER_TRANSCODE_SECONDS = Histogram(
    "kite_tier_transcode_seconds", "Time to verify, re-encode and sign one unit in a lossy codec.",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25))
POOL_LOOKUP_SECONDS = Histogram(
    "kite_pool_lookup_seconds", "Time the ru-pool spends answering one lookup (decode to encode).",
    buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05))
TIER_FETCH_SECONDS = Histogram(
    "kite_tier_fetch_seconds", "Time to read and verify one block from a tier.", ["tier"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0))
POOL_QUOTA_EVICTIONS = Counter(
    "kite_pool_quota_evictions_total",
    "Blocks the ru-pool deleted from every tier to keep their tenant under its quota "
    "(KITE_POOL_TENANT_QUOTA_BYTES); per tenant in `kite pool stats --tenant`.")
POOL_QUOTA_REFUSED = Counter(
    "kite_pool_quota_refused_total",
    "Puts the ru-pool refused because the tenant's pinned blocks fill its quota (or the block alone "
    "exceeds it).")
TIER_HITS_UNREPORTED = Counter(
    "kite_tier_hits_unreported_total",
    "Blocks a worker read from warm or cold itself that it could not report to the ru-pool for promotion "
    "(its batch of pending reports was full, or the publish failed): those blocks are not promoted.")
