"""What the reference engine tells the ru-pool: new blocks (recyclable units) and cache events.

The engine thread hands over new blocks (`add_blocks`, filtered by the write policy) and changes of its local
cache (`add_cache_events`) without ever waiting; two rounds that the runtime runs until shutdown send them
(`put_next_block`, `publish_next_cache_events`). The block outbox is bounded: when full, blocks are dropped
rather than slowing generation (the local cache still has them). The drain waits for `flush`.

Boundary: the pool client, the unit writer (kite_shared.tiers.unit_writer: puts, or warm written directly)
and the write policy in (each block and event names its model fingerprint:
the base's or an adapter's); no scheduler, no model: the reference engine (engine.py) feeds it and
lists its two rounds in `Engine.rounds`. (vLLM's KV connector saves blocks and reports cache events
itself, inside vLLM's processes.)
"""

from __future__ import annotations

import asyncio
import queue

from prometheus_client import Counter

from kite_shared import kv_codec
from kite_shared.recyclable_unit import RecyclableUnit
from kite_shared.security import ru_key
from kite_shared.tier_codecs import TierCodecs
from kite_shared.tiers.pool_client import PoolClient
from kite_shared.tiers.unit_writer import UnitWriter
from kite_worker import codec_tensors
from kite_worker.engines.reference.block_cache import CacheEvent
from kite_worker.engines.reference.model import NewBlock
from kite_worker.write_policy import WritePolicyFilter

POOL_DROPPED = Counter("kite_worker_pool_blocks_dropped_total",
                       "New blocks not handed to the ru-pool because its outbox was full")

POOL_OUTBOX_BLOCKS = 4096
_POLL_S = 0.25  # a thread waits this long for a block: never longer, so shutdown never waits on one


class PoolOutbox:
    def __init__(self, writer: UnitWriter, pool: PoolClient, writes: WritePolicyFilter, enabled: bool,
                 loop: asyncio.AbstractEventLoop, tier_codecs: TierCodecs = TierCodecs()) -> None:
        self.writer = writer  # KITE_WORKER_POOL_WRITE_PATH: puts, or warm written here with a notice
        self.pool = pool
        self.writes = writes
        self.enabled = enabled  # KITE_WORKER_POOL_WRITE
        self.tier_codecs = tier_codecs  # the codec of each tier (units are written in the hot tier's)
        self._ru_key = ru_key()  # once: ru_key() reads the configuration
        self._loop = loop
        self._blocks: queue.Queue[NewBlock] = queue.Queue(maxsize=POOL_OUTBOX_BLOCKS)
        self._cache_events: asyncio.Queue[list[CacheEvent]] = asyncio.Queue()

    # --- any thread ---------------------------------------------------------------------------------
    def add_blocks(self, blocks: list[NewBlock], filtered: bool = False) -> None:
        """New blocks for the pool, through the write policy unless `filtered` (blocks it released)."""
        if not self.enabled:
            return
        if not filtered:
            blocks = self.writes.filter(blocks)
        for block in blocks:
            try:
                self._blocks.put_nowait(block)
            except queue.Full:
                POOL_DROPPED.inc()

    def add_cache_events(self, events: list[CacheEvent]) -> None:
        self._loop.call_soon_threadsafe(self._cache_events.put_nowait, events)

    # --- rounds the runtime runs until shutdown (rt.every with no pause: each waits by itself) ------------
    async def put_next_block(self) -> None:
        """Encode the next block and put it in the pool (waits at most _POLL_S for one)."""
        try:
            block = await asyncio.to_thread(self._blocks.get, True, _POLL_S)
        except queue.Empty:
            return
        try:
            data = await asyncio.to_thread(self.encode_block, block)
            await self.writer.put(data)
        finally:
            self._blocks.task_done()

    async def publish_next_cache_events(self) -> None:
        """Tell the ru-pool's index what this worker's cache now holds (routing uses it)."""
        events = await self._cache_events.get()
        while not self._cache_events.empty():
            events += self._cache_events.get_nowait()
        for fingerprint in dict.fromkeys(e.model_fingerprint for e in events):
            stored = [bytes(e.block_hash) for e in events if e.kind == "stored" and e.model_fingerprint == fingerprint]
            removed = [bytes(e.block_hash) for e in events
                       if e.kind == "removed" and e.model_fingerprint == fingerprint]
            if removed:
                await self.pool.block_removed(fingerprint, removed)
            if stored:
                await self.pool.block_stored(fingerprint, stored)

    async def flush(self) -> None:
        """Return once every block queued so far has been handed to the pool (or failed to be)."""
        while self._blocks.unfinished_tasks:
            await asyncio.sleep(0.05)
        await self.writer.flush()

    def encode_block(self, block: NewBlock) -> bytes:
        return encode_block(block, self._ru_key, self.tier_codecs)


def encode_block(block: NewBlock, key: bytes, tier_codecs: TierCodecs = TierCodecs()) -> bytes:
    """A block as the recyclable unit the pool stores, signed with the cluster's RU key: its elements as
    they are, or through the hot tier's lossy codec (KITE_KV_CODEC), naming the warm and cold tiers'."""
    kv = block.kv
    codec = kv_codec.unit_codec(kv.dtype, tier_codecs.hot)
    return RecyclableUnit(
        block_hash=bytes(block.block_hash), parent_hash=bytes(block.parent_hash),
        model_fingerprint=block.model_fingerprint, block_index=block.block_index,
        num_tokens=kv.shape[3], codec=codec, shape=tuple(kv.shape), payload=codec_tensors.encode(kv, codec),
        tenant_tag=block.tenant_tag, warm_codec=tier_codecs.warm, cold_codec=tier_codecs.cold,
    ).encode(key=key)
