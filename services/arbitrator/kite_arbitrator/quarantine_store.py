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

from nats.aio.client import Client as NATS

from kite_shared.kv_bucket import Bucket
from kite_shared.messages import Decision, MessageError

log = logging.getLogger(__name__)

BUCKET = "kite_quarantine"


class QuarantineStore:
    def __init__(self, nc: NATS) -> None:
        self._bucket = Bucket(nc, BUCKET, "quarantines are not kept across arbitrator restarts")

    async def save(self, decision: Decision) -> None:
        await self._bucket.put(decision.target, decision.encode())

    async def remove(self, model_fingerprint: str) -> None:
        await self._bucket.delete(model_fingerprint)

    async def load(self) -> list[Decision]:
        decisions = []
        for key, value in await self._bucket.entries():
            try:
                decisions.append(Decision.decode(value))
            except MessageError as exc:
                log.error("quarantine entry %s unreadable (%s): kept as is, not applied", key, exc)
        return decisions
