"""One JetStream key-value bucket, for state that must outlive the processes that write it (quarantines,
adapters loaded at run time). Created on first use, one value per key (history 1), no TTL.

Without JetStream on the server nothing is kept: `put` and `delete` do nothing and `entries` is empty, and
the first use says so once, in `without_jetstream`'s words. Other NATS errors are logged and that one call
does nothing, so a caller never fails for want of the bucket.
"""

from __future__ import annotations

import logging

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

log = logging.getLogger(__name__)


class Bucket:
    def __init__(self, nc: NATS, name: str, without_jetstream: str) -> None:
        """`without_jetstream`: what is lost when the server has no JetStream (for the log line)."""
        self.nc = nc
        self.name = name
        self._without_jetstream_says = without_jetstream
        self._kv: KeyValue | None = None
        self._without_jetstream = False

    async def put(self, key: str, value: bytes) -> None:
        kv = await self._bucket()
        if kv is not None:
            await kv.put(key, value)

    async def delete(self, key: str) -> None:
        kv = await self._bucket()
        if kv is not None:
            try:
                await kv.delete(key)
            except nats.js.errors.KeyNotFoundError:
                pass  # never written, or deleted already

    async def entries(self) -> list[tuple[str, bytes]]:
        """Every (key, value) now; an entry deleted while they are read is left out."""
        kv = await self._bucket()
        if kv is None:
            return []
        try:
            keys = await kv.keys()
        except nats.js.errors.NoKeysError:
            return []
        found = []
        for key in keys:
            try:
                found.append((key, (await kv.get(key)).value or b""))
            except nats.js.errors.KeyNotFoundError:
                continue
        return found

    async def _bucket(self) -> KeyValue | None:
        if self._kv is None and not self._without_jetstream:
            try:
                self._kv = await self.nc.jetstream().create_key_value(bucket=self.name, history=1)
            except nats.js.errors.ServiceUnavailableError:
                self._without_jetstream = True
                log.warning("JetStream is not enabled on this NATS server: %s", self._without_jetstream_says)
            except nats.errors.Error as exc:
                log.warning("bucket %s unavailable (%r): not used this time", self.name, exc)
        return self._kv
