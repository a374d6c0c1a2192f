"""The ru-pool's messages: its index (block events from workers), lookups, gets, lifecycle and admin, and
what its replicas tell each other (index changes, the worker-cache snapshot).

Blocks themselves travel in the recyclable_unit binary format (subjects.POOL_PUT, and inside
PoolGetReply.units); these messages are the pool's index, lookup, lifecycle and admin traffic.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from kite_shared.messages.base import Message, OneOf
from kite_shared.messages.requests import ErrorInfo
from kite_shared.security import ANONYMOUS_TENANT



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


BLOCK_EVENT: OneOf[BlockStored | BlockRemoved] = OneOf("block event", BlockStored, BlockRemoved)



class TierHits(Message):
    """worker -> one ru-pool replica (subjects.POOL_TIER_HITS, queue group ru-pool): blocks this worker read
    from warm or cold itself, which the pool's get therefore never saw. The replica promotes them as a get
    would have (kite_ru_pool.worker_hits), so the next request for them reads hot. Batched and best-effort:
    a lost message costs a promotion, never a request."""

    KIND: ClassVar[str] = "tier_hits"
    worker_id: str = ""  # the reporting worker (logs only)
    model_fingerprint: str  # hex, the namespace's (the base model's or an adapter's)
    # The blocks' owner (kite_shared.security.tenant_tag), part of their storage keys; a tag, not the name,
    # which never needs to reach the pool for this.
    tenant_tag: str
    block_hashes: list[bytes]  # 32 bytes each, each once; any order
    # tiers[i]: where block_hashes[i] was read, b"w" warm or b"c" cold (a cold hit is also copied to warm)
    tiers: bytes = b""


class UnitsWritten(Message):
    """worker -> one ru-pool replica (subjects.POOL_UNITS_WRITTEN, queue group ru-pool): units this worker
    wrote into a shared tier itself (KITE_WORKER_POOL_WRITE_PATH=direct) instead of sending them in puts.
    The replica indexes them as stored there, under the tenant's quota, and tells the other replicas
    (kite_ru_pool.writes.PoolWrites.units_written); what its rules refuse (an invalidated model, a full
    quota) it deletes from the tier. One message per batch of one model and tenant; best-effort: a lost
    notice leaves blocks the index does not know until the tier's next listing (a resync or a restart)."""

    KIND: ClassVar[str] = "units_written"
    worker_id: str = ""  # the writing worker (logs only)
    model_fingerprint: str  # hex, the namespace's (the base model's or an adapter's)
    tenant_tag: str  # the blocks' owner (kite_shared.security.tenant_tag), part of their storage keys
    tier: Literal["warm"] = "warm"  # where the worker wrote them (only warm: cold is the pool's archive)
    block_hashes: list[bytes]  # 32 bytes each
    sizes: list[int]  # encoded bytes of each unit as written, in the order of block_hashes
    depths: list[int]  # each block's index in its chain (the unit's block_index)


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
    workers: dict[str, int] = Field(default_factory=dict)  # worker -> prefix in its local cache, if > 0
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
    # The asker can read the units from the pool's block stream (kite_shared.tiers.block_stream): when the
    # pool has one (and no hand-off applies), the reply carries a ticket instead of the units.
    stream: bool = False


class PoolGetReply(Message):
    """The leading blocks found, each a verified encoded recyclable unit; it stops at the first miss or
    when the next unit would exceed the byte budget (ask again from the number received for the rest).
    The units come inline (`units`), same-host as hand-off files (`unit_files`), or from another host on
    the pool's block stream (`stream_ticket`): one of the three."""

    KIND: ClassVar[str] = "pool_get_reply"
    units: list[bytes] = Field(default_factory=list)
    # Paths of same-host hand-off files, one encoded unit each, in order (kite_shared.tiers.handoff.map_units).
    unit_files: list[str] = Field(default_factory=list)
    # True: the files are the pool's hot files, lent: read them, leave them (one may be gone by then: the
    # unit left hot, a miss from there on). False: written for this reply; the asker removes them.
    files_lent: bool = False
    # The units wait on the pool's block stream: connect to stream_address ("host:port"; TLS when
    # stream_tls), send stream_ticket (16 bytes, one transfer, ~10 s) and read them.
    stream_address: str = ""
    stream_ticket: bytes = b""
    stream_tls: bool = False
    tiers: bytes = b""  # tier each unit came from (b"h", b"w", b"c")
    complete: bool = True  # False when the budget, not a miss, ended the reply
    error: ErrorInfo | None = None


class PoolAdminRequest(Message):
    """-> ru-pool (subjects.POOL_ADMIN). ops: stats (with `tenant`: also that tenant's usage), clear
    (all, one model_fingerprint, one tenant, or a model's blocks of one tenant), pin / unpin
    (model_fingerprint + block_hashes: never evicted, archived or expired until unpinned; with `tenant`
    for a tenant's blocks, default anonymous), evict (model_fingerprint + block_hashes: delete those
    blocks from hot, warm, cold and the index, pins included, so no request loads them from the pool
    again; a worker's own prefix cache keeps its copy until it evicts it; same `tenant` rule as pin), purge (delete every block of model_fingerprint from every tier and refuse it
    from now on)."""

    KIND: ClassVar[str] = "pool_admin_request"
    op: Literal["stats", "clear", "pin", "unpin", "evict", "purge"]
    model_fingerprint: str = ""
    block_hashes: list[bytes] = Field(default_factory=list)
    tenant: str = ""  # tenant name; "" = every tenant (stats, clear) or anonymous (pin, unpin, evict)


class IndexChange(BaseModel):
    """One operation on the pool's index, as one ru-pool replica tells the others (PoolIndexChanges): the
    blocks of one model tag and one tenant, in order.

    ops and what a receiver does with them:
      stored       `tier` now holds these blocks (written, promoted, demoted, archived, found by a resync);
                   `sizes`, `depths` (-1: unknown) and `last_hits` per block
      missing      `tier` does not hold them any more (expired, archived away, deleted, failed verification)
      renewed      their warm expiry was renewed at `at`
      hit          they were read at `at` (a get), which keeps them from archival
      dropped      forget them everywhere, pins included (an admin evict, a quota eviction)
      pinned / unpinned
      cleared      forget every block of `model_tag` ("*": every model), of `tenant_tag` only when set
                   (an admin clear); the storage purge it queues is the leader's to finish
      invalidated  never serve `model_tag` again (an admin purge)
      purged       the storage purge of `model_tag` ("*": all) [of `tenant_tag`] finished
    """

    model_config = ConfigDict(frozen=True)
    op: Literal["stored", "missing", "renewed", "hit", "dropped", "pinned", "unpinned", "cleared",
                "invalidated", "purged"]
    tier: Literal["", "warm", "cold"] = ""  # stored, missing
    model_tag: str = ""  # kite_shared.tiers.keys.model_tag of the fingerprint; "*" = every model
    tenant_tag: str = ""  # the blocks' owner (kite_shared.security.tenant_tag); "" = every tenant
    block_hashes: list[bytes] = Field(default_factory=list)
    sizes: list[int] = Field(default_factory=list)  # stored: encoded bytes of each block
    depths: list[int] = Field(default_factory=list)  # stored: block index in its chain, -1 unknown
    last_hits: list[float] = Field(default_factory=list)  # stored: unix seconds of each block's last hit
    at: float = 0.0  # renewed, hit: unix seconds


class PoolIndexChanges(Message):
    """ru-pool replica -> every other replica (subjects.POOL_INDEX_CHANGES, no queue group): what it
    changed in the shared tiers (warm, cold), pins, clears and invalidations, batched (one message per
    operation or per few milliseconds of background writes or sweep actions). Receivers apply them to
    their own index and ignore their own messages (`instance_id` + `nonce`)."""

    KIND: ClassVar[str] = "pool_index_changes"
    instance_id: str  # the sending replica
    nonce: str = ""  # per process: two replicas misconfigured with one instance id still hear each other
    seq: int = 0  # per sender, +1 per message; a gap means changes were lost (counted, warm re-listed)
    changes: list[IndexChange] = Field(default_factory=list)


class WorkerCachesRequest(Message):
    """joining ru-pool replica -> one live replica (subjects.POOL_WORKER_CACHES): the worker-cache index,
    one page of whole workers at a time, in worker id order."""

    KIND: ClassVar[str] = "pool_worker_caches_request"
    instance_id: str  # the asking replica
    after_worker_id: str = ""  # the page starts after this worker id ("" = from the first)


class WorkerCache(BaseModel):
    """One worker's local cache as a replica knows it from the worker's block events."""

    model_config = ConfigDict(frozen=True)
    worker_id: str
    seq: int = 0  # the last event number applied (events after it are replayed by the asker)
    seen: float = 0.0  # unix seconds of its last event or heartbeat
    models: dict[str, list[bytes]] = Field(default_factory=dict)  # model tag -> block hashes
    truncated: bool = False  # the blocks did not fit one reply: only part of them is here


class WorkerCachesReply(Message):
    KIND: ClassVar[str] = "pool_worker_caches_reply"
    instance_id: str = ""  # the answering replica
    workers: list[WorkerCache] = Field(default_factory=list)
    more: bool = False  # ask again after the last worker id for the rest
    # First page only: what the replica learned from ModelFingerprintChanged and purges, which no tier
    # listing tells a joining replica: the current fingerprint of each model name, the invalidated tags.
    current_fingerprints: dict[str, str] = Field(default_factory=dict)
    invalidated_tags: list[str] = Field(default_factory=list)
    error: ErrorInfo | None = None


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


class NamespaceStats(BaseModel):
    """One namespace (a model fingerprint: base or adapter, one execution path) in `stats`."""

    name: str = ""  # the model name it serves ("<base>" or "<base>:<adapter>"); "" if not heard yet
    blocks: int = 0  # blocks the index holds
    blocks_served: int = 0  # blocks this replica served by gets
    shadow_checks: int = 0  # shadow verifications workers reported
    divergences: int = 0  # of those, how many found the reused KV diverging from recomputation
    quarantined: bool = False  # the arbitrator quarantined it: its blocks are misses and purged


class PoolAdminReply(Message):
    KIND: ClassVar[str] = "pool_admin_reply"
    ok: bool
    affected: int = 0  # blocks cleared, pinned, unpinned, evicted (those the index held) or purged
    tiers: dict[str, TierStats] = Field(default_factory=dict)  # "hot", "warm", "cold" (op stats)
    # op stats: per tenant tag (kite_shared.security.tenant_tag); only the asked tenant when one was named
    tenants: dict[str, TenantUsage] = Field(default_factory=dict)
    counters: dict[str, int] = Field(default_factory=dict)  # puts, duplicates, promotions, ...
    namespaces: dict[str, NamespaceStats] = Field(default_factory=dict)  # op stats: by model tag (16 hex)
    error: ErrorInfo | None = None
