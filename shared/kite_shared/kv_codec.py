"""KV block codecs: how a recyclable unit's payload stores a block [layers, 2 (key, value), kv heads,
tokens, head dim].

Pure (torch tensors in, bytes out); no I/O. Lossless codecs store the elements as they are (fp16, bf16,
fp32). Lossy ones store fewer bytes and change the numbers, so a block decoded from them is not the block
that was computed: they are opt-in, and their blocks must live in a namespace of their own (the codec in
the execution-path fingerprint) so that they are never taken for exact ones.
- "int8": symmetric 8-bit integers, keys scaled per channel (per layer, head and head-dim channel, over
  the block's tokens) and values per token (per layer, head and token), as KIVI (ICML 2024) found keys
  have outlier channels and values do not. Scales are stored as fp16. The default model's 32-token vLLM
  block: 385,920 bytes against 737,280 in fp16 (1.91x smaller).
- "fp8_e4m3": 8-bit floats (torch.float8_e4m3fn), one fp32 scale per layer, key/value and head, mapping
  the block's largest magnitude to 448 (the format's largest finite value).

Layout of a lossy payload: the 8-bit elements in [layers, 2, heads, tokens, head dim] order, then the
scales (int8: the keys' [layers, heads, head dim], then the values' [layers, heads, tokens]; fp8: [layers,
2, heads]). `payload_bytes` says how long a payload of a codec and shape is; `decode` refuses any other
length, a codec it does not know, and scales that are not finite and positive.
"""

from __future__ import annotations

import math

import torch

from kite_shared import recyclable_unit
from kite_shared.recyclable_unit import LOSSY_CODECS, TORCH_DTYPE_TO_CODEC

LOSSLESS = {codec: getattr(torch, dtype) for dtype, codec in TORCH_DTYPE_TO_CODEC.items()}  # codec -> torch dtype
LOSSY = LOSSY_CODECS
CODECS = (*LOSSLESS, *LOSSY)
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_INT8_MAX = 127.0
_FP16_TINY = 6.104e-5  # smallest normal fp16: an int8 scale stored as fp16 must not round to zero


class CodecError(ValueError):
    """A payload that does not decode under its codec (unknown codec, wrong length, bad scales)."""


def unit_codec(storage_dtype: torch.dtype, lossy_codec: str = "") -> str:
    """The codec a worker's units are stored in: its lossy codec (KITE_KV_CODEC), else the storage dtype's."""
    return lossy_codec or TORCH_DTYPE_TO_CODEC[str(storage_dtype).removeprefix("torch.")]


def is_lossy(codec: str) -> bool:
    _known(codec)
    return codec in LOSSY


def payload_bytes(codec: str, shape: tuple[int, ...]) -> int:
    """Bytes of a payload of `shape` = (layers, 2, heads, tokens, head dim) under `codec`."""
    _known(codec)
    return recyclable_unit.payload_bytes(codec, _geometry(shape))


def encode(block: torch.Tensor, codec: str) -> bytes:
    """The payload of `block` ([layers, 2, heads, tokens, head dim], any float dtype) under `codec`."""
    _known(codec)
    _geometry(tuple(block.shape))
    if codec in LOSSLESS:
        return _raw(block.to(LOSSLESS[codec]))
    x = block.to(torch.float32)
    if codec == "int8":
        keys, values = x[:, 0], x[:, 1]  # [layers, heads, tokens, head dim]
        key_scale = _scales(keys.abs().amax(dim=2), _INT8_MAX).clamp(min=_FP16_TINY).to(torch.float16)  # per channel
        value_scale = _scales(values.abs().amax(dim=3), _INT8_MAX).clamp(min=_FP16_TINY).to(torch.float16)  # per token
        # the stored (fp16) scales are the ones decoding uses: quantise with them
        q_keys = torch.round(keys / key_scale.float().unsqueeze(2)).clamp_(-_INT8_MAX, _INT8_MAX)
        q_values = torch.round(values / value_scale.float().unsqueeze(3)).clamp_(-_INT8_MAX, _INT8_MAX)
        quantised = torch.stack([q_keys, q_values], dim=1).to(torch.int8)
        return _raw(quantised) + _raw(key_scale) + _raw(value_scale)
    scale = _scales(x.abs().amax(dim=(3, 4)), _FP8_MAX)  # [layers, 2, heads]
    quantised = (x / scale[..., None, None]).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return _raw(quantised) + _raw(scale)


def decode(payload, codec: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The block a payload holds, as `dtype`. A lossless payload in its own dtype is not copied (a view
    over `payload`, which must then stay alive). Raises CodecError."""
    _known(codec)
    layers, kv, heads, tokens, head_dim = _geometry(shape)
    data = memoryview(payload).cast("B")
    expected = payload_bytes(codec, shape)
    if data.nbytes != expected:
        raise CodecError(f"a {codec} payload of shape {shape} is {expected} bytes, got {data.nbytes}")
    if codec in LOSSLESS:
        return torch.frombuffer(data, dtype=LOSSLESS[codec]).view(shape).to(dtype)
    elements = math.prod(shape)
    if codec == "int8":
        quantised = torch.frombuffer(data, dtype=torch.int8, count=elements).view(shape).float()
        num_key_scales = layers * heads * head_dim
        scales = torch.frombuffer(data, dtype=torch.float16, offset=elements).float()
        key_scale = _checked(scales[:num_key_scales]).view(layers, heads, 1, head_dim)
        value_scale = _checked(scales[num_key_scales:]).view(layers, heads, tokens, 1)
        return torch.stack([quantised[:, 0] * key_scale, quantised[:, 1] * value_scale], dim=1).to(dtype)
    quantised = torch.frombuffer(data, dtype=torch.float8_e4m3fn, count=elements).view(shape).float()
    scale = _checked(torch.frombuffer(data, dtype=torch.float32, offset=elements)).view(layers, kv, heads, 1, 1)
    return (quantised * scale).to(dtype)


def _known(codec: str) -> None:
    if codec not in CODECS:
        raise CodecError(f"unknown KV codec {codec!r} (known: {', '.join(CODECS)})")


def _geometry(shape: tuple[int, ...]) -> tuple[int, int, int, int, int]:
    if len(shape) != 5 or shape[1] != 2 or any(n <= 0 for n in shape):
        raise CodecError(f"a KV block is [layers, 2, heads, tokens, head dim], got {tuple(shape)}")
    return tuple(int(n) for n in shape)  # type: ignore[return-value]


def _scales(amax: torch.Tensor, top: float) -> torch.Tensor:
    """Scales mapping each group's largest magnitude to `top`; an all-zero group gets scale 1."""
    return torch.where(amax > 0, amax / top, torch.ones_like(amax))


def _checked(scales: torch.Tensor) -> torch.Tensor:
    if not bool(torch.isfinite(scales).all()) or not bool((scales > 0).all()):
        raise CodecError("a lossy payload's scales must be finite and positive")
    return scales


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()
