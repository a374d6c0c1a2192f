"""KITE's vLLM KV connector: vLLM's paged KV cache gains the ru-pool's tiers (the way LMCache plugs in).

vLLM loads it from `kv_transfer_config` (`kv_connector_module_path`: model.KV_CONNECTOR_MODULE, this
module) and makes two instances:
- role SCHEDULER, in the engine-core process: for each new request, after vLLM's own prefix-cache hit,
  asks the ru-pool (through `KVAgent`) for the following blocks and reports how many tokens they cover
  (`get_num_new_matched_tokens`). The fetch runs on the agent's thread: until it has staged the blocks
  the connector answers None, which makes vLLM skip the request for a step and ask again, so running
  requests keep decoding while a prefix loads and vLLM's loop never waits for the pool. Blocks are asked
  for only when the pool is known to hold them: the worker's front end looked them up before submitting
  the request (`RequestParams.pool_blocks`), and a prompt whose blocks past vLLM's hit the pool lacks (the
  common shared-prefix case) is scheduled at once. Each step, it tells the model runner which paged
  blocks to fill from staging and which newly computed blocks to save (`build_connector_meta`, decided
  by `KVPlanner`), and hands those saves to the agent, which publishes each once the model runner's file
  appears (saves never wait for a later engine step, which an idle engine would not take).
- role WORKER, in the model-runner process: copies staged blocks from the staging arena (one shared
  mapping: staging_arena.py) into the paged KV before the forward pass (`start_load_kv`; loads are
  synchronous, a block is a few hundred KB), and after it copies the
  blocks to save out of the paged KV at once (the request may free them soon) and writes them to staging
  on a background thread (`wait_for_save`), so a save costs a step one memory copy.

What this worker holds is vLLM's own prefix cache: vLLM publishes its KV cache events (blocks stored,
removed, all cleared) on an in-process ZMQ endpoint (`kv_events_endpoint`); the scheduler side
translates them into KITE block hashes (`LocalBlockMirror`) and the agent announces them to the ru-pool's
index, which cache-aware routing reads. An evicted prefix stops attracting requests to this worker.

Requests carry KITE's decisions in `kv_transfer_params["kite"]` (kv_plan.RequestParams), set by the
worker's front end (engine.py); a request without them is served by vLLM alone. A LoRA adapter's
request names the adapter's model fingerprint there: its blocks are hashed, fetched, saved and announced
under the adapter's root, never the base's (vLLM's own hashes of them include the adapter too).

Failures never fail a request or change an answer: a block the pool cannot supply in time is computed;
a staged block whose slot no longer holds it (cleared at a quarantine) is reported through
`get_block_ids_with_load_errors`, and with
`kv_load_failure_policy="recompute"` vLLM computes those blocks again. Units are verified (payload
tag, HMAC, model fingerprint, tenant) before they are staged.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import msgspec
import torch
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kite_shared.config import CommonConfig, load
from kite_shared.fingerprint import BlockHash
from kite_shared.service import setup_package_logging
from kite_worker.engines.vllm.kv_agent import (AgentOptions, ConnectorOptions, KVAgent, PendingFetch,
                                               kv_events_endpoint, save_path, write_atomically)
from kite_worker.engines.vllm.kv_plan import PARAMS_KEY, KVPlanner, LocalBlockMirror, RequestParams
from kite_worker.engines.vllm.paged_layout import PagedCache, kv_split_of
from kite_worker.engines.vllm.staging_arena import ARENA_FILE, StagingArena

if TYPE_CHECKING:
    import numpy
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class KiteConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> model runner, once per step."""

    loads: list[tuple[int, int, bytes]] = field(default_factory=list)  # (paged block id, arena slot, block hash)
    saves: list[tuple[int, str]] = field(default_factory=list)  # (paged block id, file path to write)


class KiteConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.options = ConnectorOptions.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        setup_package_logging("worker", f"{self.options.worker_id}/{role.name.lower()}",
                              load(CommonConfig).log_level)
        self.block_size = vllm_config.cache_config.block_size
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(self, vllm_config, kv_cache_config)
        else:
            self._worker = _WorkerSide(self, vllm_config)

    # --- scheduler side -------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        self._scheduler.planner.allocated(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self._scheduler.on_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.finished(request.request_id)
        return False, None

    # --- worker side ----------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KiteConnectorMetadata)
        self._worker.load(metadata.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are copied after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KiteConnectorMetadata)
        self._worker.save(metadata.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.SCHEDULER:
            self._scheduler.stop()
        else:
            self._worker.stop()


class _SchedulerSide:
    def __init__(self, connector: KiteConnector, vllm_config: "VllmConfig",
                 kv_cache_config: "KVCacheConfig | None") -> None:
        options = connector.options
        self.options = options
        self.block_size = connector.block_size
        self.planner = KVPlanner(self.block_size, BlockHash(bytes.fromhex(options.model_fingerprint)))
        model = vllm_config.model_config
        num_layers = model.get_num_layers(vllm_config.parallel_config)
        num_kv_heads = model.get_num_kv_heads(vllm_config.parallel_config)
        head_size = model.get_head_size()
        # The recyclable-unit layout of every KITE engine: [layers, key/value, kv heads, tokens, head dim].
        unit_shape = (num_layers, 2, num_kv_heads, self.block_size, head_size)
        self.agent = KVAgent(AgentOptions(
            worker_id=options.worker_id, model_fingerprint=options.model_fingerprint,
            block_size=self.block_size, unit_shape=unit_shape, storage_dtype=options.storage_dtype,
            staging_dir=options.staging_dir, pool_read=options.pool_read, pool_write=options.pool_write,
            staging_bytes=options.staging_bytes, keep_mapped_bytes=options.keep_mapped_bytes,
            tier_codecs=options.tier_codecs, pool_write_path=options.pool_write_path))
        self.agent.start()
        self.mirror = LocalBlockMirror()
        self._mirror_lock = threading.Lock()  # learned on the scheduler thread, read by the event listener
        self._events = _KVEventListener(kv_events_endpoint(options.worker_id), self._on_kv_events)
        self._requests: dict[str, "Request"] = {}  # tracked requests (their token ids grow as they decode)
        self._pinned: dict[str, list[BlockHash]] = {}  # request id -> staged blocks it holds
        # request id -> (its fetch under way, the hashes wanted, the first block they start at)
        self._fetches: dict[str, tuple[PendingFetch, list[BlockHash], int]] = {}
        self._step_started: float | None = None
        self._step_prefill_tokens = 0

    def num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> int | None:
        """Tokens the pool supplies after vLLM's own hit; None while their fetch runs (vLLM then skips the
        request this step and asks again at the next: the pool is never waited for in its loop)."""
        params = RequestParams.decode((request.kv_transfer_params or {}).get(PARAMS_KEY))
        if params is None:
            return 0
        request_id = request.request_id
        plan_known = request_id in self.planner.requests
        plan = self.planner.track(request_id, params, request.prompt_token_ids or [])
        self._requests[request_id] = request
        if not plan_known:  # fetch once per request; a request vLLM asks about again reuses the answer
            self._learn(request, 0, plan.hashes)
            wanted = self.planner.wanted(request_id, num_computed_tokens)
            if wanted:
                fetch = self.agent.fetch(wanted, params.tenant, bytes(plan.root).hex())
                self._fetches[request_id] = (fetch, wanted, num_computed_tokens // self.block_size)
        if request_id in self._fetches:
            fetch, wanted, first = self._fetches[request_id]
            num_staged = fetch.result()
            if num_staged is None:
                return None
            del self._fetches[request_id]
            self._pinned[request_id] = wanted[:num_staged]
            self.planner.set_loadable(request_id, first, num_staged)
            log.debug("request %s: vLLM has %d tokens, the pool supplies %d of %d wanted blocks",
                      request_id, first * self.block_size, num_staged, len(wanted))
        return self.planner.num_matched_tokens(request_id, num_computed_tokens)

    def build_meta(self, scheduler_output: "SchedulerOutput") -> KiteConnectorMetadata:
        now = time.perf_counter()
        meta = KiteConnectorMetadata()
        steps = []
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id not in self.planner.requests:
                continue
            request_tokens = new.prompt_token_ids or []
            steps.append((new.req_id, self.planner.plan_step(
                new.req_id, new.block_ids[0], True, new.num_computed_tokens,
                scheduler_output.num_scheduled_tokens.get(new.req_id, 0), request_tokens)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            plan = self.planner.requests.get(req_id)
            if plan is None:
                continue
            new_ids = cached.new_block_ids[i]
            tokens = self._tokens(req_id, cached)
            steps.append((req_id, self.planner.plan_step(
                req_id, new_ids[0] if new_ids is not None else None, req_id in cached.resumed_req_ids,
                cached.num_computed_tokens[i], scheduler_output.num_scheduled_tokens.get(req_id, 0), tokens)))
        saves = []
        for req_id, step in steps:
            request = self._requests.get(req_id)
            for copy in step.loads + step.saves:
                if request is not None:
                    self._learn(request, copy.block_index, [copy.block_hash])
            for copy in step.loads:
                meta.loads.append((copy.block_id, self.agent.staged_slot(copy.block_hash), bytes(copy.block_hash)))
            for copy in step.saves:
                meta.saves.append((copy.block_id, str(save_path(self.options.staging_dir, copy.block_hash))))
                saves.append(self.planner.saved_info(req_id, copy))
        if meta.loads or meta.saves:
            log.debug("step: load %d blocks, save %d", len(meta.loads), len(meta.saves))
        self.agent.publish(saves)
        self._step_started = now
        self._step_prefill_tokens = sum(
            n for req_id, n in scheduler_output.num_scheduled_tokens.items() if n >= self.block_size)
        return meta

    def _learn(self, request: "Request", first_block: int, kite_hashes: list[BlockHash]) -> None:
        """Pair vLLM's hashes of these blocks with KITE's (vLLM hashes a block once its tokens are known;
        its hashes of an adapter's blocks include the adapter, as KITE's root does)."""
        plan = self.planner.requests.get(request.request_id)
        if plan is None:
            return
        vllm_hashes = request.block_hashes[first_block:first_block + len(kite_hashes)]
        with self._mirror_lock:  # announcing under the lock keeps the two threads' changes in order
            self.mirror.learn([maybe_convert_block_hash(h) for h in vllm_hashes], kite_hashes,
                              bytes(plan.root).hex())
            self.agent.announce(self.mirror.take_events())

    def _on_kv_events(self, batch: KVEventBatch) -> None:
        """vLLM's cache changed (listener thread): tell the ru-pool's index, in KITE's hashes."""
        with self._mirror_lock:
            apply_kv_events(self.mirror, batch.events)
            self.agent.announce(self.mirror.take_events())

    def stop(self) -> None:
        self._events.stop()
        self.agent.stop()

    def _tokens(self, req_id: str, cached) -> "Sequence[int]":
        """The request's tokens so far (vLLM's read-only list, not copied: read only when a block fills)."""
        request = self._requests.get(req_id)
        if request is not None:
            return request.all_token_ids
        return cached.all_token_ids.get(req_id, [])

    def on_output(self, output: "KVConnectorOutput") -> None:
        if self._step_started is not None and self._step_prefill_tokens:
            self.agent.observe_prefill(time.perf_counter() - self._step_started, self._step_prefill_tokens)
            self._step_prefill_tokens = 0

    def finished(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self.agent.unpin(self._pinned.pop(request_id, []))
        pending = self._fetches.pop(request_id, None)
        if pending is not None:  # aborted while its blocks were fetched: unpinned when they are staged
            fetch, wanted, _ = pending
            fetch.on_done(lambda num_staged: self.agent.unpin(wanted[:num_staged]))
        self.planner.finished(request_id)


def apply_kv_events(mirror: LocalBlockMirror, events) -> None:
    """Feed vLLM's KV cache events to the mirror (which turns them into announcements)."""
    for event in events:
        if isinstance(event, BlockStored):
            mirror.stored(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            mirror.removed(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            mirror.cleared()


def attention_backend(vllm_config: "VllmConfig", layer_names: list[str]) -> str:
    """The name of the one attention backend vLLM runs these layers with (its layout decides how a block's
    keys and values lie: paged_layout.kv_split_of); ValueError when the layers use several."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    names = sorted({backend.get_name() for backend in get_current_attn_backends(vllm_config, layer_names)})
    if len(names) != 1:
        raise ValueError(f"the KITE KV connector copies whole blocks of one attention layout; these layers "
                         f"run {', '.join(names) or 'no attention backend'}")
    return names[0]


class _KVEventListener:
    """Subscribes to vLLM's KV event publisher (ZMQ PUB, inproc in this process) on a thread of its own
    and hands each decoded batch to `handle`. A lost batch only leaves the index stale for a while: the
    pool forgets a silent worker's blocks, and routing is a preference, never a correctness matter."""

    def __init__(self, endpoint: str, handle) -> None:
        self._endpoint = endpoint
        self._handle = handle
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kite-kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.SUB)  # inproc needs the publisher's context: instance()
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._endpoint)
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        try:
            while not self._stopped.is_set():
                if not sock.poll(100):
                    continue
                _topic, _seq, payload = sock.recv_multipart()
                try:
                    self._handle(decoder.decode(payload))
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    log.warning("undecodable vLLM KV event batch skipped: %r", exc)
        finally:
            sock.close()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(2.0)


class _WorkerSide:
    def __init__(self, connector: KiteConnector, vllm_config: "VllmConfig") -> None:
        self.options = connector.options
        self._vllm_config = vllm_config
        self.paged: PagedCache | None = None
        self._load_errors: set[int] = set()
        self._staging: StagingArena | None = None
        self._staging_failed = False  # the agent creates it before any load: a failure to open it is for good
        self._writes: queue.Queue[tuple[str, "numpy.ndarray"] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kite-kv-save", daemon=True)
        self._writer.start()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        backend = attention_backend(self._vllm_config, list(kv_caches))
        self.paged = PagedCache.of(kv_caches.values(), kv_split_of(backend))  # model order
        log.info("paged KV: %d layers of %s blocks on %s (%s)", len(self.paged.layers),
                 "x".join(map(str, self.paged.unit_shape[1:])), self.paged.device, backend)

    def load(self, loads: list[tuple[int, int, bytes]]) -> None:
        arena = self._arena()
        for block_id, slot, block_hash in loads:
            if arena is None or not arena.holds(slot, block_hash):  # cleared at a quarantine: compute it
                self._load_errors.add(block_id)
                continue
            # The slot's host memory as a tensor (no copy); write moves it to the paged tensors' device.
            block = torch.frombuffer(arena.payload(slot), dtype=self.options.storage_dtype)
            self.paged.write(block_id, block.view(self.paged.unit_shape))
            if not arena.holds(slot, block_hash):  # cleared while copied: what was copied is not trusted
                self._load_errors.add(block_id)

    def _arena(self) -> StagingArena | None:
        """The agent's staging arena, mapped at the first load (the agent creates it as vLLM starts)."""
        if self._staging is None and not self._staging_failed:
            try:
                self._staging = StagingArena.open(self.options.staging_dir / ARENA_FILE,
                                                  self.paged.unit_bytes(self.options.storage_dtype))
            except (OSError, ValueError) as exc:
                log.error("staging arena not readable (%r); every staged block is computed", exc)
                self._staging_failed = True
        return self._staging

    def save(self, saves: list[tuple[int, str]]) -> None:
        if not saves:
            return
        # Copy now (the request may free these blocks right after this step), in the storage dtype, into
        # host memory, on this thread: a torch operation on another thread would start a second OpenMP team
        # beside the model's, and on a small machine the two teams' spin-waits slow every step (measured:
        # the engine-core process took 40% of a core). The writer thread only writes bytes.
        gathered = self.paged.gather([block_id for block_id, _ in saves], self.options.storage_dtype)
        for (_, path), block in zip(saves, gathered):  # views of the one gathered copy, written from there
            self._writes.put((path, block.view(torch.uint8).numpy()))
        log.debug("saving %d blocks", len(saves))

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            path, data = item
            try:
                write_atomically(Path(path), data)
            except OSError as exc:  # the agent gives up waiting for it: one block not saved
                log.warning("could not stage saved block %s: %r", Path(path).name, exc)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def stop(self) -> None:
        self._writes.put(None)
