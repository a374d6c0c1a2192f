"""The reference engine's model execution with Upcycle reuse: inject cached prefix KV, compute only the
rest, keep new blocks.

Boundary: `ReferenceModel` knows the model, the tokenizer and the worker-local `BlockCache`; it knows
nothing of NATS or threads (the engine's scheduler, scheduler.py, drives it one call at a time from one
thread; the tests drive it directly).

Prefill of a request:
  1. verify the fingerprinter's block hashes against our own model identity and the token ids
     (kite_worker.engines.admission: a wrong hash would poison the cache, so the worker never trusts them
     blindly; recomputing costs < 1 ms);
  2. find the longest run of leading blocks in the local cache (after inserting the blocks the pool loader
     fetched for this request, `Sequence.prefetched`); reuse at most len(prompt) - 1 tokens, so the last
     prompt token is always computed and its logits exist (a full-prompt hit crops the last block);
  3. compute the remaining prompt tokens in chunks of `prefill_chunk_tokens` (the scheduler interleaves
     other requests' decode steps between chunks, so one long prompt does not stall every stream);
  4. sample the first token; then the scheduler calls `store_prompt_blocks` *after* the first token is
     on its way, so packaging never delays time to first token.
At the end of generation, full blocks covering prompt + answer are kept too (KITE_WORKER_CACHE_GENERATED),
so the next turn of a chat reuses the answer.

LoRA adapters (KITE_ADAPTERS): the model is then a peft model holding every adapter; each forward runs
with the sequence's adapter active (or all disabled for the base). A sequence's identity is its adapter's,
so its hashes, and the blocks it stores, are its adapter's alone.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kite_shared.adapters import Adapter
from kite_shared.fingerprint import BlockHash, block_hash_chain
from kite_shared.messages import TokenizedRequest
from kite_shared.model_store import ModelIdentity
from kite_shared.security import tenant_tag
from kite_worker.engines.admission import identity_of, validate_request
from kite_worker.engines.reference.block_cache import BlockCache
from kite_worker.engines.reference.detokenize import IncrementalDetokenizer, StopStringMatcher
from kite_worker.engines.reference.kv_blocks import INITIAL_SPARE_POSITIONS, build_cache, extract_blocks, new_cache
from kite_worker.engines.reference.sampling import make_generator, sample

log = logging.getLogger(__name__)


@dataclass
class NewBlock:
    """A block computed here, for the local cache and the ru-pool."""

    block_hash: BlockHash
    parent_hash: bytes
    block_index: int
    kv: torch.Tensor  # [L, 2, H, block_size, D] in the storage dtype
    model_fingerprint: str  # hex root of the model (base or adapter) that computed it
    tenant_tag: str  # security.tenant_tag of the request's tenant: the pool accounts the block to it


@dataclass
class Sequence:
    request: TokenizedRequest
    identity: ModelIdentity  # the base's, or the request's adapter's
    prompt_ids: list[int]
    prompt_hashes: list[BlockHash]
    reuse: bool
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    admitted_at: float = field(default_factory=time.monotonic)
    cache: DynamicCache | None = None
    num_computed: int = 0  # prompt + generated positions whose KV is in `cache`
    num_cached_tokens: int = 0  # prompt tokens reused instead of computed
    num_prompt_blocks_cached: int = 0  # leading prompt blocks that came from the cache
    prefetched: list[tuple[BlockHash, torch.Tensor]] = field(default_factory=list)  # loaded from the ru-pool
    # Prompt tokens expected to be computed rather than reused, for admission control's backlog until the
    # prefix is injected (then num_computed says it): a shared system prompt must not count as work.
    expected_computed_tokens: int = 0
    num_pool_blocks: int = 0  # of the reused blocks, how many were loaded from the ru-pool
    generated: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    first_token_logits: torch.Tensor | None = None  # kept when `keep_logits` or the engine option says so
    keep_logits: bool = False  # sampled for shadow verification (kite_worker.shadow)
    shadow: bool = False  # a shadow recomputation: counted in no statistic, stores nothing
    finish_reason: str | None = None
    final_text: str = ""  # text released when the sequence finished
    final_token_ids: list[int] = field(default_factory=list)  # the finishing token, unless it was EOS

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prefilling(self) -> bool:
        return not self.generated


@dataclass(frozen=True)
class ReferenceOptions:
    """The reference engine's settings (KITE_REUSE, KITE_BLOCK_SIZE, KITE_KV_STORAGE_DTYPE, ...)."""

    reuse: bool = True  # deployment switch (KITE_REUSE)
    block_size: int = 16
    storage_dtype: torch.dtype = torch.float32  # KITE_KV_STORAGE_DTYPE resolved: the compute dtype
    prefill_chunk_tokens: int = 512
    cache_generated: bool = True
    keep_first_logits: bool = False  # for equivalence tests


class ReferenceModel:
    """A transformers causal LM (a peft model when it serves adapters) run one sequence step at a time."""

    def __init__(self, model, tokenizer, identity: ModelIdentity, block_cache: BlockCache,
                 options: ReferenceOptions, max_context_tokens: int,
                 adapters: dict[str, Adapter] | None = None) -> None:
        self.adapters = dict(adapters or {})  # served now; the peft model may hold unloaded ones too
        self.model = attach_adapters(model, self.adapters)
        self._peft = bool(self.adapters)  # the model is a peft model (from the first adapter on)
        self.tokenizer = tokenizer
        self.identity = identity
        self.block_cache = block_cache
        self.options = options
        self.max_context_tokens = max_context_tokens
        self.compute_dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device  # where the model computes; blocks stay in host memory
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos_ids)
        self.num_prompt_tokens_computed = 0
        self.num_prompt_tokens_reused = 0
        # Model fingerprints (hex) the arbitrator quarantined: their requests neither reuse nor store KV.
        self.quarantined: set[str] = set()
        # measured prefill cost (exponentially weighted); the pool loader's cost model reads it
        self.prefill_seconds_per_token = 0.003
        self.decode_seconds_per_token = 0.0  # measured decode step time (EWMA); 0 until the first step

    # --- admission ---------------------------------------------------------------------------------

    def identity_of(self, request: TokenizedRequest) -> ModelIdentity:
        return identity_of(request, self.identity, self.adapters)

    def new_sequence(self, request: TokenizedRequest) -> Sequence:
        identity = self.identity_of(request)
        hashes = validate_request(request, identity, self.options.block_size, self.max_context_tokens)
        prompt = list(request.prompt_token_ids)
        seq = Sequence(
            request=request, identity=identity, prompt_ids=prompt, prompt_hashes=hashes,
            reuse=self.options.reuse and request.reuse and identity.fingerprint_hex not in self.quarantined,
            generator=make_generator(request.sampling),
            detokenizer=IncrementalDetokenizer(self._decode),
            stops=StopStringMatcher(request.sampling.stop),
        )
        _prime_resumed(seq)  # request migration (issue 7)
        self.expect_reuse(seq, self.block_cache.longest_prefix(hashes) if seq.reuse else 0)
        return seq

    def expect_reuse(self, seq: Sequence, num_blocks: int) -> None:
        """Record that `num_blocks` leading prompt blocks are expected to be reused (local or loaded)."""
        num_tokens = min(num_blocks * self.options.block_size, len(seq.prompt_ids) - 1)
        seq.expected_computed_tokens = len(seq.prompt_ids) - max(0, num_tokens)

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # --- prefill -------------------------------------------------------------------------------------

    def prefill_step(self, seq: Sequence, chunk_tokens: int = 0) -> int | None:
        """Compute the next prompt chunk (`chunk_tokens`, or the engine's prefill chunk); returns the
        first generated token once the prompt is done."""
        with torch.inference_mode():
            if seq.cache is None:
                self._inject_cached_prefix(seq)
            prompt_len = len(seq.prompt_ids)
            end = min(prompt_len, seq.num_computed + (chunk_tokens or self.options.prefill_chunk_tokens))
            started = time.perf_counter()
            logits = self._forward(seq, seq.prompt_ids[seq.num_computed:end])
            if end - seq.num_computed >= self.options.block_size:  # single tokens are decode-like, not prefill
                per_token = (time.perf_counter() - started) / (end - seq.num_computed)
                self.prefill_seconds_per_token += 0.2 * (per_token - self.prefill_seconds_per_token)
            if not seq.shadow:
                self.num_prompt_tokens_computed += end - seq.num_computed
            seq.num_computed = end
            if end < prompt_len:
                return None
            if self.options.keep_first_logits or seq.keep_logits:
                seq.first_token_logits = logits.float().clone()
            return sample(logits, seq.request.sampling, seq.generator)

    def shadow_sequence(self, request: TokenizedRequest) -> Sequence:
        """The prompt of a served request, to recompute without reuse and keep nothing of (a shadow
        check); raises RequestRejected when it can no longer run here (its adapter is gone)."""
        seq = self.new_sequence(request.model_copy(update={"reuse": False}))
        seq.shadow = seq.keep_logits = True
        return seq

    def _inject_cached_prefix(self, seq: Sequence) -> None:
        num_local = self.block_cache.longest_prefix(seq.prompt_hashes) if seq.reuse else 0
        for block_hash, kv in seq.prefetched:  # the loader fetched these after the local prefix
            self.block_cache.put(block_hash, kv, seq.identity.fingerprint_hex)
        seq.prefetched = []
        num_blocks = self.block_cache.longest_prefix(seq.prompt_hashes) if seq.reuse else 0
        seq.num_pool_blocks = max(0, num_blocks - num_local)
        num_tokens = min(num_blocks * self.options.block_size, len(seq.prompt_ids) - 1)
        seq.num_prompt_blocks_cached = num_blocks
        # Room for the prompt and the first answer tokens up front; longer answers grow the buffers.
        capacity = len(seq.prompt_ids) + min(seq.request.sampling.max_tokens or INITIAL_SPARE_POSITIONS,
                                             INITIAL_SPARE_POSITIONS)
        if num_tokens <= 0:
            seq.cache = new_cache(capacity)
            return
        needed = -(-num_tokens // self.options.block_size)
        blocks = self.block_cache.get_prefix(seq.prompt_hashes[:needed])
        seq.cache = build_cache(blocks, num_tokens, self.compute_dtype, capacity, self.device)
        seq.num_computed = num_tokens
        seq.num_cached_tokens = num_tokens
        self.num_prompt_tokens_reused += num_tokens

    def _forward(self, seq: Sequence, token_ids: list[int]) -> torch.Tensor:
        start = seq.num_computed
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(token_ids), dtype=torch.long, device=self.device).unsqueeze(0)
        # logits_to_keep=1: only the last position is sampled, and the LM head over every prompt position
        # (49,152 x 576 per token for SmolLM2) would be about a fifth of a prefill's matrix work.
        with self._adapter_active(seq.request.adapter):
            out = self.model(input_ids=input_ids, past_key_values=seq.cache, position_ids=positions,
                             use_cache=True, logits_to_keep=1)
        seq.cache = out.past_key_values
        # The last position's logits in host memory (free on the CPU): a request's sampling generator is a
        # CPU one, so its seed draws the same numbers whatever device computed the logits.
        return out.logits[0, -1].cpu()

    def _adapter_active(self, adapter: str):
        if not self._peft:
            return nullcontext()
        if not adapter:
            return self.model.disable_adapter()
        if self.model.active_adapter != adapter:
            self.model.set_adapter(adapter)
        return nullcontext()

    # --- adapters loaded at run time (engine thread only: Scheduler.call_on_engine_thread) -------------

    def add_adapter(self, adapter: Adapter) -> None:
        from peft import PeftModel  # only workers that serve adapters import peft

        if not self._peft:
            self.model = PeftModel.from_pretrained(self.model, str(adapter.path), adapter_name=adapter.name,
                                                   is_trainable=False).eval()
            self._peft = True
        else:
            if adapter.name in self.model.peft_config:  # unloaded earlier: its old weights go now
                self.model.delete_adapter(adapter.name)
            self.model.load_adapter(str(adapter.path), adapter_name=adapter.name, is_trainable=False)
            # Activate it now: after a delete_adapter, peft's model-level active_adapter can still name it
            # while its layers have no active adapter, and _adapter_active would then skip set_adapter.
            self.model.set_adapter(adapter.name)
        self.adapters[adapter.name] = adapter

    def remove_adapter(self, name: str) -> None:
        """New requests of `name` are refused from now on; its local blocks are dropped. Its weights stay
        until an adapter of the same name is loaded, so requests still running finish with them."""
        adapter = self.adapters.pop(name)
        self.block_cache.drop_model(adapter.identity.fingerprint_hex)

    # --- decode ----------------------------------------------------------------------------------------

    def decode_step(self, seq: Sequence) -> int:
        """Feed the last generated token and sample the next one."""
        with torch.inference_mode():
            started = time.perf_counter()
            logits = self._forward(seq, [seq.generated[-1]])
            step = time.perf_counter() - started
            self.decode_seconds_per_token += (0.2 * (step - self.decode_seconds_per_token)
                                              if self.decode_seconds_per_token else step)
            seq.num_computed += 1
            return sample(logits, seq.request.sampling, seq.generator)

    def accept_token(self, seq: Sequence, token_id: int) -> tuple[str, bool]:
        """Record a sampled token; returns (text to stream now, finished)."""
        if seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
        params = seq.request.sampling
        if token_id in self.eos_token_ids and not params.ignore_eos:
            seq.finish_reason = "stop"
            return seq.stops.flush(), True
        seq.generated.append(token_id)
        text, stopped = seq.stops.feed(seq.detokenizer.add(token_id))
        if stopped:
            seq.finish_reason = "stop"
            return text, True
        if len(seq.generated) >= (params.max_tokens or 0) or \
                len(seq.prompt_ids) + len(seq.generated) >= self.max_context_tokens:
            seq.finish_reason = "length"
            return text + seq.stops.flush(), True
        return text, False

    # --- keeping blocks ----------------------------------------------------------------------------------

    def store_prompt_blocks(self, seq: Sequence) -> list[NewBlock]:
        """Keep the prompt's newly computed full blocks; returns them for the ru-pool."""
        if not seq.reuse:
            return []
        return self._store(seq, seq.prompt_hashes, seq.num_prompt_blocks_cached)

    def store_generated_blocks(self, seq: Sequence) -> list[NewBlock]:
        """Keep full blocks of prompt + answer whose KV exists (all but the last sampled token)."""
        if not (seq.reuse and self.options.cache_generated) or seq.cache is None:
            return []
        ids = seq.prompt_ids + seq.generated
        num_blocks = min(len(ids), seq.num_computed) // self.options.block_size
        first_new = len(seq.prompt_hashes)
        if num_blocks <= first_new:
            return []
        hashes = block_hash_chain(ids[:num_blocks * self.options.block_size], self.options.block_size,
                                  seq.identity.root, seq.request.cache_salt)
        return self._store(seq, hashes, first_new)

    def _store(self, seq: Sequence, hashes: list[BlockHash], first_new: int) -> list[NewBlock]:
        # Blocks another request stored meanwhile are skipped (computed once, kept once).
        missing = [i for i in range(first_new, len(hashes)) if hashes[i] not in self.block_cache]
        if not missing:
            return []
        with torch.inference_mode():
            tensors = extract_blocks(seq.cache, missing[0], missing[-1] + 1, self.options.block_size,
                                     self.options.storage_dtype)
        new_blocks = []
        owner = tenant_tag(seq.request.tenant)
        fingerprint = seq.identity.fingerprint_hex
        for i in missing:
            kv = tensors[i - missing[0]]
            if self.block_cache.put(hashes[i], kv, fingerprint):
                parent = hashes[i - 1] if i > 0 else seq.identity.root
                new_blocks.append(NewBlock(hashes[i], parent, i, kv, fingerprint, owner))
        return new_blocks


def attach_adapters(model, adapters: dict[str, Adapter]):
    """`model` itself without adapters; else a peft model holding each adapter under its name."""
    if not adapters:
        return model
    from peft import PeftModel  # only workers that serve adapters import peft

    first, *rest = adapters.values()
    model = PeftModel.from_pretrained(model, str(first.path), adapter_name=first.name, is_trainable=False)
    for adapter in rest:
        model.load_adapter(str(adapter.path), adapter_name=adapter.name, is_trainable=False)
    model.eval()
    return model


def _prime_resumed(seq: Sequence) -> None:
    """Request migration: the last `num_resumed_tokens` prompt tokens were generated (and their text sent)
    by a worker that died. Feed them through the detokenizer and stop matcher, discarding the text, so
    this worker's state is exactly the dead one's: a split UTF-8 character or a partial stop string
    pending at the migration continues correctly."""
    num = min(seq.request.num_resumed_tokens, len(seq.prompt_ids))
    for token_id in seq.prompt_ids[len(seq.prompt_ids) - num:]:
        seq.stops.feed(seq.detokenizer.add(token_id))
