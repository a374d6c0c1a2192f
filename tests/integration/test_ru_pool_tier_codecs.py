"""A codec per tier in the ru-pool (issue 17): a unit that names a lossy codec for the warm or the cold tier
is transcoded on its way there (write-through, archival, demotion on hot eviction), verified and signed
again, over a real nats-server, redis-server and S3 server (moto); a unit that names none is stored byte for
byte as it came."""

from __future__ import annotations

import hashlib
from typing import Callable

import boto3
import numpy as np

from kite_shared import kv_codec, recyclable_unit
from kite_shared.recyclable_unit import RecyclableUnit
from kite_shared.security import ru_key
from kite_shared.tiers import metrics
from kite_shared.tiers.keys import BlockKey, object_key, redis_key
from tests.helpers import new_fp, unit_chain, wait_until_async
from tests.integration.test_ru_pool_service import client, env, pools, put_chain  # noqa: F401 (fixtures)

SHAPE = (2, 2, 1, 16, 8)  # [layers, key/value, kv heads, tokens, head dim]


def kv_like() -> Callable[[int], bytes]:
    """Payloads for unit_chain: fp16 blocks of KV-like values (normal, seed 7), block after block."""
    rng = np.random.default_rng(7)
    return lambda i: kv_codec.encode(rng.standard_normal(SHAPE).astype(np.float16), "fp16")


def transcoded_as(data: bytes, original: bytes, codec: str) -> RecyclableUnit:
    """`data`, checked to be `original` in `codec`: the same block, signed, its payload the codec's encoding."""
    unit = recyclable_unit.decode(data, key=ru_key())
    source = recyclable_unit.decode(original, key=ru_key())
    assert unit.codec == codec and unit.block_hash == source.block_hash
    assert (unit.model_fingerprint, unit.block_index, unit.created_at) == (
        source.model_fingerprint, source.block_index, source.created_at)
    (elements,) = kv_codec.split(source.payload, "fp16", SHAPE)
    assert bytes(unit.payload) == kv_codec.encode(elements, codec)
    return unit


def transcodes(tier: str, codec: str) -> float:
    return metrics.TIER_TRANSCODES.labels(tier, codec)._value.get()


async def test_lossless_hot_and_warm_int8_cold_transcodes_on_archival_only(pools, client, env):
    pool = await pools.start(hot_bytes=1 << 20, archive_after_s=0.3)
    fp = new_fp()
    chain = unit_chain(fp, 3, shape=SHAPE, payload=kv_like(), cold_codec="int8")
    before = transcodes("cold", "int8")
    await put_chain(client, pool, chain)
    hashes = [h for h, _ in chain]
    # Hot and warm hold the units exactly as the worker wrote them.
    assert await client.get(fp, hashes) == [d for _, d in chain]
    r = env.redis()
    assert [r.get(redis_key(BlockKey.of(fp, h))) for h in hashes] == [d for _, d in chain]
    await wait_until_async(lambda: pool.core.counters.archived == 3, timeout_s=5.0, what="archival to cold")
    s3 = boto3.client("s3", endpoint_url=env.s3_url, region_name="us-east-1")
    for h, data in chain:
        body = s3.get_object(Bucket="kite-pool", Key=object_key(env.s3_prefix, BlockKey.of(fp, h)))["Body"].read()
        transcoded_as(body, data, "int8")
        assert len(data) - len(body) == kv_codec.payload_bytes("fp16", SHAPE) - kv_codec.payload_bytes("int8", SHAPE)
    assert pool.core.counters.transcoded == 3 and transcodes("cold", "int8") - before == 3
    # A cold hit serves the int8 unit (a worker of this namespace decodes it) and promotes it as it is.
    await pools.stop(pool)  # a fresh pool with no hot tier: it rebuilds its index from cold, reads go there
    pool = await pools.start(hot_bytes=0, archive_after_s=3600.0)
    units = await client.get(fp, hashes)
    assert [recyclable_unit.decode(u, key=ru_key()).codec for u in units] == ["int8"] * 3
    await pool.drain_background()
    promoted = [r.get(redis_key(BlockKey.of(fp, h))) for h in hashes]
    assert [recyclable_unit.decode(u, key=ru_key()).codec for u in promoted] == ["int8"] * 3
    assert pool.core.counters.transcoded == 0  # never back to lossless, never a second codec


async def test_an_int8_warm_tier_is_written_through_in_int8_while_hot_keeps_the_exact_unit(pools, client, env):
    pool = await pools.start()
    fp = new_fp()
    chain = unit_chain(fp, 2, shape=SHAPE, payload=kv_like(), warm_codec="int8", cold_codec="int8")
    await put_chain(client, pool, chain)
    hashes = [h for h, _ in chain]
    assert await client.get(fp, hashes) == [d for _, d in chain]  # hot: as written
    r = env.redis()
    for h, data in chain:
        transcoded_as(r.get(redis_key(BlockKey.of(fp, h))), data, "int8")
    assert pool.core.counters.transcoded == 2


async def test_hot_eviction_with_warm_off_demotes_to_cold_in_its_codec(pools, client, env):
    fp = new_fp()
    chain = unit_chain(fp, 4, shape=SHAPE, payload=kv_like(), cold_codec="fp8_e4m3")
    pool = await pools.start(hot_bytes=2 * len(chain[0][1]), tier_cfg=env.tier_cfg(redis_url=""))
    assert pool.warm is None
    await put_chain(client, pool, chain)
    await pool.drain_background()
    assert pool.core.counters.demotions == 2
    hashes = [h for h, _ in chain]
    assert (await client.lookup(fp, hashes)).tiers == b"cchh"
    units = await client.get(fp, hashes[:2])  # from cold (hot keeps the exact units of the others)
    for unit, (_, data) in zip(units, chain[:2], strict=True):
        transcoded_as(unit, data, "fp8_e4m3")


async def test_units_that_name_no_tier_codec_are_stored_byte_for_byte(pools, client, env):
    pool = await pools.start(hot_bytes=1 << 20, archive_after_s=0.3)
    fp = new_fp()
    chain = unit_chain(fp, 2, shape=SHAPE, payload=kv_like())
    await put_chain(client, pool, chain)
    await wait_until_async(lambda: pool.core.counters.archived == 2, timeout_s=5.0, what="archival to cold")
    s3 = boto3.client("s3", endpoint_url=env.s3_url, region_name="us-east-1")
    for h, data in chain:
        assert s3.get_object(Bucket="kite-pool", Key=object_key(env.s3_prefix, BlockKey.of(fp, h)))["Body"].read() == data
    assert pool.core.counters.transcoded == 0


async def test_a_unit_with_no_lossy_form_is_archived_as_it_is_and_counted(pools, client, env):
    pool = await pools.start(hot_bytes=1 << 20, archive_after_s=0.3)
    fp = new_fp()
    h = hashlib.sha256(b"inf").digest()
    block = np.zeros(SHAPE, dtype=np.float16)
    block[0, 0, 0, 0, 0] = np.inf  # no int8 form: its scale would be infinite
    data = RecyclableUnit(block_hash=h, parent_hash=b"\0" * 32, model_fingerprint=fp, block_index=0,
                          num_tokens=16, codec="fp16", shape=SHAPE, payload=kv_codec.encode(block, "fp16"),
                          cold_codec="int8").encode(key=ru_key())
    refusals = metrics.TIER_TRANSCODE_REFUSALS._value.get()
    await put_chain(client, pool, [(h, data)])
    await wait_until_async(lambda: pool.core.counters.archived == 1, timeout_s=5.0, what="archival to cold")
    s3 = boto3.client("s3", endpoint_url=env.s3_url, region_name="us-east-1")
    assert s3.get_object(Bucket="kite-pool", Key=object_key(env.s3_prefix, BlockKey.of(fp, h)))["Body"].read() == data
    assert (pool.core.counters.transcode_refused, pool.core.counters.transcoded) == (1, 0)
    assert metrics.TIER_TRANSCODE_REFUSALS._value.get() - refusals == 1
