"""KV codecs on torch tensors: the worker's side of kite_shared.kv_codec (which is numpy, so that the
ru-pool transcodes units without torch).

Encoding goes through kv_codec's numpy encoder: saves run off the token path, and one encoder means a
unit a worker writes and one the pool transcodes are the same bytes. Decoding is torch, from kv_codec's
`split` (which knows the layout and checks it): on the load path torch decodes an int8 block of the
default model (32 tokens) in about 0.56 ms on two cores, numpy in 1.6 ms.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from kite_shared import kv_codec
from kite_shared.recyclable_unit import TORCH_DTYPE_TO_CODEC

# codec -> torch dtype, from the unit format's own table of lossless codecs
LOSSLESS = {codec: getattr(torch, dtype) for dtype, codec in TORCH_DTYPE_TO_CODEC.items()}


def to_array(block: torch.Tensor) -> np.ndarray:
    """`block` as a numpy array of the same element type (bfloat16 through ml_dtypes), in host memory:
    without a copy when it is contiguous and on the CPU, else made dense where it is (on a GPU, the one
    transfer is then dense) and copied to the host."""
    block = host(block)
    if block.dtype == torch.bfloat16:
        return block.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return block.numpy()


def host_bytes(block: torch.Tensor) -> np.ndarray:
    """The bytes of `block` (its elements as they are, uint8) in host memory: a view when it is contiguous
    and on the CPU, else one copy."""
    return host(block).view(torch.uint8).numpy()


def host(block: torch.Tensor) -> torch.Tensor:
    """`block` dense and on the CPU: itself when it already is (no copy on the host path)."""
    return block.detach().contiguous().cpu()


def encode(block: torch.Tensor, codec: str) -> bytes:
    """The payload of `block` ([layers, 2, heads, tokens, head dim]) under `codec`."""
    return kv_codec.encode(to_array(block), codec)


def decode(payload, codec: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The block a payload holds, as `dtype`, in host memory (the payload's bytes are there; a caller on a
    GPU moves the result, in `dtype`, once). A lossless payload in its own dtype, in writable memory, is
    not copied (a view over `payload`, which must then stay alive). Raises kv_codec.CodecError."""
    parts = kv_codec.split(payload, codec, shape)
    if codec in LOSSLESS:
        (elements,) = parts
        if codec == "bf16":
            return _tensor(elements.view(np.int16)).view(torch.bfloat16).to(dtype)
        return _tensor(elements).to(dtype)
    if codec == "int8":
        quantised, key_scale, value_scale = (_tensor(part) for part in parts)
        q = quantised.float()
        return torch.stack([q[:, 0] * key_scale.float(), q[:, 1] * value_scale.float()], dim=1).to(dtype)
    quantised, scale = parts
    q = _tensor(quantised.view(np.uint8)).view(torch.float8_e4m3fn).float()
    return (q * _tensor(scale)).to(dtype)


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor over the array's memory when it is writable. torch has no read-only tensors: the parts of
    read-only bytes (a NATS reply, a tier read) are copied, which costs little beside the decoding."""
    return torch.from_numpy(array if array.flags.writeable else array.copy())
