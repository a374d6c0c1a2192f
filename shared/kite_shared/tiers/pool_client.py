"""NATS client of the ru-pool, for workers and tools: put, lookup, get, worker cache events, tier hits, notices
of units written into warm directly, admin.

Never raises on a pool that is absent, slow or failing: lookups and gets return None / [] (a miss, so
the caller computes), puts and events are fire-and-forget publishes. Bad arguments still raise.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import ssl
import time
from typing import Sequence

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError, TimeoutError as NatsTimeoutError

from kite_shared import subjects
from kite_shared.security import ANONYMOUS_TENANT
from kite_shared.tiers import block_stream as kite_block_stream
from kite_shared.tiers import handoff as kite_handoff
from kite_shared.tracing import headers_with_context
from kite_shared.messages import (
    BlockRemoved, BlockStored, ModelFingerprintChanged, PoolAdminReply, PoolAdminRequest,
    PoolGetReply, PoolGetRequest, PoolLookupReply, PoolLookupRequest, TierHits, UnitsWritten, decode_or_log,
)

log = logging.getLogger(__name__)

STREAM_RETRY_S = 60.0  # after the pool's block stream could not be reached, inline replies this long
# How much of the pool's lent hot files a same-host reader keeps mapped by default (handoff.KeptMappings).
DEFAULT_KEEP_MAPPED_BYTES = 1 << 30


class PoolClient:
    def __init__(self, nc: NATS, worker_id: str = "", lookup_timeout_s: float = 0.1,
                 get_timeout_s: float = 2.0, admin_timeout_s: float = 30.0, handoff: bool = True,
                 stream: bool = True, stream_ssl: ssl.SSLContext | None = None,
                 keep_mapped_bytes: int = DEFAULT_KEEP_MAPPED_BYTES) -> None:
        """`handoff`: accept same-host hand-off files, keeping up to `keep_mapped_bytes` of the lent hot
        files mapped for the next fetch of the same units (0: mapped afresh each time). `stream`: accept
        the pool's block stream (TCP) when the files do not apply; `stream_ssl` verifies a TLS stream
        (None: the system CAs). Both off: units always inline in NATS replies."""
        self.nc = nc
        self.handoff = handoff
        self.kept = kite_handoff.KeptMappings(keep_mapped_bytes) if handoff and keep_mapped_bytes > 0 else None
        self.stream = stream
        self.stream_ssl = stream_ssl
        self._stream_retry_at = 0.0  # after a stream that could not be reached, inline until then
        self._host_id = kite_handoff.host_id()
        self.worker_id = worker_id
        self.lookup_timeout_s = lookup_timeout_s
        self.get_timeout_s = get_timeout_s
        self.admin_timeout_s = admin_timeout_s
        self._seq = itertools.count(1)

    async def put(self, unit_bytes: bytes) -> bool:
        """Hand one encoded unit to the pool (at most once; the pool dedupes). False if not sent."""
        try:
            await self.nc.publish(subjects.POOL_PUT, unit_bytes)
            return True
        except Exception as exc:  # MaxPayloadError, connection closed: the pool is best-effort
            log.warning("pool put not sent: %r", exc)
            return False

    async def lookup(self, model_fingerprint: str, block_hashes: Sequence[bytes],
                     include_workers: bool = True, timeout_s: float | None = None) -> PoolLookupReply | None:
        req = PoolLookupRequest(model_fingerprint=model_fingerprint, block_hashes=list(block_hashes),
                                include_workers=include_workers)
        reply = await self._request(subjects.POOL_LOOKUP, req.encode(), timeout_s or self.lookup_timeout_s)
        if reply is None:
            return None
        return decode_or_log(PoolLookupReply.decode, reply, log, "bad pool lookup reply")

    async def get(self, model_fingerprint: str, block_hashes: Sequence[bytes], max_bytes: int = 0,
                  timeout_s: float | None = None, tenant: str = ANONYMOUS_TENANT
                  ) -> list[bytes | memoryview]:
        """Encoded units of the leading blocks the pool has (several requests if the units do not fit
        one reply), unverified: the caller decodes each with recyclable_unit.decode before use.
        On the pool's host the units come as mapped hand-off files (kite_shared.tiers.handoff): writable
        memory, shared with the pool's page cache until written; from another host, on the pool's block
        stream (kite_shared.tiers.block_stream) when it has one, else inline."""
        units: list[bytes | memoryview] = []
        hashes = list(block_hashes)
        while len(units) < len(hashes):
            req = PoolGetRequest(model_fingerprint=model_fingerprint, block_hashes=hashes[len(units):],
                                 max_bytes=max_bytes, tenant=tenant,
                                 host_id=self._host_id if self.handoff else "",
                                 stream=self.stream and time.monotonic() >= self._stream_retry_at)
            raw = await self._request(subjects.POOL_GET, req.encode(), timeout_s or self.get_timeout_s)
            if raw is None:
                break
            reply = decode_or_log(PoolGetReply.decode, raw, log, "bad pool get reply")
            if reply is None:
                break
            if reply.error is not None:
                log.debug("pool get: %s", reply.error.message)
            received: list = list(reply.units)
            if reply.unit_files:
                try:
                    received = await asyncio.to_thread(kite_handoff.map_units, reply.unit_files,
                                                       remove=not reply.files_lent, kept=self.kept)
                except kite_handoff.FilesGone:
                    break  # evicted from the pool's hot tier since the reply: a miss from here on
                except OSError as exc:
                    # Same boot id, another mount namespace (a container without the pool's folder):
                    # inline from now on, and ask again for these.
                    log.warning("pool hand-off files unreadable here (%r); asking for inline replies from now on",
                                exc)
                    self.handoff = False
                    continue
            elif reply.stream_ticket:
                try:
                    received = await asyncio.wait_for(kite_block_stream.fetch(
                        reply.stream_address, reply.stream_ticket,
                        (self.stream_ssl or ssl.create_default_context()) if reply.stream_tls else None),
                        timeout_s or self.get_timeout_s)
                except (OSError, asyncio.TimeoutError) as exc:
                    # A firewall, or the pool gone: inline for a while, and ask again for these.
                    log.warning("pool block stream %s unreachable (%r); inline replies for %.0f s",
                                reply.stream_address, exc, STREAM_RETRY_S)
                    self._stream_retry_at = time.monotonic() + STREAM_RETRY_S
                    continue
            units.extend(received)
            if len(received) < len(reply.tiers) or not received or reply.complete:
                break  # a miss, a lent file gone, a stream cut short: the rest is computed
        return units

    def forget(self, unit: bytes | memoryview) -> None:
        """A unit `get` returned failed verification: never serve it from a kept mapping again."""
        if self.kept is not None:
            self.kept.forget(unit)

    async def block_stored(self, model_fingerprint: str, block_hashes: Sequence[bytes]) -> None:
        await self._publish(subjects.POOL_BLOCK_EVENTS, BlockStored(
            worker_id=self.worker_id, model_fingerprint=model_fingerprint,
            block_hashes=list(block_hashes), seq=next(self._seq)).encode())

    async def block_removed(self, model_fingerprint: str, block_hashes: Sequence[bytes],
                            all_blocks: bool = False) -> None:
        await self._publish(subjects.POOL_BLOCK_EVENTS, BlockRemoved(
            worker_id=self.worker_id, model_fingerprint=model_fingerprint,
            block_hashes=list(block_hashes), all_blocks=all_blocks, seq=next(self._seq)).encode())

    async def tier_hits(self, hits: TierHits) -> bool:
        """Report blocks this worker read from warm or cold itself, for the pool to promote
        (kite_shared.tiers.hit_report sends these). False if not sent."""
        try:
            await self.nc.publish(subjects.POOL_TIER_HITS, hits.encode())
            return True
        except Exception as exc:  # connection closed or reconnecting: a lost report costs a promotion only
            log.debug("tier hit report not sent: %r", exc)
            return False

    async def units_written(self, notice: UnitsWritten) -> None:
        """Tell the pool about units this worker wrote into warm itself (kite_shared.tiers.unit_writer)."""
        await self._publish(subjects.POOL_UNITS_WRITTEN, notice.encode())

    async def model_fingerprint_changed(self, model_name: str, fingerprint: str, previous: str = "") -> None:
        await self._publish(subjects.MODEL_FINGERPRINT, ModelFingerprintChanged(
            model_name=model_name, model_fingerprint=fingerprint, previous_fingerprint=previous).encode())

    async def admin(self, req: PoolAdminRequest, timeout_s: float | None = None) -> PoolAdminReply | None:
        raw = await self._request(subjects.POOL_ADMIN, req.encode(), timeout_s or self.admin_timeout_s)
        return None if raw is None else PoolAdminReply.decode(raw)

    async def _publish(self, subject: str, data: bytes) -> None:
        try:
            await self.nc.publish(subject, data)
        except Exception as exc:
            log.warning("publish to %s failed: %r", subject, exc)

    async def _request(self, subject: str, data: bytes, timeout_s: float) -> bytes | None:
        try:
            # The caller's trace continues in the pool (W3C traceparent in the NATS headers).
            msg = await self.nc.request(subject, data, timeout=timeout_s, headers=headers_with_context() or None)
        except NoRespondersError:
            log.debug("no ru-pool is listening on %s", subject)
            return None
        except NatsTimeoutError:
            log.warning("ru-pool did not answer %s within %.3f s", subject, timeout_s)
            return None
        except Exception as exc:  # connection closed or reconnecting: a miss, not a failure
            log.warning("request to %s failed: %r", subject, exc)
            return None
        return msg.data
