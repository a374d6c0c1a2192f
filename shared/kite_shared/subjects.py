"""Every NATS subject KITE uses, in one place.

Subjects are versioned (`kite.v1.`) so a future wire change can run beside the old one. Queue groups make
a subject load-balanced across replicas: running more processes of a service is how it scales.

Request path (each arrow is a NATS request/reply, so "nobody listening" is an immediate NoRespondersError,
never a timeout):

    gateway --FINGERPRINT--> fingerprinter --WORKER_GENERATE--> worker
    worker  --stream_subject(gateway, request)--> gateway          (token chunks, then end or error)
"""

from __future__ import annotations

PREFIX = "kite.v1"

# gateway -> fingerprinter (queue group FINGERPRINTER_QUEUE); reply: messages.Admission
FINGERPRINT = f"{PREFIX}.fingerprint"
FINGERPRINTER_QUEUE = "fingerprinter"

# fingerprinter -> any worker (queue group WORKER_QUEUE); reply: messages.Admission
WORKER_GENERATE = f"{PREFIX}.worker.generate"
WORKER_QUEUE = "worker"

# gateway -> every worker: stop generating a request whose client went away (messages.Cancel)
WORKER_CANCEL = f"{PREFIX}.worker.cancel"

# worker -> ru-pool (queue group RU_POOL_QUEUE): an encoded recyclable unit (kite_shared.recyclable_unit)
POOL_PUT = f"{PREFIX}.pool.put"
RU_POOL_QUEUE = "ru-pool"

# every service -> anyone: messages.Heartbeat, one subject per service kind
HEARTBEAT_WILDCARD = f"{PREFIX}.heartbeat.>"

# telemetry and decisions (arbitrator); schemas in kite_shared.messages.control
TELEMETRY_WILDCARD = f"{PREFIX}.telemetry.>"
# arbitrator -> everyone (no queue group): telemetry.Decision, applied by the service(s) it names
DECISIONS = f"{PREFIX}.arbitrator.decisions"
# admin tools -> every fingerprinter and worker (no queue group), request with many replies:
# messages.AdapterAdminRequest -> one messages.AdapterAdminReply from each
ADAPTER_ADMIN = f"{PREFIX}.adapters.admin"
# worker -> arbitrators and ru-pools (no queue group): messages.ShadowCheckResult, one per shadow verification
SHADOW_RESULTS = f"{PREFIX}.shadow.results"
# admin tools -> arbitrator, request/reply: telemetry.ArbitratorAdminRequest -> ArbitratorAdminReply
ARBITRATOR_ADMIN = f"{PREFIX}.arbitrator.admin"


def telemetry(service: str) -> str:
    """Subject of one service kind's telemetry (telemetry.WorkerTelemetry, PoolTelemetry, ...)."""
    return f"{PREFIX}.telemetry.{_token(service)}"


def worker_generate(worker_id: str) -> str:
    """One worker's own generate subject: the fingerprinter's router sends a TokenizedRequest here
    (same reply as WORKER_GENERATE); every active worker subscribes to both."""
    safe = "".join("_" if c in ".*> \t\r\n" else c for c in worker_id)  # host names have dots
    return f"{PREFIX}.worker.{_token(safe)}.generate"

SERVICES = ("gateway", "fingerprinter", "worker", "ru-pool", "arbitrator")


def heartbeat(service: str) -> str:
    return f"{PREFIX}.heartbeat.{service}"


def ping(service: str) -> str:
    """Request/reply health probe answered by one replica of `service` (messages.Pong)."""
    return f"{PREFIX}.{service}.ping"


def stream(gateway_id: str, request_id: str) -> str:
    """Per-request subject on which the worker streams events back to the gateway that asked."""
    return f"{PREFIX}.stream.{_token(gateway_id)}.{_token(request_id)}"


def _token(part: str) -> str:
    # NATS subject tokens may not contain '.', '*', '>' or whitespace.
    if not part or any(c in part for c in ".*> \t\r\n"):
        raise ValueError(f"not a valid NATS subject token: {part!r}")
    return part


# --- ru-pool -----------------------------------------------------------------------------------------
# Any number of ru-pool replicas (docs/ru-pool.md, "Replicas"). Puts, lookups, gets and admin use queue
# group RU_POOL_QUEUE (any replica answers: each keeps the whole index); worker block events, index
# changes and model fingerprints reach every replica (no queue group); each replica also answers on its
# own subjects (pool_replica).

# anyone -> ru-pool, request/reply: messages.PoolLookupRequest -> messages.PoolLookupReply
POOL_LOOKUP = f"{PREFIX}.pool.lookup"
# anyone -> ru-pool, request/reply: messages.PoolGetRequest -> messages.PoolGetReply
POOL_GET = f"{PREFIX}.pool.get"
# admin tools -> ru-pool, request/reply: messages.PoolAdminRequest -> messages.PoolAdminReply
POOL_ADMIN = f"{PREFIX}.pool.admin"
# worker -> every ru-pool replica (no queue group): messages.BlockStored / messages.BlockRemoved (decode
# with BLOCK_EVENT)
POOL_BLOCK_EVENTS = f"{PREFIX}.pool.block_events"
# ru-pool replica -> every other replica (no queue group): messages.PoolIndexChanges, what it changed in
# the shared tiers (warm, cold), pins, clears and invalidations
POOL_INDEX_CHANGES = f"{PREFIX}.pool.index_changes"
# a joining ru-pool replica -> one live replica (queue group RU_POOL_QUEUE), request/reply:
# messages.WorkerCachesRequest -> messages.WorkerCachesReply (the worker-cache index, page by page)
POOL_WORKER_CACHES = f"{PREFIX}.pool.worker_caches"
# fingerprinter -> everyone (no queue group at the receivers): messages.ModelFingerprintChanged
MODEL_FINGERPRINT = f"{PREFIX}.model.fingerprint"

POOL_REPLICA_OPS = ("put", "lookup", "get", "admin")


def pool_replica(instance_id: str, op: str) -> str:
    """One ru-pool replica's own subject for `op` (put, lookup, get, admin): the same request and reply as
    the queue-group subject (POOL_PUT, ...), answered by that replica only (tests, per-replica stats)."""
    if op not in POOL_REPLICA_OPS:
        raise ValueError(f"not an ru-pool operation: {op!r}")
    safe = "".join("_" if c in ".*> \t\r\n" else c for c in instance_id)  # host names have dots
    return f"{PREFIX}.pool.replica.{_token(safe)}.{op}"
