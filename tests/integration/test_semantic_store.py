"""The semantic cache's shared store on a real redis-server: two gateways' replicas (SemanticResponses)
see each other's entries and labels, never their own twice, apply no record without a valid MAC, and a
Redis that is gone means `bypass` (computed), never a failed request. Embeddings come from a fixed table
(the decisions, not the embedding model, are under test here; tests/integration/test_semantic_cache_stack.py
runs the real one)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import math

import msgpack
import numpy as np
import pytest
from prometheus_client import REGISTRY

from kite_cli.local_servers import free_port
from kite_gateway.fleet import Fleet
from kite_gateway.semantic import SemanticResponses
from kite_shared.config import GatewayConfig, load
from kite_shared.messages import ChatMessage, Heartbeat, SamplingParams

MODEL_FP = "cd" * 32
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
VECTORS = {
    "What is the capital of France?": [1.0, 0.0, 0.0],
    "Which city is the capital of France?": [0.98, math.sqrt(1 - 0.98 ** 2), 0.0],
    "Tell me a joke": [0.0, 0.0, 1.0],
}


def embed(texts: list[str]) -> np.ndarray:
    return np.array([VECTORS[t] for t in texts], dtype=np.float32)


def gateway(redis_url: str, name: str, **overrides) -> SemanticResponses:
    cfg = load(GatewayConfig, {}, redis_url=redis_url, semantic_cache_tenants="acme,globex",
               semantic_cache_delta=0.5, semantic_cache_min_observations=1, semantic_cache_explore_fraction=0.0,
               **overrides)
    fleet = Fleet(dead_after_s=60)
    fleet.observe(Heartbeat(service="fingerprinter", instance_id="f1", started_at=0, sent_at=0, model="m",
                            model_fingerprints={"m": MODEL_FP}))
    semantic = SemanticResponses.from_config(cfg, fleet, origin=name)
    semantic.embed = embed
    return semantic


async def ask(semantic: SemanticResponses, question: str, tenant: str = "acme"):
    return await semantic.consult(tenant, "m", "chat", [ChatMessage(role="user", content=question)], "", GREEDY, 1)


async def learnt(semantic: SemanticResponses, consulted, answer: str) -> None:
    semantic.learn(consulted, answer, {"finish_reason": "stop", "usage": {"completion_tokens": 2}})
    await semantic.settled()


@pytest.fixture()
async def gateways(redis_server):
    """Opens gateways (SemanticResponses) on one emptied Redis; closes them after the test."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_server.url)
    await client.flushdb()
    await client.aclose()
    opened: list[SemanticResponses] = []

    def open_gateway(name: str) -> SemanticResponses:
        opened.append(gateway(redis_server.url, name))
        return opened[-1]

    yield open_gateway
    for semantic in opened:
        await semantic.close()


def replica(semantic: SemanticResponses):
    return semantic.cache_for(MODEL_FP)


async def test_two_gateways_share_entries_and_labels(gateways):
    east, west = gateways("east"), gateways("west")
    miss = await ask(east, "What is the capital of France?")
    assert miss.outcome == "miss"
    await learnt(east, miss, "Paris.")
    explored = await ask(west, "Which city is the capital of France?")  # east's entry, no threshold yet
    assert explored.outcome == "explore" and explored.entry.answer == "Paris."
    assert explored.lookup.similarity == pytest.approx(0.98, abs=1e-5)
    await learnt(west, explored, "paris.")  # the same answer once case is normalised: a label
    assert replica(west).num_entries(miss.namespace) == 1  # the same answer is not stored again

    hit = await ask(east, "Which city is the capital of France?")  # east applied west's label
    assert hit.outcome == "hit" and hit.entry.answer == "Paris." and hit.entry.details["finish_reason"] == "stop"
    assert (await ask(west, "Which city is the capital of France?")).outcome == "hit"
    for semantic in (east, west):  # the one label, applied once by each (west skips its own record)
        assert replica(semantic).calibration_of("acme").num_observations == 1
    assert (await ask(west, "Tell me a joke")).outcome == "miss"
    other = await ask(west, "What is the capital of France?", tenant="initech")
    assert other.outcome == "bypass" and "tenant" in other.reason
    late = gateways("late")  # a gateway started later reads everything so far
    assert (await ask(late, "Which city is the capital of France?")).outcome == "hit"


async def test_labels_reach_every_gateway_but_no_other_tenant(gateways):
    east, west = gateways("east"), gateways("west")
    await learnt(east, await ask(east, "What is the capital of France?"), "Paris.")
    await learnt(west, await ask(west, "Which city is the capital of France?"), "Paris.")  # acme's label
    assert (await ask(east, "Which city is the capital of France?")).outcome == "hit"

    # globex asks the same on both: its own entry, and no threshold until its own labels teach one.
    await learnt(west, await ask(west, "What is the capital of France?", tenant="globex"), "Paris.")
    explored = await ask(east, "Which city is the capital of France?", tenant="globex")
    assert explored.outcome == "explore" and explored.lookup.threshold == math.inf
    await learnt(east, explored, "Paris.")
    assert (await ask(west, "Which city is the capital of France?", tenant="globex")).outcome == "hit"
    for semantic in (east, west):
        assert [replica(semantic).calibration_of(t).num_observations for t in ("acme", "globex")] == [1, 1]


async def test_a_cancelled_generation_is_not_learnt(gateways):
    east = gateways("east")
    miss = await ask(east, "What is the capital of France?")
    east.learn(miss, "Par", {"finish_reason": "cancelled", "usage": {"completion_tokens": 1}})  # cut short
    await east.settled()
    assert replica(east).num_entries(miss.namespace) == 0
    assert (await ask(east, "What is the capital of France?")).outcome == "miss"


async def test_concurrent_lookups_apply_each_label_once(gateways):
    east, west = gateways("east"), gateways("west")
    await learnt(east, await ask(east, "What is the capital of France?"), "Paris.")
    await learnt(west, await ask(west, "Which city is the capital of France?"), "Paris.")
    await asyncio.gather(*(ask(east, "Tell me a joke") for _ in range(8)))  # all read the same label
    assert replica(east).calibration_of("acme").num_observations == 1


async def test_a_redis_that_is_gone_means_bypass_not_failure():
    semantic = gateway(f"redis://127.0.0.1:{free_port()}", "lonely", tier_timeout_s=0.2)
    try:
        consulted = await ask(semantic, "What is the capital of France?")
        assert consulted.outcome == "bypass" and "store" in consulted.reason
        semantic.learn(consulted, "Paris", {})  # nothing to learn from a bypass
        await semantic.settled()
    finally:
        await semantic.close()


def rejected(reason: str) -> float:
    value = REGISTRY.get_sample_value("kite_gateway_semantic_cache_rejected_records_total", {"reason": reason})
    return value or 0.0


async def test_a_record_without_a_valid_mac_is_never_applied_and_costs_no_request(gateways, redis_server):
    """Whoever can write to Redis without the cluster secret cannot plant an answer: a record with no MAC,
    one signed with another key, one signed for another tenant's stream and replayed here, and a signed
    record that is not one are each skipped and counted, and the request is still answered."""
    import redis.asyncio as aioredis

    east = gateways("east")
    miss = await ask(east, "What is the capital of France?")
    _, stream = east.store.keys(miss.namespace)
    _, other_tenants_stream = east.store.keys(miss.namespace._replace(tenant="globex"))
    planted = msgpack.packb({"origin": "mallory", "kind": "inserted", "id": 999,
                             "prompt": "What is the capital of France?", "answer": "Lyon.",
                             "vector": np.array([1.0, 0.0, 0.0], dtype=np.float32).tobytes(), "details": {},
                             "wrong_above": -math.inf})
    another_cluster = hmac.new(b"another cluster's key", stream.encode() + b"\x00" + planted,
                               hashlib.sha256).digest()
    garbled = b"\xc1 not msgpack"
    raw = aioredis.Redis.from_url(redis_server.url)
    before = rejected("mac"), rejected("unreadable")
    try:
        await raw.xadd(stream, {"r": planted})
        await raw.xadd(stream, {"r": planted, "m": another_cluster})
        await raw.xadd(stream, {"r": planted, "m": east.store.mac(other_tenants_stream, planted)})
        await raw.xadd(stream, {"r": garbled, "m": east.store.mac(stream, garbled)})
        west = gateways("west")
        consulted = await ask(west, "What is the capital of France?")
        assert consulted.outcome == "miss" and replica(west).num_entries(miss.namespace) == 0
        assert (rejected("mac"), rejected("unreadable")) == (before[0] + 3, before[1] + 1)

        await raw.xadd(stream, {"r": planted, "m": east.store.mac(stream, planted)})  # signed: it is applied
        explored = await ask(west, "What is the capital of France?")
        assert explored.outcome == "explore" and explored.entry.answer == "Lyon."
    finally:
        await raw.aclose()
