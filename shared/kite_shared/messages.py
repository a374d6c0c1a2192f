"""Every message KITE services exchange over NATS, msgpack-encoded and versioned.

Each message is a frozen pydantic model with a `KIND` tag. On the wire a message is a msgpack map holding
its fields plus `"v"` (SCHEMA_VERSION) and `"kind"`. Decoding checks both and validates every field type,
so a malformed or foreign message is a `MessageError`, never a half-built object. Unknown extra fields are
ignored so a newer sender can add optional fields without breaking an older receiver.

Recyclable units (KV blocks) are not messages: they have their own binary format in `recyclable_unit`.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, ClassVar, Literal, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kite_shared.security import ANONYMOUS_TENANT

SCHEMA_VERSION = 1


class MessageError(ValueError):
    """Bytes that are not a valid KITE message of the expected kind and version."""


class Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")
    KIND: ClassVar[str]

    def encode(self) -> bytes:
        body = self.model_dump(mode="python")
        body["v"] = SCHEMA_VERSION
        body["kind"] = self.KIND
        return msgpack.packb(body, use_bin_type=True)

    @classmethod
    def decode(cls: type[M], data: bytes) -> M:
        body = _unpack(data)
        if body.get("kind") != cls.KIND:
            raise MessageError(f"expected a {cls.KIND!r} message, got {body.get('kind')!r}")
        return _validate(cls, body)


M = TypeVar("M", bound=Message)


def _unpack(data: bytes) -> dict:
    try:
        body = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise MessageError(f"not msgpack: {exc}") from None
    if not isinstance(body, dict):
        raise MessageError("a message must be a msgpack map")
    if body.get("v") != SCHEMA_VERSION:
        raise MessageError(f"unsupported schema version {body.get('v')!r} (this build speaks {SCHEMA_VERSION})")
    return body


def _validate(cls: type[M], body: dict) -> M:
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        raise MessageError(f"invalid {cls.KIND!r} message: {exc}") from None


T = TypeVar("T")


def decode_or_log(decode: Callable[[bytes], T], data: bytes, log: logging.Logger, what: str, *args: object,
                  level: int = logging.WARNING) -> T | None:
    """`decode(data)`, or None after logging `what % args` and the MessageError at `level`.

    For a subscriber that drops a bad message (there is no one to reply to) and goes on; `decode` is a
    Message class's decode or a decode_* function:

        beat = decode_or_log(Heartbeat.decode, msg.data, log, "bad heartbeat on %s", msg.subject)
        if beat is None:
            return
    """
    try:
        return decode(data)
    except MessageError as exc:
        log.log(level, what + ": %s", *args, exc)
        return None


# --- request path ----------------------------------------------------------------------------------


class ChatMessage(BaseModel):
    model_config = ConfigDict(frozen=True)
    role: str
    content: str


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True)
    max_tokens: int | None = None  # tokens to generate at most; None = gateway default / context left
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    seed: int | None = None  # makes sampling reproducible; ignored when greedy
    stop: list[str] = Field(default_factory=list)  # generation ends before any of these strings
    ignore_eos: bool = False  # keep generating past the model's end-of-sequence token


class ErrorInfo(BaseModel):
    """An error a service reports instead of doing the work; the gateway maps `code` to an HTTP status."""

    model_config = ConfigDict(frozen=True)
    code: str  # machine-readable, e.g. "context_length_exceeded", "no_worker", "overloaded"
    message: str  # human-readable, safe to show to the client (never holds secrets)
    param: str | None = None  # the request field at fault, if any


class GenerateRequest(Message):
    """gateway -> fingerprinter: one completion to produce (one choice; `n` is fanned out by the gateway)."""

    KIND: ClassVar[str] = "generate_request"
    request_id: str  # unique per choice; also the last token of the stream subject
    model: str  # model id as the client sent it
    messages: list[ChatMessage] | None = None  # chat request: the template is applied by the fingerprinter
    prompt: str | None = None  # completion request given as text
    prompt_token_ids: list[int] | None = None  # completion request given as token ids
    sampling: SamplingParams
    reuse: bool = True  # per-request Upcycle switch (deployment switch is KITE_REUSE)
    cache_salt: str = ""  # tenant isolation salt, mixed into the first block hash
    # The authenticated tenant (decided by the gateway, never by the client): names the owner of the
    # blocks this request stores, for the pool's per-tenant accounting, quotas and clears.
    tenant: str = Field(default=ANONYMOUS_TENANT, min_length=1, max_length=128)
    stream_subject: str  # where the worker sends TokenChunk / StreamEnd / StreamError
    created_at: float = Field(default_factory=time.time)  # unix seconds, when the gateway received it
    # Request migration: tokens already generated (and sent to the client) by a worker that died. The
    # fingerprinter appends them to the templated prompt and lowers max_tokens by their count, so the new
    # worker continues the same answer (and its block hashes, hence reuse, cover them).
    resume_token_ids: list[int] = Field(default_factory=list)
    # Routing (issue 5): requests of one session (the client's `kite.session_id`) stick to one worker.
    session_id: str = Field(default="", max_length=256)


class TokenizedRequest(Message):
    """fingerprinter -> worker: a request with its exact token ids and computation fingerprint."""

    KIND: ClassVar[str] = "tokenized_request"
    request_id: str
    model: str
    prompt_token_ids: list[int]  # exactly what the worker computes (chat template already applied)
    sampling: SamplingParams  # max_tokens is always resolved here
    reuse: bool
    cache_salt: str = ""  # mixed into block 0's hash; the worker recomputes the chain to verify it
    tenant: str = Field(default=ANONYMOUS_TENANT, min_length=1, max_length=128)  # GenerateRequest.tenant
    model_fingerprint: str  # hex digest of the model-state + execution-path fingerprint
    block_size: int  # tokens per block the hashes cover
    block_hashes: list[bytes]  # hash chain over the full prompt blocks, 32 bytes each
    stream_subject: str
    created_at: float  # unix seconds, when the gateway received the request
    # The last `num_resumed_tokens` of prompt_token_ids were generated by an earlier worker (migration):
    # the worker primes its detokenizer and stop-string matcher with them, so text continues seamlessly.
    num_resumed_tokens: int = Field(default=0, ge=0)
    session_id: str = ""  # the client's session id (routing affinity), informative for the worker
    # Leading blocks of block_hashes the ru-pool held when the router looked them up (-1: it did not look):
    # the worker then need not ask again before deciding what to load.
    pool_blocks: int = Field(default=-1, ge=-1)


class Admission(Message):
    """Reply to GenerateRequest and TokenizedRequest: accepted (streaming will follow) or refused."""

    KIND: ClassVar[str] = "admission"
    accepted: bool
    worker_id: str = ""  # instance that will stream the answer
    prompt_tokens: int = 0  # prompt length in tokens
    error: ErrorInfo | None = None  # set when not accepted


class Cancel(Message):
    """gateway -> workers: the client went away; stop generating and free the slot."""

    KIND: ClassVar[str] = "cancel"
    request_id: str


# --- stream events (worker -> gateway, on the per-request stream subject) ------------------------------


class Usage(BaseModel):
    model_config = ConfigDict(frozen=True)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV was reused instead of computed


class TokenChunk(Message):
    KIND: ClassVar[str] = "token_chunk"
    request_id: str
    seq: int  # 0, 1, 2, ... per request, so the gateway can spot loss or duplication
    token_ids: list[int]  # tokens this chunk adds
    text: str  # text these tokens add (may be "" while a multi-byte character or stop string is pending)


class StreamEnd(Message):
    KIND: ClassVar[str] = "stream_end"
    request_id: str
    seq: int
    finish_reason: Literal["stop", "length", "cancelled"]
    text: str = ""  # text released at the end (held back while it could have begun a stop string)
    token_ids: list[int] = Field(default_factory=list)  # the last generated token, unless it was EOS
    usage: Usage
    ttft_s: float = 0.0  # seconds from worker admission to first token


class StreamError(Message):
    KIND: ClassVar[str] = "stream_error"
    request_id: str
    seq: int
    error: ErrorInfo


StreamEvent = TokenChunk | StreamEnd | StreamError
_STREAM_KINDS: dict[str, type[Message]] = {c.KIND: c for c in (TokenChunk, StreamEnd, StreamError)}


def decode_stream_event(data: bytes) -> StreamEvent:
    body = _unpack(data)
    cls = _STREAM_KINDS.get(body.get("kind"))
    if cls is None:
        raise MessageError(f"not a stream event: kind {body.get('kind')!r}")
    return _validate(cls, body)  # type: ignore[return-value]


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


# --- ru-pool (recyclable-unit pool) -------------------------------------------------------------------
# Blocks themselves travel in the recyclable_unit binary format (subjects.POOL_PUT, and inside
# PoolGetReply.units); these messages are the pool's index, lookup, lifecycle and admin traffic.


class BlockStored(Message):
    """worker -> ru-pool (subjects.POOL_BLOCK_EVENTS): blocks now held in this worker's local cache."""

    KIND: ClassVar[str] = "block_stored"
    worker_id: str
    model_fingerprint: str
    block_hashes: list[bytes]  # 32 bytes each; any order
    seq: int = 0  # per worker, +1 per event (BlockStored and BlockRemoved share it); gaps are counted


class BlockRemoved(Message):
    """worker -> ru-pool (subjects.POOL_BLOCK_EVENTS): blocks dropped from this worker's local cache."""

    KIND: ClassVar[str] = "block_removed"
    worker_id: str
    model_fingerprint: str = ""
    block_hashes: list[bytes] = Field(default_factory=list)
    all_blocks: bool = False  # the worker dropped its whole cache (restart, clear): forget all it had
    seq: int = 0


_BLOCK_EVENT_KINDS: dict[str, type[Message]] = {c.KIND: c for c in (BlockStored, BlockRemoved)}


def decode_block_event(data: bytes) -> BlockStored | BlockRemoved:
    body = _unpack(data)
    cls = _BLOCK_EVENT_KINDS.get(body.get("kind"))
    if cls is None:
        raise MessageError(f"not a block event: kind {body.get('kind')!r}")
    return _validate(cls, body)  # type: ignore[return-value]


class ModelFingerprintChanged(Message):
    """fingerprinter -> all (subjects.MODEL_FINGERPRINT): the fingerprint now current for a model name.

    Publish it at startup and whenever the weights change (e.g. an RL step). The ru-pool then never
    serves blocks of any earlier fingerprint of that name again and purges them in the background.
    """

    KIND: ClassVar[str] = "model_fingerprint_changed"
    model_name: str
    model_fingerprint: str
    previous_fingerprint: str = ""  # informative; the pool also remembers what it saw before


class PoolLookupRequest(Message):
    """-> ru-pool (subjects.POOL_LOOKUP): how much of this block chain is stored, and where."""

    KIND: ClassVar[str] = "pool_lookup_request"
    model_fingerprint: str
    block_hashes: list[bytes]  # the chain from block 0
    include_workers: bool = True


class PoolLookupReply(Message):
    """Longest available prefix (in blocks) per place. Each count is of leading blocks present in that
    place itself; `pool` counts leading blocks present in any pool tier that is up, and `tiers[i]` is
    the cheapest tier holding block i of that prefix (b"h" hot, b"w" warm, b"c" cold)."""

    KIND: ClassVar[str] = "pool_lookup_reply"
    hot: int = 0
    warm: int = 0
    cold: int = 0
    pool: int = 0
    tiers: bytes = b""
    workers: dict[str, int] = Field(default_factory=dict)  # worker_id -> prefix in its local cache
    invalidated: bool = False  # the fingerprint was replaced: nothing of it will be served
    error: ErrorInfo | None = None


class PoolGetRequest(Message):
    """-> ru-pool (subjects.POOL_GET): the encoded units of these blocks, in order."""

    KIND: ClassVar[str] = "pool_get_request"
    model_fingerprint: str
    block_hashes: list[bytes]
    max_bytes: int = 0  # reply budget; 0 = what the NATS connection allows (no cap for hand-off files)
    tenant: str = ANONYMOUS_TENANT  # whose blocks these are (part of their storage keys)
    # The asker's kite_shared.tiers.handoff.host_id(), "" for inline bytes: when it is the pool's host and
    # the pool has a hand-off folder, the reply names files there instead of carrying the units.
    host_id: str = ""


class PoolGetReply(Message):
    """The leading blocks found, each a verified encoded recyclable unit; it stops at the first miss or
    when the next unit would exceed the byte budget (ask again from the number received for the rest).
    The units come inline (`units`) or, same-host, as hand-off files (`unit_files`), never both."""

    KIND: ClassVar[str] = "pool_get_reply"
    units: list[bytes] = Field(default_factory=list)
    # Paths of same-host hand-off files, one encoded unit each, in order; the asker reads and removes them
    # (kite_shared.tiers.handoff.take_all).
    unit_files: list[str] = Field(default_factory=list)
    tiers: bytes = b""  # tier each unit came from (b"h", b"w", b"c")
    complete: bool = True  # False when the budget, not a miss, ended the reply
    error: ErrorInfo | None = None


class PoolAdminRequest(Message):
    """-> ru-pool (subjects.POOL_ADMIN). ops: stats (with `tenant`: also that tenant's usage), clear
    (all, one model_fingerprint, one tenant, or a model's blocks of one tenant), pin / unpin
    (model_fingerprint + block_hashes: never evicted, archived or expired until unpinned; with `tenant`
    for a tenant's blocks, default anonymous), evict (model_fingerprint + block_hashes: delete those
    blocks from hot, warm, cold and the index, pins included, so the next request computes them; same
    `tenant` rule as pin), purge (delete every block of model_fingerprint from every tier and refuse it
    from now on)."""

    KIND: ClassVar[str] = "pool_admin_request"
    op: Literal["stats", "clear", "pin", "unpin", "evict", "purge"]
    model_fingerprint: str = ""
    block_hashes: list[bytes] = Field(default_factory=list)
    tenant: str = ""  # tenant name; "" = every tenant (stats, clear) or anonymous (pin, unpin, evict)


class TierStats(BaseModel):
    model_config = ConfigDict(frozen=True)
    up: bool = True
    blocks: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    hit_rate: float = 0.0  # hits / (hits + misses) over the pool's lifetime; 0 before any request
    integrity_failures: int = 0


class TenantUsage(BaseModel):
    """What one tenant stores in the pool: each block counted once, whichever tiers hold it."""

    model_config = ConfigDict(frozen=True)
    blocks: int = 0
    bytes: int = 0  # encoded unit bytes
    quota_bytes: int = 0  # 0 = no quota
    quota_evictions: int = 0  # blocks evicted to make room under the quota, since the pool started
    quota_refused: int = 0  # puts refused because pinned blocks alone left no room


class PoolAdminReply(Message):
    KIND: ClassVar[str] = "pool_admin_reply"
    ok: bool
    affected: int = 0  # blocks cleared, pinned, unpinned, evicted (those the index held) or purged
    tiers: dict[str, TierStats] = Field(default_factory=dict)  # "hot", "warm", "cold" (op stats)
    # op stats: per tenant tag (kite_shared.security.tenant_tag); only the asked tenant when one was named
    tenants: dict[str, TenantUsage] = Field(default_factory=dict)
    counters: dict[str, int] = Field(default_factory=dict)  # puts, duplicates, promotions, ...
    error: ErrorInfo | None = None
