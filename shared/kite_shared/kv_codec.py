"""KV block codecs: how a recyclable unit's payload stores a block [layers, 2 (key, value), kv heads,
tokens, head dim].

Pure numpy (arrays in, bytes out; ml_dtypes gives numpy bfloat16 and float8_e4m3fn), no I/O and no torch:
the ru-pool transcodes units with it (`transcode`) in its light image. Workers reach it through
kite_worker.codec_tensors, which decodes with torch (three times faster than numpy on the load path).

Lossless codecs store the elements as they are (fp16, bf16, fp32). Lossy ones store fewer bytes and change
the numbers, so a block decoded from them is not the block that was computed: they are opt-in, and their
blocks must live in a namespace of their own (the tiers' codecs in the execution-path fingerprint,
kite_shared.tier_codecs) so that they are never taken for exact ones.
- "int8": symmetric 8-bit integers, keys scaled per channel (per layer, head and head-dim channel, over
  the block's tokens) and values per token (per layer, head and token), as KIVI (ICML 2024) found keys
  have outlier channels and values do not. Scales are stored as fp16. The default model's 32-token vLLM
  block: 385,920 bytes against 737,280 in fp16 (1.91x smaller).
- "fp8_e4m3": 8-bit floats (float8_e4m3fn, bit for bit torch's), one fp32 scale per layer, key/value and
  head, mapping the block's largest magnitude to 448 (the format's largest finite value).
A block with a non-finite value has no lossy form (its scales would not be finite).

Layout of a lossy payload: the 8-bit elements in [layers, 2, heads, tokens, head dim] order, then the
scales (int8: the keys' [layers, heads, head dim], then the values' [layers, heads, tokens]; fp8: [layers,
2, heads]). `payload_bytes` says how long a payload of a codec and shape is; `split` (what a decoder
reads) refuses any other length, a codec it does not know, and scales that are not finite and positive.
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

from kite_shared import recyclable_unit
from kite_shared.recyclable_unit import TORCH_DTYPE_TO_CODEC
from kite_shared.tier_codecs import LOSSY_CODECS

LOSSLESS = {"fp16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16),
            "fp32": np.dtype(np.float32)}  # codec -> numpy element type
LOSSY = LOSSY_CODECS
CODECS = (*LOSSLESS, *LOSSY)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_INT8_MAX = 127.0
_FP16_TINY = 6.104e-5  # smallest normal fp16: an int8 scale stored as fp16 must not round to zero


class CodecError(ValueError):
    """A payload that does not decode under its codec (unknown codec, wrong length, bad scales)."""


def unit_codec(storage_dtype, lossy_codec: str = "") -> str:
    """The codec a worker's units are stored in: its lossy codec (KITE_KV_CODEC), else the storage dtype's
    (a torch or numpy dtype, or its name: "float16", ...)."""
    return lossy_codec or TORCH_DTYPE_TO_CODEC[str(storage_dtype).removeprefix("torch.")]


def is_lossy(codec: str) -> bool:
    _known(codec)
    return codec in LOSSY


def payload_bytes(codec: str, shape: tuple[int, ...]) -> int:
    """Bytes of a payload of `shape` = (layers, 2, heads, tokens, head dim) under `codec`."""
    _known(codec)
    return recyclable_unit.payload_bytes(codec, _geometry(shape))


def encode(block: np.ndarray, codec: str) -> bytes:
    """The payload of `block` ([layers, 2, heads, tokens, head dim]; float16, bfloat16 or float32) under
    `codec`."""
    _known(codec)
    _geometry(tuple(block.shape))
    if codec in LOSSLESS:
        return np.ascontiguousarray(block, dtype=LOSSLESS[codec]).tobytes()
    x = block.astype(np.float32)
    if not bool(np.isfinite(x).all()):  # its scales would not be finite: no decoder would take the payload
        raise CodecError(f"a block with non-finite values has no {codec} form")
    if codec == "int8":
        keys, values = x[:, 0], x[:, 1]  # [layers, heads, tokens, head dim]
        key_scale = _to_fp16_scale(_scales(np.abs(keys).max(axis=2), _INT8_MAX))  # per channel
        value_scale = _to_fp16_scale(_scales(np.abs(values).max(axis=3), _INT8_MAX))  # per token
        # the stored (fp16) scales are the ones decoding uses: quantise with them
        quantised = np.empty(x.shape, dtype=np.int8)
        quantised[:, 0] = np.clip(np.rint(keys / key_scale.astype(np.float32)[:, :, None, :]), -_INT8_MAX, _INT8_MAX)
        quantised[:, 1] = np.clip(np.rint(values / value_scale.astype(np.float32)[..., None]), -_INT8_MAX, _INT8_MAX)
        return quantised.tobytes() + key_scale.tobytes() + value_scale.tobytes()
    scale = _scales(np.abs(x).max(axis=(3, 4)), _FP8_MAX)  # [layers, 2, heads]
    quantised = np.clip(x / scale[..., None, None], -_FP8_MAX, _FP8_MAX).astype(FP8)
    return quantised.tobytes() + scale.tobytes()


def split(payload, codec: str, shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """The parts of a payload, as views over it (no copy), for a decoder:
    - a lossless codec: (elements [shape] in the codec's type,);
    - int8: (elements int8 [shape], key scales fp16 [layers, heads, 1, head dim], value scales fp16
      [layers, heads, tokens, 1]): a block is elements x scales, keys and values each with their own;
    - fp8_e4m3: (elements float8_e4m3fn [shape], scales fp32 [layers, 2, heads, 1, 1]).
    Raises CodecError: unknown codec, wrong length, scales not finite and positive."""
    _known(codec)
    layers, kv, heads, tokens, head_dim = _geometry(shape)
    data = memoryview(payload).cast("B")
    expected = payload_bytes(codec, shape)
    if data.nbytes != expected:
        raise CodecError(f"a {codec} payload of shape {shape} is {expected} bytes, got {data.nbytes}")
    if codec in LOSSLESS:
        return (np.frombuffer(data, dtype=LOSSLESS[codec]).reshape(shape),)
    elements = math.prod(shape)
    if codec == "int8":
        quantised = np.frombuffer(data, dtype=np.int8, count=elements).reshape(shape)
        scales = _checked(np.frombuffer(data, dtype=np.float16, offset=elements))
        num_key_scales = layers * heads * head_dim
        return (quantised, scales[:num_key_scales].reshape(layers, heads, 1, head_dim),
                scales[num_key_scales:].reshape(layers, heads, tokens, 1))
    quantised = np.frombuffer(data, dtype=FP8, count=elements).reshape(shape)
    scale = _checked(np.frombuffer(data, dtype=np.float32, offset=elements))
    return quantised, scale.reshape(layers, kv, heads, 1, 1)


def transcode(data, codec: str, key: bytes | None) -> bytes:
    """The unit `data` with its payload re-encoded in the lossy `codec` and signed with `key` (the
    cluster RU key), all else unchanged: how the ru-pool stores a unit in a lossier tier. The unit is
    verified first (RUError). A lossy unit is never transcoded (CodecError): that would add a second
    codec's error to the first."""
    if codec not in LOSSY:
        raise CodecError(f"units are transcoded into a lossy codec ({', '.join(LOSSY)}), not {codec!r}")
    unit = recyclable_unit.decode(data, key=key)
    if unit.codec == codec:
        return bytes(data)
    if unit.codec not in LOSSLESS:
        raise CodecError(f"a {unit.codec} unit is lossy already: it is not transcoded into {codec}")
    (block,) = split(unit.payload, unit.codec, unit.shape)
    return dataclasses.replace(unit, codec=codec, payload=encode(block, codec)).encode(key)


def _known(codec: str) -> None:
    if codec not in CODECS:
        raise CodecError(f"unknown KV codec {codec!r} (known: {', '.join(CODECS)})")


def _geometry(shape: tuple[int, ...]) -> tuple[int, int, int, int, int]:
    if len(shape) != 5 or shape[1] != 2 or any(n <= 0 for n in shape):
        raise CodecError(f"a KV block is [layers, 2, heads, tokens, head dim], got {tuple(shape)}")
    return tuple(int(n) for n in shape)  # type: ignore[return-value]


def _scales(amax: np.ndarray, top: float) -> np.ndarray:
    """Scales mapping each group's largest magnitude to `top`; an all-zero group gets scale 1."""
    return np.where(amax > 0, amax / np.float32(top), np.float32(1)).astype(np.float32)


def _to_fp16_scale(scales: np.ndarray) -> np.ndarray:
    return np.maximum(scales, np.float32(_FP16_TINY)).astype(np.float16)


def _checked(scales: np.ndarray) -> np.ndarray:
    if not bool(np.isfinite(scales).all()) or not bool((scales > 0).all()):
        raise CodecError("a lossy payload's scales must be finite and positive")
    return scales
