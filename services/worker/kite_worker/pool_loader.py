"""Load a request's missing prefix blocks from the ru-pool's tiers, when that beats recomputing them.

Boundary: runs on the worker's asyncio thread, before a request enters the engine queue. It knows the
ru-pool's NATS client (lookup, and `get` for blocks only in the pool's memory) and the shared tier
client (warm Redis and cold S3/folder are read directly: docs/ru-pool.md measured direct reads several
times faster than relaying ~369 KB units through the pool over NATS). Since the pool never sees those
reads, the loader reports them (kite_shared.tiers.hit_report: batched, off the request's path) and the
pool promotes them into hot as its own get would have. It never touches the block cache: loaded blocks
ride on the Sequence and the engine thread inserts them.

Cost model (the LMCache lesson, #1639: a slow tier must never make a hit slower than a miss):
    fetch_time(k)     = sum over the tiers used by the first k missing blocks of
                        latency[tier] + bytes[tier] / bandwidth[tier]
    recompute_time(k) = k * block_size * prefill_seconds_per_token   (measured by the engine)
The loader takes the longest run of missing blocks whose estimated fetch time is below its recompute
time, and gives the fetch a deadline of that recompute time; a fetch that misses its deadline loads
nothing and the whole run is computed (so a hit never costs more than the miss plus that deadline). Each tier's bandwidth is an exponentially weighted average over this worker's
own fetches (wall time of whole fetches, so it folds latency in), seeded with conservative guesses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator, Sequence as Seq

import torch

from kite_shared import kv_codec
from kite_shared.fingerprint import BlockHash
from kite_shared.recyclable_unit import RecyclableUnit, RUError, payload_bytes
from kite_shared.security import ANONYMOUS_TENANT, tenant_tag
from kite_shared.tier_codecs import TierCodecs
from kite_shared.tiers.base import check_units
from kite_shared.tiers.hit_report import HitReporter
from kite_worker import codec_tensors

log = logging.getLogger(__name__)

Buffer = bytes | memoryview  # an encoded unit as the pool (inline, or a mapped hand-off file) or a tier gave it
_EWMA_WEIGHT = 0.2  # weight of the newest sample


@dataclass
class TierEstimate:
    latency_s: float  # fixed per-fetch overhead guess
    bytes_per_s: float  # measured: bytes over wall time of whole fetches (so it includes latency)

    def observe(self, seconds: float, num_bytes: int) -> None:
        if num_bytes > 0 and seconds > 0:
            self.bytes_per_s += _EWMA_WEIGHT * (num_bytes / seconds - self.bytes_per_s)


@dataclass
class CostModel:
    """Pure: estimates and the load-or-recompute decision. Tier letters: h (pool memory), w, c."""

    block_size: int
    block_bytes: int  # of a unit as workers write it (the hot tier's codec)
    prefill_seconds_per_token: float = 0.003  # replaced by the engine's measurement
    # Seeds, replaced by this worker's own fetches: bench/bench_data_plane.py on the 2-core CI machine
    # (2026-12-06, verified reads of 128 float32 blocks of 32 tokens, the default's), the low ends of five
    # runs, two of them beside other test suites. Hot: 912-3,473 MB/s on the pool's block stream, the path
    # of a worker on another host (one on the pool's host maps the pool's files at 4,355-8,178 MB/s on a
    # first fetch; one that can reach neither gets 239-442 inline: each learns its own on its first
    # fetch); warm: 850-2,659 MB/s; cold: 177-547 MB/s from an S3 server.
    tiers: dict[str, TierEstimate] = field(default_factory=lambda: {
        "h": TierEstimate(latency_s=0.002, bytes_per_s=900e6),
        "w": TierEstimate(latency_s=0.001, bytes_per_s=850e6),
        "c": TierEstimate(latency_s=0.010, bytes_per_s=170e6),
    })

    # A unit's bytes in the tiers whose codec differs from the hot tier's (a lossy warm or cold tier).
    tier_block_bytes: dict[str, int] = field(default_factory=dict)

    @classmethod
    def for_units(cls, block_size: int, shape: tuple[int, ...], storage_dtype: torch.dtype,
                  tier_codecs: TierCodecs) -> CostModel:
        """The cost model of units of `shape`, stored as `tier_codecs` says."""
        def size(lossy_codec: str) -> int:
            return payload_bytes(kv_codec.unit_codec(storage_dtype, lossy_codec), shape)
        return cls(block_size, size(tier_codecs.hot),
                   tier_block_bytes={"w": size(tier_codecs.warm), "c": size(tier_codecs.cold)})

    def fetch_seconds(self, letters: bytes) -> float:
        total = 0.0
        for letter in {chr(c) for c in letters}:
            estimate = self.tiers[letter]
            num_bytes = letters.count(ord(letter)) * self.tier_block_bytes.get(letter, self.block_bytes)
            total += estimate.latency_s + num_bytes / estimate.bytes_per_s
        return total

    def recompute_seconds(self, num_blocks: int) -> float:
        return num_blocks * self.block_size * self.prefill_seconds_per_token

    def prefix_fetch_seconds(self, letters: bytes) -> Iterator[float]:
        """`fetch_seconds(letters[:k])` for k = 1, 2, ..., in one pass, O(len * tiers), the same floats.

        Running counts per tier; each prefix's terms are summed over the same tiers in the same order as
        `fetch_seconds` sums them: the order of a set of the prefix's letters, which is the order of the
        set built by adding each letter when it first appears (the letters are not sorted: a set of
        strings iterates in an order of their hashes, which PYTHONHASHSEED varies)."""
        counts: dict[str, int] = {}
        present: set[str] = set()
        terms: list[tuple[str, float, int, float]] = []  # (letter, latency, bytes a block, bytes/s)
        for code in letters:
            letter = chr(code)
            if letter not in counts:
                counts[letter] = 0
                present.add(letter)
                terms = [(x, self.tiers[x].latency_s, self.tier_block_bytes.get(x, self.block_bytes),
                          self.tiers[x].bytes_per_s) for x in present]
            counts[letter] += 1
            total = 0.0
            for x, latency, block_bytes, rate in terms:
                total += latency + counts[x] * block_bytes / rate
            yield total

    def plan(self, letters: bytes) -> int:
        """How many of these missing leading blocks (tier letter each) to load rather than compute: the
        longest prefix whose fetch time is below its recompute time. Linear in len(letters) (issue 38:
        it called fetch_seconds on every prefix, quadratic), with the same floats and so the same answer."""
        best = 0
        for k, fetch_s in enumerate(self.prefix_fetch_seconds(letters), start=1):
            if fetch_s < self.recompute_seconds(k):
                best = k
        return best


class PoolLoader:
    def __init__(self, pool, tier_client, cost: CostModel, model_fingerprint: str,
                 block_shape: tuple[int, ...], storage_dtype: torch.dtype, mac_key: bytes | None,
                 staging_bytes: int = 64 << 20, tier_codecs: TierCodecs = TierCodecs(),
                 report_hits: bool = True) -> None:
        self.pool = pool  # kite_shared.tiers.pool_client.PoolClient
        self.tier_client = tier_client  # kite_shared.tiers.client.TierClient | None
        self.cost = cost
        self.model_fingerprint = model_fingerprint  # the base model's; a request's adapter has its own
        self.block_shape = block_shape  # [layers, 2, kv_heads, block_size, head_dim]
        self.storage_dtype = storage_dtype
        self.mac_key = mac_key  # cluster RU key: a unit without a valid MAC is never loaded
        self.staging_bytes = staging_bytes
        # The codecs this worker's namespace stores (its fingerprint says so): lossy units load only when
        # one of its tiers has their codec.
        self.tier_codecs = tier_codecs
        # Blocks read from warm or cold here are reported to the pool, which promotes them as its own get
        # would have (docs/ru-pool.md, "Lifecycle", Promotion); without a pool or direct reads there is
        # nothing to report. `report_hits=False` only for tests that show what the reports change.
        self.hits: HitReporter | None = (
            HitReporter(pool.tier_hits, worker_id=pool.worker_id)
            if report_hits and pool is not None and tier_client is not None else None)
        self._staged: OrderedDict[BlockHash, torch.Tensor] = OrderedDict()
        self._staged_bytes = 0
        self._lock = asyncio.Lock()
        self.num_blocks_loaded = 0
        self.num_loads_timed_out = 0
        self.num_rejected = 0

    async def load(self, hashes: Seq[BlockHash], num_local: int, tenant: str = ANONYMOUS_TENANT,
                   model_fingerprint: str = "") -> list[tuple[BlockHash, torch.Tensor]]:
        """Leading blocks after the first `num_local` (already in the worker cache) that the pool has and
        that are cheaper to load than to compute; verified and ready to insert. `tenant` is the
        request's: its blocks are stored under its tenant tag. `model_fingerprint`: the request's model
        (an adapter's), when not the base's.

        Loads run one at a time and loaded blocks stay staged (a small LRU) until the engine has them:
        requests queued behind each other with the same prefix share one copy of its blocks instead of
        each fetching and holding its own (200 queued requests would otherwise hold 200 copies)."""
        async with self._lock:
            missing = list(hashes[num_local:])
            staged = []
            for block_hash in missing:
                tensor = self._staged.get(block_hash)
                if tensor is None:
                    break
                self._staged.move_to_end(block_hash)
                staged.append((block_hash, tensor))
            fetched = (await self._load_uncached(missing[len(staged):], tenant,
                                                 model_fingerprint or self.model_fingerprint)
                       if len(staged) < len(missing) else [])
            for block_hash, tensor in fetched:
                self._stage(block_hash, tensor)
            return staged + fetched

    async def flush_hits(self) -> None:
        """Report the pending direct hits now (a worker stopping; tests)."""
        if self.hits is not None:
            await self.hits.flush()

    def forget_staged(self) -> None:
        """Drop every staged block (a namespace was quarantined: none of its loaded copies may be reused)."""
        self._staged.clear()
        self._staged_bytes = 0

    def _stage(self, block_hash: BlockHash, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if size > self.staging_bytes:
            return
        self._staged[block_hash] = tensor
        self._staged_bytes += size
        while self._staged_bytes > self.staging_bytes:
            _, old = self._staged.popitem(last=False)
            self._staged_bytes -= old.numel() * old.element_size()

    async def _load_uncached(self, missing: list[BlockHash], tenant: str,
                             model_fingerprint: str) -> list[tuple[BlockHash, torch.Tensor]]:
        lookup = await self.pool.lookup(model_fingerprint, [bytes(h) for h in missing],
                                        include_workers=False)
        if lookup is None or lookup.invalidated or lookup.pool == 0:
            log.debug("pool lookup of %d blocks: %s", len(missing), "no answer" if lookup is None else
                      "invalidated" if lookup.invalidated else "none held")
            return []
        letters = bytes(lookup.tiers[:lookup.pool])
        num_to_load = self.cost.plan(letters)
        if num_to_load == 0:
            log.debug("pool holds %d blocks (%s); the cost model computes them (%.2f ms/token)",
                      lookup.pool, letters.decode(), 1000 * self.cost.prefill_seconds_per_token)
            return []
        deadline_s = self.cost.recompute_seconds(num_to_load)
        wanted = missing[:num_to_load]
        started = time.perf_counter()
        try:
            units = await asyncio.wait_for(self._fetch(wanted, letters[:num_to_load], tenant, model_fingerprint), timeout=deadline_s)
        except asyncio.TimeoutError:
            self.num_loads_timed_out += 1
            log.info("pool fetch of %d blocks passed its %.3f s budget; computing instead", num_to_load, deadline_s)
            return []
        log.debug("pool fetch of %d blocks (%s) took %.3f s of its %.3f s budget", num_to_load,
                  letters[:num_to_load].decode(), time.perf_counter() - started, deadline_s)
        loaded = []
        for block_hash, unit in zip(wanted, self._verified(wanted, units, tenant_tag(tenant), model_fingerprint)):
            tensor = self._to_tensor(block_hash, unit)
            if tensor is None:
                break
            loaded.append((block_hash, tensor))
        self.num_blocks_loaded += len(loaded)
        return loaded

    async def _fetch(self, hashes: list[BlockHash], letters: bytes, tenant: str,
                     model_fingerprint: str) -> list[Buffer | RecyclableUnit | None]:
        """Units in order, fetched concurrently per tier: encoded bytes from the pool (to verify here),
        decoded units from direct tier reads (verified by the tier client), None where none could be had."""
        results: list[Buffer | RecyclableUnit | None] = [None] * len(hashes)
        from_pool = [i for i, c in enumerate(letters) if c == ord("h") or self.tier_client is None]
        direct = [i for i in range(len(hashes)) if i not in set(from_pool)]

        async def via_pool() -> None:
            if not from_pool:
                return
            started = time.perf_counter()
            units = await self.pool.get(model_fingerprint, [bytes(hashes[i]) for i in from_pool],
                                        tenant=tenant)
            self.cost.tiers["h"].observe(time.perf_counter() - started, sum(map(len, units)))
            for i, data in zip(from_pool, units):
                results[i] = data

        # Direct reads: the warm blocks in one pipelined batch, the cold ones in one batch of concurrent
        # reads (and the warm batch's misses from cold after it). Each tier is observed once per fetch, its bytes over the
        # wall time until its last block arrived. (Observing each block over its own wall time would
        # count the shared bandwidth once per concurrent read: 16 reads would make a tier look 16 times
        # slower than it is, and the plan would stop using it for good.)
        direct_started = time.perf_counter()
        arrived: dict[str, list] = {}  # tier letter -> [bytes, time the last block arrived]
        owner = tenant_tag(tenant)
        warm, cold = (self.tier_client.warm, self.tier_client.cold) if self.tier_client else (None, None)

        direct_hits: list[int] = []  # blocks read from warm or cold here ...
        hit_letters = bytearray()  # ... and the tier each came from

        def take(i: int, found, letter: str) -> bool:
            if found is None:
                return False
            results[i] = found[0]
            direct_hits.append(i)
            hit_letters.append(ord(letter))
            tier = arrived.setdefault(letter, [0, 0.0])
            tier[0] += len(found[1])
            tier[1] = time.perf_counter()
            return True

        async def from_cold(indices: list[int]) -> None:
            if cold is None or not indices:
                return
            # One batch: the reads run concurrently and the batch is verified a share per core off the
            # event loop (per-block `get_unit` would verify each on the loop, one core).
            found = await cold.get_units(model_fingerprint, [bytes(hashes[i]) for i in indices], owner)
            for i, hit in zip(indices, found):
                take(i, hit, "c")

        async def from_warm(indices: list[int]) -> None:
            if warm is None:
                await from_cold(indices)
                return
            found = await warm.get_units(model_fingerprint, [bytes(hashes[i]) for i in indices], owner)
            await from_cold([i for i, hit in zip(indices, found) if not take(i, hit, "w")])

        try:
            await asyncio.gather(via_pool(), from_warm([i for i in direct if letters[i] == ord("w")]),
                                 from_cold([i for i in direct if letters[i] != ord("w")]))
        finally:  # also when the deadline cut the fetch short: what arrived by then is a measurement
            for letter, (num_bytes, last) in arrived.items():
                self.cost.tiers[letter].observe(last - direct_started, num_bytes)
            # ... and a hit worth promoting: the next request for it is then served from hot.
            if self.hits is not None and direct_hits:
                self.hits.record(model_fingerprint, owner, [bytes(hashes[i]) for i in direct_hits],
                                 bytes(hit_letters))
        return results

    def _verified(self, hashes: list[BlockHash], units: list[Buffer | RecyclableUnit | None], owner: str,
                  model_fingerprint: str) -> list[RecyclableUnit | None]:
        """`units` with the pool's encoded bytes verified here (all at once, on every core: `check_units`);
        units read from tiers directly were verified by the tier client. None for a rejected unit. Only
        the units before the first miss are verified: a prefix loads up to its first gap."""
        num_usable = next((i for i, found in enumerate(units) if found is None), len(units))
        crossed = [i for i in range(num_usable) if not isinstance(units[i], RecyclableUnit)]
        outcomes = check_units([units[i] for i in crossed], [bytes(hashes[i]) for i in crossed],
                               model_fingerprint, self.mac_key, owner)
        verified: list[RecyclableUnit | None] = [u if isinstance(u, RecyclableUnit) else None
                                                 for u in units[:num_usable]] + [None] * (len(units) - num_usable)
        for i, outcome in zip(crossed, outcomes):
            if isinstance(outcome, RUError):
                self.num_rejected += 1
                self.pool.forget(units[i])  # not served again from a kept mapping
                log.warning("pool block %s rejected: %s", bytes(hashes[i]).hex()[:16], outcome)
            else:
                verified[i] = outcome
        return verified

    def _to_tensor(self, block_hash: BlockHash, unit: RecyclableUnit | None) -> torch.Tensor | None:
        if unit is None:
            return None
        if unit.codec not in codec_tensors.LOSSLESS and unit.codec not in self.tier_codecs.lossy:
            # A lossy unit is not the block that was computed: only a namespace that chose the codec
            # (its fingerprint holds it) may load it.
            self.num_rejected += 1
            log.warning("pool block %s is %s (lossy): this worker loads %s", bytes(block_hash).hex()[:16],
                        unit.codec, ", ".join(self.tier_codecs.lossy) or "exact KV only")
            return None
        if tuple(unit.shape) != tuple(self.block_shape):
            self.num_rejected += 1
            log.warning("pool block %s has shape %s, this worker needs %s", bytes(block_hash).hex()[:16],
                        unit.shape, self.block_shape)
            return None
        payload = unit.payload
        if unit.codec in kv_codec.LOSSY:
            try:
                return codec_tensors.decode(payload, unit.codec, tuple(unit.shape), self.storage_dtype)
            except kv_codec.CodecError as exc:  # a valid MAC over bad scales: a writer's bug, still a miss
                self.num_rejected += 1
                log.warning("pool block %s does not decode: %s", bytes(block_hash).hex()[:16], exc)
                return None
        if not isinstance(payload, memoryview) or payload.readonly:
            # Bytes that arrived in a NATS reply or a tier read: torch needs writable memory of its own.
            # (A mapped hand-off file is writable copy-on-write memory already: used as it is.)
            payload = bytearray(payload)
        tensor = torch.frombuffer(payload, dtype=codec_tensors.LOSSLESS[unit.codec]).reshape(unit.shape)
        return tensor.to(self.storage_dtype)
