"""Workers' tier hits: blocks a worker read from warm or cold itself (its PoolLoader reads those tiers
directly, so this pool's get never saw them), promoted into this replica's hot tier as a get's read would
have been, so that a block wanted again is served from hot (docs/ru-pool.md, "Lifecycle", Promotion).

Boundary: part of the coordinating layer, above reads.PoolReads (its `promote_reported` reads the block
from warm, else cold, and promotes it by the get's own path: PoolWrites.store_hot, under hot's capacity
and LRU, and a cold hit copied to warm too) and the index (is the block hot already?). `plan_promotions`
is pure; WorkerHits queues what it plans and reads in the background (background.BackgroundTasks, which a
stop waits for), at most PROMOTION_READS at a time and MAX_WAITING waiting: a flood of reports costs
bounded memory and tier reads, and what is beyond the bound is dropped and counted (`worker_hits_dropped`),
a promotion lost, never a request. The reports' handler (handlers.tier_hits) returns before any read.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Container, Iterable, NamedTuple

from kite_shared.tiers.keys import BlockKey
from kite_ru_pool.background import BackgroundTasks
from kite_ru_pool.counters import Counters
from kite_ru_pool.index import COLD, HOT, WARM, BlockIndex
from kite_ru_pool.reads import PoolReads

log = logging.getLogger(__name__)

MAX_WAITING = 1024  # reported blocks queued for promotion (being read included)
PROMOTION_READS = 8  # promotions reading warm or cold at once (the get reads runs of 8 too)

_TIER_BITS = {ord("w"): WARM, ord("c"): COLD}


class Reported(NamedTuple):
    """One block a worker read from warm or cold."""

    model_fingerprint: str
    block_hash: bytes
    tenant_tag: str
    tier: int = 0  # WARM or COLD: where the worker found it (0: not said)


@dataclass
class PromotionPlan:
    """What to do with one report: `wanted` to queue, in order; the rest, counted by why not."""

    wanted: list[Reported] = field(default_factory=list)
    num_hot: int = 0  # hot holds them already
    num_queued: int = 0  # waiting or being read already (or twice in the report)
    num_dropped: int = 0  # beyond MAX_WAITING


def plan_promotions(reported: Iterable[Reported], is_hot: Callable[[Reported], bool],
                    queued: Container[tuple[str, bytes, str]], room: int) -> PromotionPlan:
    """Which reported blocks to promote: each once (against `queued`, keyed by fingerprint, hash and
    tenant tag, and within the report), none that is hot already, at most `room` of them."""
    plan = PromotionPlan()
    seen: set[tuple[str, bytes, str]] = set()
    for block in reported:
        key = block[:3]
        if key in seen or key in queued:
            plan.num_queued += 1
            continue
        seen.add(key)
        if is_hot(block):
            plan.num_hot += 1
        elif len(plan.wanted) < room:
            plan.wanted.append(block)
        else:
            plan.num_dropped += 1
    return plan


class WorkerHits:
    def __init__(self, index: BlockIndex, reads: PoolReads, counters: Counters, background: BackgroundTasks,
                 max_waiting: int = MAX_WAITING, max_reads: int = PROMOTION_READS) -> None:
        self.index = index
        self.reads = reads
        self.counters = counters
        self.background = background
        self.max_waiting = max_waiting
        self.max_reads = max_reads
        self._waiting: deque[Reported] = deque()
        self._queued: set[tuple[str, bytes, str]] = set()  # waiting or being read
        self._num_reading = 0

    @property
    def num_queued(self) -> int:
        """Reported blocks waiting for promotion or being read."""
        return len(self._queued)

    def reported(self, model_fingerprint: str, tenant_tag: str, hashes: list[bytes], tiers: bytes) -> PromotionPlan:
        """A worker's report (messages.TierHits): the blocks worth promoting are queued and read in the
        background; returns at once with the plan."""
        blocks = [Reported(model_fingerprint, h, tenant_tag, _TIER_BITS.get(tiers[i], 0) if i < len(tiers) else 0)
                  for i, h in enumerate(hashes)]
        plan = plan_promotions(blocks, self._is_hot, self._queued, self.max_waiting - len(self._queued))
        self.counters.worker_hits += len(blocks)
        self.counters.worker_hits_dropped += plan.num_dropped
        for block in plan.wanted:
            self._queued.add(block[:3])
            self._waiting.append(block)
        while self._num_reading < self.max_reads and self._num_reading < len(self._waiting):
            self._num_reading += 1
            self.background.spawn(self._promote_waiting(), "promotion of workers' tier hits")
        return plan

    def _is_hot(self, block: Reported) -> bool:
        return bool(self.index.tiers_of(BlockKey.of(block.model_fingerprint, block.block_hash, block.tenant_tag)) & HOT)

    async def _promote_waiting(self) -> None:
        try:
            while self._waiting:
                block = self._waiting.popleft()
                try:
                    await self.reads.promote_reported(block.model_fingerprint, block.block_hash, block.tenant_tag,
                                                      block.tier)
                except Exception:  # a bug on one block's path: logged, and the queue goes on
                    log.exception("promotion of a reported block %s failed", block.block_hash.hex()[:16])
                finally:
                    self._queued.discard(block[:3])
        finally:
            self._num_reading -= 1
