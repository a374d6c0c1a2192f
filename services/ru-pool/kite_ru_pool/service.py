"""The ru-pool service: NATS handlers (decode -> core -> encode) and the I/O that carries out the core's
decisions on the warm and cold tiers.

Boundaries: decisions live in `core.PoolCore` (pure); this module only moves bytes and reports outcomes
back. No handler ever waits on a slow tier longer than that tier's timeout, and writes (write-through,
demotion, archival, purges) run as background tasks, so a put returns as soon as the unit is verified
and in the hot tier. Warm/cold failures only mark the tier down (kite_shared.tiers.base): the pool keeps
answering, with misses for that tier.

One replica per deployment: the index is in this process, rebuilt from warm (Redis SCAN) and cold
(object listing) at start and after warm comes back from an outage.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from kite_shared import recyclable_unit, security, subjects
from kite_shared.config import RuPoolConfig, TierConfig
from kite_shared.messages import (
    ErrorInfo, Heartbeat, MessageError, ModelFingerprintChanged, PoolAdminReply, PoolAdminRequest,
    PoolGetReply, PoolGetRequest, PoolLookupReply, PoolLookupRequest, TenantUsage, TierStats,
    BLOCK_EVENT, decode_or_log, BlockStored,
)
from kite_shared.tiers import metrics
from kite_shared.tiers.base import RemoteTier, TierUnavailable
from kite_shared.tiers import handoff
from kite_shared.tiers.client import TierClient
from kite_shared.tiers.keys import BlockKey, model_tag
from kite_shared.tracing import start_span_from_headers, use_span
from kite_ru_pool.core import (
    ALL_TAGS, COLD, HOT, WARM, Archive, Demote, DropBlock, ExpireCold, PoolCore, RenewWarm,
)

log = logging.getLogger(__name__)

GET_REPLY_OVERHEAD_BYTES = 4096  # msgpack framing of PoolGetReply around the units
HANDOFF_REPLY_MAX_BYTES = 1 << 30  # units one same-host get may hand off as files (tmpfs is memory)
HANDOFF_SWEEP_INTERVAL_S = 10.0
MAX_PENDING_WARM_WRITES = 256  # beyond this, write-through is skipped (demotion on eviction covers it)
WORKER_FORGET_AFTER_S = 30.0  # a worker silent this long (no heartbeat, no events) is presumed gone
FETCH_CONCURRENCY = 8
MAX_TENANTS_IN_STATS = 1000  # the largest tenants by bytes; keeps an all-tenant stats reply far under max_payload
SWEEP_STEP_ENTRIES = 1000  # index entries a sweep examines per event-loop turn (0.2-0.5 ms, 2 vCPU)


class PoolService:
    def __init__(self, cfg: RuPoolConfig, tier_cfg: TierConfig, nc: NATS,
                 tiers: TierClient | None = None, clock: Callable[[], float] = time.time,
                 ru_key: bytes | None = None, instance_id: str = "ru-pool", freeze_gc: bool = False) -> None:
        """`instance_id` names its telemetry; `freeze_gc`: keep the cyclic GC off the index
        (kite_ru_pool.gc_freeze); only the pool's own process sets it, so pools started inside a test
        runner leave the runner's GC alone."""
        self.cfg = cfg
        self.instance_id = instance_id
        self.freeze_gc = freeze_gc
        self.nc = nc
        # Every unit put or moved must carry a valid HMAC under the cluster key (default: this process's).
        self.ru_key = ru_key if ru_key is not None else security.ru_key()
        self.tiers = tiers if tiers is not None else TierClient.from_config(tier_cfg, ru_key=self.ru_key)
        self.warm = self.tiers.warm
        self.cold = self.tiers.cold
        self.clock = clock
        self.core = PoolCore(cfg.hot_bytes, cfg.archive_after_s, tier_cfg.warm_ttl_s, tier_cfg.cold_ttl_s,
                             cfg.sweep_interval_s, has_warm=self.warm is not None,
                             has_cold=self.cold is not None, tenant_quota_bytes=cfg.tenant_quota_bytes,
                             tenant_quotas={security.tenant_tag(name): quota
                                            for name, quota in cfg.tenant_quota_overrides().items()})
        # Same-host readers get hot blocks as files in memory rather than through NATS (tiers.handoff).
        self.host_id = handoff.host_id()
        self.handoff = handoff.open_folder(cfg.handoff_dir)
        self.rebuilding = False
        self._background: set[asyncio.Task] = set()
        self._subs: list = []
        self._loops: list[asyncio.Task] = []
        self._pending_warm_writes = 0
        self._writing: set[BlockKey] = set()  # write-throughs in flight
        self._dropped_while_writing: set[BlockKey] = set()  # ... whose block was dropped meanwhile
        self._warm_resync = asyncio.Event()
        self._wake = asyncio.Event()
        if self.warm is not None:
            self.warm.on_recover(self._on_warm_recovered)

    # --- lifecycle of the service ----------------------------------------------------------------
    async def start(self) -> None:
        await self.tiers.start()
        q = subjects.RU_POOL_QUEUE
        self._subs = [
            await self.nc.subscribe(subjects.POOL_PUT, queue=q, cb=self._guard(self._on_put)),
            await self.nc.subscribe(subjects.POOL_LOOKUP, queue=q, cb=self._guard(self._traced("kite.ru_pool.lookup", self._lookup))),
            await self.nc.subscribe(subjects.POOL_GET, queue=q, cb=self._guard(self._traced("kite.ru_pool.get", self._get))),
            await self.nc.subscribe(subjects.POOL_ADMIN, queue=q, cb=self._guard(self._on_admin)),
            await self.nc.subscribe(subjects.POOL_BLOCK_EVENTS, queue=q,
                                    cb=self._guard(self._on_block_event)),
            await self.nc.subscribe(subjects.MODEL_FINGERPRINT, cb=self._guard(self._on_model_fingerprint)),
            await self.nc.subscribe(subjects.heartbeat("worker"), cb=self._guard(self._on_worker_heartbeat)),
        ]
        self.rebuilding = True
        # issue 4: keep the cyclic GC off the index (when freeze_gc) and measure how late the event loop
        # runs (kite_pool_event_loop_lag_seconds)
        from kite_ru_pool.gc_freeze import IndexGcFreezer
        from kite_ru_pool.telemetry import loop_lag_probe, publish_loop
        self._gc = IndexGcFreezer(enabled=self.freeze_gc)
        self._swept_totals: dict[str, tuple[int, int]] | None = None

        async def rebuild() -> None:
            await self._rebuild()
            self._gc.freeze(self.core.num_blocks())
        self._spawn(rebuild(), "index rebuild")
        self._loops.append(asyncio.create_task(self._sweep_loop()))
        if self.handoff is not None:
            self._loops.append(asyncio.create_task(self._handoff_sweep_loop()))
        self._loops.append(asyncio.create_task(loop_lag_probe()))
        # issue 5: tier health, fill and hit rates for the arbitrator, every KITE_TELEMETRY_INTERVAL_S
        self._loops.append(asyncio.create_task(publish_loop(self, self.instance_id,
                                                            self.cfg.telemetry_interval_s)))

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop taking work, let background writes finish (bounded), close the tier clients."""
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # connection already closing: nothing more to unsubscribe
                log.debug("unsubscribe failed: %r", exc)
        self._subs = []
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        self._loops = []
        if self._background:
            done, pending = await asyncio.wait(set(self._background), timeout=timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                log.warning("stopped with %d background tier operations unfinished", len(pending))
        await self.tiers.close()
        if self.handoff is not None:
            self.handoff.remove()

    def _spawn(self, coro: Awaitable[object], what: str) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._background.add(task)

        def done(t: asyncio.Task) -> None:
            self._background.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("%s failed", what, exc_info=t.exception())
        task.add_done_callback(done)
        return task

    async def drain_background(self) -> None:
        """Wait until no background tier operation is running (tests and benchmarks)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def _guard(self, handler: Callable[[Msg], Awaitable[None]]) -> Callable[[Msg], Awaitable[None]]:
        async def run(msg: Msg) -> None:
            try:
                await handler(msg)
            except Exception:
                # One bad message must not kill the subscription; answer if someone waits.
                log.exception("handler for %s failed", msg.subject)
                if msg.reply:
                    error = ErrorInfo(code="internal", message="ru-pool failed to handle the request")
                    reply = {subjects.POOL_LOOKUP: PoolLookupReply(error=error),
                             subjects.POOL_GET: PoolGetReply(error=error)}.get(
                        msg.subject, PoolAdminReply(ok=False, error=error))
                    try:
                        await msg.respond(reply.encode())
                    except Exception as exc:
                        log.warning("could not send the error reply: %r", exc)
        return run

    def _up_mask(self) -> int:
        mask = HOT
        if self.warm is not None and self.warm.up:
            mask |= WARM
        if self.cold is not None and self.cold.up:
            mask |= COLD
        return mask

    # --- put ------------------------------------------------------------------------------------
    async def _on_put(self, msg: Msg) -> None:
        self.put_bytes(msg.data)

    def put_bytes(self, data: bytes) -> str:
        """Verify and store one encoded unit; returns the core's decision, "corrupt" or "over_quota"."""
        try:
            unit = recyclable_unit.decode(data, key=self.ru_key)
        except recyclable_unit.RUError as exc:
            self.core.counters.refused_corrupt += 1
            if isinstance(exc, recyclable_unit.RUAuthError):
                metrics.TIER_INTEGRITY_FAILURES.labels("hot").inc()
            log.warning("refused a put: not an intact recyclable unit (%s: %s)", type(exc).__name__, exc)
            return "corrupt"
        key = BlockKey.of(unit.model_fingerprint, unit.block_hash, unit.tenant_tag)
        decision = self.core.admit_put(key)
        if decision != "store":
            return decision
        drops = self.core.reserve_quota(key, len(data))
        if drops is None:
            metrics.POOL_QUOTA_REFUSED.inc()
            log.info("refused a put of tenant %s: its pinned blocks fill its quota of %d bytes",
                     key.tenant_tag, self.core.quota_of(key.tenant_tag))
            return "over_quota"
        if drops:
            metrics.POOL_QUOTA_EVICTIONS.inc(len(drops))
            for drop in drops:
                self._drop_stored(drop)
        data = bytes(data)
        self._put_hot(key, data, depth=unit.block_index)
        if self.warm is not None:
            if self._pending_warm_writes >= MAX_PENDING_WARM_WRITES:
                self.core.counters.warm_writes_dropped += 1
            else:
                self._pending_warm_writes += 1
                self._spawn(self._write_through(key, data, unit.block_index), "warm write-through")
        elif not self.core.tiers_of(key) & HOT and self.cold is not None:
            self._spawn(self._demote(Demote(key, data, COLD)), "cold write")
        return decision

    async def _write_through(self, key: BlockKey, data: bytes, depth: int) -> None:
        self._writing.add(key)
        try:
            if await self.warm.put(key, data, pinned=self.core.is_pinned(key)):
                if key in self._dropped_while_writing:
                    await self.warm.delete(key)  # a quota eviction or clear took it meanwhile
                    return
                self.core.note_stored(key, WARM, len(data), self.clock(), depth=depth)
            elif not self.core.tiers_of(key) and self.cold is not None:
                # Neither hot (did not fit) nor warm (down) holds it: keep it in cold rather than lose it.
                await self._demote(Demote(key, data, COLD))
        finally:
            self._pending_warm_writes -= 1
            self._writing.discard(key)
            self._dropped_while_writing.discard(key)

    @staticmethod
    def _traced(name: str, handler: Callable[[Msg], Awaitable[None]]) -> Callable[[Msg], Awaitable[None]]:
        """`handler` inside a span that continues the caller's trace (traceparent in the NATS headers)."""
        async def run(msg: Msg) -> None:
            with use_span(start_span_from_headers(name, msg.headers)) as span:
                try:
                    await handler(msg)
                finally:
                    span.end()
        return run

    # --- lookup ---------------------------------------------------------------------------------
    async def _lookup(self, msg: Msg) -> None:
        started = time.perf_counter()
        try:
            req = PoolLookupRequest.decode(msg.data)
        except MessageError as exc:
            reply = PoolLookupReply(error=ErrorInfo(code="bad_request", message=str(exc)))
        else:
            r = self.core.lookup(req.model_fingerprint, req.block_hashes, self._up_mask(), req.include_workers)
            reply = PoolLookupReply(hot=r.hot, warm=r.warm, cold=r.cold, pool=r.pool, tiers=r.tiers,
                                    workers=r.workers, invalidated=r.invalidated)
        if msg.reply:
            await msg.respond(reply.encode())
        metrics.POOL_LOOKUP_SECONDS.observe(time.perf_counter() - started)

    # --- get ------------------------------------------------------------------------------------
    async def _get(self, msg: Msg) -> None:
        try:
            req = PoolGetRequest.decode(msg.data)
        except MessageError as exc:
            reply = PoolGetReply(error=ErrorInfo(code="bad_request", message=str(exc)))
        else:
            handoff = self.handoff is not None and req.host_id == self.host_id
            inline_budget = self.nc.max_payload - GET_REPLY_OVERHEAD_BYTES
            budget = HANDOFF_REPLY_MAX_BYTES if handoff else inline_budget
            if req.max_bytes > 0:
                budget = min(budget, req.max_bytes)
            reply = await self.get_blocks(req.model_fingerprint, req.block_hashes, budget,
                                          security.tenant_tag(req.tenant))
            if handoff and reply.units:
                reply = await self._hand_off(reply, min(budget, inline_budget))
        if msg.reply:
            await msg.respond(reply.encode())

    async def _hand_off(self, reply: PoolGetReply, inline_budget: int) -> PoolGetReply:
        """The same reply with its units in hand-off files; inline (cut to `inline_budget`) if the folder
        cannot take them (a full tmpfs, say)."""
        try:
            paths = await asyncio.to_thread(self.handoff.write_all, reply.units)
        except OSError as exc:
            log.warning("hand-off write failed (%r); replying inline", exc)
            units, total = [], 0
            for data in reply.units:
                if total + len(data) > inline_budget:
                    break
                units.append(data)
                total += len(data)
            return reply.model_copy(update={"units": units, "tiers": reply.tiers[:len(units)],
                                            "complete": reply.complete and len(units) == len(reply.units)})
        return reply.model_copy(update={"units": [], "unit_files": paths})

    async def get_blocks(self, model_fingerprint: str, hashes: list[bytes], budget: int,
                         tenant_tag: str = security.ANONYMOUS_TENANT_TAG) -> PoolGetReply:
        """Leading verified units of `hashes` (blocks of tenant `tenant_tag`) within `budget` bytes,
        promoting what it reads."""
        if self.core.is_invalidated(model_fingerprint):
            return PoolGetReply(error=ErrorInfo(
                code="invalidated", message="this model fingerprint was replaced; its blocks are gone"))
        units: list[bytes] = []
        letters = bytearray()
        total = 0
        i = 0
        while i < len(hashes):
            key = BlockKey.of(model_fingerprint, hashes[i], tenant_tag)
            started = time.perf_counter()
            data = self.core.hot_get(key, self.clock())
            if data is not None:
                metrics.TIER_HITS.labels("hot").inc()
                metrics.TIER_BYTES.labels("hot", "read").inc(len(data))
                metrics.TIER_FETCH_SECONDS.labels("hot").observe(time.perf_counter() - started)
                found = [(data, "h")]
                stop = False
            else:
                metrics.TIER_MISSES.labels("hot").inc()
                # Read the run of non-hot blocks that follows concurrently: one round trip, not N.
                batch = [hashes[i]]
                j = i + 1
                while (j < len(hashes) and len(batch) < FETCH_CONCURRENCY
                       and not self.core.tiers_of(BlockKey.of(model_fingerprint, hashes[j])) & HOT):
                    batch.append(hashes[j])
                    j += 1
                results = await asyncio.gather(*(self._fetch_remote(model_fingerprint, h, tenant_tag)
                                                 for h in batch))
                found = []
                for r in results:
                    if r is None:
                        break
                    found.append(r)
                stop = len(found) < len(batch)
            for unit_bytes, letter in found:
                if len(unit_bytes) > budget:
                    return PoolGetReply(units=units, tiers=bytes(letters), complete=False,
                                        error=ErrorInfo(code="too_large", message=(
                                            f"a unit of {len(unit_bytes)} bytes exceeds the reply budget "
                                            f"of {budget}; read it from the tiers directly")))
                if total + len(unit_bytes) > budget:
                    return PoolGetReply(units=units, tiers=bytes(letters), complete=False)
                units.append(unit_bytes)
                letters += letter.encode()
                total += len(unit_bytes)
            i += len(found)
            if stop:
                break
        return PoolGetReply(units=units, tiers=bytes(letters), complete=True)

    async def _fetch_remote(self, model_fingerprint: str, block_hash: bytes,
                            tenant_tag: str) -> tuple[bytes, str] | None:
        """A verified unit from warm, else cold, promoted on the way; None on a miss."""
        key = BlockKey.of(model_fingerprint, block_hash, tenant_tag)
        entry = self.core.entry(key)
        if entry is not None and entry.tenant_tag != tenant_tag:
            return None  # another tenant's block: a miss, and no reason to doubt the index
        known = 0 if entry is None else entry.tiers
        # While the index is rebuilding it may not know the block yet: ask the tiers anyway.
        try_all = self.rebuilding and not known
        for tier, bit, letter in ((self.warm, WARM, "w"), (self.cold, COLD, "c")):
            if tier is None or not (known & bit or try_all):
                continue
            found = await tier.get_unit(model_fingerprint, block_hash, tenant_tag)
            if found is None:
                if known & bit and tier.up:
                    self.core.note_missing(key, bit)  # expired, deleted or corrupt: not there any more
                continue
            _, data = found
            now = self.clock()
            self.core.note_stored(key, bit, len(data), now, last_hit=now)
            self._promote(key, data, from_bit=bit)
            return data, letter
        return None

    def _promote(self, key: BlockKey, data: bytes, from_bit: int) -> None:
        if self._put_hot(key, data):
            self.core.counters.promotions += 1
            metrics.TIER_PROMOTIONS.inc()
        if from_bit == COLD and self.warm is not None and self.warm.up:
            self._spawn(self._promote_to_warm(key, data), "promotion to warm")

    async def _promote_to_warm(self, key: BlockKey, data: bytes) -> None:
        if await self.warm.put(key, data, pinned=self.core.is_pinned(key)):
            self.core.note_stored(key, WARM, len(data), self.clock())
            self.core.counters.promotions += 1
            metrics.TIER_PROMOTIONS.inc()

    # --- demotion, archival, renewal, expiry -------------------------------------------------------
    def _put_hot(self, key: BlockKey, data: bytes, depth: int | None = None) -> bool:
        """Put into hot through the core, counting evictions and starting the demotions they need."""
        before = self.core.counters.hot_evictions
        actions = self.core.put_hot(key, data, self.clock(), depth)
        evicted = self.core.counters.hot_evictions - before
        if evicted:
            metrics.TIER_EVICTIONS.labels("hot").inc(evicted)
        for action in actions:
            self._spawn(self._demote(action), "demotion")
        stored = bool(self.core.tiers_of(key) & HOT)
        if stored:
            metrics.TIER_BYTES.labels("hot", "write").inc(len(data))
        return stored

    async def _demote(self, action: Demote) -> None:
        now = self.clock()
        order = [(self.warm, WARM), (self.cold, COLD)] if action.tier == WARM else [(self.cold, COLD)]
        for tier, bit in order:
            if tier is None:
                continue
            if await tier.put(action.key, action.data, pinned=self.core.is_pinned(action.key)):
                self.core.note_stored(action.key, bit, len(action.data), now)
                self.core.counters.demotions += 1
                metrics.TIER_DEMOTIONS.inc()
                return
        log.debug("demotion of %s failed: no slower tier took it", action.key.short())
        self.core.demotion_failed(action.key)

    def _drop_stored(self, drop: DropBlock) -> asyncio.Task:
        """Delete a block the core just dropped (quota, tenant clear) from the tiers that held it, and
        from warm too if a write-through of it is still running."""
        if drop.key in self._writing:
            self._dropped_while_writing.add(drop.key)

        async def delete() -> None:
            for tier, bit in ((self.warm, WARM), (self.cold, COLD)):
                if tier is not None and drop.tiers & bit:
                    await tier.delete(drop.key)  # a tier that is down keeps it until TTL or a rebuild
        return self._spawn(delete(), "deletion of a dropped block")

    async def _lifecycle(self, action: Archive | RenewWarm | ExpireCold) -> None:
        key = action.key
        if isinstance(action, RenewWarm):
            if await self.warm.set_pinned(key, False):  # EXPIRE key ttl: the lease restarts
                self.core.note_renewed(key, self.clock())
                self.core.counters.warm_renewed += 1
            elif self.warm.up:
                self.core.note_missing(key, WARM)
            return
        if isinstance(action, ExpireCold):
            if await self.cold.delete(key) or self.cold.up:
                self.core.note_missing(key, COLD)
                self.core.counters.cold_expired += 1
                metrics.TIER_EVICTIONS.labels("cold").inc()
            return
        # Archive: warm -> cold, then delete from warm only once cold surely has it.
        if not action.cold_has_it:
            data = await self.warm.get(key)
            if data is None:
                if self.warm.up:
                    self.core.note_missing(key, WARM)
                return
            if not self._intact(key, data, "warm"):
                await self.warm.delete(key)
                self.core.note_missing(key, WARM)
                return
            if not await self.cold.put(key, data):
                return  # cold down: stays in warm, retried next sweep
            self.core.note_stored(key, COLD, len(data), self.clock())
        if await self.warm.delete(key) or self.warm.up:
            self.core.note_missing(key, WARM)
            self.core.counters.archived += 1
            metrics.TIER_EVICTIONS.labels("warm").inc()
            metrics.TIER_DEMOTIONS.inc()

    def _intact(self, key: BlockKey, data: bytes, tier: str) -> bool:
        """Verify bytes read for copying between tiers (the full fingerprint is unknown: check the tag)."""
        try:
            unit = recyclable_unit.decode(data, expected_hash=key.block_hash, key=self.ru_key)
            if model_tag(unit.model_fingerprint) != key.model_tag:
                raise recyclable_unit.RUKeyMismatchError("unit belongs to another model tag")
        except recyclable_unit.RUError as exc:
            metrics.TIER_INTEGRITY_FAILURES.labels(tier).inc()
            t = self.warm if tier == "warm" else self.cold
            if t is not None:
                t.integrity_failures += 1
            log.warning("%s tier: block %s failed verification while moving it (%s); deleted",
                        tier, key.short(), exc)
            return False
        return True

    async def _handoff_sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(HANDOFF_SWEEP_INTERVAL_S)
            try:
                await asyncio.to_thread(self.handoff.sweep)
            except OSError as exc:
                log.warning("hand-off sweep failed: %r", exc)

    async def _sweep_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.cfg.sweep_interval_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.sweep_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("lifecycle sweep failed; next one in %.1f s", self.cfg.sweep_interval_s)

    async def sweep_once(self) -> None:
        """Probe down tiers, resync warm after an outage, purge, then archive / renew / expire."""
        for tier in self.tiers.tiers:
            if not tier.up:
                await tier.ping()
        if self._warm_resync.is_set() and self.warm is not None and self.warm.up and not self.rebuilding:
            self._warm_resync.clear()
            await self._resync_warm()
        await self._purge_pending()
        now = self.clock()
        for worker_id in self.core.stale_workers(now, WORKER_FORGET_AFTER_S):
            log.info("forgetting the local cache of worker %s: silent for %.0f s", worker_id,
                     WORKER_FORGET_AFTER_S)
            self.core.forget_worker(worker_id)
        warm_up = self.warm is not None and self.warm.up
        cold_up = self.cold is not None and self.cold.up
        # Walk the index SWEEP_STEP_ENTRIES at a time, letting lookups run in between (core.SweepPass).
        sweep = self.core.begin_sweep(now, warm_up, cold_up)
        while not sweep.step(SWEEP_STEP_ENTRIES):
            await asyncio.sleep(0)
        self._swept_totals = sweep.tier_totals()
        actions = sweep.actions()
        if not self.rebuilding and hasattr(self, "_gc"):
            self._gc.maybe_freeze(self.core.num_blocks())
        sem = asyncio.Semaphore(FETCH_CONCURRENCY)

        async def run(action) -> None:
            async with sem:
                await self._lifecycle(action)
        await asyncio.gather(*(run(a) for a in actions))

    # --- rebuild and resync ----------------------------------------------------------------------
    def _on_warm_recovered(self) -> None:
        self._warm_resync.set()
        self._wake.set()

    async def _rebuild(self) -> None:
        """Index the blocks warm and cold hold (warm SCAN, cold listing); runs in the background."""
        started = time.perf_counter()
        try:
            counts = {}
            for tier, bit in ((self.warm, WARM), (self.cold, COLD)):
                if tier is None:
                    continue
                counts[tier.name] = await self._index_tier(tier, bit)
            log.info("index rebuilt in %.2f s: %s", time.perf_counter() - started,
                     ", ".join(f"{n} {c if c >= 0 else 'unavailable'}" for n, c in counts.items()))
        finally:
            self.rebuilding = False

    async def _index_tier(self, tier: RemoteTier, bit: int) -> int:
        """Add what `tier` holds to the index; -1 when it could not be listed (retried on recovery)."""
        now = self.clock()
        count = 0
        try:
            async for item in tier.iter_keys():
                if self.core.is_tag_invalidated(item.key.model_tag):
                    continue
                last_hit = now - item.idle_s if item.idle_s is not None else now
                self.core.note_stored(item.key, bit, item.size, now, last_hit=last_hit)
                if item.pinned:
                    self.core.restore_pin(item.key)
                count += 1
        except TierUnavailable as exc:
            log.warning("%s tier not indexed (%s); will index it when it is back", tier.name, exc)
            if bit == WARM:
                self._warm_resync.set()
            return -1
        return count

    async def _resync_warm(self) -> None:
        """After a warm outage: forget warm copies that are gone (e.g. Redis restarted empty), index
        what is there, and write hot blocks that warm lacks (the write-through backlog)."""
        present: set[BlockKey] = set()
        now = self.clock()
        try:
            async for item in self.warm.iter_keys():
                present.add(item.key)
                if not self.core.tiers_of(item.key) & WARM and not self.core.is_tag_invalidated(item.key.model_tag):
                    last_hit = now - item.idle_s if item.idle_s is not None else now
                    self.core.note_stored(item.key, WARM, item.size, now, last_hit=last_hit)
        except TierUnavailable as exc:
            log.warning("warm resync interrupted (%s); retrying when warm is back", exc)
            self._warm_resync.set()
            return
        lost = [k for k in self.core.keys_in(WARM) if k not in present]
        for key in lost:
            self.core.note_missing(key, WARM)
        backlog = [k for k in self.core.keys_in(HOT) if not self.core.tiers_of(k) & WARM]
        for key in backlog:
            data = self.core.hot.peek(key)
            if data is not None and await self.warm.put(key, data, pinned=self.core.is_pinned(key)):
                self.core.note_stored(key, WARM, len(data), self.clock())
        log.info("warm resync: %d blocks present, %d forgotten, %d rewritten from hot",
                 len(present), len(lost), len(backlog))

    async def _purge_pending(self) -> None:
        """Delete from storage what invalidations and clears queued (by listing, so blocks the index
        never learned about go too); a purge a tier could not finish stays queued for the next sweep."""
        for tag in sorted(self.core.pending_purges):
            what = "every model" if tag == ALL_TAGS else f"model {tag}"
            if await self._purge_listed(None if tag == ALL_TAGS else tag, None, what):
                self.core.purge_done(tag)
        for tag, tenant in sorted(self.core.pending_tenant_purges):
            what = f"tenant {tenant}" + ("" if tag == ALL_TAGS else f", model {tag}")
            if await self._purge_listed(None if tag == ALL_TAGS else tag, tenant, what):
                self.core.pending_tenant_purges.discard((tag, tenant))

    async def _purge_listed(self, tag: str | None, tenant_tag: str | None, what: str) -> bool:
        complete = True
        deleted = 0
        for tier in self.tiers.tiers:
            try:
                keys = [item.key async for item in tier.iter_keys(tag)
                        if tenant_tag is None or item.key.tenant_tag == tenant_tag]
            except TierUnavailable as exc:
                log.warning("purge of %s on %s postponed: %s", what, tier.name, exc)
                complete = False
                continue
            n = await tier.delete_many(keys)
            deleted += n
            if n < len(keys) and not tier.up:
                complete = False
        self.core.counters.purged += deleted
        if complete:
            log.info("purged %d stored blocks of %s", deleted, what)
        return complete

    # --- events -----------------------------------------------------------------------------------
    async def _on_block_event(self, msg: Msg) -> None:
        ev = decode_or_log(BLOCK_EVENT.decode, msg.data, log, "bad block event")
        if ev is None:
            return
        now = self.clock()
        if isinstance(ev, BlockStored):
            self.core.worker_stored(ev.worker_id, ev.model_fingerprint, ev.block_hashes, ev.seq, now)
        else:
            self.core.worker_removed(ev.worker_id, ev.model_fingerprint, ev.block_hashes, ev.all_blocks,
                                     ev.seq, now)

    async def _on_worker_heartbeat(self, msg: Msg) -> None:
        hb = decode_or_log(Heartbeat.decode, msg.data, log, "bad worker heartbeat", level=logging.DEBUG)
        if hb is None:
            return
        if hb.draining:
            self.core.forget_worker(hb.instance_id)
        else:
            self.core.worker_alive(hb.instance_id, self.clock())

    async def _on_model_fingerprint(self, msg: Msg) -> None:
        ev = decode_or_log(ModelFingerprintChanged.decode, msg.data, log, "bad model fingerprint event")
        if ev is None:
            return
        tags = self.core.model_fingerprint_changed(ev.model_name, ev.model_fingerprint,
                                                   ev.previous_fingerprint)
        if tags:
            log.info("model %s now has fingerprint %s; blocks of %s invalidated, purging in the background",
                     ev.model_name, model_tag(ev.model_fingerprint), ", ".join(tags))
            self._spawn(self._purge_pending(), "purge of invalidated models")

    # --- admin ----------------------------------------------------------------------------------
    async def _on_admin(self, msg: Msg) -> None:
        try:
            req = PoolAdminRequest.decode(msg.data)
        except MessageError as exc:
            reply = PoolAdminReply(ok=False, error=ErrorInfo(code="bad_request", message=str(exc)))
        else:
            reply = await self.admin(req)
        if msg.reply:
            await msg.respond(reply.encode())

    async def admin(self, req: PoolAdminRequest) -> PoolAdminReply:
        tenant_tag = security.tenant_tag(req.tenant) if req.tenant else None
        if req.op == "stats":
            return self.stats(tenant_tag)
        if req.op in ("pin", "unpin", "evict", "purge") and not req.model_fingerprint:
            return PoolAdminReply(ok=False, error=ErrorInfo(
                code="bad_request", message=f"{req.op} needs model_fingerprint", param="model_fingerprint"))
        if req.op == "clear":
            tag = model_tag(req.model_fingerprint) if req.model_fingerprint else None
            if tenant_tag is None:
                affected = self.core.forget_tag(tag)
            else:
                drops = self.core.forget_tenant(tenant_tag, tag)
                await asyncio.gather(*(self._drop_stored(d) for d in drops), return_exceptions=True)
                affected = len(drops)
            await self._purge_pending()
            return PoolAdminReply(ok=True, affected=affected)
        if req.op == "purge":
            tag = model_tag(req.model_fingerprint)
            affected = len(self.core.keys_in(HOT | WARM | COLD, tag))
            self.core.invalidate_tag(tag)
            await self._purge_pending()
            return PoolAdminReply(ok=True, affected=affected)
        if req.op == "evict":
            return await self._evict(req, tenant_tag or security.ANONYMOUS_TENANT_TAG)
        if req.op == "pin":
            keys = self.core.pin(req.model_fingerprint, req.block_hashes,
                                 tenant_tag or security.ANONYMOUS_TENANT_TAG)
            affected = 0
            for key, h in zip(keys, req.block_hashes):
                affected += await self._pin_storage(req.model_fingerprint, key, h)
            return PoolAdminReply(ok=True, affected=affected)
        keys = self.core.unpin(req.model_fingerprint, req.block_hashes,
                               tenant_tag or security.ANONYMOUS_TENANT_TAG)
        affected = 0
        for key in keys:
            if self.warm is not None and self.core.tiers_of(key) & WARM:
                if await self.warm.set_pinned(key, False):
                    self.core.note_renewed(key, self.clock())
            affected += bool(self.core.tiers_of(key))
        return PoolAdminReply(ok=True, affected=affected)

    async def _evict(self, req: PoolAdminRequest, tenant_tag: str) -> PoolAdminReply:
        """Forget the blocks in the core (index, hot, pins, tenant ledger), then delete them from warm
        and cold whatever the index believed (a rebuild may not have indexed them yet; a write-through
        in flight deletes what it writes). `affected` counts the blocks the index held."""
        keys, held = self.core.evict(req.model_fingerprint, req.block_hashes, tenant_tag)
        self._dropped_while_writing.update(key for key in keys if key in self._writing)
        down = []
        for tier in self.tiers.tiers:
            await tier.delete_many(keys)  # one round trip per tier; missing keys are no error
            if not tier.up:
                down.append(tier.name)
        if down:  # a down tier keeps its copies until its TTL, a later evict, or a rebuild indexes them
            log.warning("evict of %d blocks: %s down, its copies were not deleted", len(keys),
                        ", ".join(down))
            return PoolAdminReply(ok=False, affected=held, error=ErrorInfo(
                code="tier_unavailable", message=f"tier(s) down, copies left there: {', '.join(down)}"))
        log.info("evicted %d blocks (%d indexed) of model %s", len(keys), held,
                 model_tag(req.model_fingerprint))
        return PoolAdminReply(ok=True, affected=held)

    async def _pin_storage(self, model_fingerprint: str, key: BlockKey, block_hash: bytes) -> int:
        """Make a pinned block survive restarts and expiry: keep it in warm without TTL (and hot)."""
        tiers = self.core.tiers_of(key)
        if not tiers:
            return 0
        if self.warm is None:
            return 1
        if tiers & WARM:
            if await self.warm.set_pinned(key, True):
                return 1
            if not self.warm.up:
                return 1
            self.core.note_missing(key, WARM)
            tiers = self.core.tiers_of(key)
        data = self.core.hot.peek(key)
        if data is None and tiers & COLD:
            found = await self.cold.get_unit(model_fingerprint, block_hash, key.tenant_tag)
            if found is not None:
                data = found[1]
                self._put_hot(key, data)
        if data is not None and await self.warm.put(key, data, pinned=True):
            self.core.note_stored(key, WARM, len(data), self.clock())
        return 1 if self.core.tiers_of(key) else 0

    def stats(self, tenant_tag: str | None = None, exact_totals: bool = True,
              with_tenants: bool = True) -> PoolAdminReply:
        """Tier and counter stats, and tenant usage (of `tenant_tag` only, when given).

        Warm and cold blocks/bytes walk the whole index; with `exact_totals=False` (the telemetry
        timer) they are the last sweep's count instead, or one walk's, kept until the next sweep.
        `with_tenants=False` (the telemetry timer too) leaves out the per-tenant usage."""
        if exact_totals:
            totals = self.core.tier_totals()
        else:
            if self._swept_totals is None:
                self._swept_totals = self.core.tier_totals()
            totals = dict(self._swept_totals, hot=(len(self.core.hot), self.core.hot.bytes_used))
        c = self.core.counters

        def tier_stats(name: str, tier: RemoteTier | None, hits: int, misses: int, up: bool,
                       integrity: int) -> TierStats:
            blocks, nbytes = totals[name]
            rate = hits / (hits + misses) if hits + misses else 0.0
            return TierStats(up=up, blocks=blocks, bytes=nbytes, hits=hits, misses=misses,
                             hit_rate=round(rate, 4), integrity_failures=integrity)

        tiers = {"hot": tier_stats("hot", None, c.hot_hits, c.hot_misses, True, 0)}
        for name, tier in (("warm", self.warm), ("cold", self.cold)):
            if tier is not None:
                tiers[name] = tier_stats(name, tier, tier.hits, tier.misses, tier.up, tier.integrity_failures)
        counters = dataclasses.asdict(c)
        counters["rebuilding"] = int(self.rebuilding)
        counters["index_blocks"] = self.core.num_blocks()
        counters["worker_blocks"] = sum(self.core.num_worker_blocks().values())
        counters["pending_purges"] = len(self.core.pending_purges) + len(self.core.pending_tenant_purges)
        ledgers = self.core.tenant_usage(tenant_tag) if with_tenants else {}
        if with_tenants:
            counters["tenants"] = len(ledgers)
        largest = sorted(ledgers.items(), key=lambda item: -item[1].num_bytes)[:MAX_TENANTS_IN_STATS]
        tenants = {t: TenantUsage(blocks=len(ledger.blocks), bytes=ledger.num_bytes,
                                  quota_bytes=self.core.quota_of(t), quota_evictions=ledger.quota_evictions,
                                  quota_refused=ledger.quota_refused)
                   for t, ledger in largest}
        return PoolAdminReply(ok=True, tiers=tiers, counters=counters, tenants=tenants)
