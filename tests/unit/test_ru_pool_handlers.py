"""The ru-pool's handler table without a bus (kite_ru_pool.handlers through Endpoint.answer), over a
hot-only pool built from its parts (core.PoolCore, admin): what each subject answers, and
errors the framework's way (`invalid_message`, `internal_error`, an admin refusal's `bad_request`). The
same over a real nats-server, Redis and S3: tests/integration/test_ru_pool_service.py."""

from __future__ import annotations

import asyncio

import pytest

from kite_ru_pool.admin import PoolAdmin
from kite_ru_pool.core import PoolCore
from kite_ru_pool.handlers import PoolHandlers
from kite_ru_pool.index import HOT
from kite_shared import subjects
from kite_shared.messages import (
    BlockRemoved, BlockStored, Decision, Heartbeat, ModelFingerprintChanged, PoolAdminReply, PoolAdminRequest,
    PoolGetReply, PoolGetRequest, PoolLookupReply, PoolLookupRequest, ShadowCheckResult,
)
from kite_shared.tiers.keys import BlockKey, model_tag
from tests.helpers import unit_chain

KEY = b"k" * 32
FP = "66" * 32
TINY = (1, 2, 1, 16, 1)  # [layers, key/value, kv heads, tokens, head dim]: 64 bytes of fp16
FP2 = "77" * 32
NOW = 1000.0


class Bus:
    max_payload = 1 << 20


class Pool:
    """A hot-only pool from its parts, answering through its Endpoint table."""

    def __init__(self) -> None:
        self.core = PoolCore(hot_bytes=1 << 20, archive_after_s=100.0, warm_ttl_s=60.0, cold_ttl_s=0.0,
                             sweep_interval_s=1.0, has_warm=False, has_cold=False, ru_key=KEY, clock=lambda: NOW)
        self.background = self.core.background
        handlers = PoolHandlers(self.core, PoolAdmin(self.core), Bus(), None, "host", lambda: NOW)
        self.endpoints = {ep.subject: ep for ep in handlers.endpoints()}

    async def ask(self, subject: str, data: bytes):
        return await self.endpoints[subject].answer(data)


def lookup(fp: str, hashes: list[bytes]) -> bytes:
    return PoolLookupRequest(model_fingerprint=fp, block_hashes=hashes).encode()


async def test_puts_then_lookups_and_gets_of_the_hot_tier():
    pool = Pool()
    blocks = unit_chain(FP, 3, key=KEY, shape=TINY)
    for _, unit in blocks:
        assert await pool.ask(subjects.POOL_PUT, unit) is None  # raw bytes, no reply
    hashes = [h for h, _ in blocks]
    assert all(pool.core.index.tiers_of(BlockKey.of(FP, h)) == HOT for h in hashes)
    reply = await pool.ask(subjects.POOL_LOOKUP, lookup(FP, hashes + [b"\0" * 32]))
    assert isinstance(reply, PoolLookupReply) and (reply.hot, reply.pool, reply.tiers) == (3, 3, b"hhh")
    reply = await pool.ask(subjects.POOL_GET,
                           PoolGetRequest(model_fingerprint=FP, block_hashes=hashes).encode())
    assert isinstance(reply, PoolGetReply) and reply.units == [u for _, u in blocks] and reply.complete
    stats = await pool.ask(subjects.POOL_ADMIN, PoolAdminRequest(op="stats").encode())
    assert stats.ok and stats.tiers["hot"].blocks == 3 and stats.counters["puts"] == 3


async def test_undecodable_requests_are_answered_invalid_message_and_bad_puts_are_counted():
    pool = Pool()
    for subject, reply_type in ((subjects.POOL_LOOKUP, PoolLookupReply), (subjects.POOL_GET, PoolGetReply),
                                (subjects.POOL_ADMIN, PoolAdminReply)):
        reply = await pool.ask(subject, b"\xc1 not msgpack")
        assert isinstance(reply, reply_type) and reply.error.code == "invalid_message", reply
    assert (await pool.ask(subjects.POOL_ADMIN, b"\xc1")).ok is False
    # A put carries a raw unit: not one is refused by the pool's verification, not by the framework.
    assert await pool.ask(subjects.POOL_PUT, b"not a unit") is None
    assert pool.core.counters.refused_corrupt == 1
    # Events have no one to answer: dropped.
    for subject in (subjects.POOL_BLOCK_EVENTS, subjects.MODEL_FINGERPRINT, subjects.heartbeat("worker")):
        assert await pool.ask(subject, b"junk") is None


async def test_an_admin_request_it_cannot_act_on_is_refused_bad_request():
    pool = Pool()
    for op in ("pin", "unpin", "evict", "purge"):
        reply = await pool.ask(subjects.POOL_ADMIN, PoolAdminRequest(op=op).encode())
        assert reply.ok is False and reply.error.code == "bad_request"
        assert reply.error.param == "model_fingerprint" and op in reply.error.message


async def test_a_handler_bug_is_answered_internal_error_and_the_endpoint_goes_on(monkeypatch, caplog):
    pool = Pool()

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(pool.core.reads, "lookup", broken)
    reply = await pool.ask(subjects.POOL_LOOKUP, lookup(FP, [b"\1" * 32]))
    assert reply.error.code == "internal_error" and "a bug" not in reply.error.message
    assert "KeyError" in caplog.text
    monkeypatch.undo()
    assert (await pool.ask(subjects.POOL_LOOKUP, lookup(FP, [b"\1" * 32]))).error is None


async def test_worker_events_and_heartbeats_feed_the_worker_caches():
    pool = Pool()
    hashes = [h for h, _ in unit_chain(FP, 4, key=KEY, shape=TINY)]
    await pool.ask(subjects.POOL_BLOCK_EVENTS, BlockStored(worker_id="w1", model_fingerprint=FP,
                                                           block_hashes=hashes[:3], seq=1).encode())
    await pool.ask(subjects.POOL_BLOCK_EVENTS, BlockRemoved(worker_id="w1", model_fingerprint=FP,
                                                            block_hashes=hashes[2:3], seq=3).encode())
    assert (await pool.ask(subjects.POOL_LOOKUP, lookup(FP, hashes))).workers == {"w1": 2}
    assert pool.core.counters.worker_event_gaps == 1  # seq 2 was lost
    beat = Heartbeat(service="worker", instance_id="w1", started_at=0.0, sent_at=NOW, draining=True)
    await pool.ask(subjects.heartbeat("worker"), beat.encode())
    assert (await pool.ask(subjects.POOL_LOOKUP, lookup(FP, hashes))).workers == {}


async def test_a_new_fingerprint_invalidates_the_old_and_its_purge_runs_in_the_background():
    pool = Pool()
    blocks = unit_chain(FP, 2, key=KEY, shape=TINY)
    for _, unit in blocks:
        await pool.ask(subjects.POOL_PUT, unit)
    for fp in (FP, FP2):
        await pool.ask(subjects.MODEL_FINGERPRINT, ModelFingerprintChanged(
            model_name="m", model_fingerprint=fp).encode())
    assert (await pool.ask(subjects.POOL_LOOKUP, lookup(FP, [h for h, _ in blocks]))).invalidated
    get = await pool.ask(subjects.POOL_GET,
                         PoolGetRequest(model_fingerprint=FP, block_hashes=[blocks[0][0]]).encode())
    assert get.error.code == "invalidated" and get.units == []
    await asyncio.wait_for(pool.background.drain(), 5)
    assert model_tag(FP) not in pool.core.index.pending_purges  # no remote tier: nothing left to purge


@pytest.mark.parametrize("op", ["pin", "evict"])
async def test_pins_and_evictions_of_hot_blocks(op):
    pool = Pool()
    blocks = unit_chain(FP, 2, key=KEY, shape=TINY)
    for _, unit in blocks:
        await pool.ask(subjects.POOL_PUT, unit)
    req = PoolAdminRequest(op=op, model_fingerprint=FP, block_hashes=[h for h, _ in blocks])
    reply = await pool.ask(subjects.POOL_ADMIN, req.encode())
    assert reply.ok and reply.affected == 2
    assert pool.core.index.is_pinned(BlockKey.of(FP, blocks[0][0])) == (op == "pin")
    assert pool.core.index.num_blocks() == (2 if op == "pin" else 0)


def quarantine(quarantined: bool, fp: str = FP) -> bytes:
    return Decision(decision_id="d", action="quarantine", target=fp, namespace="m:alpha",
                    quarantined=quarantined, reason="test").encode()


def shadow(diverged: bool, fp: str = FP) -> bytes:
    return ShadowCheckResult(instance_id="w1", model_fingerprint=fp, namespace="m:alpha", request_id="r",
                             num_reused_tokens=32, divergence=2.0 if diverged else 0.0, tolerance=1e-4,
                             diverged=diverged).encode()


async def test_a_quarantined_namespace_is_a_miss_refuses_puts_and_is_purged_until_lifted():
    pool = Pool()
    blocks, others = unit_chain(FP, 2, key=KEY, shape=TINY), unit_chain(FP2, 2, key=KEY, shape=TINY)
    for _, unit in blocks + others:
        await pool.ask(subjects.POOL_PUT, unit)
    await pool.ask(subjects.MODEL_FINGERPRINT, ModelFingerprintChanged(model_name="m:alpha",
                                                                       model_fingerprint=FP).encode())
    hashes = [h for h, _ in blocks]
    await pool.ask(subjects.POOL_GET, PoolGetRequest(model_fingerprint=FP, block_hashes=hashes).encode())
    await pool.ask(subjects.SHADOW_RESULTS, shadow(False))
    await pool.ask(subjects.SHADOW_RESULTS, shadow(True))
    await pool.ask(subjects.DECISIONS, quarantine(True))
    assert (await pool.ask(subjects.POOL_LOOKUP, lookup(FP, hashes))).invalidated
    assert pool.core.index.num_blocks() == 2  # the other namespace keeps its blocks
    await pool.ask(subjects.POOL_PUT, blocks[0][1])
    assert pool.core.counters.refused_invalidated == 1
    await asyncio.wait_for(pool.background.drain(), 5)
    assert model_tag(FP) not in pool.core.index.pending_purges
    # The fingerprinter announcing the namespace again (a restart) does not lift it; an operator does.
    await pool.ask(subjects.MODEL_FINGERPRINT, ModelFingerprintChanged(model_name="m:alpha",
                                                                       model_fingerprint=FP).encode())
    assert (await pool.ask(subjects.POOL_LOOKUP, lookup(FP, hashes))).invalidated
    stats = await pool.ask(subjects.POOL_ADMIN, PoolAdminRequest(op="stats").encode())
    audit = stats.namespaces[model_tag(FP)]
    assert (audit.name, audit.blocks, audit.blocks_served, audit.shadow_checks, audit.divergences,
            audit.quarantined) == ("m:alpha", 0, 2, 2, 1, True)
    assert stats.namespaces[model_tag(FP2)].blocks == 2 and not stats.namespaces[model_tag(FP2)].quarantined
    await pool.ask(subjects.DECISIONS, quarantine(False))
    assert not (await pool.ask(subjects.POOL_LOOKUP, lookup(FP, hashes))).invalidated
    await pool.ask(subjects.POOL_PUT, blocks[0][1])
    assert (await pool.ask(subjects.POOL_LOOKUP, lookup(FP, hashes))).pool == 1
    stats = await pool.ask(subjects.POOL_ADMIN, PoolAdminRequest(op="stats").encode())
    assert not stats.namespaces[model_tag(FP)].quarantined
