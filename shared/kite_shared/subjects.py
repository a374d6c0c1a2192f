"""Every NATS subject KITE uses, in one place, and the table of what each carries.

Subjects are versioned (`kite.v1.`) so a future wire change can run beside the old one. Queue groups make
a subject load-balanced across replicas: running more processes of a service is how it scales.

Request path (each arrow is a NATS request/reply, so "nobody listening" is an immediate NoRespondersError,
never a timeout):

    gateway --FINGERPRINT--> fingerprinter --WORKER_GENERATE--> worker
    worker  --stream_subject(gateway, request)--> gateway          (token chunks, then end or error)
    worker  --stream_batch(gateway)--> gateway                     (the same, several requests' at once)

TABLE says, for each subject (or the pattern of a per-instance one, `<name>` standing for one token): the
message it carries, the reply (None: published, nobody answers), the queue group of its subscribers and who
sends it to whom. The service framework decodes what an endpoint receives by it (kite_shared.endpoints:
an Endpoint names only its subject), REFUSALS says how each reply type carries an error, and
docs/subjects.md is generated from it (`python -m kite_shared.subjects --markdown`).

Boundary: names and the table; how messages are encoded is kite_shared.messages.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

from kite_shared.messages import (
    BLOCK_EVENT, STREAM_EVENT, TELEMETRY, AdapterAdminReply, AdapterAdminRequest, Admission, ArbitratorAdminReply,
    ArbitratorAdminRequest, ArbitratorTelemetry, Cancel, Decision, ErrorInfo, FingerprinterTelemetry,
    GatewayTelemetry, GenerateRequest, Heartbeat, Message, ModelFingerprintChanged, OneOf, Ping, PoolAdminReply,
    PoolAdminRequest, PoolGetReply, PoolGetRequest, PoolIndexChanges, PoolLookupReply, PoolLookupRequest,
    PoolTelemetry, Pong, ShadowCheckResult, StreamBatch, TierHits, TokenizedRequest, UnitsWritten, WorkerCachesReply,
    WorkerCachesRequest, WorkerTelemetry,
)

PREFIX = "kite.v1"

FINGERPRINT = f"{PREFIX}.fingerprint"
FINGERPRINTER_QUEUE = "fingerprinter"

WORKER_GENERATE = f"{PREFIX}.worker.generate"
WORKER_QUEUE = "worker"
WORKER_CANCEL = f"{PREFIX}.worker.cancel"

POOL_PUT = f"{PREFIX}.pool.put"
RU_POOL_QUEUE = "ru-pool"

HEARTBEAT_WILDCARD = f"{PREFIX}.heartbeat.>"
TELEMETRY_WILDCARD = f"{PREFIX}.telemetry.>"
DECISIONS = f"{PREFIX}.arbitrator.decisions"
ADAPTER_ADMIN = f"{PREFIX}.adapters.admin"
SHADOW_RESULTS = f"{PREFIX}.shadow.results"
ARBITRATOR_ADMIN = f"{PREFIX}.arbitrator.admin"
ARBITRATOR_QUEUE = "arbitrator"


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


def stream_wildcard(gateway_id: str) -> str:
    """Every request's stream subject of one gateway (its one subscription to them all)."""
    return f"{PREFIX}.stream.{_token(gateway_id)}.*"


def stream_batch(gateway_id: str) -> str:
    """Where workers send one gateway the stream events of several of its requests in one StreamBatch."""
    return f"{PREFIX}.stream_batch.{_token(gateway_id)}"


def _token(part: str) -> str:
    # NATS subject tokens may not contain '.', '*', '>' or whitespace.
    if not part or any(c in part for c in ".*> \t\r\n"):
        raise ValueError(f"not a valid NATS subject token: {part!r}")
    return part


# --- ru-pool -----------------------------------------------------------------------------------------
# Any number of ru-pool replicas (docs/ru-pool.md, "Replicas"). Puts, lookups, gets, admin and the
# workers' tier hits use queue group RU_POOL_QUEUE (any replica answers: each keeps the whole index; a
# tier hit is promoted into that replica's hot tier); worker block events, index changes and model
# fingerprints reach every replica (no queue group); each replica also answers on its own subjects
# (pool_replica).

POOL_LOOKUP = f"{PREFIX}.pool.lookup"
POOL_GET = f"{PREFIX}.pool.get"
POOL_ADMIN = f"{PREFIX}.pool.admin"
POOL_BLOCK_EVENTS = f"{PREFIX}.pool.block_events"
POOL_TIER_HITS = f"{PREFIX}.pool.tier_hits"
POOL_UNITS_WRITTEN = f"{PREFIX}.pool.units_written"
POOL_INDEX_CHANGES = f"{PREFIX}.pool.index_changes"
POOL_WORKER_CACHES = f"{PREFIX}.pool.worker_caches"
MODEL_FINGERPRINT = f"{PREFIX}.model.fingerprint"

POOL_REPLICA_OPS = ("put", "lookup", "get", "admin")


def pool_replica(instance_id: str, op: str) -> str:
    """One ru-pool replica's own subject for `op` (put, lookup, get, admin): the same request and reply as
    the queue-group subject (POOL_PUT, ...), answered by that replica only (tests, per-replica stats)."""
    if op not in POOL_REPLICA_OPS:
        raise ValueError(f"not an ru-pool operation: {op!r}")
    safe = "".join("_" if c in ".*> \t\r\n" else c for c in instance_id)  # host names have dots
    return f"{PREFIX}.pool.replica.{_token(safe)}.{op}"


# --- the table ---------------------------------------------------------------------------------------

Carried = type[Message] | OneOf | type[bytes]  # a message, one of several kinds, or raw bytes


@dataclass(frozen=True)
class SubjectSpec:
    """One row of TABLE."""

    subject: str  # the subject, or its pattern: `<name>` stands for one token (a wildcard is a row of its own)
    carries: Carried
    reply: type[Message] | None  # None: published, nobody answers
    route: str  # who sends it to whom, and when
    queue: str = ""  # the subscribers' queue group ("": every subscriber gets each message); `<name>`: that token

    @property
    def decode(self) -> Callable[[bytes], Any]:
        return self.carries if self.carries is bytes else self.carries.decode

    @property
    def refusal(self) -> Callable[[ErrorInfo], Message] | None:
        """The reply carrying an error, when the reply type carries one by itself (REFUSALS)."""
        return REFUSALS.get(self.reply) if self.reply is not None else None

    def tokens(self, subject: str) -> dict[str, str] | None:
        """The placeholders' values when `subject` is this row's subject (or an instance of its pattern),
        else None. A wildcard token never fills a placeholder."""
        if subject == self.subject:
            return {}
        want, got = self.subject.split("."), subject.split(".")
        if len(want) != len(got):
            return None
        values: dict[str, str] = {}
        for pattern, token in zip(want, got):
            if _is_placeholder(pattern) and token not in ("*", ">"):
                values[pattern] = token
            elif pattern != token:
                return None
        return values

    def queue_for(self, subject: str) -> str:
        """The queue group of `subject`'s subscribers."""
        return self.tokens(subject)[self.queue] if _is_placeholder(self.queue) else self.queue


def _is_placeholder(token: str) -> bool:
    return token.startswith("<") and token.endswith(">")


_TELEMETRY = {  # service -> its telemetry message, who listens and when it is sent
    "gateway": (GatewayTelemetry, "gateway -> arbitrator, every KITE_TELEMETRY_INTERVAL_S"),
    "fingerprinter": (FingerprinterTelemetry, "fingerprinter -> arbitrator, every KITE_TELEMETRY_INTERVAL_S"),
    "worker": (WorkerTelemetry, "worker -> arbitrator and fingerprinters (routing), every "
                                "KITE_TELEMETRY_INTERVAL_S and at once on a significant change"),
    "ru-pool": (PoolTelemetry, "ru-pool -> arbitrator, every KITE_TELEMETRY_INTERVAL_S"),
    "arbitrator": (ArbitratorTelemetry, "arbitrator -> anyone watching (not an input to decisions), every "
                                        "KITE_TELEMETRY_INTERVAL_S"),
}
_REPLICA = f"{PREFIX}.pool.replica.<instance>"
_ONE_REPLICA = "the same, to one ru-pool replica only (pool_replica: dots in the instance id become _)"

TABLE: tuple[SubjectSpec, ...] = (
    # the request path
    SubjectSpec(FINGERPRINT, GenerateRequest, Admission, queue=FINGERPRINTER_QUEUE,
                route="gateway -> one fingerprinter: a completion to tokenize, fingerprint and dispatch"),
    SubjectSpec(WORKER_GENERATE, TokenizedRequest, Admission, queue=WORKER_QUEUE,
                route="fingerprinter -> any worker (routing's fallback)"),
    SubjectSpec(f"{PREFIX}.worker.<worker>.generate", TokenizedRequest, Admission,
                route="fingerprinter -> the worker its router chose (worker_generate: dots become _)"),
    SubjectSpec(WORKER_CANCEL, Cancel, None,
                route="gateway -> every worker: stop generating a request whose client went away"),
    SubjectSpec(f"{PREFIX}.stream.<gateway>.<request>", STREAM_EVENT, None,
                route="worker -> the gateway that asked (stream): the request's tokens, then its end or error"),
    SubjectSpec(f"{PREFIX}.stream_batch.<gateway>", StreamBatch, None,
                route="worker -> a gateway: the stream events of its requests that were ready at once, in order "
                      "(every event of a request whose GenerateRequest named this subject)"),
    # the ru-pool
    SubjectSpec(POOL_PUT, bytes, None, queue=RU_POOL_QUEUE,
                route="worker -> one ru-pool replica: an encoded recyclable unit (kite_shared.recyclable_unit)"),
    SubjectSpec(POOL_LOOKUP, PoolLookupRequest, PoolLookupReply, queue=RU_POOL_QUEUE,
                route="worker, fingerprinter -> one ru-pool replica: how much of a block chain is stored, where"),
    SubjectSpec(POOL_GET, PoolGetRequest, PoolGetReply, queue=RU_POOL_QUEUE,
                route="worker -> one ru-pool replica: the units of these blocks"),
    SubjectSpec(POOL_ADMIN, PoolAdminRequest, PoolAdminReply, queue=RU_POOL_QUEUE,
                route="admin tools -> one ru-pool replica: stats, clear, pin, unpin, evict, purge"),
    SubjectSpec(f"{_REPLICA}.put", bytes, None, route=_ONE_REPLICA),
    SubjectSpec(f"{_REPLICA}.lookup", PoolLookupRequest, PoolLookupReply, route=_ONE_REPLICA),
    SubjectSpec(f"{_REPLICA}.get", PoolGetRequest, PoolGetReply, route=_ONE_REPLICA),
    SubjectSpec(f"{_REPLICA}.admin", PoolAdminRequest, PoolAdminReply, route=_ONE_REPLICA),
    SubjectSpec(POOL_BLOCK_EVENTS, BLOCK_EVENT, None,
                route="worker -> every ru-pool replica: blocks its local cache now holds or dropped"),
    SubjectSpec(POOL_TIER_HITS, TierHits, None, queue=RU_POOL_QUEUE,
                route="worker -> one ru-pool replica: blocks it read from warm or cold itself, batched, for the "
                      "replica to promote into its hot tier"),
    SubjectSpec(POOL_UNITS_WRITTEN, UnitsWritten, None, queue=RU_POOL_QUEUE,
                route="worker -> one ru-pool replica: units it wrote into warm itself, for the replica to index "
                      "(KITE_WORKER_POOL_WRITE_PATH=direct)"),
    SubjectSpec(POOL_INDEX_CHANGES, PoolIndexChanges, None,
                route="ru-pool replica -> every other replica: what it changed in the shared tiers, pins, "
                      "clears and invalidations"),
    SubjectSpec(POOL_WORKER_CACHES, WorkerCachesRequest, WorkerCachesReply, queue=RU_POOL_QUEUE,
                route="a joining ru-pool replica -> one live replica: the worker-cache index, page by page"),
    SubjectSpec(MODEL_FINGERPRINT, ModelFingerprintChanged, None,
                route="fingerprinter -> everyone: the fingerprint now current for a model name"),
    # liveness, telemetry, decisions, admin
    SubjectSpec(f"{PREFIX}.heartbeat.<service>", Heartbeat, None,
                route="every service -> anyone (heartbeat), every KITE_HEARTBEAT_INTERVAL_S"),
    SubjectSpec(HEARTBEAT_WILDCARD, Heartbeat, None, route="every service's heartbeats at once (gateway, arbitrator)"),
    SubjectSpec(f"{PREFIX}.<service>.ping", Ping, Pong, queue="<service>",
                route="anyone -> one replica of the service (ping): a health probe"),
    *(SubjectSpec(telemetry(service), message, None, route=route) for service, (message, route) in _TELEMETRY.items()),
    SubjectSpec(TELEMETRY_WILDCARD, TELEMETRY, None, route="every service's telemetry at once (arbitrator)"),
    SubjectSpec(DECISIONS, Decision, None,
                route="arbitrator -> everyone: a decision on every change and a periodic refresh, applied by "
                      "the service(s) it names"),
    SubjectSpec(SHADOW_RESULTS, ShadowCheckResult, None,
                route="worker -> arbitrators and ru-pools: one shadow verification of a cache hit"),
    SubjectSpec(ARBITRATOR_ADMIN, ArbitratorAdminRequest, ArbitratorAdminReply, queue=ARBITRATOR_QUEUE,
                route="admin tools -> the leading arbitrator"),
    SubjectSpec(ADAPTER_ADMIN, AdapterAdminRequest, AdapterAdminReply,
                route="admin tools -> every fingerprinter and worker: one reply from each (scatter-gather)"),
)

# How each reply type carries an error: the framework's answer to a request it cannot decode, to a
# handler's Refusal and to a handler's bug (kite_shared.endpoints). A reply type missing here carries none
# (Pong: a bad ping is dropped) or names its responder (AdapterAdminReply: its endpoints give their own).
REFUSALS: dict[type[Message], Callable[[ErrorInfo], Message]] = {
    Admission: lambda error: Admission(accepted=False, error=error),
    PoolLookupReply: lambda error: PoolLookupReply(error=error),
    PoolGetReply: lambda error: PoolGetReply(error=error),
    PoolAdminReply: lambda error: PoolAdminReply(ok=False, error=error),
    WorkerCachesReply: lambda error: WorkerCachesReply(error=error),
    ArbitratorAdminReply: lambda error: ArbitratorAdminReply(ok=False, error=error.message),
}

_BY_SUBJECT = {spec.subject: spec for spec in TABLE}


def spec_of(subject: str) -> SubjectSpec:
    """The row of TABLE for `subject` (a subject, an instance of a row's pattern, or a row's wildcard)."""
    spec = _BY_SUBJECT.get(subject)
    if spec is not None:
        return spec
    found = [spec for spec in TABLE if spec.tokens(subject) is not None]
    if len(found) != 1:
        raise ValueError(f"subject {subject!r} is " + ("not in kite_shared.subjects.TABLE" if not found else
                         f"an instance of several rows of kite_shared.subjects.TABLE: {[s.subject for s in found]}"))
    return found[0]


def _names(carried: Carried | None) -> str:
    if carried is None:
        return "(published)"
    if carried is bytes:
        return "bytes"
    if isinstance(carried, OneOf):
        return " \\| ".join(f"`{cls.__name__}`" for cls in carried.classes)
    return f"`{carried.__name__}`"


def markdown_reference() -> str:
    """docs/subjects.md, generated from TABLE."""
    lines = [
        "# NATS subjects",
        "",
        "Generated from `shared/kite_shared/subjects.py` (`TABLE`) by `python -m kite_shared.subjects --markdown`;"
        " do not edit by hand.",
        "Every subject KITE uses: the message it carries (`shared/kite_shared/messages/`), the reply (none: it is"
        " published), the queue group of its subscribers (none: every subscriber gets each message) and who"
        " sends it to whom. `<name>` stands for one token of a per-instance subject (as a queue group: that"
        " token). A service's endpoint"
        " (`shared/kite_shared/endpoints.py`) decodes what it receives by this table; a request that does not"
        " decode is answered with the reply carrying `error.code=\"invalid_message\"`.",
        "",
        "| Subject | Carries | Reply | Queue group | From -> to |",
        "|---|---|---|---|---|",
    ]
    for spec in TABLE:
        queue = f"`{spec.queue}`" if spec.queue else ""
        lines.append(f"| `{spec.subject}` | {_names(spec.carries)} | {_names(spec.reply)} | {queue} | {spec.route} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--markdown"]:
        sys.stdout.write(markdown_reference())
    else:
        sys.exit("usage: python -m kite_shared.subjects --markdown")
