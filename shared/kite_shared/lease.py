"""One leader among the replicas of a service: a lease held in a JetStream key-value bucket.

    bucket  kite_lease_<service> (created on first use; its TTL is the lease, `lease_s`)
    key     "holder"; value: the holder's instance id

Every `renew_interval_s` (a third of the lease) each replica calls `hold()`:
- the holder rewrites the key with the revision it last wrote (compare-and-set). Writing renews the entry's
  age, so it never expires while the holder lives; a failed compare means another replica holds it now;
- any other replica tries to create the key, which succeeds only when it does not exist: the holder resigned
  (deleted it on drain) or died and its entry aged out after `lease_s`.
So a holder killed with SIGKILL is replaced within `lease_s + renew_interval_s`; one that drains is replaced
at the next `hold()` of another replica. Two holders at once would need the bus to lose a compare-and-set:
JetStream serializes writes to a key, so it cannot.

Without JetStream (a bare nats-server) nothing can be shared: the lease says so once and every replica
leads, which is right for the one replica such a deployment runs.
"""

from __future__ import annotations

import asyncio
import logging

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

log = logging.getLogger(__name__)

KEY = "holder"
RESIGN_TIMEOUT_S = 1.0


class LeaderLease:
    def __init__(self, nc: NATS, name: str, instance_id: str, lease_s: float) -> None:
        self.nc = nc
        self.name = name  # the service: one lease (bucket) each
        self.bucket = f"kite_lease_{name}"
        self.instance_id = instance_id
        self.lease_s = lease_s
        self.leader = False
        self._revision = 0  # of our last write, while leader
        self._kv: KeyValue | None = None
        self._without_jetstream = False

    @property
    def renew_interval_s(self) -> float:
        return self.lease_s / 3

    async def hold(self) -> bool:
        """Renew the lease if this replica holds it, else try to take it; whether this replica leads now."""
        kv = await self._bucket()
        if kv is None:
            return True
        value = self.instance_id.encode()
        if self.leader:
            try:
                self._revision = await kv.update(KEY, value, last=self._revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                self.leader = False  # our entry aged out (a stall longer than the lease) and another took it
                log.warning("%s lease lost to another replica", self.name)
        else:
            try:
                self._revision = await kv.create(KEY, value)
                self.leader = True
            except nats.js.errors.KeyWrongLastSequenceError:
                pass  # held by another replica
        return self.leader

    async def resign(self) -> None:
        """Give the lease up now (drain), so another replica takes it at its next hold(); nothing when this
        replica does not hold it."""
        if not self.leader or self._kv is None:
            return
        self.leader = False
        if not self.nc.is_connected:  # the bus is gone (its launcher died): nobody to hand over to
            log.info("%s lease not released (no NATS connection): it ages out in %.1f s", self.name,
                     self.lease_s)
            return
        try:
            # Bounded: a drain must not wait out JetStream's 5 s default for a bus that goes away meanwhile.
            await asyncio.wait_for(self._kv.delete(KEY, last=self._revision), RESIGN_TIMEOUT_S)
            log.info("%s lease released", self.name)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.errors.Error, asyncio.TimeoutError) as exc:
            log.info("%s lease not released (%r): it ages out in %.1f s", self.name, exc, self.lease_s)

    async def holder(self) -> str:
        """The instance id holding the lease ("" when none does, or without JetStream)."""
        kv = await self._bucket()
        if kv is None:
            return ""
        try:
            entry = await kv.get(KEY)
        except nats.js.errors.KeyNotFoundError:
            return ""
        return (entry.value or b"").decode()

    async def _bucket(self) -> KeyValue | None:
        if self._kv is None and not self._without_jetstream:
            js = self.nc.jetstream()
            try:
                self._kv = await js.create_key_value(bucket=self.bucket, ttl=self.lease_s, history=1)
            except nats.js.errors.ServiceUnavailableError:
                self._without_jetstream = True
                log.warning("JetStream is not enabled on this NATS server: no %s lease, this replica leads "
                            "(run one replica, or enable JetStream)", self.name)
                return None
            except nats.js.errors.BadRequestError:
                # The bucket exists with another TTL (replicas configured with another lease): use it as is.
                self._kv = await js.key_value(self.bucket)
        return self._kv
