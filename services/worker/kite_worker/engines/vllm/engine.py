"""The worker on vLLM (KITE_ENGINE=vllm), as the worker service drives it (kite_worker.engines.base.Engine):
KITE's requests in front of vLLM's v1 engine (model.py) and its KV connector (kv_connector.py).

Continuous batching, chunked prefill, paged attention, prefix caching, stop strings and sampling are vLLM's;
this module maps requests and outputs, and nothing here saves to the ru-pool (the connector does, inside
vLLM's processes, as the write policy lets it):

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

Boundary: runs on the worker's event loop (vLLM's output handler shares it); imports nothing from
kite_worker.engines.reference.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Mapping

from kite_shared.adapters import Adapter
from kite_shared.config import ModelConfig, WorkerConfig
from kite_shared.fingerprint import BlockHash
from kite_shared.messages import (ErrorInfo, Message, StreamEnd, StreamError, TokenChunk, TokenizedRequest,
                                  Usage)
from kite_shared.model_store import LocalModel, ModelIdentity
from kite_shared.tiers.pool_client import PoolClient
from kite_worker.engines.admission import validate_request
from kite_worker.engines.base import EngineHooks, EngineLoad, RequestRejected, Round
from kite_worker.engines.vllm.kv_plan import PARAMS_KEY, RequestParams
from kite_worker.engines.vllm.model import VllmModel
from kite_worker.shadow import TOP_LOGPROBS, ShadowCheck, ShadowOutcome, ShadowVerifier
from kite_worker.write_policy import WritePolicyFilter

log = logging.getLogger(__name__)


@dataclass
class VllmSequence:
    """One admitted request: what `reserve` returns and `submit` runs."""

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


class VllmEngine:
    def __init__(self, model: VllmModel, max_queued: int, shadow: ShadowVerifier | None = None,
                 shadow_idle_s: float = 0.2, shadow_chunk_tokens: int = 32) -> None:
        self.model = model
        self.shadow = shadow
        self._on_shadow: Callable[[ShadowOutcome], None] | None = None  # from `start`, as the next three
        self._emit: Callable[[str, Message], None] | None = None
        self._pool: PoolClient | None = None
        self._writes: WritePolicyFilter | None = None
        self.shadow_idle_s = shadow_idle_s
        self._busy_at = time.monotonic()  # when a request last arrived or ended
        self.shadow_chunk_tokens = shadow_chunk_tokens
        self._shadow_runner: asyncio.Task | None = None
        self._shadow_offered = asyncio.Event()  # a check joined the queue
        self._shadow_running = False  # a check is being recomputed
        self.max_queued = max_queued
        self._active: dict[str, VllmSequence] = {}  # reserved or generating
        self.quarantined: set[str] = set()  # model fingerprints (hex) whose requests reuse nothing
        self._dropping_kv: asyncio.Task | None = None  # a quarantine's reset of vLLM's prefix cache
        self._stopped = False
        self.ttft_samples: deque[float] = deque(maxlen=1000)
        self.num_prompt_tokens_reused = 0
        self.num_prompt_tokens_computed = 0
        # measured (exponentially weighted); telemetry and admission control read them
        self.prefill_seconds_per_token = 0.003
        self.decode_seconds_per_token = 0.0
        cache = model.kv_cache
        self._mirror = PrefixMirror(cache.capacity_bytes // max(1, cache.bytes_per_token * model.block_size))

    @classmethod
    def create(cls, local: LocalModel, identity: ModelIdentity, adapters: dict[str, Adapter],
               model_cfg: ModelConfig, worker_cfg: WorkerConfig, instance_id: str,
               shadow: ShadowVerifier | None) -> VllmEngine:
        model = VllmModel(local, identity, model_cfg, worker_cfg, instance_id, adapters)
        model.start()
        return cls(model, worker_cfg.max_queued, shadow, worker_cfg.shadow_idle_s, worker_cfg.shadow_chunk_tokens)

    # --- lifecycle ---------------------------------------------------------------------------------------

    async def start(self, hooks: EngineHooks) -> None:
        """vLLM's processes started when the worker loaded it; shadow checks run from now on, and the
        configured adapters' weights load now (one vLLM cannot load is not served)."""
        self._emit, self._on_shadow, self._pool, self._writes = hooks.emit, hooks.on_shadow, hooks.pool, hooks.writes
        if self.shadow is not None and self._shadow_runner is None:
            self._shadow_runner = asyncio.get_running_loop().create_task(self._run_shadow_checks())
        await self.model.load_adapters()

    def rounds(self) -> tuple[tuple[Round, str], ...]:
        return ()  # the KV connector puts blocks and cache events inside vLLM's processes

    @property
    def alive(self) -> bool:
        llm = self.model.llm
        return llm is not None and not llm.errored

    def stop(self) -> None:
        """Refuse new requests and end the shadow checks."""
        self._stopped = True
        if self._shadow_runner is not None:
            self._shadow_runner.cancel()

    async def close(self, bus_connected: bool) -> None:
        self.stop()
        await asyncio.to_thread(self.model.shutdown if bus_connected else self.model.abandon)

    # --- load --------------------------------------------------------------------------------------------

    @property
    def max_running(self) -> int:
        return self.model.options.max_num_seqs

    @property
    def num_running(self) -> int:
        return min(len(self._active), self.model.options.max_num_seqs)

    @property
    def num_queued(self) -> int:
        return max(0, len(self._active) - self.model.options.max_num_seqs)

    def load_snapshot(self) -> tuple[int, int]:
        """(KV positions of requests past their first token, prompt tokens of requests before it)."""
        running = backlog = 0
        for seq in self._active.values():
            if seq.first_token_at is None:
                backlog += seq.expected_computed_tokens
            else:
                running += len(seq.request.prompt_token_ids) + seq.num_generated
        return running, backlog

    def load(self) -> EngineLoad:
        """The cache figures are the KV of the requests generating now (vLLM does not report what its
        prefix cache keeps of finished ones)."""
        running, backlog = self.load_snapshot()
        cache = self.model.kv_cache
        return EngineLoad(
            running_tokens=running, prefill_backlog_tokens=backlog,
            cache_bytes=min(cache.capacity_bytes, running * cache.bytes_per_token),
            cache_capacity_bytes=cache.capacity_bytes, prompt_tokens_reused=self.num_prompt_tokens_reused,
            prompt_tokens_computed=self.num_prompt_tokens_computed,
            prefill_seconds_per_token=self.prefill_seconds_per_token,
            decode_seconds_per_token=self.decode_seconds_per_token)

    @property
    def pool_read(self) -> bool:
        """The KV connector loads missing prefix blocks (after this front end looked up how many the pool
        holds: `pool_blocks`)."""
        return self.model.options.reuse and self.model.options.pool_read

    # --- requests ----------------------------------------------------------------------------------------

    def reserve(self, request: TokenizedRequest) -> VllmSequence:
        identity = self.model.identity_of(request)
        hashes = validate_request(request, identity, self.model.block_size, self.model.max_context_tokens)
        if self._stopped:
            raise RequestRejected("shutting_down", "this worker is draining")
        if len(self._active) >= self.model.options.max_num_seqs + self.max_queued:
            raise RequestRejected("overloaded", "worker queue is full")
        seq = VllmSequence(request=request, identity=identity, prompt_hashes=hashes,
                           reuse=self.model.options.reuse and request.reuse
                           and identity.fingerprint_hex not in self.quarantined,
                           lora=self.model.lora_request(request.adapter))
        seq.num_mirror_hits = self._mirror.leading_hits(hashes) if seq.reuse else 0
        seq.expected_computed_tokens = len(request.prompt_token_ids) - seq.num_mirror_hits * self.model.block_size
        seq.backlog_at_admission = self.load_snapshot()[1] + seq.expected_computed_tokens
        self._mirror.add(hashes)
        seq.shadow_sampled = seq.reuse and self.shadow is not None and self.shadow.draw()
        self._active[seq.request_id] = seq
        self._busy_at = time.monotonic()
        return seq

    def submit(self, seq: VllmSequence) -> None:
        # The write policy counts this prompt's blocks (the selective policy saves a block seen twice); it
        # holds nothing back here: the connector saves the leading blocks it lets through (`_save_limit`).
        self._writes.seen([bytes(h) for h in seq.request.block_hashes])
        seq.task = asyncio.get_running_loop().create_task(self._generate(seq))

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
        self._dropping_kv = asyncio.get_running_loop().create_task(self.model.drop_reused_kv())

    @property
    def num_shadow_checks_waiting(self) -> int:
        """Checks queued or being recomputed (0 without shadow verification)."""
        if self.shadow is None:
            return 0
        return self.shadow.num_pending + self._shadow_running

    # --- adapters (vLLM's LoRA layers) ----------------------------------------------------------------------

    @property
    def adapters(self) -> Mapping[str, Adapter]:
        return self.model.adapters

    async def load_adapter(self, adapter: Adapter) -> None:
        """vLLM names each load apart (VllmModel.add_adapter): no wait for an earlier adapter's requests."""
        await self.model.add_adapter(adapter)

    async def unload_adapter(self, name: str) -> None:
        await self.model.remove_adapter(name, in_use=self.uses_adapter(name))

    def uses_adapter(self, name: str) -> bool:
        """Whether a request of this adapter is reserved or generating."""
        return any(seq.request.adapter == name for seq in self._active.values())

    # --- one request ------------------------------------------------------------------------------------

    async def _pool_blocks_worth_knowing(self, seq: VllmSequence) -> int:
        """The pool's leading blocks of this prompt, asked here on the worker's event loop rather than by
        the connector inside vLLM's scheduler loop, where a round trip would stall every running request.
        -1 when vLLM is expected to hold every reusable block already (nothing to load: not worth asking)."""
        max_reusable = max(0, (len(seq.request.prompt_token_ids) - 1) // self.model.block_size)
        if seq.num_mirror_hits >= max_reusable:
            return -1
        return await self.pool_blocks(seq.request)

    async def pool_blocks(self, request: TokenizedRequest) -> int:
        """Leading prompt blocks the ru-pool holds: the router's answer when it looked, else a lookup; 0
        when the pool does not answer in time (those blocks are computed)."""
        if request.pool_blocks >= 0:
            return request.pool_blocks
        reply = await self._pool.lookup(request.model_fingerprint, request.block_hashes, include_workers=False)
        return reply.pool if reply is not None and not reply.invalidated else 0

    def _save_limit(self, seq: VllmSequence) -> int:
        """How many of the prompt's leading blocks the write policy lets the connector save (-1: all, and
        the generated ones)."""
        return self._writes.num_leading_to_write([bytes(h) for h in seq.prompt_hashes])

    def _sampling_params(self, seq: VllmSequence, pool_blocks: int = -1):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = seq.request.sampling
        extra = None
        if seq.reuse:
            params = RequestParams(
                cache_salt=seq.request.cache_salt, tenant=seq.request.tenant,
                load=self.model.options.pool_read, save=self.model.options.pool_write,
                save_generated=self.model.options.cache_generated,
                max_save_blocks=self._save_limit(seq),
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
                           if seq.reuse and self.model.options.pool_read else -1)
            sampling = self._sampling_params(seq, pool_blocks)
            async for out in self.model.llm.generate(prompt, sampling, request.request_id, lora_request=seq.lora):
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
        self.num_prompt_tokens_reused += cached
        self.num_prompt_tokens_computed += len(request.prompt_token_ids) - cached
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
        if self.model.identity_of(request).fingerprint_hex != check.model_fingerprint:
            raise RequestRejected("model_not_found", "its adapter was reloaded with other weights")
        lora = self.model.lora_request(request.adapter)
        salt = f"kite-shadow-{uuid.uuid4().hex}"
        tokens = list(request.prompt_token_ids)
        block = self.model.block_size
        piece = max(block, self.shadow_chunk_tokens // block * block)
        ends = [*range(piece, len(tokens), piece), len(tokens)]
        final = None
        for i, end in enumerate(ends):
            if i:
                await self._until_idle()
            last = end == len(tokens)
            params = SamplingParams(n=1, temperature=0.0, max_tokens=1, logprobs=TOP_LOGPROBS if last else None,
                                    output_kind=RequestOutputKind.FINAL_ONLY)
            async for out in self.model.llm.generate(TokensPrompt(prompt_token_ids=tokens[:end], cache_salt=salt),
                                                      params, f"shadow-{request.request_id}-{i}", lora_request=lora):
                final = out
        if final is None or not final.outputs[0].logprobs:
            raise RuntimeError("vLLM returned no log-probabilities")
        return _top_logprobs(final.outputs[0].logprobs[0])

    async def _drop_unloaded_lora(self, seq: VllmSequence) -> None:
        """The last request of an adapter unloaded while it ran has ended: vLLM drops its weights now."""
        if seq.lora is None or self.model.serves_lora(seq.lora):
            return
        if not any(other.lora is seq.lora for other in self._active.values()):
            try:
                await self.model.llm.remove_lora(seq.lora.lora_int_id)
            except Exception as exc:  # its weights stay until vLLM's LRU of adapters evicts them
                log.warning("vLLM could not drop the unloaded adapter %s: %r", seq.request.adapter, exc)

    def _measure(self, seq: VllmSequence, computed: int) -> None:
        if seq.first_token_at is None:
            return
        if computed >= self.model.block_size:
            # The first token came after this prompt and the backlog ahead of it were computed (vLLM batches
            # them): seconds per backlog token is what admission control divides the backlog by.
            per_token = (seq.first_token_at - seq.admitted_at) / max(computed, seq.backlog_at_admission)
            self.prefill_seconds_per_token += 0.2 * (per_token - self.prefill_seconds_per_token)
        if seq.num_generated > 1:
            step = (time.monotonic() - seq.first_token_at) / (seq.num_generated - 1)
            self.decode_seconds_per_token = step if not self.decode_seconds_per_token else \
                self.decode_seconds_per_token + 0.2 * (step - self.decode_seconds_per_token)

    def _eos_token_ids(self) -> frozenset[int]:
        eos = self.model.local.hf_config.get("eos_token_id")
        return frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])


def _top_logprobs(position) -> dict[int, float]:
    """vLLM's log-probabilities of one position (token id -> Logprob) as token id -> float."""
    return {int(token): float(lp.logprob) for token, lp in position.items()}


_FINISH_REASONS = {"length": "length", "abort": "cancelled"}  # vLLM's "stop" (EOS or a stop string) stays
