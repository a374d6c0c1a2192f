"""Where a worker's newly computed units go (KITE_WORKER_POOL_WRITE_PATH): the contract `UnitWriter`, its
two paths, and `unit_writer`, which picks one at start (the engines never ask which).

pool     Each unit in a put to the ru-pool (subjects.POOL_PUT): the pool verifies it, stores it in its hot
         tier and writes it through to warm. One NATS message of the unit's size per block (1,474,973 bytes
         for the default vLLM block) through nats-server to the pool, which spends 3.6 ms of CPU on it
         (bench/bench_pool_messages.py, 2026-12-07).
direct   The worker writes the unit into warm itself (the key, TTL and bytes the pool's write-through
         would use) and tells the pool in a notice (messages.UnitsWritten: a hash, a size and a depth per
         block, batched for up to NOTICE_DELAY_S), which the pool indexes as a put's write-through (about
         20 us a block there). The pool's CPU per new block then no longer grows with the block's bytes, and
         the bytes cross one link (worker -> Redis) instead of three (worker -> NATS -> pool -> Redis). New
         blocks reach the pool's hot tier when workers read them (the pool promotes reported warm hits),
         not when written. A unit goes by a put all the same when it names a warm codec other than its
         own (the pool transcodes for lossy warm storage) or when warm does not take it (down, full): the
         pool then keeps it in hot, or cold.

Boundary: the pool client (kite_shared.tiers.pool_client) and the warm tier (kite_shared.tiers.warm) below;
the engines' save paths above (the reference engine's PoolOutbox, vLLM's KV agent), which hand over encoded
units one at a time. Not thread-safe: one event loop calls it.
"""

from __future__ import annotations

import abc
import asyncio
import logging

from kite_shared import recyclable_unit
from kite_shared.messages import UnitsWritten
from kite_shared.tiers.keys import BlockKey
from kite_shared.tiers.pool_client import PoolClient
from kite_shared.tiers.warm import RedisTier

log = logging.getLogger(__name__)

WRITE_PATHS = ("direct", "pool")
NOTICE_DELAY_S = 0.02  # a notice waits this long for more units (a prompt's blocks are saved one by one)
NOTICE_MAX_BLOCKS = 256  # ... or until it names this many


class UnitWriter(abc.ABC):
    """Stores a worker's newly computed units in the pool, by one path."""

    path: str

    @abc.abstractmethod
    async def put(self, unit: bytes) -> bool:
        """Store one encoded unit (at most once; the pool dedupes); False when it went nowhere."""

    async def flush(self) -> None:  # noqa: B027 - only a batching path has anything to send
        """Send what is batched (at a drain)."""


class PoolPut(UnitWriter):
    """Every unit in a put to the ru-pool."""

    path = "pool"

    def __init__(self, pool: PoolClient) -> None:
        self.pool = pool

    async def put(self, unit: bytes) -> bool:
        return await self.pool.put(unit)


class DirectToWarm(UnitWriter):
    """Units written into warm here, with a notice to the pool; a put when warm will not do."""

    path = "direct"

    def __init__(self, pool: PoolClient, warm: RedisTier, ru_key: bytes) -> None:
        self.pool = pool
        self.warm = warm
        self.ru_key = ru_key  # the header's MAC is checked before its fields name a storage key
        self.num_direct = 0  # units written into warm here
        self.num_put = 0  # units that went by a put instead
        # (model fingerprint, tenant tag) -> (hash, bytes, depth) of each unit written, not yet noticed
        self._unnoticed: dict[tuple[str, str], list[tuple[bytes, int, int]]] = {}
        self._num_unnoticed = 0
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task] = set()

    async def put(self, unit: bytes) -> bool:
        try:
            header, _ = recyclable_unit.decode_header(unit, key=self.ru_key)
        except recyclable_unit.RUError as exc:  # an engine's bug: the pool would refuse it too
            log.error("not storing a unit that does not verify: %s: %s", type(exc).__name__, exc)
            return False
        lossy_warm = bool(header.warm_codec) and header.warm_codec != header.codec
        key = BlockKey.of(header.model_fingerprint, header.block_hash, header.tenant_tag)
        if lossy_warm or not self.warm.up or not await self.warm.put(key, unit):
            self.num_put += 1
            return await self.pool.put(unit)
        self.num_direct += 1
        group = (header.model_fingerprint, header.tenant_tag)
        self._unnoticed.setdefault(group, []).append((header.block_hash, len(unit), header.block_index))
        self._num_unnoticed += 1
        if self._num_unnoticed >= NOTICE_MAX_BLOCKS:
            await self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(NOTICE_DELAY_S, self._flush_later)
        return True

    def _flush_later(self) -> None:
        self._timer = None
        task = asyncio.get_running_loop().create_task(self.flush())
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        groups, self._unnoticed, self._num_unnoticed = self._unnoticed, {}, 0
        for (fingerprint, tenant_tag), units in groups.items():
            await self.pool.units_written(UnitsWritten(
                worker_id=self.pool.worker_id, model_fingerprint=fingerprint, tenant_tag=tenant_tag,
                block_hashes=[h for h, _, _ in units], sizes=[n for _, n, _ in units],
                depths=[d for _, _, d in units]))


def unit_writer(path: str, pool: PoolClient, warm: RedisTier | None, ru_key: bytes) -> UnitWriter:
    """The writer of KITE_WORKER_POOL_WRITE_PATH `path`; puts when `path` is "direct" but there is no warm
    tier to write into (KITE_REDIS_URL empty)."""
    if path not in WRITE_PATHS:
        raise ValueError(f"unknown pool write path {path!r}: expected one of {', '.join(WRITE_PATHS)}")
    if path == "direct" and warm is not None:
        return DirectToWarm(pool, warm, ru_key)
    if path == "direct":
        log.info("no warm tier (KITE_REDIS_URL is empty): new blocks go to the ru-pool in puts")
    return PoolPut(pool)
