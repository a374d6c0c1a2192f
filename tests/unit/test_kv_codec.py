"""KV codecs (kite_shared.kv_codec, numpy, and the worker's torch side kite_worker.codec_tensors): lossless
round trips are exact (and not copied), lossy ones stay within their format's error, payload lengths are
what `payload_bytes` says, bad payloads are refused, and the pool's transcoding re-signs a unit."""

from __future__ import annotations

import pytest
import torch

from kite_shared import kv_codec, recyclable_unit
from kite_shared.kv_codec import CodecError
from kite_shared.recyclable_unit import RecyclableUnit, RUAuthError
from kite_worker import codec_tensors
from tests.devices import DEVICES

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
        assert len(codec_tensors.encode(block(), codec)) == kv_codec.payload_bytes(codec, SHAPE)


def test_lossless_codecs_round_trip_exactly_and_fp16_is_a_view():
    x = block()
    for codec in ("fp16", "bf16", "fp32"):
        assert not kv_codec.is_lossy(codec)
        decoded = codec_tensors.decode(codec_tensors.encode(x, codec), codec, SHAPE, torch.float32)
        assert torch.equal(decoded, x.to(codec_tensors.LOSSLESS[codec]).float())
    payload = bytearray(codec_tensors.encode(x, "fp16"))
    view = codec_tensors.decode(payload, "fp16", SHAPE, torch.float16)
    payload[0] ^= 0xFF
    assert view.view(torch.uint8).flatten()[0] == payload[0]  # no copy: the tensor is the payload


def test_int8_error_is_at_most_half_a_step_of_each_group():
    x = block().float()
    decoded = codec_tensors.decode(codec_tensors.encode(block(), "int8"), "int8", SHAPE, torch.float32)
    key_step = x[:, 0].abs().amax(dim=2, keepdim=True) / 127  # per channel
    value_step = x[:, 1].abs().amax(dim=3, keepdim=True) / 127  # per token
    assert ((decoded[:, 0] - x[:, 0]).abs() <= key_step * 0.5 + 1e-3).all()
    assert ((decoded[:, 1] - x[:, 1]).abs() <= value_step * 0.5 + 1e-3).all()
    # per-channel key scales keep the outlier channel from flattening the others
    assert (decoded[:, 0, :, :, 0] - x[:, 0, :, :, 0]).abs().max() < 0.05


def test_fp8_relative_error_is_within_its_three_mantissa_bits():
    x = block().float()
    decoded = codec_tensors.decode(codec_tensors.encode(block(), "fp8_e4m3"), "fp8_e4m3", SHAPE, torch.float32)
    scale = x.abs().amax(dim=(3, 4), keepdim=True) / 448
    tolerance = x.abs() / 16 + scale * 2 ** -9  # relative 2^-4, and subnormals near zero
    assert ((decoded - x).abs() <= tolerance + 1e-6).all()


def test_an_all_zero_block_survives_every_codec():
    zeros = torch.zeros(SHAPE, dtype=torch.float16)
    for codec in kv_codec.CODECS:
        assert torch.equal(codec_tensors.decode(codec_tensors.encode(zeros, codec), codec, SHAPE, torch.float16), zeros)


def test_bad_payloads_and_codecs_are_refused():
    payload = codec_tensors.encode(block(), "int8")
    with pytest.raises(CodecError, match="385920 bytes, got 385919"):
        codec_tensors.decode(payload[:-1], "int8", SHAPE, torch.float16)
    with pytest.raises(CodecError, match="unknown KV codec 'zstd'"):
        codec_tensors.decode(payload, "zstd", SHAPE, torch.float16)
    with pytest.raises(CodecError, match="layers, 2, heads"):
        codec_tensors.encode(torch.zeros(2, 3, 4), "int8")
    nan_scale = bytearray(codec_tensors.encode(block(), "fp8_e4m3"))
    nan_scale[-4:] = torch.tensor([float("nan")], dtype=torch.float32).view(torch.uint8).numpy().tobytes()
    with pytest.raises(CodecError, match="finite and positive"):
        codec_tensors.decode(nan_scale, "fp8_e4m3", SHAPE, torch.float16)


def test_numpy_encoding_matches_every_input_dtype():
    x = block().float()
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        source = x.to(dtype)
        for codec in kv_codec.CODECS:  # the payload of a block is the payload of its numpy array
            assert codec_tensors.encode(source, codec) == kv_codec.encode(codec_tensors.to_array(source), codec)
        assert torch.equal(codec_tensors.decode(codec_tensors.encode(source, "bf16"), "bf16", SHAPE, dtype),
                           source.to(torch.bfloat16).to(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_a_block_on_a_device_encodes_as_its_host_copy_and_decodes_to_host_memory(device):
    x = block().float().to(device)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        source = x.to(dtype)
        strided = source.transpose(3, 4).contiguous().transpose(3, 4)  # the same values, not contiguous
        assert not strided.is_contiguous()
        host = source.cpu()
        assert codec_tensors.host_bytes(strided).tobytes() == host.view(torch.uint8).numpy().tobytes()
        for codec in kv_codec.CODECS:
            payload = codec_tensors.encode(strided, codec)
            assert payload == codec_tensors.encode(host, codec), codec
            decoded = codec_tensors.decode(payload, codec, SHAPE, dtype)
            assert decoded.device.type == "cpu" and decoded.dtype == dtype
            if not kv_codec.is_lossy(codec):
                assert torch.equal(decoded, host.to(codec_tensors.LOSSLESS[codec]).to(dtype)), codec


def test_host_tensors_reach_numpy_without_a_copy():
    x = block()  # contiguous, on the CPU: what the save and load paths hand over
    assert codec_tensors.host_bytes(x).ctypes.data == x.data_ptr()
    assert codec_tensors.to_array(x).ctypes.data == x.data_ptr()
    assert codec_tensors.to_array(x.to(torch.bfloat16)).dtype.name == "bfloat16"


def test_split_names_the_parts_of_a_payload_without_copying():
    payload = codec_tensors.encode(block(), "int8")
    quantised, key_scale, value_scale = kv_codec.split(payload, "int8", SHAPE)
    assert (quantised.shape, key_scale.shape, value_scale.shape) == (SHAPE, (30, 3, 1, 64), (30, 3, 32, 1))
    assert quantised.base is not None and not quantised.flags.writeable  # a view over the bytes
    elements, scale = kv_codec.split(codec_tensors.encode(block(), "fp8_e4m3"), "fp8_e4m3", SHAPE)
    assert elements.dtype == kv_codec.FP8 and scale.shape == (30, 2, 3, 1, 1)


def unit_of(payload_codec: str, key: bytes | None, cold_codec: str = "int8") -> RecyclableUnit:
    return RecyclableUnit(block_hash=b"\x01" * 32, parent_hash=b"\x00" * 32, model_fingerprint="ab" * 32,
                          block_index=3, num_tokens=32, codec=payload_codec, shape=SHAPE,
                          payload=codec_tensors.encode(block(), payload_codec), created_at=1.5e9,
                          cold_codec=cold_codec)


def test_transcoding_re_encodes_the_payload_and_signs_the_unit_again():
    key = b"k" * 32
    original = unit_of("fp16", key)
    transcoded = recyclable_unit.decode(kv_codec.transcode(original.encode(key), "int8", key), key=key)
    assert transcoded.codec == "int8" and bytes(transcoded.payload) == codec_tensors.encode(block(), "int8")
    for field in ("block_hash", "parent_hash", "model_fingerprint", "block_index", "created_at", "tenant_tag",
                  "shape", "warm_codec", "cold_codec"):
        assert getattr(transcoded, field) == getattr(original, field), field
    already = kv_codec.transcode(kv_codec.transcode(original.encode(key), "int8", key), "int8", key)
    assert recyclable_unit.decode(already, key=key).codec == "int8"  # already in the codec: as it is


def test_transcoding_refuses_a_forged_unit_a_lossy_unit_and_a_lossless_target():
    key = b"k" * 32
    with pytest.raises(RUAuthError):
        kv_codec.transcode(unit_of("fp16", None).encode(b"x" * 32), "int8", key)
    with pytest.raises(CodecError, match="lossy already"):
        kv_codec.transcode(unit_of("fp8_e4m3", key).encode(key), "int8", key)
    with pytest.raises(CodecError, match="into a lossy codec"):
        kv_codec.transcode(unit_of("fp32", key).encode(key), "fp16", key)


def test_a_block_with_non_finite_values_has_no_lossy_form():
    x = block()
    x[0, 0, 0, 0, 0] = float("inf")
    for codec in kv_codec.LOSSY:
        with pytest.raises(CodecError, match="non-finite"):
            codec_tensors.encode(x, codec)
    exact = codec_tensors.decode(codec_tensors.encode(x, "fp16"), "fp16", SHAPE, torch.float16)
    assert exact[0, 0, 0, 0, 0] == float("inf")  # lossless storage keeps what was computed
