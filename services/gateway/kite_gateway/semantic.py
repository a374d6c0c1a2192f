"""The gateway's semantic response cache (issue 17): whole answers reused by meaning, opt-in per tenant
(KITE_SEMANTIC_CACHE_TENANTS) and per request (`kite: {"semantic_cache": true}`).

Boundary: the HTTP and gRPC APIs ask `consult_if_asked()` before they open any generation and hand the
computed answer to `learn_if_consulted()` once it ended (a cancelled one is not an answer); this module
knows the embedder, Redis and the decision core (kite_shared.semantic_cache, which holds the algorithm);
nothing of HTTP or gRPC.

Which requests: only those whose answer is a function of the prompt: temperature 0, one choice, one text
prompt (a chat's last message from the user), a model whose fingerprint every live fingerprinter agrees on
(Fleet.model_fingerprint). Anything else is a `bypass` with its reason, computed as usual.

What is compared: the last user message (a chat) or the prompt (a completion) is embedded; everything else
that shapes the answer must be equal and goes into the namespace: the tenant, the model fingerprint, and a
digest of the conversation before the last message and the sampling parameters (max_tokens, stop,
ignore_eos). Tenants never share an entry nor a threshold: each tenant's labels calibrate its own
(kite_shared.semantic_cache, step 3, says why).

Where entries live: in the warm tier's Redis, so every gateway answers from the same entries. Each gateway
keeps a replica (a SemanticCache per model fingerprint, its HNSW index in memory) and, before a lookup,
reads what others appended since it last looked (one XREAD of two streams, one round trip):

    kite:sem:v3:{<model fp>}:ns:<namespace digest>               a stream of entry events: inserted,
                                                                 updated, evicted
    kite:sem:v3:{<model fp>}:tenant:<tenant digest>:observations  a stream of one tenant's labelled
                                                                 observations (its calibration)
    kite:sem:v3:{<model fp>}:next_id                             the counter that makes entry ids unique
                                                                 across gateways

(The braces are a Redis Cluster hash tag: one model's keys share a slot, so one XREAD reads both streams.)
A record names the gateway that wrote it, which skips its own on reading. Each record carries an
HMAC-SHA256 of its stream's key and its bytes under a key derived from the cluster secret
(security.semantic_cache_key), as every recyclable unit does: whoever can write to Redis but does not hold
the secret cannot plant an answer or a label, nor move a tenant's record into another's stream. A record
without a valid MAC, or one this gateway cannot read (another version's), is skipped and counted in
kite_gateway_semantic_cache_rejected_records_total, never applied. Streams are trimmed to a few
times KITE_SEMANTIC_CACHE_MAX_ENTRIES records and expire KITE_SEMANTIC_CACHE_TTL_S after their last write.

Failures: Redis down or slow (KITE_TIER_TIMEOUT_S) means a `bypass` (computed, not stored), never a failed
request; the embedder failing likewise. Nothing of this sits between a computed token and the client:
`learn()` runs after the answer is complete and its writes go to a background task.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import msgpack
import numpy as np
import redis.asyncio as aioredis
from prometheus_client import Counter, Histogram
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from kite_shared.config import GatewayConfig
from kite_shared.messages import ChatMessage, SamplingParams, StreamEnd
from kite_shared.security import semantic_cache_key
from kite_shared.semantic_cache import CacheEntry, CacheEvent, Lookup, Namespace, SemanticCache
from kite_shared.tiers.warm import redis_client
from kite_gateway.fleet import Fleet
from kite_gateway.generation import GenerationParams
from kite_gateway.openai_protocol import usage_body

log = logging.getLogger(__name__)

LOOKUPS = Counter("kite_gateway_semantic_cache_lookups_total",
                  "Requests that asked for the semantic cache, by outcome (hit, miss, explore, guarded, bypass)",
                  ["outcome"])
VERIFIED_ERRORS = Counter("kite_gateway_semantic_cache_verified_errors_total",
                          "Explored requests whose computed answer differed from the nearest entry's: answers "
                          "the cache would have got wrong at that similarity")
STORE_ERRORS = Counter("kite_gateway_semantic_cache_store_errors_total",
                       "Reads or writes of the semantic cache's Redis that failed or timed out")
REJECTED_RECORDS = Counter("kite_gateway_semantic_cache_rejected_records_total",
                           "Records of the semantic cache's Redis streams never applied, by reason: mac (no valid "
                           "MAC: not written under this cluster secret, or altered, or moved to another stream), "
                           "unreadable (written by another version)", ["reason"])
LOOKUP_SECONDS = Histogram("kite_gateway_semantic_cache_lookup_seconds",
                           "Embedding, store read and decision of one semantic cache lookup",
                           buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))

Outcome = Literal["hit", "miss", "explore", "guarded", "bypass"]
# v3: observations per tenant (v2's streams mixed tenants, v1's were unsigned: neither is ever read)
_KEY_PREFIX = "kite:sem:v3"
_RECORDS_PER_READ = 1000
_OBSERVATIONS_KEPT = 100_000  # the calibration's memory; a Wilson bound at 2% needs hundreds
_RECORDS_PER_ENTRY = 4  # an entry's stream holds its insertion, an update or two, its eviction
_WHITESPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class Consulted:
    """What the cache said about one request. On a hit, `entry` is the answer to send; otherwise the
    request is computed and its answer handed to `learn()` (unless `outcome` is bypass)."""

    outcome: Outcome
    reason: str = ""  # bypass: why the cache was not asked
    lookup: Lookup | None = None
    model_fingerprint: str = ""
    namespace: Namespace | None = None
    text: str = ""  # what was embedded
    vector: np.ndarray | None = None

    @property
    def entry(self) -> CacheEntry | None:
        return self.lookup.entry if self.lookup is not None else None

    def report(self) -> dict:
        """The response's extension field `kite.semantic_cache`."""
        body: dict = {"outcome": self.outcome}
        if self.reason:
            body["reason"] = self.reason
        if self.lookup is not None and math.isfinite(self.lookup.similarity):
            body["similarity"] = round(self.lookup.similarity, 4)
        if self.lookup is not None and math.isfinite(self.lookup.threshold):
            body["threshold"] = round(self.lookup.threshold, 4)
        return body


def bypass(reason: str) -> Consulted:
    return Consulted("bypass", reason=reason)


def counted(consulted: Consulted) -> Consulted:
    LOOKUPS.labels(consulted.outcome).inc()
    return consulted


def same_answer(a: str, b: str) -> bool:
    """For greedy decoding: the same text once whitespace and case are normalised."""
    return _WHITESPACE.sub(" ", a).strip().casefold() == _WHITESPACE.sub(" ", b).strip().casefold()


def request_key(kind: str, context: list[ChatMessage], sampling: SamplingParams) -> str:
    """The namespace's `sampling_key`: a digest of what, besides the embedded text, shapes the answer."""
    canonical = json.dumps({"kind": kind, "context": [[m.role, m.content] for m in context],
                            "max_tokens": sampling.max_tokens, "stop": sampling.stop,
                            "ignore_eos": sampling.ignore_eos}, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class SemanticStore:
    """The shared entries in Redis: appends a replica's events, reads the others' (those whose MAC holds).
    Raises RedisError."""

    def __init__(self, redis: aioredis.Redis | RedisCluster, origin: str, ttl_s: float, max_entries: int,
                 mac_key: bytes) -> None:
        self.redis = redis
        self.origin = origin  # this gateway: its own records are skipped when read back
        self.ttl_s = max(1, int(ttl_s))
        self.max_entries = max_entries
        self.mac_key = mac_key  # security.semantic_cache_key(): the same on every gateway of a cluster

    def mac(self, stream_key: str, record: bytes) -> bytes:
        """The MAC of a record in one stream: a record moved to another stream no longer verifies."""
        return hmac.new(self.mac_key, stream_key.encode() + b"\x00" + record, hashlib.sha256).digest()

    @staticmethod
    def keys(namespace: Namespace) -> tuple[str, str]:
        """(the observations stream of the namespace's tenant, the namespace's entry stream)."""
        base = f"{_KEY_PREFIX}:{{{namespace.model_fingerprint[:32]}}}"
        tenant = hashlib.sha256(namespace.tenant.encode()).hexdigest()[:32]
        digest = hashlib.sha256("\x00".join(namespace).encode()).hexdigest()[:32]
        return f"{base}:tenant:{tenant}:observations", f"{base}:ns:{digest}"

    async def next_id(self, model_fingerprint: str) -> int:
        return int(await self.redis.incr(f"{_KEY_PREFIX}:{{{model_fingerprint[:32]}}}:next_id"))

    async def read(self, namespace: Namespace, after: dict[str, str]) -> list[CacheEvent]:
        """Others' events on the two streams since the ids in `after` (stream key -> last id read,
        advanced in place)."""
        observations, entries = self.keys(namespace)
        events: list[CacheEvent] = []
        while True:
            streams = {key: after.get(key, "0-0") for key in (observations, entries)}
            replies = await self.redis.xread(streams, count=_RECORDS_PER_READ)
            num_read = 0
            for key, records in replies or ():
                key = key.decode() if isinstance(key, bytes) else key
                for record_id, fields in records:
                    num_read += 1
                    after[key] = record_id.decode() if isinstance(record_id, bytes) else record_id
                    decoded = self._decoded(key, fields, namespace)
                    if decoded is not None and decoded[0] != self.origin:
                        events.append(decoded[1])
            if num_read < _RECORDS_PER_READ:
                return events

    def _decoded(self, stream_key: str, fields: dict[bytes, bytes], namespace: Namespace
                 ) -> tuple[str, CacheEvent] | None:
        """(the record's origin, its event), or None for a record that is rejected (counted)."""
        packed, mac = fields.get(b"r"), fields.get(b"m")
        if packed is None or mac is None or not hmac.compare_digest(self.mac(stream_key, packed), mac):
            _reject("mac", f"a record in {stream_key} has no valid MAC (not written under this cluster "
                          "secret, or altered, or moved from another stream)")
            return None
        try:
            record = msgpack.unpackb(packed)
            return record["origin"], _event_of(record, namespace)
        except (msgpack.UnpackException, ValueError, KeyError, TypeError) as exc:
            _reject("unreadable", f"a record in {stream_key} cannot be read ({type(exc).__name__}: {exc}): "
                                 "written by another version?")
            return None

    async def append(self, events: list[CacheEvent]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            touched = set()
            for event in events:
                observations, entries = self.keys(event.entry.namespace)
                key, kept = (observations, _OBSERVATIONS_KEPT) if event.kind == "observed" else \
                    (entries, _RECORDS_PER_ENTRY * self.max_entries)
                packed = msgpack.packb(_record_of(event, self.origin))
                pipe.xadd(key, {"r": packed, "m": self.mac(key, packed)}, maxlen=kept, approximate=True)
                touched.add(key)
            for key in touched:
                pipe.expire(key, self.ttl_s)
            await pipe.execute()


def _record_of(event: CacheEvent, origin: str) -> dict:
    if event.kind == "observed":
        return {"origin": origin, "kind": "observed", "similarity": event.similarity, "same": event.same_answer}
    e = event.entry
    return {"origin": origin, "kind": event.kind, "id": e.entry_id, "prompt": e.prompt, "answer": e.answer,
            "vector": e.vector.astype(np.float32).tobytes(), "details": e.details, "wrong_above": e.wrong_above}


def _event_of(record: dict, namespace: Namespace) -> CacheEvent:
    """The event of a record `_record_of` wrote; TypeError or ValueError for any other shape."""
    kind = record["kind"]
    if kind == "observed":
        _expect(record, similarity=float, same=bool)
        # The stream is the tenant's (its key is under the record's MAC).
        return CacheEvent("observed", None, record["similarity"], record["same"], namespace.tenant)
    if kind not in ("inserted", "updated", "evicted"):
        raise ValueError(f"unknown kind {kind!r}")
    _expect(record, id=int, prompt=str, answer=str, vector=bytes, details=dict, wrong_above=float)
    entry = CacheEntry(record["id"], namespace, record["prompt"], record["answer"],
                       np.frombuffer(record["vector"], dtype=np.float32).copy(), record["details"],
                       wrong_above=record["wrong_above"])
    return CacheEvent(kind, entry)


def _expect(record: dict, **types: type) -> None:
    for name, expected in types.items():
        if not isinstance(record[name], expected):
            raise TypeError(f"{name} is a {type(record[name]).__name__}, not a {expected.__name__}")


def _reject(reason: str, detail: str) -> None:
    REJECTED_RECORDS.labels(reason).inc()
    log.warning("semantic cache: %s; skipped", detail)


class SemanticResponses:
    """One per gateway process: consults the cache for eligible requests and learns from computed ones."""

    def __init__(self, cfg: GatewayConfig, fleet: Fleet, store: SemanticStore, embed) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.store = store
        self.embed = embed  # list[str] -> [n, dims] unit-norm float32 (blocking: run on `_embedding`)
        self.tenants = cfg.semantic_cache_tenant_set()
        self._caches: dict[str, SemanticCache] = {}  # by model fingerprint
        self._read_up_to: dict[str, str] = {}  # stream key -> last record id applied
        # One read-and-apply at a time: two lookups reading from the same id would both apply an
        # observation, and a calibration must count each label once.
        self._reading = asyncio.Lock()
        self._embedding = ThreadPoolExecutor(1, thread_name_prefix="kite-embed")
        self._writes: set[asyncio.Task] = set()

    @classmethod
    def from_config(cls, cfg: GatewayConfig, fleet: Fleet, origin: str) -> "SemanticResponses | None":
        """None when KITE_SEMANTIC_CACHE_TENANTS is empty (the embedding model is then never loaded)."""
        if not cfg.semantic_cache_tenant_set():
            return None
        from kite_shared.embedder import Embedder

        redis = redis_client(cfg.redis_url, cfg.redis_cluster, cfg.tier_timeout_s, max(cfg.tier_timeout_s, 0.5))
        store = SemanticStore(redis, origin, cfg.semantic_cache_ttl_s, cfg.semantic_cache_max_entries,
                              semantic_cache_key())
        return cls(cfg, fleet, store, Embedder().embed)

    async def start(self) -> None:
        """Load the embedding model now rather than on a tenant's first request."""
        await asyncio.get_running_loop().run_in_executor(self._embedding, self.embed, ["warm up"])

    async def settled(self, timeout_s: float | None = None) -> None:
        """Wait for the store writes of what was learnt so far (at most `timeout_s`)."""
        if self._writes:
            await asyncio.wait(set(self._writes), timeout=timeout_s)

    async def close(self) -> None:
        await self.settled(self.cfg.tier_timeout_s * 4)
        self._embedding.shutdown(wait=False)
        await self.store.redis.aclose()

    def enabled_for(self, tenant: str) -> bool:
        return "*" in self.tenants or tenant in self.tenants

    def cache_for(self, model_fingerprint: str) -> SemanticCache:
        """This gateway's replica of one model's entries and calibrations."""
        cache = self._caches.get(model_fingerprint)
        if cache is None:
            cfg = self.cfg
            cache = self._caches[model_fingerprint] = SemanticCache(
                delta=cfg.semantic_cache_delta, confidence=cfg.semantic_cache_confidence,
                min_similarity=cfg.semantic_cache_min_similarity,
                min_observations=cfg.semantic_cache_min_observations,
                explore_fraction=cfg.semantic_cache_explore_fraction, max_entries=cfg.semantic_cache_max_entries)
        return cache

    async def consult(self, tenant: str, model: str, kind: str, messages: list[ChatMessage], text: str,
                      sampling: SamplingParams, num_choices: int) -> Consulted:
        """The cache's answer for one request: `messages` (a chat: all of them; the last is embedded) or
        `text` (a completion's one text prompt)."""
        if not self.enabled_for(tenant):
            return counted(bypass("the semantic cache is not enabled for this tenant"))
        if sampling.temperature != 0:
            return counted(bypass("temperature is not 0: the answer is not a function of the prompt"))
        if num_choices != 1:
            return counted(bypass("only requests for one choice (n = 1, one prompt) are cached"))
        if messages:
            if messages[-1].role != "user":
                return counted(bypass("the last message is not the user's"))
            context, text = messages[:-1], messages[-1].content
        else:
            context = []
        if not text.strip():
            return counted(bypass("only text prompts are cached"))
        model_fingerprint = self.fleet.model_fingerprint(model)
        if model_fingerprint is None:
            return counted(bypass("the model's fingerprint is not known to this gateway (yet)"))
        namespace = Namespace(tenant, model_fingerprint, request_key(kind, context, sampling))
        with LOOKUP_SECONDS.time():
            try:
                vector = (await asyncio.get_running_loop().run_in_executor(self._embedding, self.embed, [text]))[0]
            except Exception:
                log.exception("the semantic cache's embedder failed; computing the request")
                return counted(bypass("the embedder failed"))
            cache = self.cache_for(model_fingerprint)
            try:
                async with self._reading:
                    for event in await self.store.read(namespace, self._read_up_to):
                        try:
                            cache.apply(event)
                        except ValueError as exc:  # an embedding of other dimensions: another embedder's
                            _reject("unreadable", f"an event cannot be applied ({exc})")
            except (RedisError, OSError) as exc:
                STORE_ERRORS.inc()
                log.warning("the semantic cache's Redis cannot be read (%s); computing the request", exc)
                return counted(bypass("the semantic cache's store is unavailable"))
            lookup = cache.lookup(namespace, text, vector)
        return counted(Consulted(lookup.outcome, lookup=lookup, model_fingerprint=model_fingerprint,
                                       namespace=namespace, text=text, vector=vector))

    def learn(self, consulted: Consulted, answer: str, details: dict) -> None:
        """The computed answer of a request the cache did not answer: a label, an entry, or both. The store
        is written by a background task (never on the response's path)."""
        if consulted.outcome in ("hit", "bypass") or details.get("finish_reason") == "cancelled":
            return  # a cancelled generation's text is not the answer
        task = asyncio.create_task(self._learn(consulted, answer, details))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _learn(self, consulted: Consulted, answer: str, details: dict) -> None:
        cache = self.cache_for(consulted.model_fingerprint)
        add = True
        if consulted.outcome == "explore":
            same = same_answer(answer, consulted.entry.answer)
            cache.record(consulted.lookup, same)
            if not same:
                VERIFIED_ERRORS.inc()
            add = not same
        try:
            if add:
                entry_id = await self.store.next_id(consulted.model_fingerprint)
                cache.insert(consulted.namespace, consulted.text, consulted.vector, answer, details, entry_id)
            await self.store.append(cache.take_events())
        except (RedisError, OSError) as exc:
            STORE_ERRORS.inc()
            log.warning("the semantic cache's Redis cannot be written (%s); the answer is not shared", exc)
            cache.take_events()  # what was learnt stays in this replica only
        except Exception:  # a background task: nobody awaits it, so its failure is logged here
            log.exception("the semantic cache could not learn from a computed answer")




async def consult_if_asked(semantic: SemanticResponses | None, asked: bool, tenant: str, kind: str,
                           params: GenerationParams, num_choices: int) -> Consulted | None:
    """The semantic cache's outcome for a request (`kind` "chat" or "completion"), whichever API it came
    by; None when it did not ask, a bypass when this deployment has no semantic cache."""
    if not asked:
        return None
    if semantic is None:
        return counted(bypass("the semantic cache is off in this deployment (KITE_SEMANTIC_CACHE_TENANTS)"))
    return await semantic.consult(tenant, params.model, kind, params.messages or [], params.prompt or "",
                                  params.sampling, num_choices)


def learn_if_consulted(semantic: SemanticResponses | None, consulted: Consulted | None, text: str,
                       end: StreamEnd) -> None:
    """Hand a computed answer to the cache, with what an entry keeps besides the text (how it ended and
    its usage, in OpenAI's shape, given back with every hit)."""
    if consulted is not None and semantic is not None:
        semantic.learn(consulted, text, {"finish_reason": end.finish_reason, "usage": usage_body([end])})
