"""The load-or-recompute cost model (pure): a slow tier must never make a hit slower than a miss; and
the verification of a fetch's units, which loads a prefix up to its first gap."""

from __future__ import annotations

import pytest
import torch

from kite_shared import kv_codec, recyclable_unit
from kite_shared.recyclable_unit import RecyclableUnit
from kite_shared.security import ANONYMOUS_TENANT_TAG
from kite_shared.tier_codecs import TierCodecs
from kite_shared.tiers.pool_client import PoolClient
from kite_worker import codec_tensors
from kite_worker.pool_loader import CostModel, PoolLoader, TierEstimate

BLOCK_BYTES = 368_640  # one SmolLM2 block in fp16


def model(prefill_s_per_token: float, warm_bytes_per_s: float = 200e6, cold_bytes_per_s: float = 50e6) -> CostModel:
    return CostModel(block_size=16, block_bytes=BLOCK_BYTES, prefill_seconds_per_token=prefill_s_per_token,
                     tiers={"h": TierEstimate(0.002, 100e6), "w": TierEstimate(0.001, warm_bytes_per_s),
                            "c": TierEstimate(0.010, cold_bytes_per_s)})


@pytest.mark.parametrize("letters, prefill, expected", [
    (b"wwww", 0.003, 4),          # CPU prefill (48 ms a block) loses to Redis (~2 ms a block)
    (b"hhhh", 0.003, 4),
    (b"cccc", 0.003, 4),          # even cold wins on CPU
    (b"wwww", 0.00001, 0),        # a GPU-fast prefill (0.16 ms a block) beats fetching
    (b"w", 0.0001, 0),            # one block: 1 ms latency + 1.8 ms transfer > 1.6 ms compute
    (b"wwwwwwwwcc", 0.0002, 8),   # 3.2 ms a block computed: the 8 warm blocks load, the cold tail is computed
    (b"", 0.003, 0),
])
def test_plan_loads_only_what_beats_recompute(letters, prefill, expected):
    assert model(prefill).plan(letters) == expected


def test_a_tier_measured_slow_stops_being_used():
    cost = model(0.001)  # 16 ms to compute a block
    assert cost.plan(b"cccc") == 4
    for _ in range(20):  # cold measured at 10 MB/s: 37 ms a block
        cost.tiers["c"].observe(seconds=BLOCK_BYTES / 10e6, num_bytes=BLOCK_BYTES)
    assert cost.plan(b"cccc") == 0
    assert cost.plan(b"wwcc") == 2  # still worth loading the warm blocks in front


def test_recompute_time_is_the_fetch_deadline_scale():
    cost = model(0.003)
    assert cost.recompute_seconds(4) == pytest.approx(4 * 16 * 0.003)
    assert cost.fetch_seconds(b"ww") == pytest.approx(0.001 + 2 * BLOCK_BYTES / 200e6)


def test_a_fetch_is_verified_up_to_its_first_miss():
    key, fp, shape = b"k" * 32, "ab" * 32, (1, 2, 1, 16, 4)
    units = [RecyclableUnit(block_hash=bytes([i]) * 32, parent_hash=bytes([i - 1 & 255]) * 32, model_fingerprint=fp,
                            block_index=i, num_tokens=16, codec="fp16", shape=shape, payload=bytes(256))
             for i in range(4)]
    encoded = [u.encode(key=key) for u in units]
    damaged = bytearray(encoded[3])
    damaged[-1] ^= 0xFF
    pool = PoolClient(None)  # never connected: `forget` of a rejected unit is the reader's own business
    loader = PoolLoader(pool, None, model(0.003), fp, shape, torch.float16, key)
    hashes = [u.block_hash for u in units]

    # Mapped bytes, a unit a tier client verified, a miss, then damaged bytes nothing will load.
    verified = loader._verified(hashes, [encoded[0], units[1], None, bytes(damaged)], ANONYMOUS_TENANT_TAG, fp)
    assert [u.block_index if u else None for u in verified] == [0, 1, None, None]
    assert loader.num_rejected == 0

    verified = loader._verified(hashes, [encoded[0], bytes(damaged)], ANONYMOUS_TENANT_TAG, fp)
    assert [u.block_index if u else None for u in verified] == [0, None]
    assert loader.num_rejected == 1


def test_a_lossy_unit_is_never_loaded_as_exact_kv():
    fp, shape = "ab" * 32, (1, 2, 1, 16, 4)
    block = torch.randn(shape)
    loader = PoolLoader(None, None, model(0.003), fp, shape, torch.float16, None)

    def unit(codec: str) -> RecyclableUnit:
        return RecyclableUnit(block_hash=b"\x01" * 32, parent_hash=b"\x00" * 32, model_fingerprint=fp,
                              block_index=0, num_tokens=16, codec=codec, shape=shape,
                              payload=codec_tensors.encode(block, codec))

    assert torch.equal(loader._to_tensor(b"\x01" * 32, unit("fp16")), block.half())
    for codec in kv_codec.LOSSY:  # a valid unit (the ru-pool stores it), but not the block that was computed
        assert recyclable_unit.decode(unit(codec).encode(), expected_hash=b"\x01" * 32).codec == codec
        assert loader._to_tensor(b"\x01" * 32, unit(codec)) is None
    assert loader.num_rejected == 2


def test_a_worker_that_chose_a_lossy_codec_loads_its_units_decoded_and_no_other_codec():
    fp, shape = "ab" * 32, (1, 2, 1, 16, 4)
    block = torch.randn(shape)
    loader = PoolLoader(None, None, model(0.003), fp, shape, torch.float16, None,
                        tier_codecs=TierCodecs.from_settings("int8"))

    def unit(codec: str, payload: bytes | None = None) -> RecyclableUnit:
        return RecyclableUnit(block_hash=b"\x01" * 32, parent_hash=b"\x00" * 32, model_fingerprint=fp,
                              block_index=0, num_tokens=16, codec=codec, shape=shape,
                              payload=payload if payload is not None else codec_tensors.encode(block, codec))

    loaded = loader._to_tensor(b"\x01" * 32, unit("int8"))
    assert loaded.dtype == torch.float16 and loaded.shape == shape
    assert torch.allclose(loaded.float(), block, atol=float(block.abs().max()) / 100)
    assert loader._to_tensor(b"\x01" * 32, unit("fp8_e4m3")) is None  # another codec's namespace
    bad_scales = bytearray(codec_tensors.encode(block, "int8"))
    bad_scales[-2:] = b"\x00\xfc"  # a value scale of -inf (fp16)
    assert loader._to_tensor(b"\x01" * 32, unit("int8", bytes(bad_scales))) is None
    assert loader.num_rejected == 2


def test_a_worker_whose_cold_tier_is_int8_loads_exact_and_int8_units_and_no_other_lossy_codec():
    fp, shape = "ab" * 32, (1, 2, 1, 16, 4)
    block = torch.randn(shape)
    loader = PoolLoader(None, None, model(0.003), fp, shape, torch.float16, None,
                        tier_codecs=TierCodecs.from_settings("", cold="int8"))

    def unit(codec: str) -> RecyclableUnit:
        return RecyclableUnit(block_hash=b"\x01" * 32, parent_hash=b"\x00" * 32, model_fingerprint=fp,
                              block_index=0, num_tokens=16, codec=codec, shape=shape,
                              payload=codec_tensors.encode(block, codec), cold_codec="int8")

    assert torch.equal(loader._to_tensor(b"\x01" * 32, unit("fp16")), block.half())  # hot and warm: exact
    cold = loader._to_tensor(b"\x01" * 32, unit("int8"))  # what the pool transcoded on its way to cold
    assert torch.allclose(cold.float(), block, atol=float(block.abs().max()) / 100)
    assert loader._to_tensor(b"\x01" * 32, unit("fp8_e4m3")) is None
    assert loader.num_rejected == 1


def test_the_cost_model_weighs_a_unit_in_each_tier_s_codec():
    shape = (30, 2, 3, 16, 64)
    exact = CostModel.for_units(16, shape, torch.float16, TierCodecs())
    cold_int8 = CostModel.for_units(16, shape, torch.float16, TierCodecs.from_settings("", cold="int8"))
    assert exact.block_bytes == cold_int8.block_bytes == kv_codec.payload_bytes("fp16", shape) == 368_640
    assert cold_int8.tier_block_bytes == {"w": 368_640, "c": kv_codec.payload_bytes("int8", shape)}
    cold = exact.tiers["c"]  # the same seed bandwidth in both: only the bytes differ
    assert cold_int8.fetch_seconds(b"cccc") == pytest.approx(cold.latency_s + 4 * 198_720 / cold.bytes_per_s)
    assert exact.fetch_seconds(b"cccc") == pytest.approx(cold.latency_s + 4 * 368_640 / cold.bytes_per_s)
    assert cold_int8.fetch_seconds(b"ww") == exact.fetch_seconds(b"ww")
