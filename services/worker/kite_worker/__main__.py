"""Worker entrypoint: load the model, connect, serve generate requests, drain on SIGTERM.

Handlers decode -> call the scheduler -> encode. The model is loaded before the process joins NATS, so a
worker that answers pings can also serve.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from dataclasses import dataclass

import torch
from nats.aio.msg import Msg
from prometheus_client import Counter, Gauge, Histogram, start_http_server

from kite_shared import model_store, subjects
from kite_shared.config import ModelConfig, TierConfig, WorkerConfig, load
from kite_shared.messages import Admission, Cancel, ErrorInfo, Message, MessageError, TokenizedRequest
from kite_shared.recyclable_unit import TORCH_DTYPE_TO_CODEC, RecyclableUnit
from kite_shared.security import ru_key
from kite_shared.service import ServiceRuntime, run_service
from kite_shared.tiers.client import TierClient
from kite_shared.tiers.pool_client import PoolClient
from kite_worker.block_cache import BlockCache, CacheEvent
from kite_worker.engine import Engine, EngineOptions, NewBlock, RequestRejected, Sequence
from kite_worker.pool_loader import CostModel, PoolLoader
from kite_worker.scheduler import Scheduler

log = logging.getLogger("kite_worker")

PROMPT_TOKENS = Counter("kite_prompt_tokens_total", "Prompt tokens by how their KV was obtained",
                        ["source"])
TTFT = Histogram("kite_worker_ttft_seconds", "Worker admission to first token",
                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
QUEUE_DEPTH = Gauge("kite_worker_queue_depth", "Requests waiting for a slot")
RUNNING = Gauge("kite_worker_running_requests", "Requests generating now")
POOL_DROPPED = Counter("kite_worker_pool_blocks_dropped_total",
                       "New blocks not handed to the ru-pool because its outbox was full")
REQUESTS = Counter("kite_worker_requests_total", "Generate requests by outcome", ["outcome"])
POOL_BLOCKS_LOADED = Counter("kite_worker_pool_blocks_loaded_total", "Prefix blocks loaded from the ru-pool")
POOL_LOAD_SECONDS = Histogram("kite_worker_pool_load_seconds", "Lookup + fetch time of pool blocks per request",
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))

# New blocks waiting to be encoded and published to the ru-pool; when full, blocks are dropped rather
# than slowing generation (the local cache still has them).
POOL_OUTBOX_BLOCKS = 4096


@dataclass
class LoadedModel:
    local: model_store.LocalModel
    identity: model_store.ModelIdentity
    engine: Engine


def load_engine(model_cfg: ModelConfig, worker_cfg: WorkerConfig) -> LoadedModel:
    if worker_cfg.num_threads > 0:
        torch.set_num_threads(worker_cfg.num_threads)
    local = model_store.prepare(model_cfg)
    identity = model_store.identity(local, model_cfg)
    engine = Engine(
        model=model_store.load_causal_lm(local, model_cfg),
        tokenizer=model_store.load_tokenizer(local),
        identity=identity,
        block_cache=BlockCache(worker_cfg.cache_bytes),
        options=EngineOptions(reuse=worker_cfg.reuse, block_size=model_cfg.block_size,
                              storage_dtype=getattr(torch, model_cfg.kv_storage_dtype),
                              prefill_chunk_tokens=worker_cfg.prefill_chunk_tokens,
                              cache_generated=worker_cfg.cache_generated),
        max_context_tokens=local.max_context_tokens,
    )
    return LoadedModel(local, identity, engine)


class WorkerService:
    def __init__(self, rt: ServiceRuntime, loaded: LoadedModel, cfg: WorkerConfig) -> None:
        self.rt = rt
        self.loaded = loaded
        self.cfg = cfg
        self.loop = asyncio.get_running_loop()
        self.scheduler = Scheduler(loaded.engine, cfg.max_running, cfg.max_queued,
                                   emit=self._emit_from_engine, on_new_blocks=self._blocks_from_engine,
                                   on_cache_events=self._cache_events_from_engine)
        self.pool = PoolClient(rt.nc, worker_id=rt.instance_id)
        self.tier_client: TierClient | None = None
        self.loader: PoolLoader | None = None
        self._loads: set[asyncio.Task] = set()
        self._cache_events: asyncio.Queue[list[CacheEvent]] = asyncio.Queue()
        self._events: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        self._pool_outbox: queue.Queue[NewBlock] = queue.Queue(maxsize=POOL_OUTBOX_BLOCKS)
        self._last_reused = 0
        self._last_computed = 0
        self._stopping = False

    async def start(self) -> None:
        if self.cfg.pool_read and self.loaded.engine.options.reuse:
            self.tier_client = TierClient.from_config(load(TierConfig))
            await self.tier_client.start()
            self.loader = self._make_loader()
        self.scheduler.start()
        self.rt.set_heartbeat_fields(self.heartbeat_fields)
        # A (re)started worker has an empty cache: whatever the pool's index remembers of it is gone.
        await self.pool.block_removed(self.loaded.identity.fingerprint_hex, [], all_blocks=True)
        self._events_task = asyncio.create_task(self._publish_events())
        self._blocks_task = asyncio.create_task(self._publish_blocks())
        self._cache_events_task = asyncio.create_task(self._publish_cache_events())
        self._generate_sub = await self.rt.nc.subscribe(subjects.WORKER_GENERATE, queue=subjects.WORKER_QUEUE,
                                                        cb=self.on_generate)
        await self.rt.nc.subscribe(subjects.WORKER_CANCEL, cb=self.on_cancel)
        self.rt.on_drain(self.drain)

    def _make_loader(self) -> PoolLoader:
        engine = self.loaded.engine
        layout = self.loaded.identity.model.layout
        shape = (layout.num_layers, 2, layout.num_kv_heads, layout.block_size, layout.head_dim)
        block_bytes = 1
        for dim in shape:
            block_bytes *= dim
        block_bytes *= torch.empty(0, dtype=engine.options.storage_dtype).element_size()
        return PoolLoader(self.pool, self.tier_client, CostModel(layout.block_size, block_bytes),
                          self.loaded.identity.fingerprint_hex, shape, engine.options.storage_dtype,
                          mac_key=ru_key())

    def heartbeat_fields(self) -> dict:
        self._update_metrics()
        return {"model": self.loaded.local.name, "max_context_tokens": self.loaded.local.max_context_tokens,
                "num_running": self.scheduler.num_running, "num_queued": self.scheduler.num_queued}

    def _update_metrics(self) -> None:
        engine = self.loaded.engine
        PROMPT_TOKENS.labels("reused").inc(engine.num_prompt_tokens_reused - self._last_reused)
        PROMPT_TOKENS.labels("computed").inc(engine.num_prompt_tokens_computed - self._last_computed)
        self._last_reused = engine.num_prompt_tokens_reused
        self._last_computed = engine.num_prompt_tokens_computed
        QUEUE_DEPTH.set(self.scheduler.num_queued)
        RUNNING.set(self.scheduler.num_running)
        while self.scheduler.ttft_samples:
            TTFT.observe(self.scheduler.ttft_samples.popleft())

    # --- handlers --------------------------------------------------------------------------------------

    async def on_generate(self, msg: Msg) -> None:
        try:
            request = TokenizedRequest.decode(msg.data)
        except MessageError as exc:
            REQUESTS.labels("invalid").inc()
            await self._reply(msg, Admission(accepted=False, error=ErrorInfo(code="invalid_message",
                                                                             message=str(exc))))
            return
        if self.rt.draining:
            REQUESTS.labels("draining").inc()
            await self._reply(msg, Admission(accepted=False, error=ErrorInfo(
                code="shutting_down", message="worker is draining")))
            return
        try:
            seq = self.scheduler.reserve(request)
        except RequestRejected as exc:
            REQUESTS.labels(exc.code).inc()
            await self._reply(msg, Admission(accepted=False, error=ErrorInfo(code=exc.code, message=str(exc))))
            return
        REQUESTS.labels("accepted").inc()
        await self._reply(msg, Admission(accepted=True, worker_id=self.rt.instance_id,
                                         prompt_tokens=len(request.prompt_token_ids)))
        if self.loader is None or not seq.reuse:
            self.scheduler.enqueue(seq)
            return
        # NATS runs a subscription's callbacks one at a time: load in a task so admissions never wait.
        task = asyncio.create_task(self._load_then_enqueue(seq))
        self._loads.add(task)
        task.add_done_callback(self._loads.discard)

    async def _load_then_enqueue(self, seq: Sequence) -> None:
        """Attach pool blocks to the request when they beat recomputing; any failure just means compute."""
        started = time.perf_counter()
        try:
            engine = self.loaded.engine
            self.loader.cost.prefill_seconds_per_token = engine.prefill_seconds_per_token
            num_local = engine.block_cache.longest_prefix(seq.prompt_hashes)
            seq.prefetched = await self.loader.load(seq.prompt_hashes, num_local)
            POOL_BLOCKS_LOADED.inc(len(seq.prefetched))
        except Exception:
            log.exception("loading pool blocks for %s failed; computing them", seq.request_id)
            seq.prefetched = []
        finally:
            POOL_LOAD_SECONDS.observe(time.perf_counter() - started)
            self.scheduler.enqueue(seq)

    async def _reply(self, msg: Msg, admission: Admission) -> None:
        if msg.reply:
            await msg.respond(admission.encode())

    async def on_cancel(self, msg: Msg) -> None:
        try:
            self.scheduler.cancel(Cancel.decode(msg.data).request_id)
        except MessageError as exc:
            log.warning("bad cancel message: %s", exc)

    # --- engine thread -> asyncio -------------------------------------------------------------------

    def _emit_from_engine(self, subject: str, message: Message) -> None:
        data = message.encode()
        self.loop.call_soon_threadsafe(self._events.put_nowait, (subject, data))

    async def _publish_events(self) -> None:
        # One consumer keeps each stream's events in order.
        while True:
            subject, data = await self._events.get()
            try:
                await self.rt.nc.publish(subject, data)
            except Exception:
                log.exception("could not publish a stream event on %s", subject)

    def _cache_events_from_engine(self, events: list[CacheEvent]) -> None:
        self.loop.call_soon_threadsafe(self._cache_events.put_nowait, events)

    async def _publish_cache_events(self) -> None:
        """Tell the ru-pool's index what this worker's cache holds (routing uses it)."""
        fingerprint = self.loaded.identity.fingerprint_hex
        while True:
            events = await self._cache_events.get()
            while not self._cache_events.empty():
                events += self._cache_events.get_nowait()
            stored = [bytes(e.block_hash) for e in events if e.kind == "stored"]
            removed = [bytes(e.block_hash) for e in events if e.kind == "removed"]
            if removed:
                await self.pool.block_removed(fingerprint, removed)
            if stored:
                await self.pool.block_stored(fingerprint, stored)

    def _blocks_from_engine(self, blocks: list[NewBlock]) -> None:
        if not self.cfg.pool_write:
            return
        for block in blocks:
            try:
                self._pool_outbox.put_nowait(block)
            except queue.Full:
                POOL_DROPPED.inc()

    async def _publish_blocks(self) -> None:
        # Polls with a timeout (instead of blocking in get()) so that shutdown never waits on a thread
        # stuck in an empty queue; on drain it flushes what is queued, then returns.
        while True:
            try:
                block = await asyncio.to_thread(self._pool_outbox.get, True, 0.25)
            except queue.Empty:
                if self._stopping:
                    return
                continue
            try:
                data = await asyncio.to_thread(self._encode_block, block)
                await self.pool.put(data)
            except Exception:
                log.exception("could not hand block %s to the ru-pool", block.block_hash.hex()[:16])

    def _encode_block(self, block: NewBlock) -> bytes:
        kv = block.kv
        return RecyclableUnit(
            block_hash=bytes(block.block_hash), parent_hash=bytes(block.parent_hash),
            model_fingerprint=self.loaded.identity.fingerprint_hex, block_index=block.block_index,
            num_tokens=kv.shape[3], codec=TORCH_DTYPE_TO_CODEC[str(kv.dtype).removeprefix("torch.")],
            shape=tuple(kv.shape), payload=kv.contiguous().view(torch.uint8).numpy().tobytes(),
        ).encode(key=ru_key())

    async def drain(self) -> None:
        """Finish in-flight requests (new ones are refused while draining), then stop the engine."""
        # Leave the queue group first, so NATS routes new requests to the other workers (issue 7).
        try:
            await self._generate_sub.unsubscribe()
        except Exception as exc:
            log.debug("could not leave the worker queue group: %s", exc)
        while not self.scheduler.idle():
            await asyncio.sleep(0.05)
        while not self._events.empty():
            await asyncio.sleep(0.01)
        self.scheduler.stop()
        await asyncio.to_thread(self.scheduler.join, 5.0)
        self._stopping = True
        await self._blocks_task  # returns once the ru-pool outbox is flushed
        self._events_task.cancel()
        self._cache_events_task.cancel()
        if self.tier_client is not None:
            await self.tier_client.close()


def main() -> None:
    model_cfg = load(ModelConfig)
    worker_cfg = load(WorkerConfig)
    loaded = load_engine(model_cfg, worker_cfg)
    if worker_cfg.metrics_port:
        start_http_server(worker_cfg.metrics_port, addr="0.0.0.0")

    async def setup(rt: ServiceRuntime) -> None:
        await WorkerService(rt, loaded, worker_cfg).start()

    run_service("worker", setup)


if __name__ == "__main__":
    main()
