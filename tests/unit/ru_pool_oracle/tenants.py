"""Tenants: what each tenant stores in the pool (blocks and bytes) and its quota.

Boundary: pure bookkeeping over block identities (model tag, block hash) and sizes. It knows nothing of
tiers, index entries or storage, and calls nothing of the pool: the block index (index.py) keeps the
ledgers in step as blocks come and go, and writes.PoolWrites asks `quota_victims` which of a tenant's
blocks to drop for a put (the index lists the candidates) and then has catalog.Catalog drop them.

Every block belongs to the tenant whose request computed it (its storage key and RU header name the
tenant tag). The ledger counts each block once, whatever tiers hold it, so the figure survives promotion
and demotion, and a rebuild from key listings restores it.

Quotas (`tenant_quota_bytes`, per-tenant overrides) are enforced on put: when the new block would take
the tenant over its quota, the tenant's own least recently hit unpinned blocks are dropped from every
tier until the tenant, new block included, is at or under QUOTA_EVICT_TO of its quota. Evicting a little
below the line means a tenant at its quota pays one sort per ~10% of its quota, not one per put. Recency
is compared at QUOTA_RECENCY_GRAIN_S, and among blocks equally recent the deepest (highest block index)
go first, then by key: a chain is put or hit head to tail within milliseconds, and dropping its tail
first (as vLLM's free queue does) leaves a shorter prefix that still hits, where dropping its head would
strand the rest. If pinned blocks leave no room, or the block alone is larger than the quota, the put is
refused. Only a tenant's own blocks are ever evicted for it: one tenant's traffic cannot push another's
blocks out of warm or cold (the hot tier remains one shared LRU). Blocks already being written (a
demotion in flight) are not eviction candidates. A quota lowered below what a tenant holds takes effect
at that tenant's next put.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

QUOTA_EVICT_TO = 0.9  # a tenant over its quota is brought down to this fraction of it (docstring)
QUOTA_RECENCY_GRAIN_S = 1.0  # last hits closer than this count as equally recent for quota evictions

Ident = tuple[str, bytes]  # (model tag, block hash): a block in the index


@dataclass
class TenantLedger:
    """One tenant's blocks in the pool (index identities) and their total encoded size."""

    num_bytes: int = 0
    blocks: set[Ident] = field(default_factory=set)  # (model tag, block hash)
    quota_evictions: int = 0  # blocks dropped to keep the tenant under its quota
    quota_refused: int = 0  # puts refused: pinned blocks left no room, or the block exceeds the quota


class Tenants:
    def __init__(self, quota_bytes: int = 0, quotas: dict[str, int] | None = None) -> None:
        """`quota_bytes`: every tenant's quota (0: none); `quotas`: overrides by tenant tag
        (kite_shared.security.tenant_tag), 0 meaning no quota for that tenant."""
        self.quota_bytes = quota_bytes
        self.quotas = dict(quotas or {})
        self.ledgers: dict[str, TenantLedger] = {}

    def ledger(self, tenant_tag: str) -> TenantLedger:
        ledger = self.ledgers.get(tenant_tag)
        if ledger is None:
            ledger = self.ledgers[tenant_tag] = TenantLedger()
        return ledger

    def quota_of(self, tenant_tag: str) -> int:
        """The tenant's quota in bytes; 0 = none."""
        return self.quotas.get(tenant_tag, self.quota_bytes)

    def usage(self, tenant_tag: str | None = None) -> dict[str, TenantLedger]:
        """Ledgers by tenant tag (of one tenant when given: an empty ledger if it stores nothing)."""
        if tenant_tag is not None:
            return {tenant_tag: self.ledgers.get(tenant_tag) or TenantLedger()}
        return {t: ledger for t, ledger in sorted(self.ledgers.items()) if ledger.blocks
                or ledger.quota_evictions or ledger.quota_refused}

    # --- kept in step by the index ------------------------------------------------------------------
    def added(self, tenant_tag: str, ident: Ident) -> None:
        self.ledger(tenant_tag).blocks.add(ident)

    def resized(self, tenant_tag: str, delta: int) -> None:
        self.ledger(tenant_tag).num_bytes += delta

    def removed(self, tenant_tag: str, ident: Ident, size: int) -> None:
        ledger = self.ledgers.get(tenant_tag)
        if ledger is not None:
            ledger.blocks.discard(ident)
            ledger.num_bytes -= size

    # --- quotas -------------------------------------------------------------------------------------
    def quota_victims(self, tenant_tag: str, size: int,
                      candidates: Iterable[tuple[float, int, str, bytes, int]]) -> list[Ident] | None:
        """Which of the tenant's blocks to drop so that a new block of `size` bytes fits its quota
        (module docstring). `candidates`, read only when the block does not fit as it is: the blocks
        that may go, as (last hit, depth, model tag, block hash, size). [] when nothing has to go (or
        the tenant has no quota); None when the put must be refused (counted in the ledger)."""
        quota = self.quota_of(tenant_tag)
        if quota <= 0:
            return []
        ledger = self.ledger(tenant_tag)
        must_free = ledger.num_bytes + size - quota
        if must_free <= 0:
            return []
        ranked = [(last_hit // QUOTA_RECENCY_GRAIN_S, -depth, tag, h, nbytes)
                  for last_hit, depth, tag, h, nbytes in candidates]
        if size > quota or sum(c[-1] for c in ranked) < must_free:
            ledger.quota_refused += 1
            return None
        want_free = max(must_free, ledger.num_bytes + size - int(quota * QUOTA_EVICT_TO))
        ranked.sort(key=lambda c: c[:4])
        victims: list[Ident] = []
        freed = 0
        for *_, tag, h, nbytes in ranked:
            if freed >= want_free:
                break
            freed += nbytes
            victims.append((tag, h))
        ledger.quota_evictions += len(victims)
        return victims
