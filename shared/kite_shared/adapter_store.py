"""The adapters loaded at run time, kept in a JetStream key-value bucket so that a process that starts later
(a restarted worker, a new fingerprinter) serves them too.

    bucket  kite_adapters (created on first use; no TTL: only `kite adapter unload` removes an entry)
    key     the adapter's name, hex-encoded (NATS keys allow few characters); value: {"name", "path"} JSON

`kite adapter load` writes an entry once every process that answered has loaded the adapter, `unload`
deletes it. At start each fingerprinter and worker loads the stored adapters after those KITE_ADAPTERS
names (a name configured there wins), through the same path as a run-time load: the contract is checked
again, and one refused is logged with its field and left out. Without JetStream nothing is kept (said
once): run-time loads then last as long as the processes that made them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable

from nats.aio.client import Client as NATS

from kite_shared.kv_bucket import Bucket
from kite_shared.messages import AdapterAdminReply, AdapterAdminRequest

log = logging.getLogger(__name__)

BUCKET = "kite_adapters"


@dataclass(frozen=True)
class StoredAdapter:
    name: str
    path: str  # the peft folder, as the services see it


class AdapterStore:
    def __init__(self, nc: NATS) -> None:
        self._bucket = Bucket(nc, BUCKET, "adapters loaded at run time are not kept for processes that start later")

    async def save(self, name: str, path: str) -> None:
        await self._bucket.put(name.encode().hex(), json.dumps({"name": name, "path": path}).encode())

    async def remove(self, name: str) -> None:
        await self._bucket.delete(name.encode().hex())

    async def load(self) -> list[StoredAdapter]:
        stored = []
        for key, value in await self._bucket.entries():
            try:
                entry = json.loads(value)
                stored.append(StoredAdapter(name=str(entry["name"]), path=str(entry["path"])))
            except (ValueError, KeyError, TypeError) as exc:
                log.error("stored adapter entry %s unreadable (%r): not loaded", key, exc)
        return sorted(stored, key=lambda a: a.name)


async def load_stored_adapters(nc: NATS, served: dict[str, object],
                               answer: Callable[[AdapterAdminRequest], Awaitable[AdapterAdminReply]]) -> None:
    """At start: load every stored adapter this process does not serve yet through `answer` (its handler of
    `kite adapter load`), so the contract check and the engine's loading are those of a run-time load."""
    for stored in await AdapterStore(nc).load():
        if stored.name in served:
            continue  # KITE_ADAPTERS names it: the configuration wins
        reply = await answer(AdapterAdminRequest(op="load", name=stored.name, path=stored.path))
        if reply.ok:
            log.info("adapter %s loaded from the run-time store (%s)", stored.name, stored.path)
        else:
            log.error("stored adapter %s not loaded: %s", stored.name, reply.error.message if reply.error else "")
