"""A worker's direct tier hits, reported to the ru-pool in batches so that it promotes them
(subjects.POOL_TIER_HITS, messages.TierHits; the pool's side is kite_ru_pool.worker_hits).

Why: a worker reads warm and cold itself (kite_worker.pool_loader: several times faster than relaying the
units through the pool), so the pool's get, which promotes what it reads, never sees those hits; without a
report a block wanted again from cold is read from cold every time.

Boundary: `HitBatch` is pure (no clock, no bus: callers pass `now`); `HitReporter` runs one on the
caller's asyncio loop and publishes through the callable it is given (PoolClient.tier_hits). Neither
delays or fails a request: `record` returns at once, never raises for a full batch or an absent bus, and
what cannot be reported (the batch full, a publish that failed) is only counted
(kite_tier_hits_unreported_total): a lost report costs a promotion, nothing else.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Sequence

from kite_shared.messages import TierHits
from kite_shared.tiers import metrics

log = logging.getLogger(__name__)

MAX_PENDING = 8192  # distinct blocks waiting to be reported; beyond this, hits are dropped (counted)
FLUSH_BLOCKS = 512  # a batch this large is sent at once (and no message carries more blocks)
FLUSH_INTERVAL_S = 0.2  # otherwise, the oldest pending hit waits at most this long


class HitBatch:
    """Pure: pending hits (each block once per model fingerprint and tenant), bounded, and when to send."""

    def __init__(self, max_pending: int = MAX_PENDING, flush_blocks: int = FLUSH_BLOCKS,
                 flush_interval_s: float = FLUSH_INTERVAL_S) -> None:
        if max_pending < 1 or flush_blocks < 1 or flush_interval_s < 0:
            raise ValueError("max_pending and flush_blocks must be >= 1, flush_interval_s >= 0")
        self.max_pending = max_pending
        self.flush_blocks = flush_blocks
        self.flush_interval_s = flush_interval_s
        # (model fingerprint, tenant tag) -> block hash -> tier letter (b"w"[0] or b"c"[0]); dicts keep order
        self._pending: dict[tuple[str, str], dict[bytes, int]] = {}
        self.num_pending = 0
        self.num_dropped = 0  # since creation
        self._oldest: float | None = None  # when the oldest pending hit was added

    def add(self, model_fingerprint: str, tenant_tag: str, hashes: Sequence[bytes], letters: bytes,
            now: float) -> int:
        """Note that `hashes[i]` was read from tier `letters[i]` (b"w" or b"c"); returns how many of them
        were dropped because MAX_PENDING blocks wait already. A block pending already is not added again
        (its first tier is kept)."""
        if len(hashes) != len(letters):
            raise ValueError(f"{len(hashes)} hashes but {len(letters)} tier letters")
        group = self._pending.setdefault((model_fingerprint, tenant_tag), {})
        num_dropped = 0
        for block_hash, letter in zip(hashes, letters):
            if block_hash in group:
                continue
            if self.num_pending >= self.max_pending:
                num_dropped += 1
                continue
            group[block_hash] = letter
            self.num_pending += 1
        if not group:
            del self._pending[(model_fingerprint, tenant_tag)]
        if self.num_pending and self._oldest is None:
            self._oldest = now
        self.num_dropped += num_dropped
        return num_dropped

    def wait_s(self, now: float) -> float | None:
        """Seconds until a send is due (0: now); None when nothing is pending."""
        if not self.num_pending:
            return None
        if self.num_pending >= self.flush_blocks:
            return 0.0
        return max(0.0, self._oldest + self.flush_interval_s - now)

    def take(self, worker_id: str = "") -> list[TierHits]:
        """Every pending hit as messages of at most `flush_blocks` blocks each, one model fingerprint and
        tenant per message; the batch is empty afterwards."""
        messages = []
        for (model_fingerprint, tenant_tag), group in self._pending.items():
            items = list(group.items())
            for start in range(0, len(items), self.flush_blocks):
                part = items[start:start + self.flush_blocks]
                messages.append(TierHits(worker_id=worker_id, model_fingerprint=model_fingerprint,
                                         tenant_tag=tenant_tag, block_hashes=[h for h, _ in part],
                                         tiers=bytes(letter for _, letter in part)))
        self._pending = {}
        self.num_pending = 0
        self._oldest = None
        return messages


class HitReporter:
    """A HitBatch sent by `send` (True: published) on the running asyncio loop: at once when FLUSH_BLOCKS
    wait, else FLUSH_INTERVAL_S after the oldest pending hit. One send runs at a time."""

    def __init__(self, send: Callable[[TierHits], Awaitable[bool]], worker_id: str = "",
                 batch: HitBatch | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.send = send
        self.worker_id = worker_id
        self.batch = batch if batch is not None else HitBatch()
        self.clock = clock
        self.num_sent = 0  # blocks published
        self._timer: asyncio.TimerHandle | None = None
        self._sending: asyncio.Task | None = None

    def record(self, model_fingerprint: str, tenant_tag: str, hashes: Sequence[bytes], letters: bytes) -> None:
        """Note direct hits (see HitBatch.add); a send is scheduled, never awaited here."""
        if not hashes:
            return
        dropped = self.batch.add(model_fingerprint, tenant_tag, hashes, letters, self.clock())
        if dropped:
            metrics.TIER_HITS_UNREPORTED.inc(dropped)
        self._schedule()

    async def flush(self) -> None:
        """Send what is pending now (a stop; tests)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        messages = self.batch.take(self.worker_id)
        for message in messages:
            try:
                sent = await self.send(message)
            except Exception:  # a bug in `send`: logged; its hits are lost like a failed publish's
                log.exception("tier hit report of %d blocks failed", len(message.block_hashes))
                sent = False
            if sent:
                self.num_sent += len(message.block_hashes)
            else:
                metrics.TIER_HITS_UNREPORTED.inc(len(message.block_hashes))

    def _schedule(self) -> None:
        if self._sending is not None:
            return  # the running send schedules what was added meanwhile when it ends
        wait = self.batch.wait_s(self.clock())
        if wait is None:
            return
        if wait == 0.0:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._sending = asyncio.get_running_loop().create_task(self._send_pending())
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(wait, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._sending is None:
            self._sending = asyncio.get_running_loop().create_task(self._send_pending())

    async def _send_pending(self) -> None:
        try:
            await self.flush()
        finally:
            self._sending = None
        self._schedule()
