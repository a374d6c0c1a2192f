"""Replicas: what ru-pool replicas say to each other, so that any of them can answer any request
(docs/ru-pool.md, "Replicas").

    subject                          queue     message                                  what
    kite.v1.pool.index_changes       -         PoolIndexChanges                         index changes, both ways
    kite.v1.pool.worker_caches       ru-pool   WorkerCachesRequest -> WorkerCachesReply the worker-cache snapshot
    kite.v1.heartbeat.ru-pool        -         Heartbeat                                who the replicas are
    JetStream KV kite_lease_ru-pool            (kite_shared.lease.LeaderLease)          who runs the maintenance

- Index changes: the changes this replica records (index_changes.IndexChangeLog: writes, reads,
  maintenance, admin) leave in one message per few milliseconds (FLUSH_DELAY_S), so a put's
  write-through, an admin operation or a sweep step is one message, not one per block. Every replica
  applies the others' (its own come back from NATS and are ignored by instance id and a per-process
  nonce). A gap in a sender's numbers means changes were lost: counted, and this replica re-lists warm at
  its next sweep.
- Worker caches: a joining replica asks one live replica (the queue group picks it) for its worker-cache
  index, page by page (each page under the connection's max_payload), keeping the worker events that
  arrive meanwhile aside and replaying those the snapshot does not hold (per worker, by event number);
  the first page also carries the models' state no tier listing holds (current fingerprints, invalidated
  tags).
- Leadership: the holder of the lease runs the maintenance on the shared tiers. Each renewal's outcome
  goes down to maintenance.Maintenance (`lead`: held until when), which answers `leading` from it: a
  holder that could not renew for a whole lease stops leading at once, whatever the lease's bucket says
  later, so two replicas never both believe they lead for long.
- Peers: from their heartbeats (live: heard within peers.PEER_SILENT_AFTER heartbeat intervals), kept in
  peers.Peers; their number is logged when it changes and reported by `stats` (`replicas`).

Boundary: the NATS side of replication, beside the handler table above the coordinating layer. It calls
down only: catalog.Catalog.apply_changes (the others' changes), worker_events.WorkerEvents and the worker
caches (the snapshot), maintenance.Maintenance (the lease's outcome; a sweep wanted now), peers.Peers; it
reads the change log when its `pending` event says there is something to send. Nothing calls it back.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Callable

import nats.errors
from nats.aio.client import Client as NATS

from kite_shared import subjects
from kite_shared.endpoints import Endpoint
from kite_shared.lease import LeaderLease
from kite_shared.messages import (Heartbeat, PoolIndexChanges, WorkerCache, WorkerCachesReply,
                                  WorkerCachesRequest, decode_or_log)
from kite_ru_pool.core import PoolCore
from kite_ru_pool.peers import Peers

log = logging.getLogger(__name__)

FLUSH_DELAY_S = 0.005  # changes recorded within this much of the first go out in one message
SNAPSHOT_TIMEOUT_S = 2.0  # for each page of the worker-cache snapshot
SNAPSHOT_REPLY_OVERHEAD_BYTES = 4096  # msgpack framing of WorkerCachesReply around the hashes


class Replicas:
    def __init__(self, core: PoolCore, peers: Peers, nc: NATS, instance_id: str, lease_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.core = core
        self.maintenance = core.maintenance
        self.changes = core.changes
        self.counters = core.counters
        self.peers = peers
        self.nc = nc
        self.instance_id = instance_id
        self.nonce = secrets.token_hex(6)  # tells this process's messages apart from a namesake's
        self.clock = clock
        self.lease = LeaderLease(nc, "ru-pool", instance_id, lease_s)
        self.maintenance.lead(0.0)  # not leading until the lease is taken
        self._seq = 0
        self._senders: dict[tuple[str, str], int] = {}  # (instance, nonce) -> last seq applied

    # --- endpoints ----------------------------------------------------------------------------------------
    def endpoints(self) -> list[Endpoint]:
        """Served from the start: the others' index changes and heartbeats."""
        return [
            Endpoint(subjects.POOL_INDEX_CHANGES, self.on_changes),
            Endpoint(subjects.heartbeat("ru-pool"), self.on_heartbeat),
        ]

    def snapshot_endpoint(self) -> Endpoint:
        """Served once this replica's own worker caches are whole (after `fetch_worker_caches`)."""
        return Endpoint(subjects.POOL_WORKER_CACHES, self.worker_caches)

    # --- index changes --------------------------------------------------------------------------------------
    async def send_when_due(self) -> None:
        """Wait for changes in the log, then send them FLUSH_DELAY_S later, with what came meanwhile. The
        service runs this back to back; the sending is a background task, which a stop waits for rather
        than cutting a message short."""
        await self.changes.pending.wait()
        await asyncio.sleep(FLUSH_DELAY_S)
        await asyncio.wait([self.core.background.spawn(self.flush(), "index changes")])

    async def flush(self) -> int:
        """Publish what the change log holds; how many messages went out."""
        sent = 0
        for batch in self.changes.take():
            self._seq += 1
            message = PoolIndexChanges(instance_id=self.instance_id, nonce=self.nonce, seq=self._seq,
                                       changes=batch)
            try:
                await self.nc.publish(subjects.POOL_INDEX_CHANGES, message.encode())
            except (nats.errors.Error, OSError) as exc:  # the others see a gap and re-list warm
                log.warning("index changes not sent to the other replicas (%r)", exc)
                continue
            self.counters.index_changes_sent += 1
            sent += 1
        return sent

    async def on_changes(self, msg: PoolIndexChanges) -> None:
        if msg.instance_id == self.instance_id and msg.nonce == self.nonce:
            return  # our own, back from NATS
        sender = (msg.instance_id, msg.nonce)
        last = self._senders.get(sender)
        if last is not None and msg.seq > last + 1:
            self.counters.index_change_gaps += 1
            log.warning("lost %d index change message(s) of replica %s; re-listing warm", msg.seq - last - 1,
                        msg.instance_id)
            self.maintenance.changes_lost()
        self._senders[sender] = max(msg.seq, last or 0)
        self.core.catalog.apply_changes(msg.changes, self.clock())
        self.counters.index_changes_applied += 1

    # --- worker caches ----------------------------------------------------------------------------------
    async def fetch_worker_caches(self) -> bool:
        """Take the worker-cache index from a live replica, page by page; True when one answered (this
        replica joins a running pool), False when none listens (it is the first). The caller has called
        WorkerEvents.hold() before subscribing to the worker events; whatever happens here, the events
        held meanwhile are applied at the end."""
        caches: list[tuple[str, int, float, dict[str, list[bytes]]]] = []
        after, answered, truncated, source = "", False, 0, ""
        invalidated: list[str] = []
        try:
            while True:
                request = WorkerCachesRequest(instance_id=self.instance_id, after_worker_id=after)
                try:
                    msg = await self.nc.request(subjects.POOL_WORKER_CACHES, request.encode(),
                                                timeout=SNAPSHOT_TIMEOUT_S)
                except nats.errors.NoRespondersError:
                    break
                except (nats.errors.Error, asyncio.TimeoutError) as exc:
                    log.warning("worker-cache snapshot incomplete (%r): the rest comes from the workers' "
                                "next events", exc)
                    break
                reply = decode_or_log(WorkerCachesReply.decode, msg.data, log, "bad worker-cache snapshot")
                if reply is None or reply.error is not None:
                    break
                if not answered:  # the first page: the models' state
                    self.core.catalog.restore_models(reply.current_fingerprints, reply.invalidated_tags)
                    invalidated = reply.invalidated_tags
                answered, source = True, reply.instance_id
                for w in reply.workers:
                    caches.append((w.worker_id, w.seq, w.seen, w.models))
                    truncated += w.truncated
                    after = w.worker_id
                if not reply.more or not reply.workers:
                    break
        finally:
            replayed = self.core.worker_events.install(caches)
        if answered:
            log.info("worker caches of %d workers taken from replica %s (%d events replayed%s), %d invalidated "
                     "model tags", len(caches), source, replayed,
                     f"; {truncated} cut to one message" if truncated else "", len(invalidated))
        return answered

    async def worker_caches(self, req: WorkerCachesRequest) -> WorkerCachesReply:
        budget = self.nc.max_payload - SNAPSHOT_REPLY_OVERHEAD_BYTES
        page, more = self.core.workers.export(req.after_worker_id, budget)
        if any(truncated for *_, truncated in page):
            log.warning("worker-cache snapshot for %s: a worker's cache is larger than one message (%d bytes); "
                        "sent in part", req.instance_id, budget)
        current, invalidated = self.core.catalog.models_state() if not req.after_worker_id else ({}, [])
        return WorkerCachesReply(instance_id=self.instance_id, more=more, current_fingerprints=current,
                                 invalidated_tags=invalidated, workers=[
            WorkerCache(worker_id=w, seq=seq, seen=seen, models=models, truncated=truncated)
            for w, seq, seen, models, truncated in page])

    # --- leadership ---------------------------------------------------------------------------------------
    async def keep_lease(self) -> None:
        """Renew the lease, or take it when free (every third of the lease; at start, so a lone pool
        leads at once), and tell the maintenance until when it leads."""
        was = self.maintenance.leading()
        leader = await self.lease.hold()
        self.maintenance.lead(time.monotonic() + self.lease.lease_s if leader else 0.0)
        if leader and not was:
            log.info("this replica runs the pool's maintenance now (lease %.1f s)", self.lease.lease_s)
            self.maintenance.wake()
        elif was and not leader:
            log.warning("another ru-pool replica runs the maintenance now")

    async def resign(self) -> None:
        self.maintenance.lead(0.0)
        await self.lease.resign()  # says so in the log ("ru-pool lease released")

    # --- peers --------------------------------------------------------------------------------------------
    async def on_heartbeat(self, beat: Heartbeat) -> None:
        if beat.instance_id == self.instance_id:
            return
        self.peers.heard(beat.instance_id, beat.draining)
        await self.peers.watch()
