"""The control plane: liveness (heartbeats, pings), telemetry, arbitrator decisions and admin.

Which subject carries each message, who sends it to whom and when: kite_shared.subjects.TABLE
(docs/subjects.md).

`TELEMETRY_SCHEMA` is bumped when a telemetry or decision field changes meaning; such messages of another
schema fail to decode (MessageError), so receivers ignore them.
"""

from __future__ import annotations

import time
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kite_shared.messages.base import Message, OneOf
from kite_shared.messages.pool import TierStats
from kite_shared.messages.requests import ErrorInfo

# --- liveness ----------------------------------------------------------------------------------------


class Heartbeat(Message):
    """Every service, every KITE_HEARTBEAT_INTERVAL_S, on subjects.heartbeat(service)."""

    KIND: ClassVar[str] = "heartbeat"
    service: str  # one of subjects.SERVICES
    instance_id: str
    started_at: float  # unix seconds
    sent_at: float  # unix seconds
    model: str = ""  # worker and fingerprinter: the model id they serve
    max_context_tokens: int = 0  # worker and fingerprinter: the model's context window
    adapters: list[str] = Field(default_factory=list)  # worker and fingerprinter: the LoRA adapters served beside `model`
    # fingerprinter: model id as requested (the base, each adapter by its name and as "<base>:<adapter>") ->
    # hex model fingerprint (fingerprint.ModelIdentity): what the gateway's semantic cache keys answers by
    model_fingerprints: dict[str, str] = Field(default_factory=dict)
    num_running: int = 0  # worker: requests generating now
    num_queued: int = 0  # worker: requests waiting for a slot
    draining: bool = False  # the process got SIGTERM and takes no new work


class Ping(Message):
    KIND: ClassVar[str] = "ping"


class Pong(Message):
    KIND: ClassVar[str] = "pong"
    service: str
    instance_id: str
    uptime_s: float


# --- telemetry -------------------------------------------------------------------------------------

TELEMETRY_SCHEMA = 1

WritePolicy = Literal["write_through", "selective", "off"]
RoutingMode = Literal["cache_aware", "least_loaded", "round_robin", "queue_group"]
WRITE_POLICIES: tuple[str, ...] = ("write_through", "selective", "off")
ROUTING_MODES: tuple[str, ...] = ("cache_aware", "least_loaded", "round_robin", "queue_group")


def _this_schema(version: int) -> int:
    if version != TELEMETRY_SCHEMA:
        raise ValueError(f"telemetry schema {version}, this build speaks {TELEMETRY_SCHEMA}")
    return version


class Telemetry(Message):
    KIND: ClassVar[str] = "telemetry"
    schema_version: int = TELEMETRY_SCHEMA
    instance_id: str
    sent_at: float = Field(default_factory=time.time)  # unix seconds

    _check_schema = field_validator("schema_version")(_this_schema)


class WorkerTelemetry(Telemetry):
    KIND: ClassVar[str] = "worker_telemetry"
    queue_depth: int = 0  # requests admitted, waiting for a slot (incl. loading pool blocks)
    num_running: int = 0  # requests generating now
    max_running: int = 1  # KITE_WORKER_MAX_RUNNING
    running_tokens: int = 0  # KV positions held by running requests (prompt + generated)
    prefill_backlog_tokens: int = 0  # prompt tokens admitted but not computed yet
    cache_bytes: int = 0  # local hot cache use
    cache_capacity_bytes: int = 0  # KITE_WORKER_CACHE_BYTES (watermark = bytes / capacity)
    memory_used_fraction: float = 0.0  # host memory in use, 1 - MemAvailable / MemTotal (0 if unknown)
    local_hit_rate: float = 0.0  # reused / prompt tokens over the window
    prompt_tokens_window: int = 0  # prompt tokens the hit rate is over
    prefill_tokens_per_s: float = 0.0  # measured by the engine (EWMA)
    decode_tokens_per_s: float = 0.0  # measured by the engine (EWMA)
    ttft_p50_s: float = 0.0  # admission -> first token over the window
    ttft_p99_s: float = 0.0
    ttft_samples: int = 0
    healthy: bool = True  # engine thread alive, not draining
    standby: bool = False  # model loaded but not taking traffic
    draining: bool = False
    write_policy: str = "write_through"  # the Upcycle write policy in force
    pool_read: bool = True  # loads missing prefix blocks from the ru-pool (routing credits pool hits)
    requests_accepted: int = 0  # lifetime
    # Requests admitted since this worker's previous telemetry message (the newest 1,000), counted in this
    # one's load: a router stops counting them as sent-but-unreported (it counts from its decision on).
    admitted_request_ids: list[str] = Field(default_factory=list)
    # warm capacity: the decision that activated this worker and decision -> first accepted request
    activation_decision_id: str = ""
    activation_latency_s: float | None = None


class PoolTelemetry(Telemetry):
    KIND: ClassVar[str] = "pool_telemetry"
    tiers: dict[str, TierStats] = Field(default_factory=dict)  # hot / warm / cold: up, blocks, hit rate
    hot_fill: float = 0.0  # hot tier bytes / KITE_POOL_HOT_BYTES
    hit_rate: float = 0.0  # over every tier, lifetime
    index_blocks: int = 0


class FingerprinterTelemetry(Telemetry):
    KIND: ClassVar[str] = "fingerprinter_telemetry"
    request_rate: float = 0.0  # requests per second over the window
    refused_rate: float = 0.0  # fraction of those refused (bad request, no worker, worker timeout, ...)
    tokenize_p50_s: float = 0.0  # chat template + tokenization + hash chain, over the window
    tokenize_p99_s: float = 0.0
    dispatch_p50_s: float = 0.0  # routing + the chosen worker's admission reply, over the window
    dispatch_p99_s: float = 0.0
    # Leading prompt blocks the chosen worker held locally or the pool held / prompt blocks, over the
    # window: the reuse the router expected (the workers' telemetry says what they really reused).
    routed_hit_rate: float = 0.0
    num_live_workers: int = 0  # workers the router would choose among now
    routing_mode: str = ""  # the mode in force (KITE_ROUTER_MODE or the arbitrator's decision)


class ArbitratorTelemetry(Telemetry):
    KIND: ClassVar[str] = "arbitrator_telemetry"
    rules_version: str = ""  # sha-256 prefix of the active rules file
    num_decisions: int = 0  # decisions published over the window (refreshes not counted)
    decision_latency_p50_ms: float = 0.0  # telemetry received -> decision published, over the window
    decision_latency_p99_ms: float = 0.0
    num_sources: int = 0  # service instances whose telemetry the current view holds
    stale: bool = False  # no fresh worker telemetry: decisions fell back to the safe policy
    leader: bool = False  # this replica holds the lease: it decides (the others only watch)


class GatewayTelemetry(Telemetry):
    KIND: ClassVar[str] = "gateway_telemetry"
    request_rate: float = 0.0  # API requests per second over the window
    error_rate: float = 0.0  # fraction of those answered >= 500 (early rejects included)
    rejected_rate: float = 0.0  # fraction rejected early by admission control


AnyTelemetry = (WorkerTelemetry | PoolTelemetry | GatewayTelemetry | FingerprinterTelemetry
                | ArbitratorTelemetry)
TELEMETRY: OneOf[AnyTelemetry] = OneOf("telemetry", WorkerTelemetry, PoolTelemetry, GatewayTelemetry,
                                       FingerprinterTelemetry, ArbitratorTelemetry)


# --- decisions ------------------------------------------------------------------------------------


class RoutingWeights(BaseModel):
    model_config = ConfigDict(frozen=True)
    affinity: float = Field(default=1.0, ge=0)  # weight of prefill still to compute (cache affinity)
    load: float = Field(default=1.0, ge=0)  # weight of the worker's load


DecisionKind = Literal["write_policy", "admission", "routing", "warm_capacity", "quarantine"]


class Decision(Message):
    """One arbitrator decision. `action` says which fields matter and who applies it:

    write_policy   worker `target` (or "*")    write_policy
    admission      gateways                    admit, retry_after_s, predicted_ttft_s
    routing        fingerprinters              weights, routing_mode ("" = keep)
    warm_capacity  worker `target`             standby (False = activate, True = scale in)
    quarantine     workers and ru-pools        quarantined, namespace: `target` is a model fingerprint
                                               (hex); while quarantined its blocks are misses and purged
    """

    KIND: ClassVar[str] = "arbitrator_decision"
    schema_version: int = TELEMETRY_SCHEMA
    decision_id: str
    action: DecisionKind  # ("kind" is the message envelope's tag)
    target: str = "*"
    reason: str  # why, in words (rule name and the signals that matched)
    rule: str = ""  # name of the rule, "safe_policy", "default" or "admin"
    issued_at: float = Field(default_factory=time.time)  # unix seconds
    refresh: bool = False  # re-announcement of a decision already in force (for restarted services)
    write_policy: WritePolicy | None = None
    admit: bool = True
    retry_after_s: int = 1
    predicted_ttft_s: float = 0.0
    weights: RoutingWeights | None = None
    routing_mode: str = ""
    standby: bool | None = None
    quarantined: bool | None = None
    namespace: str = ""  # quarantine: the model name the fingerprint serves ("<base>" or "<base>:<adapter>")

    _check_schema = field_validator("schema_version")(_this_schema)


class ShadowCheckResult(Message):
    """worker -> arbitrator and ru-pools (subjects.SHADOW_RESULTS): one shadow verification of a cache hit.

    The worker recomputed the prompt of a request that reused KV, without reuse, and compared the
    first-token distributions: `divergence` is KL(recomputed || reused) in nats."""

    KIND: ClassVar[str] = "shadow_check_result"
    instance_id: str  # the worker
    model_fingerprint: str  # hex: the namespace whose blocks were reused
    namespace: str  # the model name it serves ("<base>" or "<base>:<adapter>")
    request_id: str
    num_reused_tokens: int  # prompt tokens the checked request reused
    divergence: float  # KL(recomputed || reused) of the first token, nats
    tolerance: float  # the bound it was held to (per storage dtype)
    diverged: bool  # divergence > tolerance
    checked_at: float = Field(default_factory=time.time)  # unix seconds


class ArbitratorAdminRequest(Message):
    """ops: status (rules version, current decisions, decision latency), reload (rules file now),
    set_routing_mode (admin override of the routing mode; routing_mode="" clears it), clear_quarantine
    (an operator lifts the quarantine of `model_fingerprint`)."""

    KIND: ClassVar[str] = "arbitrator_admin_request"
    op: Literal["status", "reload", "set_routing_mode", "clear_quarantine"]
    routing_mode: str = ""
    model_fingerprint: str = ""  # clear_quarantine: the namespace (hex fingerprint)


class ArbitratorAdminReply(Message):
    KIND: ClassVar[str] = "arbitrator_admin_reply"
    ok: bool
    error: str = ""
    rules_version: str = ""  # sha-256 prefix of the active rules file
    rules_source: str = ""
    current: list[Decision] = Field(default_factory=list)
    decision_latency_p50_ms: float = 0.0
    decision_latency_p99_ms: float = 0.0
    decision_latency_samples: int = 0
    activation_latencies_s: dict[str, float] = Field(default_factory=dict)  # worker -> seconds
    stale: bool = False


# --- adapters -----------------------------------------------------------------------------------------


class AdapterAdminRequest(Message):
    """admin tools -> every fingerprinter and worker (subjects.ADAPTER_ADMIN, no queue group): load a LoRA
    adapter (docs/adapters.md; its declaration is checked against the base first) or unload one."""

    KIND: ClassVar[str] = "adapter_admin_request"
    op: Literal["load", "unload"]
    name: str = Field(min_length=1, max_length=128)  # served as `name` and as "<base>:<name>"
    path: str = ""  # load: the peft folder, as the receiving process sees it (a shared volume)


class AdapterAdminReply(Message):
    KIND: ClassVar[str] = "adapter_admin_reply"
    service: str  # "fingerprinter" or "worker"
    instance_id: str
    ok: bool
    error: ErrorInfo | None = None  # a refused load names the declaration field at fault in `param`
    adapters: list[str] = Field(default_factory=list)  # what it serves now
    model_fingerprint: str = ""  # load: the adapter's namespace (hex)
