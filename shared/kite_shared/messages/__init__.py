"""Every message KITE services exchange over NATS: one schema, msgpack-encoded and versioned.

    base      wire rules (Message, MessageError, OneOf, decode_or_log)
    requests  the request path: GenerateRequest, TokenizedRequest, Admission, Cancel, the token stream
    pool      the ru-pool's index, lookups, gets and admin
    control   heartbeats and pings, telemetry, arbitrator decisions and admin

Import from here (`from kite_shared.messages import TokenizedRequest`); the submodules only keep the file
sizes readable. Subject names, and which message each subject carries, live in `kite_shared.subjects`.
Recyclable units (KV blocks) are not messages: they have their own binary format in `recyclable_unit`.
"""

from kite_shared.messages.base import (  # noqa: F401
    SCHEMA_VERSION, MessageError, Message, decode_or_log, OneOf)
from kite_shared.messages.requests import (  # noqa: F401
    ChatMessage, SamplingParams, ErrorInfo, GenerateRequest, TokenizedRequest, Admission, Cancel, Usage,
    TokenChunk, StreamEnd, StreamError, StreamEvent, STREAM_EVENT, StreamBatch)
from kite_shared.messages.pool import (  # noqa: F401
    BlockStored, BlockRemoved, BLOCK_EVENT, ModelFingerprintChanged, PoolLookupRequest, PoolLookupReply,
    PoolGetRequest, PoolGetReply, PoolAdminRequest, TierStats, TenantUsage, NamespaceStats, PoolAdminReply, IndexChange,
    PoolIndexChanges, WorkerCachesRequest, WorkerCache, WorkerCachesReply, TierHits, UnitsWritten)
from kite_shared.messages.control import (  # noqa: F401
    Heartbeat, Ping, Pong, TELEMETRY_SCHEMA, WritePolicy, RoutingMode, WRITE_POLICIES, ROUTING_MODES,
    Telemetry, WorkerTelemetry, PoolTelemetry, FingerprinterTelemetry, ArbitratorTelemetry,
    GatewayTelemetry, AnyTelemetry, TELEMETRY, RoutingWeights, DecisionKind, Decision, ShadowCheckResult,
    ArbitratorAdminRequest, ArbitratorAdminReply, AdapterAdminRequest, AdapterAdminReply)
