"""The KV connector's I/O: ru-pool lookups and fetches into staging, and saved blocks out to the pool.

Boundary: lives in vLLM's engine-core process, beside the scheduler-side connector, on a thread of its
own with its own asyncio loop and NATS connection (as LMCache's connector owns its I/O). The connector
calls it from the scheduler thread through two methods only:
- `fetch(hashes, tenant, model_fingerprint)`: starts staging the leading blocks the pool has (and the
  cost model says are cheaper to load than to compute), verified, into slots of the staging arena;
  returns a `PendingFetch` at once, which the scheduler polls step by step (vLLM schedules the request
  once it answers; `staged_slot` then says where each block is);
- `publish(infos)`: blocks the model runner is saving to staging files this step; the agent waits for
  each file to appear, then hands the block to the pool (encoded as a recyclable unit with its HMAC).
  Never waits on the caller's thread.
and, from the connector's KV event listener, `announce(changes)`: what vLLM's own cache now holds.

Staged loads live in the staging arena (staging_arena.py: one shared-memory file of `staging_bytes`,
mapped by vLLM's model-runner process, which copies slots into its paged KV tensors); saved blocks come
back as files in the same memory-backed folder. Block bytes cross processes without pickling. Staged
blocks are kept in LRU order (requests behind each other with the same prefix share one fetch); a block
a pending load still needs is pinned until its request ends, and a fetch stages no more blocks than
there are unpinned slots.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kite_shared import kv_codec
from kite_shared.config import CommonConfig, TierConfig, WorkerConfig, load
from kite_shared.endpoints import run_every
from kite_shared.fingerprint import BlockHash
from kite_shared.recyclable_unit import RecyclableUnit
from kite_shared.security import ru_key, tenant_tag
from kite_shared.service import connect_nats, nats_auth_options
from kite_shared.tier_codecs import TierCodecs
from kite_shared.tiers.client import TierClient
from kite_shared.tiers.unit_writer import UnitWriter, unit_writer
from kite_shared.tiers.pool_client import DEFAULT_KEEP_MAPPED_BYTES, PoolClient
from kite_worker import codec_tensors
from kite_worker.engines.vllm.kv_plan import SavedBlockInfo
from kite_worker.pool_loader import CostModel, PoolLoader
from kite_worker.engines.vllm.staging_arena import ARENA_FILE, StagingArena

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentOptions:
    worker_id: str  # the KITE worker instance: the pool's index attributes stored blocks to it
    model_fingerprint: str  # hex root of the model-state + execution-path fingerprint
    block_size: int  # tokens per block
    unit_shape: tuple[int, ...]  # [layers, *vLLM's per-layer block shape]
    storage_dtype: torch.dtype  # dtype of units in the pool (KITE_KV_STORAGE_DTYPE)
    staging_dir: Path  # memory-backed folder shared with the model-runner process
    pool_read: bool
    pool_write: bool
    staging_bytes: int  # the staging arena's size: slots for staged loads (KITE_VLLM_STAGING_MIB)
    pool_write_path: str = "direct"  # KITE_WORKER_POOL_WRITE_PATH (kite_shared.tiers.unit_writer)
    # How much of the pool's hot files stays mapped between fetches (KITE_WORKER_KEEP_MAPPED_MIB).
    keep_mapped_bytes: int = DEFAULT_KEEP_MAPPED_BYTES
    # The codec of each tier: units are saved in the hot tier's (KITE_KV_CODEC) and name the others';
    # lossy units load only in a codec one of them has.
    tier_codecs: TierCodecs = TierCodecs()
    fetch_timeout_s: float = 5.0  # hard cap on top of the cost model's deadline
    save_wait_s: float = 10.0  # how long a planned save may take to appear before it is given up


@dataclass(frozen=True)
class ConnectorOptions:
    """kv_connector_extra_config, written by the worker's front end."""

    model_fingerprint: str  # hex root hash
    worker_id: str
    staging_dir: Path
    storage_dtype: torch.dtype
    pool_read: bool
    pool_write: bool
    staging_bytes: int  # the staging arena's size
    pool_write_path: str = "direct"  # KITE_WORKER_POOL_WRITE_PATH
    keep_mapped_bytes: int = DEFAULT_KEEP_MAPPED_BYTES  # the pool's hot files kept mapped between fetches
    tier_codecs: TierCodecs = TierCodecs()  # in the extra config as its fingerprint form ("kv_codec")

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> "ConnectorOptions":
        return cls(model_fingerprint=extra["model_fingerprint"], worker_id=extra["worker_id"],
                   staging_dir=Path(extra["staging_dir"]), storage_dtype=getattr(torch, extra["storage_dtype"]),
                   pool_read=bool(extra["pool_read"]), pool_write=bool(extra["pool_write"]),
                   staging_bytes=int(extra["staging_bytes"]), pool_write_path=str(extra["pool_write_path"]),
                   keep_mapped_bytes=int(extra["keep_mapped_bytes"]),
                   tier_codecs=TierCodecs.from_fingerprint(str(extra.get("kv_codec", ""))))

    @staticmethod
    def extra_config(model_fingerprint: str, worker_id: str, staging_dir: Path, storage_dtype: str,
                     pool_read: bool, pool_write: bool, staging_bytes: int, pool_write_path: str = "direct",
                     keep_mapped_bytes: int = DEFAULT_KEEP_MAPPED_BYTES,
                     tier_codecs: TierCodecs = TierCodecs()) -> dict[str, Any]:
        return {"model_fingerprint": model_fingerprint, "worker_id": worker_id, "staging_dir": str(staging_dir),
                "storage_dtype": storage_dtype, "pool_read": pool_read, "pool_write": pool_write,
                "staging_bytes": staging_bytes, "pool_write_path": pool_write_path,
                "keep_mapped_bytes": keep_mapped_bytes,
                "kv_codec": tier_codecs.fingerprint}


def kv_events_endpoint(worker_id: str) -> str:
    """Where vLLM publishes its KV cache events for the connector (ZMQ inproc: both in engine core)."""
    return f"inproc://kite-kv-events-{worker_id}"


def save_path(staging_dir: Path, block_hash: bytes) -> Path:
    return staging_dir / f"out-{bytes(block_hash).hex()}.kv"


class KVAgent:
    def __init__(self, options: AgentOptions) -> None:
        self.options = options
        self._ru_key = ru_key()  # once: ru_key() reads the configuration
        self.block_bytes = _numel(options.unit_shape) * torch.empty(0, dtype=options.storage_dtype).element_size()
        # What a unit weighs in each tier (a lossy codec's payload is smaller than the staged block).
        self.cost = CostModel.for_units(options.block_size, tuple(options.unit_shape), options.storage_dtype,
                                        options.tier_codecs)
        options.staging_dir.mkdir(parents=True, exist_ok=True)
        self.arena = StagingArena.create(options.staging_dir / ARENA_FILE, self.block_bytes,
                                         max(1, options.staging_bytes // self.block_bytes))
        self._staged: OrderedDict[bytes, _Staged] = OrderedDict()  # hash -> where, and its pins (LRU order)
        self._free_slots = list(range(self.arena.num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._staged_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kite-kv-agent", daemon=True)
        self.pool: PoolClient | None = None
        self.writer: UnitWriter | None = None  # where saved blocks go (KITE_WORKER_POOL_WRITE_PATH)
        self.loader: PoolLoader | None = None
        self.num_blocks_fetched = 0
        self.num_blocks_published = 0

    # --- lifecycle --------------------------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            log.warning("KV agent not connected to NATS after %.0f s; reuse from the pool starts when it is",
                        timeout_s)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._connect())
        self._loop.run_forever()

    async def _connect(self) -> None:
        common = load(CommonConfig)
        nc = await connect_nats(common.nats_url, f"{self.options.worker_id}-kv", common)
        # The engine core inherits the worker's environment: its settings are read as CommonConfig's are.
        self.pool = PoolClient(nc, worker_id=self.options.worker_id,
                               stream_ssl=nats_auth_options(common).get("tls"),  # verified like NATS
                               keep_mapped_bytes=self.options.keep_mapped_bytes,
                               lookup_timeout_s=load(WorkerConfig).pool_lookup_timeout_s)
        tier_client = None
        if self.options.pool_read or (self.options.pool_write and self.options.pool_write_path == "direct"):
            tier_client = TierClient.from_config(load(TierConfig), with_cold=self.options.pool_read)
            await tier_client.start()
        self.writer = unit_writer(self.options.pool_write_path, self.pool,
                                  tier_client.warm if tier_client is not None else None, self._ru_key)
        if not self.options.pool_read:
            tier_client = None  # opened for the writer only: the loader asks the pool
        self.loader = PoolLoader(self.pool, tier_client, self.cost, self.options.model_fingerprint,
                                 self.options.unit_shape, self.options.storage_dtype, mac_key=self._ru_key,
                                 staging_bytes=0,  # staging is the files below, not the loader's memory
                                 tier_codecs=self.options.tier_codecs)
        self._announcements: asyncio.Queue[list[tuple[str, str, list[BlockHash]]]] = asyncio.Queue()
        self._announced_models: set[str] = set()  # model fingerprints (hex) with blocks announced stored
        # No service runtime in vLLM's process: the same periodic work that survives failures, ended with the loop.
        self._announcer = asyncio.create_task(run_every(0, self._send_next_announcement,
                                                        "announcing cache changes to the ru-pool"))
        self._ready.set()
        log.info("KV agent connected to NATS %s (pool reads %s, writes %s)", _masked(common.nats_url),
                 "on" if self.options.pool_read else "off", "on" if self.options.pool_write else "off")

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
        with self._staged_lock:
            self._staged.clear()
        self.arena.close()

    # --- loads (scheduler thread) --------------------------------------------------------------------------

    def fetch(self, hashes: list[BlockHash], tenant: str, model_fingerprint: str) -> "PendingFetch":
        """Stage the leading blocks of `hashes` (of the model `model_fingerprint`, hex: the base or an
        adapter) that the pool has; returns at once. The blocks staged when `PendingFetch.result()` answers
        are pinned: `unpin` them when the request ends."""
        num_staged = self._pin_staged_prefix(hashes)
        if num_staged == len(hashes) or not self._ready.is_set() or not self.options.pool_read:
            return PendingFetch(num_staged, None, self.options.fetch_timeout_s)
        ticket = _FetchTicket()
        future: Future = asyncio.run_coroutine_threadsafe(
            self._fetch(hashes[num_staged:], tenant, model_fingerprint, ticket), self._loop)
        return PendingFetch(num_staged, future, self.options.fetch_timeout_s, abandon=lambda: self._abandon(ticket))

    def _pin_staged_prefix(self, hashes: list[BlockHash]) -> int:
        with self._staged_lock:
            count = 0
            for block_hash in hashes:
                key = bytes(block_hash)
                staged = self._staged.get(key)
                if staged is None:
                    break
                if not self.arena.holds(staged.slot, key):  # cleared at a quarantine: fetch it again
                    if staged.pins == 0:
                        self._release(key)
                    break
                staged.pins += 1
                self._staged.move_to_end(key)
                count += 1
            return count

    def staged_slot(self, block_hash: BlockHash) -> int:
        """The arena slot of a block a `PendingFetch` reported staged (pinned, so it stays there)."""
        with self._staged_lock:
            return self._staged[bytes(block_hash)].slot

    async def _fetch(self, hashes: list[BlockHash], tenant: str, model_fingerprint: str,
                     ticket: "_FetchTicket") -> int:
        loaded = await self.loader.load(hashes, 0, tenant, model_fingerprint)
        num_staged = 0
        for block_hash, tensor in loaded:
            key = bytes(block_hash)
            with self._staged_lock:
                if ticket.abandoned:  # the scheduler gave up on this fetch: nobody would unpin more
                    break
                staged = self._staged.get(key)
                if staged is not None and self.arena.holds(staged.slot, key):  # staged by a fetch beside this one
                    staged.pins += 1
                    self._staged.move_to_end(key)
                    ticket.pinned.append(key)
                    num_staged += 1
                    continue
                slot = self._take_slot(key)
            if slot is None:  # every slot pinned by loads under way: the rest is computed
                break
            # The slot is this fetch's alone until it is recorded below: one copy, without the lock the
            # scheduler thread takes (the loader's tensors are host memory: host_bytes is a view of them).
            self.arena.write(slot, key, codec_tensors.host_bytes(tensor))
            with self._staged_lock:
                if ticket.abandoned:
                    self._staged[key] = _Staged(slot, pins=0)  # kept for a later request, not pinned
                    break
                self._staged[key] = _Staged(slot, pins=1)
                ticket.pinned.append(key)
            num_staged += 1
        self.num_blocks_fetched += num_staged
        return num_staged

    def _abandon(self, ticket: "_FetchTicket") -> None:
        """A fetch was cancelled (its deadline passed): it may still finish staging, but its result is never
        read, so the pins it took are dropped now and it takes no more."""
        with self._staged_lock:
            ticket.abandoned = True
            self._unpin_locked(ticket.pinned)
            ticket.pinned.clear()

    def _take_slot(self, key: bytes) -> int | None:
        """A slot for `key` (under the lock): a free one, else the least recently used unpinned one."""
        cleared = self._staged.get(key)
        if cleared is not None:  # its slot was cleared at a quarantine
            if cleared.pins:  # a load under way still has it (and finds it cleared: computes it)
                return None
            self._release(key)
        if not self._free_slots:
            victim = next((k for k, staged in self._staged.items() if staged.pins == 0), None)
            if victim is None:
                return None
            self._release(victim)
        return self._free_slots.pop()

    def _release(self, key: bytes) -> None:
        staged = self._staged.pop(key)
        self.arena.clear(staged.slot)
        self._free_slots.append(staged.slot)

    def unpin(self, hashes: list[BlockHash]) -> None:
        with self._staged_lock:
            self._unpin_locked([bytes(h) for h in hashes])

    def _unpin_locked(self, keys: list[bytes]) -> None:
        for key in keys:
            staged = self._staged.get(key)
            if staged is not None and staged.pins > 0:
                staged.pins -= 1

    def observe_prefill(self, seconds: float, num_tokens: int) -> None:
        """A step that computed `num_tokens` prompt tokens took `seconds`: the recompute side of the
        cost model (exponentially weighted)."""
        if num_tokens >= self.options.block_size and seconds > 0:
            per_token = seconds / num_tokens
            self.cost.prefill_seconds_per_token += 0.2 * (per_token - self.cost.prefill_seconds_per_token)

    # --- saves (scheduler thread) ---------------------------------------------------------------------------

    def publish(self, infos: list[SavedBlockInfo]) -> None:
        """Encode and put these blocks once the model runner has written their files; returns at once."""
        if not infos:
            return
        if not self._ready.is_set() or not self.options.pool_write:
            self._loop.call_soon_threadsafe(self._discard_when_written, infos)
            return
        asyncio.run_coroutine_threadsafe(self._publish(infos), self._loop).add_done_callback(_log_failure)

    def _discard_when_written(self, infos: list[SavedBlockInfo]) -> None:
        async def discard() -> None:
            for info in infos:
                path = save_path(self.options.staging_dir, info.block_hash)
                await self._wait_for_file(path)
                path.unlink(missing_ok=True)
        self._loop.create_task(discard())

    async def _wait_for_file(self, path: Path) -> bool:
        """The model runner renames a save file into place once complete; poll for it with backoff."""
        delay, waited = 0.001, 0.0
        while not path.exists():
            if waited > self.options.save_wait_s:
                log.warning("saved block %s never appeared; not stored", path.name)
                return False
            await asyncio.sleep(delay)
            waited += delay
            delay = min(delay * 2, 0.05)
        return True

    async def _publish(self, infos: list[SavedBlockInfo]) -> None:
        stored = []
        for info in infos:
            path = save_path(self.options.staging_dir, info.block_hash)
            if not await self._wait_for_file(path):
                continue
            try:
                data = await asyncio.to_thread(self._encode, info, path)
            except OSError as exc:
                log.warning("saved block %s unreadable: %r", bytes(info.block_hash).hex()[:16], exc)
                continue
            finally:
                path.unlink(missing_ok=True)
            if await self.writer.put(data):
                stored.append(bytes(info.block_hash))
        await self.writer.flush()  # one notice for the batch (a direct writer's)
        self.num_blocks_published += len(stored)
        log.debug("%d of %d saved blocks handed to the ru-pool", len(stored), len(infos))

    @property
    def unit_codec(self) -> str:
        """What saved units are stored in: KITE_KV_CODEC, or the storage dtype's lossless codec."""
        return kv_codec.unit_codec(self.options.storage_dtype, self.options.tier_codecs.hot)

    def _encode(self, info: SavedBlockInfo, path: Path) -> bytes:
        payload = path.read_bytes()
        if len(payload) != self.block_bytes:
            raise OSError(f"{path.name}: {len(payload)} bytes, expected {self.block_bytes}")
        tier_codecs = self.options.tier_codecs
        if tier_codecs.hot:
            block = torch.frombuffer(bytearray(payload), dtype=self.options.storage_dtype).view(self.options.unit_shape)
            payload = codec_tensors.encode(block, tier_codecs.hot)
        return RecyclableUnit(
            block_hash=bytes(info.block_hash), parent_hash=bytes(info.parent_hash),
            model_fingerprint=info.model_fingerprint, block_index=info.block_index,
            num_tokens=self.options.block_size, codec=self.unit_codec, shape=tuple(self.options.unit_shape),
            payload=payload, tenant_tag=tenant_tag(info.tenant), warm_codec=tier_codecs.warm,
            cold_codec=tier_codecs.cold,
        ).encode(key=self._ru_key)

    # --- what this worker holds (listener thread) ------------------------------------------------------------

    def announce(self, changes: list[tuple[str, str, list[BlockHash]]]) -> None:
        """vLLM's cache changed: ("stored" | "removed", model fingerprint, hashes) or ("cleared", "", []),
        in order. Tells the ru-pool's index, which attributes blocks to this worker for cache-aware
        routing, in the order of the calls (one queue, one sender); returns at once."""
        if changes and self._ready.is_set():
            self._loop.call_soon_threadsafe(self._announcements.put_nowait, changes)

    async def _send_next_announcement(self) -> None:
        for kind, fingerprint, hashes in await self._announcements.get():
            if kind == "stored":
                self._announced_models.add(fingerprint)
                await self.pool.block_stored(fingerprint, [bytes(h) for h in hashes])
            elif kind == "removed":
                await self.pool.block_removed(fingerprint, [bytes(h) for h in hashes])
            else:  # vLLM dropped its whole cache: every namespace this worker announced blocks of
                for model in sorted(self._announced_models | {self.options.model_fingerprint}):
                    await self.pool.block_removed(model, [], all_blocks=True)


@dataclass
class _FetchTicket:
    """What one fetch pinned, so that a cancelled fetch leaves no pin behind (guarded by the staging lock)."""

    abandoned: bool = False
    pinned: list[bytes] = field(default_factory=list)


@dataclass
class _Staged:
    slot: int  # in the staging arena
    pins: int  # loads under way or scheduled that need it


class PendingFetch:
    """A fetch into staging under way. The scheduler thread polls it (`result()`: None while it runs) and
    never waits for it; one that outlives `timeout_s` is cancelled and counts what was staged before it."""

    def __init__(self, num_staged: int, future: Future | None, timeout_s: float, abandon=None) -> None:
        self._num_staged = num_staged  # leading blocks staged (and pinned) before the fetch started
        self._future = future
        self._abandon = abandon  # called when the fetch is cancelled: it drops the fetch's pins
        self._deadline = time.monotonic() + timeout_s

    def result(self) -> int | None:
        """Leading blocks now staged and pinned, or None while the fetch runs."""
        future = self._future
        if future is None:
            return self._num_staged
        if not future.done():
            if time.monotonic() < self._deadline:
                return None
            future.cancel()  # too slow: those blocks are computed
            if self._abandon is not None:
                self._abandon()
            log.warning("pool fetch took longer than its deadline; computing the blocks")
        self._future = None
        if not future.cancelled():
            if future.exception() is not None:  # a tier error: those blocks are computed
                log.warning("pool fetch failed (%r); computing the blocks", future.exception())
            else:
                self._num_staged += future.result()
        return self._num_staged

    def on_done(self, callback) -> None:
        """Call `callback(num_staged)` once the fetch has ended (at once if it has)."""
        future = self._future
        if future is None:
            callback(self._num_staged)
        else:
            future.add_done_callback(lambda _: callback(self.result()))


def _masked(url: str) -> str:
    return url.split("@")[-1] if "@" in url else url


def _log_failure(future: Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("KV agent task failed", exc_info=future.exception())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def write_atomically(path: Path, data) -> None:
    """Readers never see a partial file: write beside it, then rename. `data`: any contiguous buffer."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
