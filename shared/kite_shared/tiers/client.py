"""The warm + cold tiers as configured (TierConfig), for the ru-pool and for workers reading directly.

A worker that got a PoolLookupReply can fetch the blocks itself: its PoolLoader reads a request's warm
blocks with `warm.get_units` (one pipelined round trip) and cold ones with `cold.get_units` (concurrent
reads, the batch verified a share per core off the event loop). It never writes:
the ru-pool owns writes, promotion and deletion (except that a unit failing verification is deleted by
whoever read it).
"""

from __future__ import annotations

import logging

from kite_shared import security
from kite_shared import recyclable_unit
from kite_shared.config import TierConfig
from kite_shared.security import ANONYMOUS_TENANT_TAG
from kite_shared.tiers.base import RemoteTier
from kite_shared.tiers.cold import LocalDirTier, S3Tier
from kite_shared.tiers.warm import RedisTier

log = logging.getLogger(__name__)


class TierClient:
    def __init__(self, warm: RedisTier | None, cold: S3Tier | LocalDirTier | None) -> None:
        self.warm = warm
        self.cold = cold

    @classmethod
    def from_config(cls, cfg: TierConfig, with_cold: bool = True, ru_key: bytes | None = None) -> "TierClient":
        """Tiers as configured; every verified read also checks the unit's HMAC with `ru_key` (default:
        this process's cluster key, kite_shared.security.ru_key)."""
        warm = None
        if cfg.redis_url:
            warm = RedisTier(cfg.redis_url, ttl_s=cfg.warm_ttl_s, timeout_s=cfg.timeout_s,
                             backoff_max_s=cfg.backoff_max_s, cluster=cfg.redis_cluster)
        else:
            log.warning("warm tier off: KITE_REDIS_URL is empty (blocks go from hot straight to cold)")
        cold: S3Tier | LocalDirTier | None = None
        if with_cold:
            if cfg.s3_endpoint:
                cold = S3Tier(cfg.s3_endpoint, cfg.s3_bucket, cfg.s3_prefix, cfg.s3_region,
                              timeout_s=cfg.cold_timeout_s, backoff_max_s=cfg.backoff_max_s)
            else:
                cold = LocalDirTier(cfg.cold_dir, cfg.s3_prefix, timeout_s=cfg.cold_timeout_s,
                                    backoff_max_s=cfg.backoff_max_s)
            log.info("cold tier: %s", cold.describe())
        client = cls(warm, cold)
        key = ru_key if ru_key is not None else security.ru_key()
        for tier in client.tiers:
            tier.ru_key = key
        return client

    @property
    def tiers(self) -> list[RemoteTier]:
        return [t for t in (self.warm, self.cold) if t is not None]

    async def start(self) -> None:
        """Create the cold bucket/folder if needed and probe the warm tier; failures only mark down."""
        if self.cold is not None:
            await self.cold.ensure_bucket()
        if self.warm is not None:
            await self.warm.ping()

    async def close(self) -> None:
        for tier in self.tiers:
            await tier.close()

    async def fetch(self, model_fingerprint: str, block_hash: bytes, tiers: str = "wc",
                    tenant_tag: str = ANONYMOUS_TENANT_TAG) -> tuple[bytes, str] | None:
        """Verified encoded unit and the tier letter it came from ("w" or "c"), trying `tiers` in order.
        `tenant_tag` names the tenant whose request computed the block (part of its storage key)."""
        found = await self.fetch_unit(model_fingerprint, block_hash, tiers, tenant_tag)
        return None if found is None else (found[1], found[2])

    async def fetch_unit(self, model_fingerprint: str, block_hash: bytes, tiers: str = "wc",
                         tenant_tag: str = ANONYMOUS_TENANT_TAG
                         ) -> tuple[recyclable_unit.RecyclableUnit, bytes, str] | None:
        """Like `fetch`, with the decoded unit too (already verified: callers need not decode again)."""
        for letter in tiers:
            tier = self.warm if letter == "w" else self.cold if letter == "c" else None
            if tier is None:
                continue
            found = await tier.get_unit(model_fingerprint, block_hash, tenant_tag)
            if found is not None:
                return found[0], found[1], letter
        return None
