"""Warm (real redis-server) and cold (real moto S3 server, local folder) tiers: round trips, integrity,
TTL and pins, and behaviour while a server is down."""

from __future__ import annotations

import hashlib
import time
import uuid

import boto3
import pytest
import redis

from kite_cli.local_servers import free_port, start_redis
from kite_shared.recyclable_unit import RecyclableUnit
from kite_shared.security import ANONYMOUS_TENANT_TAG
from kite_shared.tiers import metrics
from kite_shared.tiers.cold import LocalDirTier, S3Tier
from kite_shared.tiers.keys import BlockKey, object_key, redis_key
from kite_shared.tiers.warm import RedisTier
from tests.helpers import wait_until_async

FP = hashlib.sha256(b"tiers-test-model").hexdigest()
SHAPE = (2, 2, 1, 16, 4)


def make_unit(i: int, fp: str = FP) -> tuple[bytes, bytes]:
    """(block_hash, encoded unit) of a small fp16 block."""
    block_hash = hashlib.sha256(f"{fp}/{i}".encode()).digest()
    n = 2 * 2 * 1 * 16 * 4
    payload = bytes((i * 7 + j) % 256 for j in range(n * 2))
    unit = RecyclableUnit(block_hash=block_hash, parent_hash=b"\0" * 32, model_fingerprint=fp,
                          block_index=i, num_tokens=16, codec="fp16", shape=SHAPE, payload=payload)
    return block_hash, unit.encode()


def integrity(tier: str) -> float:
    return metrics.TIER_INTEGRITY_FAILURES.labels(tier)._value.get()


def flip(data: bytes) -> bytes:
    b = bytearray(data)
    b[-1] ^= 0x01
    return bytes(b)


@pytest.fixture
async def warm(redis_server):
    db = 1 + (uuid.uuid4().int % 14)
    redis.Redis(port=redis_server.port, db=db).flushdb()
    tier = RedisTier(f"{redis_server.url}/{db}", ttl_s=30, timeout_s=0.5)
    yield tier
    await tier.close()


@pytest.fixture
async def s3(s3_server):
    tier = S3Tier(s3_server.url, "kite-test", prefix=f"t-{uuid.uuid4().hex[:8]}/", timeout_s=5.0)
    assert await tier.ensure_bucket()
    yield tier
    await tier.close()


@pytest.fixture(params=["warm", "s3", "local"])
async def any_tier(request, redis_server, s3_server, tmp_path):
    if request.param == "warm":
        db = 1 + (uuid.uuid4().int % 14)
        redis.Redis(port=redis_server.port, db=db).flushdb()
        tier = RedisTier(f"{redis_server.url}/{db}", ttl_s=30, timeout_s=0.5)
    elif request.param == "s3":
        tier = S3Tier(s3_server.url, "kite-test", prefix=f"t-{uuid.uuid4().hex[:8]}/", timeout_s=5.0)
        assert await tier.ensure_bucket()
    else:
        tier = LocalDirTier(tmp_path / "cold", prefix="kite/")
        assert await tier.ensure_bucket()
    yield tier
    await tier.close()


async def test_round_trip_listing_and_delete(any_tier):
    tier = any_tier
    units = [make_unit(i) for i in range(5)]
    for h, data in units:
        assert await tier.put(BlockKey.of(FP, h), data)
    for h, data in units:
        assert await tier.get_verified(FP, h) == data
        assert await tier.exists(BlockKey.of(FP, h))
    listed = sorted([(s.key, s.size) async for s in tier.iter_keys()])
    assert listed == sorted((BlockKey.of(FP, h), len(d)) for h, d in units)
    assert [s async for s in tier.iter_keys("f" * 16)] == []
    assert await tier.delete_many([BlockKey.of(FP, units[0][0]), BlockKey.of(FP, units[1][0])]) == 2
    assert await tier.get_verified(FP, units[0][0]) is None
    assert tier.up and tier.hits == 5 and tier.misses == 1


async def test_corrupt_and_foreign_units_are_counted_deleted_and_missed(any_tier):
    tier = any_tier
    label = tier.name
    before = integrity(label)
    h0, d0 = make_unit(0)
    h1, d1 = make_unit(1)
    h2, d2 = make_unit(2, fp="ab" * 32)
    await tier.put(BlockKey.of(FP, h0), flip(d0))  # flipped payload byte: checksum fails
    await tier.put(BlockKey.of(FP, h1), d0)  # intact unit, but of another block
    await tier.put(BlockKey.of(FP, h2), d2)  # intact unit of another model under this model's key
    for h in (h0, h1, h2):
        assert await tier.get_verified(FP, h) is None
        assert not await tier.exists(BlockKey.of(FP, h))
    assert tier.integrity_failures == 3
    assert integrity(label) - before == 3
    assert tier.up  # corruption is not an outage


async def test_a_batched_read_verifies_each_unit_and_misses_only_the_bad_ones(any_tier):
    tier = any_tier
    units = [make_unit(i) for i in range(4)]
    for i, (h, d) in enumerate(units):
        await tier.put(BlockKey.of(FP, h), flip(d) if i == 2 else d)
    absent = hashlib.sha256(b"never stored").digest()
    found = await tier.get_units(FP, [h for h, _ in units] + [absent])
    assert [f is not None and f[1] for f in found] == [units[0][1], units[1][1], False, units[3][1], False]
    assert found[0][0].block_index == 0
    assert not await tier.exists(BlockKey.of(FP, units[2][0]))  # the corrupted unit is deleted
    assert tier.integrity_failures == 1 and tier.up


async def test_warm_ttl_is_refreshed_on_hit_and_pins_have_none(warm, redis_server):
    r = redis.Redis(port=redis_server.port, db=int(warm.url.rsplit("/", 1)[1]))
    h, d = make_unit(0)
    hp, dp = make_unit(1)
    key, pkey = BlockKey.of(FP, h), BlockKey.of(FP, hp)
    await warm.put(key, d)
    await warm.put(pkey, dp, pinned=True)
    assert 0 < r.pttl(redis_key(key)) <= 30_000
    r.pexpire(redis_key(key), 5_000)
    assert await warm.get_verified(FP, h) == d
    assert r.pttl(redis_key(key)) > 25_000  # the hit restarted the TTL
    assert await warm.get_verified(FP, hp) == dp
    assert r.pttl(redis_key(pkey)) == -1  # EXPIRE XX left the pinned block without expiry
    assert await warm.set_pinned(key, True) and r.pttl(redis_key(key)) == -1
    assert await warm.set_pinned(key, False) and 0 < r.pttl(redis_key(key)) <= 30_000
    assert not await warm.set_pinned(BlockKey.of(FP, b"\x07" * 32), True)
    listed = {s.key: s for s in [s async for s in warm.iter_keys()]}
    assert listed[pkey].pinned and listed[pkey].idle_s is None
    assert not listed[key].pinned and listed[key].idle_s < 2.0


async def test_a_batched_warm_read_refreshes_the_hits_expiry_once_verified(warm, redis_server):
    r = redis.Redis(port=redis_server.port, db=int(warm.url.rsplit("/", 1)[1]))
    (h, d), (hp, dp) = make_unit(0), make_unit(1)
    key, pkey = BlockKey.of(FP, h), BlockKey.of(FP, hp)
    await warm.put(key, d)
    await warm.put(pkey, dp, pinned=True)
    r.pexpire(redis_key(key), 5_000)
    found = await warm.get_units(FP, [h, hp, b"\x07" * 32])
    assert [f is not None and f[1] for f in found] == [d, dp, False]
    assert warm._refreshing  # the refresh runs after the verified reply, as a task of its own
    assert not await warm.settle(5.0)
    assert r.pttl(redis_key(key)) > 25_000, "the batched hit did not restart the TTL"
    assert r.pttl(redis_key(pkey)) == -1  # EXPIRE XX left the pinned block without expiry
    assert not r.exists(redis_key(BlockKey.of(FP, b"\x07" * 32)))  # a miss creates nothing


async def test_redis_down_is_a_fast_miss_and_the_tier_comes_back_on_the_same_port():
    port = free_port()
    server = start_redis(port)
    tier = RedisTier(f"redis://127.0.0.1:{port}/0", ttl_s=30, timeout_s=0.2, backoff_max_s=1.0,
                     initial_backoff_s=0.2)
    try:
        h, d = make_unit(0)
        assert await tier.put(BlockKey.of(FP, h), d)
        server.stop()
        started = time.perf_counter()
        assert await tier.get_verified(FP, h) is None
        assert time.perf_counter() - started < 0.5
        assert not tier.up
        started = time.perf_counter()
        for _ in range(100):  # while down: no I/O at all
            assert await tier.get(BlockKey.of(FP, h)) is None
            assert not await tier.put(BlockKey.of(FP, h), d)
        assert time.perf_counter() - started < 0.05
        server = start_redis(port)  # restarted empty on the same port
        await wait_until_async(tier.ping, 5, "the warm tier to come back", interval_s=0.05)
        assert tier.up
        assert await tier.put(BlockKey.of(FP, h), d)
        assert await tier.get_verified(FP, h) == d
    finally:
        await tier.close()
        server.stop()


async def test_s3_unreachable_is_a_miss_and_marks_the_tier_down():
    tier = S3Tier(f"http://127.0.0.1:{free_port()}", "nobucket", timeout_s=0.5)
    try:
        h, d = make_unit(0)
        assert await tier.get_verified(FP, h) is None
        assert not tier.up
        assert not await tier.put(BlockKey.of(FP, h), d)
        with pytest.raises(Exception, match="cold tier listing failed"):
            _ = [s async for s in tier.iter_keys()]
    finally:
        await tier.close()


async def test_s3_object_layout_is_the_documented_one(s3, s3_server):
    h, d = make_unit(3)
    await s3.put(BlockKey.of(FP, h), d)
    client = boto3.client("s3", endpoint_url=s3_server.url, region_name="us-east-1")
    body = client.get_object(Bucket="kite-test", Key=object_key(s3.prefix, BlockKey.of(FP, h)))["Body"].read()
    assert body == d
    layout = f"ru/v2/{FP[:16]}/{ANONYMOUS_TENANT_TAG}/{h.hex()}.kru"
    assert object_key(s3.prefix, BlockKey.of(FP, h)).endswith(layout)


async def test_s3_units_larger_than_a_part_are_read_whole_in_ranged_parts(s3_server):
    # A unit is 840 bytes: with 300-byte parts it is read as three ranges into one buffer, and
    # verified as a whole (a part missing or misplaced would fail the checksum).
    tier = S3Tier(s3_server.url, "kite-test", prefix=f"t-{uuid.uuid4().hex[:8]}/", part_bytes=300)
    try:
        assert await tier.ensure_bucket()
        units = [make_unit(i) for i in range(4)]
        for h, d in units:
            assert 600 < len(d) <= 900
            await tier.put(BlockKey.of(FP, h), d)
        found = await tier.get_units(FP, [h for h, _ in units])
        assert [data for _, data in found] == [d for _, d in units]
        assert (await tier.get(BlockKey.of(FP, units[0][0]))) == units[0][1]
        assert await tier.get(BlockKey.of(FP, b"\x09" * 32)) is None  # absent: a miss, the tier still up
        assert tier.up
    finally:
        await tier.close()


async def test_an_s3_unit_replaced_between_its_parts_is_a_miss_not_a_splice(s3_server):
    # Between the first part and the others the unit is overwritten with another block's bytes of the
    # same size: the later parts name the first part's ETag, S3 refuses them, and the read is a miss.
    class ReplacedMidRead(S3Tier):
        replacement = b""

        def _read_part(self, name, etag, into, start):
            self._s3.put_object(Bucket=self.bucket, Key=name, Body=self.replacement)
            return super()._read_part(name, etag, into, start)

    tier = ReplacedMidRead(s3_server.url, "kite-test", prefix=f"t-{uuid.uuid4().hex[:8]}/", part_bytes=300)
    try:
        assert await tier.ensure_bucket()
        (h, d), (_, other) = make_unit(1), make_unit(2)
        tier.replacement = other
        assert len(other) == len(d)
        await tier.put(BlockKey.of(FP, h), d)
        assert await tier.get(BlockKey.of(FP, h)) is None
        assert tier.up  # a changed unit is not a failing tier
    finally:
        await tier.close()
