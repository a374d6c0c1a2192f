"""KV codecs: lossless round trips are exact (and not copied), lossy ones stay within their format's
error, payload lengths are what `payload_bytes` says, and bad payloads are refused."""

from __future__ import annotations

import pytest
import torch

from kite_shared import kv_codec
from kite_shared.kv_codec import CodecError

SHAPE = (30, 2, 3, 32, 64)  # the default model's vLLM block


def block(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=g)
    x[:, 0, :, :, 5] *= 20  # an outlier key channel, as real keys have
    return x.to(torch.float16)


def test_payload_sizes_per_codec():
    assert kv_codec.payload_bytes("fp16", SHAPE) == 737_280
    assert kv_codec.payload_bytes("fp32", SHAPE) == 1_474_560
    assert kv_codec.payload_bytes("int8", SHAPE) == 368_640 + 2 * (30 * 3 * 64 + 30 * 3 * 32) == 385_920
    assert kv_codec.payload_bytes("fp8_e4m3", SHAPE) == 368_640 + 4 * 30 * 2 * 3
    for codec in kv_codec.CODECS:
        assert len(kv_codec.encode(block(), codec)) == kv_codec.payload_bytes(codec, SHAPE)


def test_lossless_codecs_round_trip_exactly_and_fp16_is_a_view():
    x = block()
    for codec in ("fp16", "bf16", "fp32"):
        assert not kv_codec.is_lossy(codec)
        decoded = kv_codec.decode(kv_codec.encode(x, codec), codec, SHAPE, torch.float32)
        assert torch.equal(decoded, x.to(kv_codec.LOSSLESS[codec]).float())
    payload = bytearray(kv_codec.encode(x, "fp16"))
    view = kv_codec.decode(payload, "fp16", SHAPE, torch.float16)
    payload[0] ^= 0xFF
    assert view.view(torch.uint8).flatten()[0] == payload[0]  # no copy: the tensor is the payload


def test_int8_error_is_at_most_half_a_step_of_each_group():
    x = block().float()
    decoded = kv_codec.decode(kv_codec.encode(block(), "int8"), "int8", SHAPE, torch.float32)
    key_step = x[:, 0].abs().amax(dim=2, keepdim=True) / 127  # per channel
    value_step = x[:, 1].abs().amax(dim=3, keepdim=True) / 127  # per token
    assert ((decoded[:, 0] - x[:, 0]).abs() <= key_step * 0.5 + 1e-3).all()
    assert ((decoded[:, 1] - x[:, 1]).abs() <= value_step * 0.5 + 1e-3).all()
    # per-channel key scales keep the outlier channel from flattening the others
    assert (decoded[:, 0, :, :, 0] - x[:, 0, :, :, 0]).abs().max() < 0.05


def test_fp8_relative_error_is_within_its_three_mantissa_bits():
    x = block().float()
    decoded = kv_codec.decode(kv_codec.encode(block(), "fp8_e4m3"), "fp8_e4m3", SHAPE, torch.float32)
    scale = x.abs().amax(dim=(3, 4), keepdim=True) / 448
    tolerance = x.abs() / 16 + scale * 2 ** -9  # relative 2^-4, and subnormals near zero
    assert ((decoded - x).abs() <= tolerance + 1e-6).all()


def test_an_all_zero_block_survives_every_codec():
    zeros = torch.zeros(SHAPE, dtype=torch.float16)
    for codec in kv_codec.CODECS:
        assert torch.equal(kv_codec.decode(kv_codec.encode(zeros, codec), codec, SHAPE, torch.float16), zeros)


def test_bad_payloads_and_codecs_are_refused():
    payload = kv_codec.encode(block(), "int8")
    with pytest.raises(CodecError, match="385920 bytes, got 385919"):
        kv_codec.decode(payload[:-1], "int8", SHAPE, torch.float16)
    with pytest.raises(CodecError, match="unknown KV codec 'zstd'"):
        kv_codec.decode(payload, "zstd", SHAPE, torch.float16)
    with pytest.raises(CodecError, match="layers, 2, heads"):
        kv_codec.encode(torch.zeros(2, 3, 4), "int8")
    nan_scale = bytearray(kv_codec.encode(block(), "fp8_e4m3"))
    nan_scale[-4:] = torch.tensor([float("nan")], dtype=torch.float32).view(torch.uint8).numpy().tobytes()
    with pytest.raises(CodecError, match="finite and positive"):
        kv_codec.decode(nan_scale, "fp8_e4m3", SHAPE, torch.float16)
