"""The reference engine as the worker service drives it (kite_worker.engines.base.Engine): its model and
generation loop (model.py, scheduler.py) wired to the ru-pool.

Pool reads happen on the worker's event loop, between admission and the engine thread: after `reserve`
(the gateway already has its answer), the PoolLoader (kite_worker.pool_loader) looks up the blocks
missing from the local cache and fetches those its cost model says beat recomputing; they ride on the
Sequence into the engine thread, which inserts them into the local cache. Pool writes: the engine thread
hands new blocks and cache events to the outbox (pool_outbox.py), which filters blocks through the write
policy and sends both from two rounds of the event loop (`rounds`).

Adapters load and unload on the engine thread, between two steps (Scheduler.call_on_engine_thread): the
model's adapters are the engine's one record of what it serves.

Boundary: the contract's side only; the model and the loop know nothing of NATS.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Mapping

import torch
from prometheus_client import Counter, Histogram

from kite_shared.adapters import Adapter, AdapterRefused
from kite_shared.config import ModelConfig, TierConfig, WorkerConfig, load
from kite_shared.messages import TokenizedRequest
from kite_shared.model_store import LocalModel, ModelIdentity, load_causal_lm, load_tokenizer
from kite_shared.security import ru_key
from kite_shared.tiers.client import TierClient
from kite_shared.tiers.unit_writer import unit_writer
from kite_shared.tiers.pool_client import PoolClient
from kite_worker.engines.base import EngineHooks, EngineLoad, Round
from kite_worker.engines.reference.block_cache import BlockCache
from kite_worker.engines.reference.model import ReferenceModel, ReferenceOptions, Sequence
from kite_worker.engines.reference.pool_outbox import PoolOutbox
from kite_worker.engines.reference.scheduler import Scheduler
from kite_worker.pool_loader import CostModel, PoolLoader
from kite_worker.shadow import ShadowVerifier
from kite_worker.write_policy import WritePolicyFilter

log = logging.getLogger(__name__)

POOL_BLOCKS_LOADED = Counter("kite_worker_pool_blocks_loaded_total", "Prefix blocks loaded from the ru-pool")
POOL_LOAD_SECONDS = Histogram("kite_worker_pool_load_seconds", "Lookup + fetch time of pool blocks per request",
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))


class ReferenceEngine:
    def __init__(self, model: ReferenceModel, max_running: int, max_queued: int, pool_read: bool,
                 pool_write: bool, shadow: ShadowVerifier | None = None, shadow_chunk_tokens: int = 32,
                 shadow_idle_s: float = 0.2, pool_write_path: str = "direct") -> None:
        self.model = model
        self.scheduler = Scheduler(model, max_running, max_queued, shadow=shadow,
                                   shadow_chunk_tokens=shadow_chunk_tokens, shadow_idle_s=shadow_idle_s)
        self.shadow = shadow
        self.ttft_samples = self.scheduler.ttft_samples
        self.pool_read_enabled = pool_read  # KITE_WORKER_POOL_READ
        self.pool_write_enabled = pool_write  # KITE_WORKER_POOL_WRITE
        self.pool_write_path = pool_write_path  # KITE_WORKER_POOL_WRITE_PATH
        self.outbox: PoolOutbox | None = None  # from `start`
        self.loader: PoolLoader | None = None  # from `start`, when this worker reads the pool
        self.tier_client: TierClient | None = None
        self._writes: WritePolicyFilter | None = None
        self._tasks: set[asyncio.Task] = set()  # pool loads, held until done

    @classmethod
    def create(cls, local: LocalModel, identity: ModelIdentity, adapters: dict[str, Adapter],
               model_cfg: ModelConfig, worker_cfg: WorkerConfig, instance_id: str,
               shadow: ShadowVerifier | None) -> ReferenceEngine:
        model = ReferenceModel(
            model=load_causal_lm(local, model_cfg),
            tokenizer=load_tokenizer(local),
            identity=identity,
            block_cache=BlockCache(worker_cfg.cache_bytes),
            options=ReferenceOptions(reuse=worker_cfg.reuse, block_size=model_cfg.block_size,
                                     storage_dtype=getattr(torch, model_cfg.kv_storage_dtype),
                                     prefill_chunk_tokens=worker_cfg.prefill_chunk_tokens,
                                     cache_generated=worker_cfg.cache_generated),
            max_context_tokens=local.max_context_tokens,
            adapters=adapters,
        )
        return cls(model, worker_cfg.max_running, worker_cfg.max_queued, worker_cfg.pool_read, worker_cfg.pool_write,
                   shadow, worker_cfg.shadow_chunk_tokens, worker_cfg.shadow_idle_s, worker_cfg.pool_write_path)

    # --- lifecycle ---------------------------------------------------------------------------------------

    async def start(self, hooks: EngineHooks) -> None:
        """Start the pool loader (reading the pool) and the outbox, then the engine thread; the configured
        adapters were attached when the model was built."""
        self._writes = hooks.writes
        reads = self.pool_read_enabled and self.model.options.reuse
        writes_warm = self.pool_write_enabled and self.pool_write_path == "direct"
        if reads or writes_warm:
            self.tier_client = TierClient.from_config(load(TierConfig), with_cold=reads)
            await self.tier_client.start()
        writer = unit_writer(self.pool_write_path, hooks.pool,
                             self.tier_client.warm if self.tier_client is not None else None, ru_key())
        self.outbox = PoolOutbox(writer, hooks.pool, hooks.writes, self.pool_write_enabled,
                                 asyncio.get_running_loop(), tier_codecs=self.model.identity.execution.tier_codecs)
        if reads:
            self.loader = self._make_loader(hooks.pool)
        self.scheduler.start(hooks.emit, on_new_blocks=self.outbox.add_blocks,
                             on_cache_events=self.outbox.add_cache_events, on_shadow=hooks.on_shadow)

    def _make_loader(self, pool: PoolClient) -> PoolLoader:
        identity = self.model.identity
        layout = identity.model.layout
        shape = (layout.num_layers, 2, layout.num_kv_heads, layout.block_size, layout.head_dim)
        storage_dtype = self.model.options.storage_dtype
        tier_codecs = identity.execution.tier_codecs
        return PoolLoader(pool, self.tier_client,
                          CostModel.for_units(layout.block_size, shape, storage_dtype, tier_codecs),
                          identity.fingerprint_hex, shape, storage_dtype, mac_key=ru_key(), tier_codecs=tier_codecs)

    def rounds(self) -> tuple[tuple[Round, str], ...]:
        return ((self.outbox.put_next_block, "handing new blocks to the ru-pool"),
                (self.outbox.publish_next_cache_events, "publishing cache events to the ru-pool"))

    @property
    def alive(self) -> bool:
        return self.scheduler.alive

    def idle(self) -> bool:
        return self.scheduler.idle()

    async def close(self, bus_connected: bool) -> None:
        """Ends the engine thread (5 s at most), hands the outbox's blocks and the pending tier-hit reports
        to the pool and closes the tier connections; without a bus the puts fail at once, so the end is
        the same."""
        self.scheduler.stop()
        await asyncio.to_thread(self.scheduler.join, 5.0)
        if self.outbox is not None:
            await self.outbox.flush()
        if self.loader is not None:
            await self.loader.flush_hits()  # the last direct hits, for the pool to promote
        if self.tier_client is not None:
            await self.tier_client.close()

    # --- requests ----------------------------------------------------------------------------------------

    def reserve(self, request: TokenizedRequest) -> Sequence:
        return self.scheduler.reserve(request)

    def submit(self, seq: Sequence) -> None:
        # This prompt may be the second sighting of blocks the selective write policy held back: they go now.
        self.outbox.add_blocks(self._writes.seen([bytes(h) for h in seq.request.block_hashes]), filtered=True)
        if self.loader is None or not seq.reuse:
            self.scheduler.enqueue(seq)
            return
        # Endpoints handle one message at a time: load in a task so admissions never wait.
        task = asyncio.create_task(self._load_then_enqueue(seq))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _load_then_enqueue(self, seq: Sequence) -> None:
        """Attach pool blocks to the request when they beat recomputing; any failure just means compute."""
        started = time.perf_counter()
        try:
            self.loader.cost.prefill_seconds_per_token = self.model.prefill_seconds_per_token
            num_local = self.model.block_cache.longest_prefix(seq.prompt_hashes)
            seq.prefetched = await self.loader.load(seq.prompt_hashes, num_local, seq.request.tenant,
                                                    seq.identity.fingerprint_hex)
            POOL_BLOCKS_LOADED.inc(len(seq.prefetched))
            self.model.expect_reuse(seq, num_local + len(seq.prefetched))
        except Exception:
            log.exception("loading pool blocks for %s failed; computing them", seq.request_id)
            seq.prefetched = []
        finally:
            POOL_LOAD_SECONDS.observe(time.perf_counter() - started)
            self.scheduler.enqueue(seq)

    def cancel(self, request_id: str) -> None:
        self.scheduler.cancel(request_id)

    def cancel_all(self) -> None:
        self.scheduler.cancel_all()

    # --- load --------------------------------------------------------------------------------------------

    @property
    def num_queued(self) -> int:
        return self.scheduler.num_queued

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def max_running(self) -> int:
        return self.scheduler.max_running

    def load(self) -> EngineLoad:
        running_tokens, backlog = self.scheduler.load_snapshot()
        model = self.model
        return EngineLoad(
            running_tokens=running_tokens, prefill_backlog_tokens=backlog,
            cache_bytes=model.block_cache.num_bytes, cache_capacity_bytes=model.block_cache.capacity_bytes,
            prompt_tokens_reused=model.num_prompt_tokens_reused,
            prompt_tokens_computed=model.num_prompt_tokens_computed,
            prefill_seconds_per_token=model.prefill_seconds_per_token,
            decode_seconds_per_token=model.decode_seconds_per_token)

    @property
    def pool_read(self) -> bool:
        return self.loader is not None

    # --- adapters ----------------------------------------------------------------------------------------

    @property
    def adapters(self) -> Mapping[str, Adapter]:
        return self.model.adapters

    async def load_adapter(self, adapter: Adapter) -> None:
        def load_on_engine_thread() -> None:
            if self.scheduler.uses_adapter(adapter.name):  # the weights of an earlier adapter of this name
                raise AdapterRefused(adapter.name, "name", "requests of the adapter unloaded under this name are "
                                                           "still running: retry in a moment")
            self.model.add_adapter(adapter)

        await asyncio.wrap_future(self.scheduler.call_on_engine_thread(load_on_engine_thread))

    async def unload_adapter(self, name: str) -> None:
        await asyncio.wrap_future(self.scheduler.call_on_engine_thread(lambda: self.model.remove_adapter(name)))

    # --- shadow verification and quarantine ----------------------------------------------------------------

    @property
    def num_shadow_checks_waiting(self) -> int:
        return self.scheduler.num_shadow_checks_waiting

    def quarantine(self, model_fingerprint: str, quarantined: bool) -> None:
        if quarantined == (model_fingerprint in self.model.quarantined):
            return
        self.scheduler.quarantine(model_fingerprint, quarantined)
        if quarantined and self.loader is not None:  # staged loads are copies of pool blocks too
            self.loader.forget_staged()
