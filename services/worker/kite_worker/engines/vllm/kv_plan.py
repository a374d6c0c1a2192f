"""Which KITE blocks a vLLM request loads and saves, step by step: the KV connector's bookkeeping.

Pure: no vLLM, torch or I/O here (the connector in `kv_connector.py` feeds it vLLM's scheduler facts and
turns its answers into copies), so every rule is unit-tested with exact hashes.

A KITE block is one vLLM block (KITE_BLOCK_SIZE = vLLM's block_size), so a block hash names whole paged
blocks and copies never split a block: vLLM-CPU stores a block's keys in an ISA-specific packed order,
which only a whole-block byte copy preserves.

Per request:
- **hashes**: KITE's chain over the request's tokens (model-state and execution-path root, tenant salt),
  extended as generated tokens fill blocks;
- **load**: after vLLM's own prefix-cache hit of `num_local` tokens, the agent fetched the next
  `num_loadable` blocks from the ru-pool into staging; the connector reports them to vLLM, which allocates
  paged blocks for them, and `plan_step` emits (paged block id, hash) pairs to copy in before the forward;
  never past `len(prompt) - 1` tokens, so the last prompt token is always computed and sampled from,
  nor past the blocks the pool held when the front end looked (`RequestParams.pool_blocks`);
- **save**: every block whose KV exists here and that this worker has not saved yet (nor loaded from the
  pool) is saved once its tokens are known (with async scheduling a sampled token reaches the request a
  step later), up to `max_save_blocks` (the write policy's choice; prompt-only when generated blocks are
  not kept). Local prefix-cache hits are saved too when they were never saved: under the selective
  policy a block is held back the first time and saved when a second request asks for it, which on vLLM
  is a local hit.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from kite_shared.fingerprint import BlockHash, block_hash_chain

PARAMS_KEY = "kite"  # KITE's entry in a vLLM request's kv_transfer_params


@dataclass(frozen=True)
class RequestParams:
    """What the worker's front end decided for one request (vLLM kv_transfer_params["kite"])."""

    cache_salt: str  # the tenant salt of block 0's hash, as in TokenizedRequest
    tenant: str  # owner of saved blocks in the ru-pool's accounting
    load: bool  # may load blocks from the ru-pool
    save: bool  # may save computed blocks to the ru-pool
    save_generated: bool  # also blocks of generated tokens (so a chat's next turn reuses the answer)
    max_save_blocks: int = -1  # write policy: save at most this many leading blocks (-1: no limit)
    # Leading prompt blocks the ru-pool held at admission (-1: unknown, the connector asks it): blocks past
    # it are not asked for, so the common miss never costs vLLM's scheduler a round trip to the pool.
    pool_blocks: int = -1
    # Hex root of the request's model (a LoRA adapter's namespace); "" for the base the connector serves.
    model_fingerprint: str = ""

    def encode(self) -> dict:
        return {"cache_salt": self.cache_salt, "tenant": self.tenant, "load": self.load, "save": self.save,
                "save_generated": self.save_generated, "max_save_blocks": self.max_save_blocks,
                "pool_blocks": self.pool_blocks, "model_fingerprint": self.model_fingerprint}

    @classmethod
    def decode(cls, raw: dict | None) -> "RequestParams | None":
        if not raw:
            return None
        return cls(cache_salt=str(raw.get("cache_salt", "")), tenant=str(raw.get("tenant", "")),
                   load=bool(raw.get("load")), save=bool(raw.get("save")),
                   save_generated=bool(raw.get("save_generated")),
                   max_save_blocks=int(raw.get("max_save_blocks", -1)),
                   pool_blocks=int(raw.get("pool_blocks", -1)),
                   model_fingerprint=str(raw.get("model_fingerprint", "")))


@dataclass
class RequestPlan:
    params: RequestParams
    num_prompt_tokens: int
    root: BlockHash  # the request's model root: the base's or its adapter's (hashes and units are its own)
    hashes: list[BlockHash] = field(default_factory=list)  # chain over the tokens known so far
    block_ids: list[int] = field(default_factory=list)  # vLLM's paged block table (group 0)
    first_load_block: int = 0  # index of the first block the staged load covers
    num_loadable: int = 0  # staged blocks from first_load_block on (fetched and verified)
    num_local_tokens: int = 0  # vLLM's own prefix-cache hit when it last asked for matched tokens
    pending_load: tuple[int, int] | None = None  # (first block, count) vLLM allocated for loading
    loaded_blocks: range = range(0)  # block indices that came from the pool (never saved back)
    next_save_block: int = 0  # blocks before it are saved (or never will be)

    def max_reusable_blocks(self, block_size: int) -> int:
        return max(0, (self.num_prompt_tokens - 1) // block_size)


@dataclass(frozen=True)
class BlockCopy:
    block_id: int  # paged block in vLLM's KV cache
    block_hash: BlockHash
    block_index: int  # position of the block in its request's chain


@dataclass(frozen=True)
class SavedBlockInfo:
    """What the ru-pool needs beside the bytes to store one saved block as a recyclable unit."""

    block_hash: BlockHash
    parent_hash: BlockHash  # the previous block's hash, or the root for block 0
    block_index: int
    tenant: str
    model_fingerprint: str  # hex root of the model that computed it (the base's or an adapter's)


@dataclass
class StepPlan:
    loads: list[BlockCopy] = field(default_factory=list)
    saves: list[BlockCopy] = field(default_factory=list)


class KVPlanner:
    """Per-request load and save decisions of the scheduler-side connector."""

    def __init__(self, block_size: int, root: BlockHash, max_saved_hashes: int = 65536) -> None:
        self.block_size = block_size
        self.root = root
        self.requests: dict[str, RequestPlan] = {}
        # Blocks this worker saved or loaded lately: not saved again (the pool has them). Bounded: a block
        # forgotten here is at worst saved twice, and the pool ignores a unit it holds.
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._max_known = max_saved_hashes

    # --- admission ------------------------------------------------------------------------------------

    def track(self, request_id: str, params: RequestParams, prompt: Sequence[int]) -> RequestPlan:
        plan = self.requests.get(request_id)
        if plan is None:
            root = BlockHash(bytes.fromhex(params.model_fingerprint)) if params.model_fingerprint else self.root
            plan = RequestPlan(params=params, num_prompt_tokens=len(prompt), root=root)
            plan.hashes = block_hash_chain(prompt, self.block_size, root, params.cache_salt)
            self.requests[request_id] = plan
        return plan

    def wanted(self, request_id: str, num_local_tokens: int) -> list[BlockHash]:
        """Hashes worth fetching from the pool: the reusable prompt blocks after vLLM's own hit (and, when
        the front end looked, before the end of what the pool held)."""
        plan = self.requests[request_id]
        if not plan.params.load:
            return []
        first = num_local_tokens // self.block_size
        end = plan.max_reusable_blocks(self.block_size)
        if plan.params.pool_blocks >= 0:
            end = min(end, plan.params.pool_blocks)
        return plan.hashes[first:end]

    def set_loadable(self, request_id: str, first_block: int, num_blocks: int) -> None:
        plan = self.requests[request_id]
        plan.first_load_block, plan.num_loadable = first_block, num_blocks

    def num_matched_tokens(self, request_id: str, num_local_tokens: int) -> int:
        """Tokens beyond vLLM's hit of `num_local_tokens` that staged blocks supply (block-aligned)."""
        plan = self.requests.get(request_id)
        if plan is None:
            return 0
        plan.num_local_tokens = num_local_tokens
        first = num_local_tokens // self.block_size
        end = min(plan.first_load_block + plan.num_loadable, plan.max_reusable_blocks(self.block_size))
        if first < plan.first_load_block:  # staged blocks do not start right after the local hit
            return 0
        return max(0, end - first) * self.block_size

    def allocated(self, request_id: str, num_external_tokens: int) -> None:
        """vLLM allocated blocks for a load of `num_external_tokens` after its local hit."""
        plan = self.requests.get(request_id)
        if plan is not None and num_external_tokens > 0:
            plan.pending_load = (plan.num_local_tokens // self.block_size, num_external_tokens // self.block_size)

    # --- each scheduler step ---------------------------------------------------------------------------

    def plan_step(self, request_id: str, block_ids: list[int] | None, replace_block_ids: bool,
                  num_computed_tokens: int, num_scheduled_tokens: int,
                  all_token_ids: Sequence[int]) -> StepPlan:
        """Copies for one scheduled request in this step. `block_ids` are new paged blocks (appended) or,
        with `replace_block_ids`, the whole table (a new or resumed request); `num_computed_tokens` counts
        the tokens whose KV existed before this step (local hits and loads included)."""
        step = StepPlan()
        plan = self.requests.get(request_id)
        if plan is None:
            return step
        if block_ids is not None:
            plan.block_ids = list(block_ids) if replace_block_ids else plan.block_ids + list(block_ids)
        if plan.pending_load is not None:
            first, count = plan.pending_load
            plan.pending_load = None
            plan.loaded_blocks = range(first, first + count)
            for i in plan.loaded_blocks:
                step.loads.append(BlockCopy(plan.block_ids[i], plan.hashes[i], i))
                self._remember(plan.hashes[i])
        if not plan.params.save:
            return step
        limit = (num_computed_tokens + num_scheduled_tokens) // self.block_size  # full after this step
        if not plan.params.save_generated:
            limit = min(limit, plan.num_prompt_tokens // self.block_size)
        if plan.params.max_save_blocks >= 0:
            limit = min(limit, plan.params.max_save_blocks)
        limit = min(limit, len(all_token_ids) // self.block_size, len(plan.block_ids))
        if limit > len(plan.hashes):
            plan.hashes = block_hash_chain(all_token_ids[:limit * self.block_size], self.block_size,
                                           plan.root, plan.params.cache_salt)
        for i in range(plan.next_save_block, limit):
            if i in plan.loaded_blocks or bytes(plan.hashes[i]) in self._known:
                continue
            step.saves.append(BlockCopy(plan.block_ids[i], plan.hashes[i], i))
            self._remember(plan.hashes[i])
        plan.next_save_block = max(plan.next_save_block, limit)
        return step

    def _remember(self, block_hash: BlockHash) -> None:
        key = bytes(block_hash)
        self._known[key] = None
        self._known.move_to_end(key)
        while len(self._known) > self._max_known:
            self._known.popitem(last=False)

    def saved_info(self, request_id: str, copy: BlockCopy) -> SavedBlockInfo:
        plan = self.requests[request_id]
        parent = plan.hashes[copy.block_index - 1] if copy.block_index > 0 else plan.root
        return SavedBlockInfo(copy.block_hash, parent, copy.block_index, plan.params.tenant,
                              bytes(plan.root).hex())

    def finished(self, request_id: str) -> None:
        self.requests.pop(request_id, None)


class LocalBlockMirror:
    """vLLM's own prefix cache, in KITE's block hashes: turns vLLM's KV cache events (blocks stored in and
    removed from its paged cache, named by vLLM's hashes) into the block hashes the ru-pool's index and
    the router know, so the fleet learns what this worker holds and what it evicted.

    vLLM names blocks by its own hashes only; the connector `learn`s the pairing for the blocks of the
    requests it tracks, with the model fingerprint (base or adapter) whose namespace they belong to. The
    two arrive in either order (a block computed by a request without KITE parameters is stored before any
    tracked request names it), so the mirror keeps the set of vLLM blocks held and announces a held block
    once both are known:
    - `stored` / `learn`: a held block with a KITE hash is announced "stored" (once while held);
    - `removed`: an announced block is announced "removed"; `cleared`: everything is.
    Announcements are drained with `take_events()` as ("stored" | "removed", model fingerprint, KITE
    hashes) or ("cleared", "", []), in order. Pairings are a bounded LRU and outlive evictions (the same
    prefix cached again is announced under the same KITE hash); `held` is bounded by vLLM's own number of
    blocks."""

    def __init__(self, max_pairs: int = 1 << 18) -> None:
        # vLLM external hash -> (model fingerprint, KITE hash)
        self._kite_of: OrderedDict[object, tuple[str, BlockHash]] = OrderedDict()
        self._max_pairs = max_pairs
        self.held: set[object] = set()  # vLLM hashes of the blocks in vLLM's cache now
        self._announced: dict[object, tuple[str, BlockHash]] = {}  # held blocks the index was told about
        self._events: list[tuple[str, str, list[BlockHash]]] = []

    def learn(self, vllm_hashes: Sequence[object], kite_hashes: Sequence[BlockHash], model_fingerprint: str) -> None:
        for vllm_hash, kite_hash in zip(vllm_hashes, kite_hashes):
            self._kite_of[vllm_hash] = (model_fingerprint, kite_hash)
            self._kite_of.move_to_end(vllm_hash)
        while len(self._kite_of) > self._max_pairs:
            self._kite_of.popitem(last=False)
        self._announce_held(vllm_hashes)

    def stored(self, vllm_hashes: Sequence[object]) -> None:
        self.held.update(vllm_hashes)
        self._announce_held(vllm_hashes)

    def removed(self, vllm_hashes: Sequence[object]) -> None:
        gone = []
        for vllm_hash in vllm_hashes:
            self.held.discard(vllm_hash)
            named = self._announced.pop(vllm_hash, None)
            if named is not None:
                gone.append(named)
        self._emit("removed", gone)

    def cleared(self) -> None:
        self.held.clear()
        self._announced.clear()
        self._events.append(("cleared", "", []))

    def take_events(self) -> list[tuple[str, str, list[BlockHash]]]:
        events, self._events = self._events, []
        return events

    def _announce_held(self, vllm_hashes: Sequence[object]) -> None:
        new = []
        for vllm_hash in vllm_hashes:
            named = self._kite_of.get(vllm_hash)
            if named is not None and vllm_hash in self.held and vllm_hash not in self._announced:
                self._announced[vllm_hash] = named
                new.append(named)
        self._emit("stored", new)

    def _emit(self, kind: str, named: list[tuple[str, BlockHash]]) -> None:
        for model_fingerprint, kite_hash in named:
            last = self._events[-1] if self._events else None
            if last is not None and last[0] == kind and last[1] == model_fingerprint:
                last[2].append(kite_hash)  # consecutive changes of one kind and model: one message
            else:
                self._events.append((kind, model_fingerprint, [kite_hash]))
