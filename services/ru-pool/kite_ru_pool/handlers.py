"""The ru-pool's handler table: each NATS subject it serves, as a kite_shared.endpoints.Endpoint (decode
-> the coordinating layer -> reply), and the form of a get's reply: files on the same host, a ticket for
the block stream for another host that asks for it, else the units inline.

Boundary: the only module that knows subjects and messages (with replicas.py for the replicas' own), on
top of the coordinating layer: a put, a lookup, a get or an admin request is one call into it, and the
reply is built from what comes back; no handler calls the lower layers (index, tier I/O, worker
caches). A put and a worker's units_written notice go to writes.PoolWrites, a lookup and a get to reads.PoolReads, worker events to
worker_events.WorkerEvents, workers' tier hits to worker_hits.WorkerHits, fingerprints, quarantines and
shadow checks to catalog.Catalog (then maintenance.Maintenance purges on the leading replica), admin
requests to admin.PoolAdmin. The framework
decodes, traces, sets the request context, answers a bad message with `invalid_message` and a handler
bug with `internal_error`, and counts; handlers here return the reply (None for events) or raise
Refusal.

    subject                      queue     reply               handler
    kite.v1.pool.put             ru-pool   none (raw unit)     put
    kite.v1.pool.lookup          ru-pool   PoolLookupReply     lookup   (span kite.ru_pool.lookup)
    kite.v1.pool.get             ru-pool   PoolGetReply        get      (span kite.ru_pool.get)
    kite.v1.pool.admin           ru-pool   PoolAdminReply      admin
    kite.v1.pool.tier_hits       ru-pool   none                tier_hits (promotion, in the background)
    kite.v1.pool.units_written   ru-pool   none                units_written (index what a worker wrote to warm)
    kite.v1.pool.replica.<instance>.{put,lookup,get,admin}   -   the same, this replica only
    kite.v1.pool.block_events    -         none                block_event
    kite.v1.model.fingerprint    -         none                model_fingerprint
    kite.v1.heartbeat.worker     -         none                worker_heartbeat
    kite.v1.arbitrator.decisions -         none                decision (quarantine only)
    kite.v1.shadow.results       -         none                shadow_result (the namespace audit)

The queue-group subjects (`shared_endpoints`) are what clients use: any replica answers, each holding the
whole index. The others (`own_endpoints`) reach every replica: worker events and fingerprints, so each
replica keeps the whole worker-cache index and the same invalidations; and the replica's own subjects.
What replicas say to each other is replicas.py's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from nats.aio.client import Client as NATS
from prometheus_client import Histogram

from kite_shared import security, subjects
from kite_shared.endpoints import Endpoint
from kite_shared.messages import (
    BlockRemoved, BlockStored, Decision, Heartbeat, ModelFingerprintChanged, PoolGetReply,
    PoolGetRequest, PoolLookupReply, PoolLookupRequest, ShadowCheckResult, TierHits, UnitsWritten,
)
from kite_shared.tiers import metrics
from kite_shared.tiers.block_stream import BlockStreamServer
from kite_shared.tiers.handoff import HandoffFolder
from kite_shared.tiers.keys import BlockKey, model_tag
from kite_ru_pool.admin import PoolAdmin
from kite_ru_pool.core import PoolCore
from kite_ru_pool.reads import FoundBlocks

log = logging.getLogger(__name__)

GET_REPLY_OVERHEAD_BYTES = 4096  # msgpack framing of PoolGetReply around the units
HANDOFF_REPLY_MAX_BYTES = 1 << 30  # units one same-host get may hand off as files (tmpfs is memory)


@dataclass(frozen=True)
class TimedEndpoint(Endpoint):
    """An Endpoint that also observes `seconds` from receiving a message to having sent its reply
    (kite_pool_lookup_seconds: the pool's own share of a lookup's latency, which bench/ reads)."""

    seconds: Histogram | None = None

    async def on_message(self, msg: Any) -> None:
        started = time.perf_counter()
        await super().on_message(msg)
        if self.seconds is not None:
            self.seconds.observe(time.perf_counter() - started)


class PoolHandlers:
    def __init__(self, core: PoolCore, admin: PoolAdmin, nc: NATS, handoff: HandoffFolder | None,
                 host_id: str, clock: Callable[[], float], instance_id: str = "ru-pool",
                 stream: BlockStreamServer | None = None) -> None:
        self.instance_id = instance_id  # names this replica's own subjects (subjects.pool_replica)
        self.reads = core.reads
        self.writes = core.writes
        self.catalog = core.catalog
        self.worker_events = core.worker_events
        self.worker_hits = core.worker_hits
        self.maintenance = core.maintenance
        self.admin = admin
        self.nc = nc
        self.handoff = handoff  # same-host readers get units as files here (kite_shared.tiers.handoff)
        self.host_id = host_id
        # readers on other hosts take their units from this TCP stream (kite_shared.tiers.block_stream)
        self.stream = stream
        self.clock = clock

    def endpoints(self) -> list[Endpoint]:
        """Every endpoint of the pool's handler table."""
        return self.shared_endpoints() + self.own_endpoints()

    def shared_endpoints(self) -> list[Endpoint]:
        """Puts, lookups, gets, admin and the workers' tier hits on the `ru-pool` queue group: one replica
        takes each (a tier hit is promoted into that replica's hot tier)."""
        return self._block_path({op: subject for op, subject in (
            ("put", subjects.POOL_PUT), ("lookup", subjects.POOL_LOOKUP), ("get", subjects.POOL_GET),
            ("admin", subjects.POOL_ADMIN))}) + [Endpoint(subjects.POOL_TIER_HITS, self.tier_hits),
                                                 Endpoint(subjects.POOL_UNITS_WRITTEN, self.units_written)]

    def own_endpoints(self) -> list[Endpoint]:
        """What reaches every replica: worker events, heartbeats and fingerprints; and this replica's own
        put, lookup, get and admin subjects."""
        return [
            Endpoint(subjects.POOL_BLOCK_EVENTS, self.block_event),
            Endpoint(subjects.MODEL_FINGERPRINT, self.model_fingerprint),
            Endpoint(subjects.heartbeat("worker"), self.worker_heartbeat),
            Endpoint(subjects.DECISIONS, self.decision),
            Endpoint(subjects.SHADOW_RESULTS, self.shadow_result),
        ] + self._block_path({op: subjects.pool_replica(self.instance_id, op) for op in subjects.POOL_REPLICA_OPS})

    def _block_path(self, subject: dict[str, str]) -> list[Endpoint]:
        return [
            Endpoint(subject["put"], self.put),
            TimedEndpoint(subject["lookup"], self.lookup, span="kite.ru_pool.lookup",
                          seconds=metrics.POOL_LOOKUP_SECONDS),
            Endpoint(subject["get"], self.get, span="kite.ru_pool.get"),
            Endpoint(subject["admin"], self.admin.handle),
        ]

    # --- the block path ---------------------------------------------------------------------------------
    async def put(self, data: bytes) -> None:
        self.writes.put_bytes(data)

    async def lookup(self, req: PoolLookupRequest) -> PoolLookupReply:
        r = self.reads.lookup(req.model_fingerprint, req.block_hashes, include_workers=req.include_workers)
        return PoolLookupReply(hot=r.hot, warm=r.warm, cold=r.cold, pool=r.pool, tiers=r.tiers,
                               workers=r.workers, invalidated=r.invalidated)

    async def get(self, req: PoolGetRequest) -> PoolGetReply:
        handoff = self.handoff is not None and req.host_id == self.host_id
        stream = not handoff and req.stream and self.stream is not None
        inline_budget = self.nc.max_payload - GET_REPLY_OVERHEAD_BYTES
        budget = HANDOFF_REPLY_MAX_BYTES if handoff or stream else inline_budget
        if req.max_bytes > 0:
            budget = min(budget, req.max_bytes)
        found = await self.reads.get_blocks(req.model_fingerprint, req.block_hashes, budget,
                                            security.tenant_tag(req.tenant), lend_files=handoff)
        if handoff and found.units:
            return await self._hand_off(found, min(budget, inline_budget))
        if stream and found.units:
            return PoolGetReply(stream_address=self.stream.address, stream_ticket=self.stream.offer(found.units),
                                stream_tls=self.stream.tls, tiers=found.tiers, complete=found.complete,
                                error=found.error)
        return _inline(found, len(found.units))

    async def tier_hits(self, hits: TierHits) -> None:
        self.worker_hits.reported(hits.model_fingerprint, hits.tenant_tag, hits.block_hashes, hits.tiers)

    async def units_written(self, notice: UnitsWritten) -> None:
        if not len(notice.block_hashes) == len(notice.sizes) == len(notice.depths):
            log.warning("dropped a units_written notice of worker %s: %d hashes, %d sizes, %d depths",
                        notice.worker_id, len(notice.block_hashes), len(notice.sizes), len(notice.depths))
            return
        keys = [BlockKey.of(notice.model_fingerprint, h, notice.tenant_tag) for h in notice.block_hashes]
        self.writes.units_written(keys, notice.sizes, notice.depths)

    async def _hand_off(self, found: FoundBlocks, inline_budget: int) -> PoolGetReply:
        """The units as files: the hot files that hold them when every one is in one (nothing written),
        else reply files written for the asker; inline (cut to `inline_budget`) if the folder cannot
        take them (a full tmpfs, say)."""
        if found.lent_files:
            return PoolGetReply(unit_files=found.lent_files, files_lent=True, tiers=found.tiers,
                                complete=found.complete, error=found.error)
        try:
            paths = await asyncio.to_thread(self.handoff.write_all, found.units)
        except OSError as exc:
            log.warning("hand-off write failed (%r); replying inline", exc)
            count, total = 0, 0
            for data in found.units:
                if total + len(data) > inline_budget:
                    break
                count, total = count + 1, total + len(data)
            return _inline(found, count)
        return PoolGetReply(unit_files=paths, tiers=found.tiers, complete=found.complete, error=found.error)

    async def sweep_handoff(self) -> None:
        """Free the hand-off files nobody read (periodic; a reader killed between reply and read)."""
        await asyncio.to_thread(self.handoff.sweep)

    # --- events -------------------------------------------------------------------------------------------
    async def block_event(self, ev: BlockStored | BlockRemoved) -> None:
        now = self.clock()
        if isinstance(ev, BlockStored):
            self.worker_events.stored(ev.worker_id, ev.model_fingerprint, ev.block_hashes, ev.seq, now)
        else:
            self.worker_events.removed(ev.worker_id, ev.model_fingerprint, ev.block_hashes, ev.all_blocks,
                                       ev.seq, now)

    async def worker_heartbeat(self, hb: Heartbeat) -> None:
        if hb.draining:
            self.worker_events.forget(hb.instance_id)
        else:
            self.worker_events.alive(hb.instance_id, self.clock())

    async def model_fingerprint(self, ev: ModelFingerprintChanged) -> None:
        tags = self.catalog.model_fingerprint_changed(ev.model_name, ev.model_fingerprint,
                                                      ev.previous_fingerprint)
        if tags:
            # Every replica hears this and invalidates; the leader purges the storage.
            leading = self.maintenance.leading()
            log.info("model %s now has fingerprint %s; blocks of %s invalidated%s", ev.model_name,
                     model_tag(ev.model_fingerprint), ", ".join(tags),
                     ", purging in the background" if leading else " (the leading replica purges them)")
            if leading:
                self.maintenance.purge_in_background()

    async def decision(self, d: Decision) -> None:
        """The arbitrator's quarantine decisions (every replica applies them; the leader purges)."""
        if d.action != "quarantine" or d.quarantined is None:
            return
        tag = model_tag(d.target)
        if d.quarantined and self.catalog.quarantine(tag, d.namespace):
            leading = self.maintenance.leading()
            log.error("namespace %s (%s) quarantined: its blocks are misses%s (%s)", d.namespace, tag,
                      ", purging them" if leading else "; the leading replica purges them", d.reason)
            if leading:
                self.maintenance.purge_in_background()
        elif not d.quarantined and self.catalog.lift_quarantine(tag, d.namespace):
            log.warning("namespace %s (%s): quarantine lifted (%s)", d.namespace, tag, d.reason)

    async def shadow_result(self, result: ShadowCheckResult) -> None:
        self.catalog.shadow_checked(result.model_fingerprint, result.namespace, result.diverged)


def _inline(found: FoundBlocks, count: int) -> PoolGetReply:
    """The first `count` units inside the reply (views of hot files become bytes: a NATS message is
    bytes anyway)."""
    return PoolGetReply(units=[bytes(data) for data in found.units[:count]], tiers=found.tiers[:count],
                        complete=found.complete and count == len(found.units), error=found.error)
