"""ru-pool replicas (issue 14 item 4, docs/ru-pool.md "Replicas"): real `python -m kite_ru_pool` processes
started by the test stack (StackOptions.pool_replicas) on their own nats-server (JetStream on: the lease),
one real Redis (the warm tier, tests/conftest.py) and one real cold folder.

Which replica answers is known by asking each on its own subjects (subjects.pool_replica) and by counting
each replica's lookups (its `stats`); the clients of the queue group are kite_shared's PoolClient, for
which a timeout is a miss (None), never an exception."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

import nats
import pytest
import redis

from kite_cli.stack import LocalStack, StackOptions
from kite_shared import subjects
from kite_shared.messages import (PoolAdminReply, PoolAdminRequest, PoolGetReply, PoolGetRequest,
                                  PoolLookupReply, PoolLookupRequest)
from kite_shared.tiers.cold import LocalDirTier
from kite_shared.tiers.keys import BlockKey, redis_key, redis_pattern
from kite_shared.tiers.pool_client import PoolClient
from tests.helpers import new_fp, pool_stats_async, unit_chain, wait_until_async

LEASE_S = 1.5
SWEEP_S = 0.2
TAKEOVER_BOUND_S = LEASE_S + LEASE_S / 3 + SWEEP_S + 1.5  # the lease, one renewal, one sweep, delivery
A, B, C = "ru-pool-1", "ru-pool-2", "ru-pool-3"


@pytest.fixture
def pool_stack(redis_server, tmp_path):
    db = 1 + uuid.uuid4().int % 14
    redis.Redis(port=redis_server.port, db=db).flushdb()
    stacks: list[LocalStack] = []

    def start(replicas: int, cold_seed: list[tuple[str, list[tuple[bytes, bytes]]]] = ()) -> LocalStack:
        cold_dir = tmp_path / "cold"
        if cold_seed:  # blocks only the cold tier holds when the replicas start: their rebuilds list them
            async def seed() -> None:
                cold = LocalDirTier(cold_dir)
                for fp, chain in cold_seed:
                    for h, data in chain:
                        assert await cold.put(BlockKey.of(fp, h), data)
                await cold.close()
            asyncio.run(seed())
        stack = LocalStack(StackOptions(
            services=("ru-pool",), num_workers=0, pool_replicas=replicas, with_redis=False,
            log_dir=tmp_path / "logs", env={
                "KITE_REDIS_URL": f"{redis_server.url}/{db}", "KITE_S3_ENDPOINT": "",
                "KITE_COLD_DIR": str(cold_dir), "KITE_POOL_LEASE_S": str(LEASE_S),
                "KITE_POOL_SWEEP_INTERVAL_S": str(SWEEP_S), "KITE_HEARTBEAT_INTERVAL_S": "0.3",
                "KITE_LOG_LEVEL": "INFO"}))
        stacks.append(stack)
        stack.start()
        return stack

    start.redis = redis.Redis(port=redis_server.port, db=db)
    yield start
    for stack in stacks:
        stack.stop()


async def ask(nc, subject: str, request, reply_type, timeout_s: float = 5.0):
    return reply_type.decode((await nc.request(subject, request.encode(), timeout=timeout_s)).data)


async def lookup(nc, replica: str, fp: str, hashes: list[bytes]) -> PoolLookupReply:
    return await ask(nc, subjects.pool_replica(replica, "lookup"),
                     PoolLookupRequest(model_fingerprint=fp, block_hashes=hashes), PoolLookupReply)


async def get(nc, replica: str, fp: str, hashes: list[bytes]) -> PoolGetReply:
    return await ask(nc, subjects.pool_replica(replica, "get"),
                     PoolGetRequest(model_fingerprint=fp, block_hashes=hashes), PoolGetReply)


async def admin(nc, replica: str, **request) -> PoolAdminReply:
    reply = await ask(nc, subjects.pool_replica(replica, "admin"), PoolAdminRequest(**request), PoolAdminReply)
    assert reply.ok, reply
    return reply


async def ready(nc, replicas: list[str], timeout_s: float = 60.0) -> None:
    """Every replica answers on its own subject, has rebuilt its index and serves the queue group."""
    async def all_ready() -> bool:
        for replica in replicas:
            try:
                c = (await pool_stats_async(nc, replica)).counters
            except Exception:  # not subscribed yet: no responders
                return False
            if c.get("rebuilding") != 0 or c.get("serving") != 1:
                return False
        return True
    await wait_until_async(all_ready, timeout_s, f"replicas {replicas} ready")


async def lookups_answered(nc, replicas: list[str]) -> dict[str, int]:
    return {r: (await pool_stats_async(nc, r)).counters["lookups"] for r in replicas}


def test_two_replicas_share_the_index_and_a_third_joins_with_it(pool_stack):
    stack = pool_stack(2)

    async def scenario() -> None:
        nc = await nats.connect(stack.nats.url)
        client = PoolClient(nc, worker_id="w1", lookup_timeout_s=2.0, get_timeout_s=5.0, handoff=False)
        try:
            await ready(nc, [A, B])
            fp = new_fp()
            chain = unit_chain(fp, 8)
            hashes = [h for h, _ in chain]
            units = [d for _, d in chain]

            # A put through A: A holds it hot and writes it to warm; B learns it from A's index changes.
            for data in units:
                await nc.publish(subjects.pool_replica(A, "put"), data)
            await wait_until_async(lambda: lookup(nc, B, fp, hashes), 10, "B answering the lookup")
            await wait_until_async(lambda: _pool_is(nc, B, fp, hashes, 8), 10, "B indexing A's blocks")
            ra, rb = await lookup(nc, A, fp, hashes), await lookup(nc, B, fp, hashes)
            assert (ra.hot, ra.warm, ra.pool) == (8, 8, 8), ra
            assert (rb.hot, rb.warm, rb.pool, rb.tiers) == (0, 8, 8, b"w" * 8), rb  # hot is A's own
            assert (await pool_stats_async(nc, B)).counters["puts"] == 0  # B never saw the put itself
            # Gets from both: A from its hot tier, B from warm (and promoted into B's hot tier).
            ga, gb = await get(nc, A, fp, hashes), await get(nc, B, fp, hashes)
            assert ga.units == units and ga.tiers == b"h" * 8
            assert gb.units == units and gb.tiers == b"w" * 8
            assert (await lookup(nc, B, fp, hashes)).hot == 8

            # Through the queue group: every lookup answers the whole chain, and both replicas answer some.
            before = await lookups_answered(nc, [A, B])
            for _ in range(200):
                r = await client.lookup(fp, hashes)
                assert r is not None and r.pool == 8, r
            after = await lookups_answered(nc, [A, B])
            shares = {k: after[k] - before[k] for k in after}
            assert sum(shares.values()) >= 200 and all(v > 0 for v in shares.values()), shares
            assert await client.get(fp, hashes) == units

            # Worker block events reach both (no queue group).
            await client.block_stored(fp, hashes[:5])
            await wait_until_async(lambda: _workers_are(nc, [A, B], fp, hashes, {"w1": 5}), 5, "worker events on both")

            # Evict through B: A forgets the blocks too, its hot copies included; storage is cleaned.
            await admin(nc, B, op="evict", model_fingerprint=fp, block_hashes=hashes[6:])
            await wait_until_async(lambda: _pool_is(nc, A, fp, hashes, 6), 5, "A seeing B's evict")
            assert (await lookup(nc, A, fp, hashes)).hot == 6
            assert len(pool_stack.redis.keys(redis_pattern(fp[:16]))) == 6
            assert (await get(nc, A, fp, hashes)).units == units[:6]

            # A pin through A: warm keeps the blocks without expiry (the other replicas pin them in their
            # index: tests/unit/test_ru_pool_index_changes.py).
            await admin(nc, A, op="pin", model_fingerprint=fp, block_hashes=hashes[:2])
            assert [pool_stack.redis.ttl(redis_key(BlockKey.of(fp, h))) for h in hashes[:3]][:2] == [-1, -1]

            # A third replica joins: it rebuilds the block index from the tiers, takes the worker caches
            # from a running replica, and answers right from its first request.
            other = new_fp()
            other_chain = unit_chain(other, 4)
            for _, data in other_chain:
                await client.put(data)
            await wait_until_async(lambda: _pool_is(nc, A, other, [h for h, _ in other_chain], 4), 10,
                                   "the second chain")
            await wait_until_async(lambda: _pool_is(nc, B, other, [h for h, _ in other_chain], 4), 10,
                                   "the second chain")
            stack.start_pool_replica()
            await ready(nc, [C])
            rc = await lookup(nc, C, fp, hashes)
            assert (rc.pool, rc.warm, rc.hot, rc.workers) == (6, 6, 0, {"w1": 5}), rc
            assert (await lookup(nc, C, other, [h for h, _ in other_chain])).pool == 4
            assert (await get(nc, C, fp, hashes)).units == units[:6]
            # ... and takes its share of the queue group's lookups without any restart of the others.
            before = await lookups_answered(nc, [A, B, C])
            for _ in range(300):
                r = await client.lookup(fp, hashes)
                assert r is not None and r.pool == 6 and r.workers == {"w1": 5}, r
            after = await lookups_answered(nc, [A, B, C])
            shares = {k: after[k] - before[k] for k in after}
            assert all(v > 0 for v in shares.values()), shares
            print(f"lookups answered per replica, 3 replicas: {shares}")

            # Each knows the others from their heartbeats; a clear through A empties every view.
            await wait_until_async(lambda: _replicas_are(nc, [A, B, C], 3), 5, "every replica counting 3")
            await admin(nc, A, op="clear", model_fingerprint=fp)
            for r in (B, C):
                await wait_until_async(lambda r=r: _pool_is(nc, r, fp, hashes, 0), 5, f"{r} seeing A's clear")
            assert (await lookup(nc, B, fp, hashes)).hot == 0
            assert not pool_stack.redis.keys(redis_pattern(fp[:16]))
            for r in (A, B, C):
                await wait_until_async(lambda r=r: _no_pending_purges(nc, r), 5, f"{r}'s purge settled")
        finally:
            await nc.close()

    asyncio.run(scenario())


def test_sigkill_of_the_leader_during_lookups_and_gets_loses_no_request_and_no_block(pool_stack):
    fp_cold = new_fp()
    cold_chain = unit_chain(fp_cold, 6)
    stack = pool_stack(2, cold_seed=[(fp_cold, cold_chain)])

    async def scenario() -> None:
        nc = await nats.connect(stack.nats.url)
        client = PoolClient(nc, worker_id="w1", lookup_timeout_s=0.5, get_timeout_s=2.0, handoff=False)
        try:
            await ready(nc, [A, B])
            fp = new_fp()
            chain = unit_chain(fp, 16)
            hashes = [h for h, _ in chain]
            units = [d for _, d in chain]
            cold_hashes = [h for h, _ in cold_chain]
            for data in units:
                await client.put(data)
            for r in (A, B):
                await wait_until_async(lambda r=r: _warm_is(nc, r, fp, hashes, 16), 10, f"{r} indexing the warm chain")
                assert (await lookup(nc, r, fp_cold, cold_hashes)).cold == 6

            # Exactly one replica sweeps: the lease holder.
            await asyncio.sleep(1.0)
            first = {r: (await pool_stats_async(nc, r)).counters for r in (A, B)}
            await asyncio.sleep(1.0)
            second = {r: (await pool_stats_async(nc, r)).counters for r in (A, B)}
            leaders = [r for r in (A, B) if second[r]["leader"]]
            assert len(leaders) == 1, second
            leader = leaders[0]
            follower = B if leader == A else A
            assert second[leader]["sweeps"] > first[leader]["sweeps"]
            assert second[follower]["sweeps"] == 0

            # A client streams lookups and gets through the queue group; the leader dies by SIGKILL.
            log: list[tuple[float, bool, int]] = []  # (sent at, answered (after one retry), retries)
            stop = asyncio.Event()

            async def stream() -> None:
                n = 0
                while not stop.is_set():
                    n += 1
                    sent = time.monotonic()
                    retries = 0
                    for _ in range(2):  # the client's behaviour: a timeout is a miss, asked again once
                        if n % 3:
                            r = await client.lookup(fp if n % 2 else fp_cold, hashes if n % 2 else cold_hashes)
                            ok = r is not None and r.pool == (16 if n % 2 else 6)
                        else:
                            got = await client.get(fp, hashes[:4])
                            ok = got == units[:4]
                        if ok:
                            break
                        retries += 1
                    log.append((sent, ok, retries))
                    await asyncio.sleep(0.005)

            streaming = asyncio.create_task(stream())
            await asyncio.sleep(1.0)
            victim = next(p for p in stack.pool_replicas() if p.log_path.stem == leader)
            victim.process.send_signal(signal.SIGKILL)
            await asyncio.to_thread(victim.process.wait)
            killed_at = time.monotonic()
            # Another replica takes the lease and sweeps within the lease, a renewal and a sweep.
            base = (await pool_stats_async(nc, follower)).counters["sweeps"]
            started = time.monotonic()
            await wait_until_async(lambda: _sweeps_above(nc, follower, base), 10, "the follower sweeping")
            takeover_s = time.monotonic() - started
            # Stream on until the survivor has answered enough requests to mean something, however slow the
            # machine: a get that waits out its 2 s timeout on the dead replica holds the stream up (the
            # 2026-12-07 CI saw exactly 50 requests in the second after the takeover, and failed on > 50).
            await asyncio.sleep(1.0)
            await wait_until_async(lambda: sum(entry[0] >= killed_at for entry in log) > 50, 30,
                                   "50 requests after the kill")
            stop.set()
            await streaming
            assert takeover_s <= TAKEOVER_BOUND_S, takeover_s
            after = [entry for entry in log if entry[0] >= killed_at]
            assert len(after) > 50, len(after)
            failed = [entry for entry in after if not entry[1]]
            assert not failed, f"{len(failed)} of {len(after)} requests after the kill unanswered"
            before = [entry for entry in log if entry[0] < killed_at]
            assert all(ok for _, ok, _ in before), "a request before the kill was not answered even on retry"
            print(f"{len(before)} requests before the SIGKILL, {len(after)} after, all answered; "
                  f"{sum(1 for *_, retries in log if retries)} asked twice; another replica swept "
                  f"{takeover_s:.2f} s after the kill (lease {LEASE_S} s)")

            # No warm or cold block lost: the survivor still finds and serves every one.
            assert len(pool_stack.redis.keys(redis_pattern(fp[:16]))) == 16
            r = await lookup(nc, follower, fp, hashes)
            assert (r.warm, r.pool) == (16, 16), r
            r = await lookup(nc, follower, fp_cold, cold_hashes)
            assert r.pool == 6 and r.cold == 6, r
            assert (await get(nc, follower, fp_cold, cold_hashes)).units == [d for _, d in cold_chain]
            assert (await pool_stats_async(nc, follower)).counters["leader"] == 1
        finally:
            await nc.close()

    asyncio.run(scenario())


async def _pool_is(nc, replica: str, fp: str, hashes: list[bytes], n: int) -> bool:
    return (await lookup(nc, replica, fp, hashes)).pool == n


async def _warm_is(nc, replica: str, fp: str, hashes: list[bytes], n: int) -> bool:
    return (await lookup(nc, replica, fp, hashes)).warm == n


async def _workers_are(nc, replicas: list[str], fp: str, hashes: list[bytes], workers: dict[str, int]) -> bool:
    return all([(await lookup(nc, r, fp, hashes)).workers == workers for r in replicas])


async def _replicas_are(nc, replicas: list[str], n: int) -> bool:
    return all([(await pool_stats_async(nc, r)).counters["replicas"] == n for r in replicas])


async def _no_pending_purges(nc, replica: str) -> bool:
    return (await pool_stats_async(nc, replica)).counters["pending_purges"] == 0


async def _sweeps_above(nc, replica: str, base: int) -> bool:
    return (await pool_stats_async(nc, replica)).counters["sweeps"] > base
