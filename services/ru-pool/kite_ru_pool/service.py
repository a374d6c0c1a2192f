"""The ru-pool service: builds the pool from its parts, starts and stops it.

    handlers.PoolHandlers   the Endpoint table (decode -> the coordinating layer -> reply), hand-off files
      admin.PoolAdmin       kite pool stats / clear / purge / evict / pin / unpin
    replicas.Replicas       index changes to and from the other replicas, the worker-cache snapshot,
                            the maintenance lease; peers.Peers, the other replicas' heartbeats
    core.PoolCore           the parts below handlers and replicas, built together (its docstring):
      reads, writes, catalog, worker_events, maintenance    the coordinating layer
      index, tier_io, worker_caches                          the lower layers
    telemetry               PoolTelemetry and the event-loop lag probe

Boundary: wiring and lifecycle only. The subscriptions and periodic work (sweep, telemetry, lag probe,
hand-off sweep) go through a kite_shared.service.ServiceRuntime, which owns them and ends them on drain;
`stop` ends them first anyway, so the pool stops taking work before it finishes its background writes
and closes the tier clients.

Any number of replicas (docs/ru-pool.md, "Replicas"): each keeps the whole index, rebuilt from warm (Redis
SCAN) and cold (object listing) at start and kept in step by the others' index changes; the hot tier is
each replica's own. A replica that finds others running (one answers its worker-cache snapshot request)
joins the `ru-pool` queue group once its rebuild is done, so it answers right from its first request; the
first replica serves at once, answering from what the rebuild indexed so far. Only the holder of the
lease (KITE_POOL_LEASE_S) runs the maintenance on the shared tiers.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from nats.aio.client import Client as NATS

from kite_shared import security, subjects
from kite_shared.config import CommonConfig, ConfigError, RuPoolConfig, TierConfig, load
from kite_shared.endpoints import cancel_and_wait
from kite_shared.messages import PoolAdminReply
from kite_shared.service import ServiceRuntime
from kite_shared.tiers import handoff
from kite_shared.tiers.block_stream import BlockStreamServer
from kite_shared.tiers.client import TierClient
from kite_ru_pool.admin import PoolAdmin
from kite_ru_pool.core import PoolCore
from kite_ru_pool.handlers import PoolHandlers
from kite_ru_pool.index_changes import IndexChangeLog
from kite_ru_pool.peers import Peers
from kite_ru_pool.replicas import Replicas
from kite_ru_pool.telemetry import pool_telemetry, probe_loop_lag

log = logging.getLogger(__name__)

HANDOFF_SWEEP_INTERVAL_S = 10.0


class PoolService:
    def __init__(self, cfg: RuPoolConfig, tier_cfg: TierConfig, nc: NATS,
                 tiers: TierClient | None = None, clock: Callable[[], float] = time.time,
                 ru_key: bytes | None = None, instance_id: str = "ru-pool", freeze_gc: bool = False,
                 heartbeat_interval_s: float = 1.0) -> None:
        """`instance_id` names this replica (telemetry, its own subjects, the lease; unique per replica);
        `freeze_gc`: keep the cyclic GC off the index (kite_ru_pool.gc_freeze); only the pool's own
        process sets it, so pools started inside a test runner leave the runner's GC alone;
        `heartbeat_interval_s`: the replicas' heartbeat interval (how soon a silent one counts as gone)."""
        self.cfg = cfg
        self.instance_id = instance_id
        self.nc = nc
        # Every unit put or moved must carry a valid HMAC under the cluster key (default: this process's).
        self.ru_key = ru_key if ru_key is not None else security.ru_key()
        self.tiers = tiers if tiers is not None else TierClient.from_config(tier_cfg, ru_key=self.ru_key)
        self.warm = self.tiers.warm
        self.cold = self.tiers.cold
        self.clock = clock
        # Same-host readers map hot blocks from files in memory rather than get them through NATS
        # (tiers.handoff): the hot tier keeps each unit in a file of this folder.
        self.host_id = handoff.host_id()
        self.handoff = handoff.open_folder(cfg.handoff_dir)
        self.hot_files = handoff.HotFiles(self.handoff) if self.handoff is not None else None
        # Readers on other hosts take the units of their gets from a TCP stream (tiers.block_stream).
        self.stream = BlockStreamServer() if cfg.data_listen else None
        self.core = PoolCore(cfg.hot_bytes, cfg.archive_after_s, tier_cfg.warm_ttl_s, tier_cfg.cold_ttl_s,
                             cfg.sweep_interval_s, has_warm=self.warm is not None,
                             has_cold=self.cold is not None, tenant_quota_bytes=cfg.tenant_quota_bytes,
                             tenant_quotas={security.tenant_tag(name): quota
                                            for name, quota in cfg.tenant_quota_overrides().items()},
                             tiers=self.tiers, ru_key=self.ru_key, clock=clock,
                             # what this replica changes in the shared tiers, for the others
                             changes=IndexChangeLog(), hot_files=self.hot_files, freeze_gc=freeze_gc)
        self.peers = Peers(instance_id, heartbeat_interval_s, has_warm=self.warm is not None)
        self.replicas = Replicas(self.core, self.peers, nc, instance_id, cfg.lease_s, clock=clock)
        self.admin = PoolAdmin(self.core, self.peers)
        self.handlers = PoolHandlers(self.core, self.admin, nc, self.handoff, self.host_id, clock, instance_id,
                                     self.stream)
        self._subs: list = []
        self._tasks: list[asyncio.Task] = []
        self._join: asyncio.Task | None = None

    @property
    def rebuilding(self) -> bool:
        """True until the index has learned what warm and cold hold."""
        return self.core.index.rebuilding

    # --- lifecycle of the service ------------------------------------------------------------------------
    async def start(self, rt: ServiceRuntime | None = None) -> None:
        """Connect the tiers, start the index rebuild, serve the handler table, start the periodic work.

        `rt` is the process's runtime (kite_ru_pool.__main__). Without one (tests, a pool inside another
        process) a runtime over `self.nc` serves and schedules the same way; the connection stays its
        owner's to close."""
        rt = rt or _runtime_over(self.nc, self.instance_id)
        await self.tiers.start()
        if self.stream is not None:
            await self.stream.start(self.cfg.data_listen, self.cfg.data_advertise, _nats_host(rt.common.nats_url),
                                    _server_tls(self.cfg))
        self.core.maintenance.start_rebuild()
        # Worker events wait aside until the worker caches of a running replica are in (replicas.py).
        self.core.worker_events.hold()
        # What reaches every replica, from the start: the others' index changes and heartbeats, worker
        # events and fingerprints, and this replica's own subjects.
        self._subs = await rt.serve(*self.replicas.endpoints(), *self.handlers.own_endpoints())
        try:
            await self.replicas.keep_lease()  # a lone pool leads at once
        except Exception as exc:  # JetStream slow or away: the periodic renewal tries again
            log.warning("maintenance lease not taken yet: %r", exc)
        joining = await self.replicas.fetch_worker_caches()
        self._subs += await rt.serve(self.replicas.snapshot_endpoint())
        if joining:  # the others answer meanwhile; this replica takes its share once its index is whole
            self._join = asyncio.create_task(self._join_when_rebuilt(rt))
        else:
            self._subs += await rt.serve(*self.handlers.shared_endpoints())
            self.peers.serving = True
        self._tasks = [
            rt.every(self.replicas.lease.renew_interval_s, self.replicas.keep_lease, "ru-pool maintenance lease"),
            rt.every(self.peers.heartbeat_interval_s, self.peers.watch, "ru-pool replicas"),
            # waits for changes to send itself: back to back
            rt.every(0.0, self.replicas.send_when_due, "index changes"),
            # the sweep waits for its interval itself (or for warm coming back): back to back
            rt.every(0.0, self.core.maintenance.sweep_when_due, "lifecycle sweep"),
            # issue 4: how late the event loop runs (kite_pool_event_loop_lag_seconds)
            rt.every(0.0, probe_loop_lag, "event-loop lag probe"),
            # issue 5: tier health, fill and hit rates for the arbitrator, every KITE_TELEMETRY_INTERVAL_S
            rt.publish_every(self.cfg.telemetry_interval_s, subjects.telemetry("ru-pool"),
                             lambda: pool_telemetry(self, self.instance_id)),
        ]
        if self.handoff is not None:
            self._tasks.append(rt.every(HANDOFF_SWEEP_INTERVAL_S, self.handlers.sweep_handoff,
                                        "hand-off folder sweep"))

    async def _join_when_rebuilt(self, rt: ServiceRuntime) -> None:
        await self.core.maintenance.rebuilt.wait()
        self._subs += await rt.serve(*self.handlers.shared_endpoints())
        self.peers.serving = True
        log.info("joined the ru-pool queue group: index of %d blocks, %d workers' caches",
                 self.core.index.num_blocks(), len(self.core.workers.num_blocks()))

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop taking work, end the periodic work, let background writes finish (bounded), tell the
        other replicas the last changes, hand the maintenance lease over, close the tier clients. The
        runtime's drain callback in the pool's process."""
        if self._join is not None and not self._join.done():
            self._join.cancel()
        self.peers.serving = False
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # connection already closing: nothing more to unsubscribe
                log.debug("unsubscribe failed: %r", exc)
        self._subs = []
        await cancel_and_wait(self._tasks)
        self._tasks = []
        unfinished = await self.core.background.finish(timeout_s)
        if unfinished:
            log.warning("stopped with %d background tier operations unfinished", unfinished)
        try:
            await self.replicas.flush()
            await self.replicas.resign()
        except Exception as exc:  # the bus is gone: the others see a gap, the lease ages out
            log.warning("could not tell the other replicas goodbye: %r", exc)
        await self.tiers.close()
        if self.stream is not None:
            await self.stream.stop()
        if self.handoff is not None:
            self.handoff.remove()

    async def drain_background(self) -> None:
        """Wait until no background tier operation is running (tests and benchmarks)."""
        await self.core.background.drain()

    # --- the parts' entry points, for tests, benchmarks and the telemetry -----------------------------------
    def stats(self, tenant_tag: str | None = None, exact_totals: bool = True,
              with_tenants: bool = True) -> PoolAdminReply:
        return self.admin.stats(tenant_tag, exact_totals, with_tenants)

    def put_bytes(self, data: bytes) -> str:
        return self.core.writes.put_bytes(data)

    async def sweep_once(self) -> None:
        await self.core.maintenance.sweep_once()


def _nats_host(url: str) -> str:
    """The first NATS server's host: the block stream advertises this host's address on the route to it."""
    return urlsplit(url.split(",")[0].strip()).hostname or ""


def _server_tls(cfg: RuPoolConfig) -> ssl.SSLContext | None:
    if not cfg.data_tls_cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(str(Path(cfg.data_tls_cert).expanduser()), str(Path(cfg.data_tls_key).expanduser()))
    except OSError as exc:  # ssl.SSLError is an OSError too
        raise ConfigError(f"KITE_POOL_DATA_TLS_CERT={cfg.data_tls_cert!r} / KITE_POOL_DATA_TLS_KEY: cannot load "
                          f"the certificate and key: {exc}") from None
    return context


def _runtime_over(nc: NATS, instance_id: str) -> ServiceRuntime:
    """A runtime over a connection someone else owns: it serves and runs periodic work like the process's
    own, and is never started or shut down (PoolService.stop ends what it started)."""
    rt = ServiceRuntime("ru-pool", load(CommonConfig, environ={}, instance_id=instance_id))
    rt.nc = nc
    return rt
