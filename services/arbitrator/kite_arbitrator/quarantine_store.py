"""The quarantines in force, kept in a JetStream key-value bucket so that they outlive every arbitrator.

    bucket  kite_quarantine (created on first use; no TTL: only an operator's clear ends a quarantine)
    key     the namespace's model fingerprint (hex); value: its quarantine Decision, encoded

The leader writes on every quarantine and deletes on every clear; a replica that becomes leader loads the
bucket before it publishes, so a quarantine survives a restart of every arbitrator. Without JetStream
nothing is kept (said once): a restarted arbitrator then forgets, while pools and workers keep what they
were told until they restart.
"""

from __future__ import annotations

import logging

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from kite_shared.messages import Decision, MessageError

log = logging.getLogger(__name__)

BUCKET = "kite_quarantine"


class QuarantineStore:
    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self._kv: KeyValue | None = None
        self._without_jetstream = False

    async def save(self, decision: Decision) -> None:
        kv = await self._bucket()
        if kv is not None:
            await kv.put(decision.target, decision.encode())

    async def remove(self, model_fingerprint: str) -> None:
        kv = await self._bucket()
        if kv is not None:
            await kv.delete(model_fingerprint)

    async def load(self) -> list[Decision]:
        kv = await self._bucket()
        if kv is None:
            return []
        try:
            keys = await kv.keys()
        except nats.js.errors.NoKeysError:
            return []
        decisions = []
        for key in keys:
            try:
                entry = await kv.get(key)
                decisions.append(Decision.decode(entry.value or b""))
            except nats.js.errors.KeyNotFoundError:
                continue  # cleared meanwhile
            except MessageError as exc:
                log.error("quarantine entry %s unreadable (%s): kept as is, not applied", key, exc)
        return decisions

    async def _bucket(self) -> KeyValue | None:
        if self._kv is None and not self._without_jetstream:
            try:
                self._kv = await self.nc.jetstream().create_key_value(bucket=BUCKET, history=1)
            except nats.js.errors.ServiceUnavailableError:
                self._without_jetstream = True
                log.warning("JetStream is not enabled on this NATS server: quarantines are not kept across "
                            "arbitrator restarts")
            except nats.errors.Error as exc:
                log.warning("quarantine bucket unavailable (%r): not kept this time", exc)
        return self._kv
