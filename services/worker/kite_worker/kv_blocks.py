"""Convert between a transformers DynamicCache and per-block KV tensors.

A block tensor holds `block_size` positions for every layer: shape
[num_layers, 2 (key, value), num_kv_heads, block_size, head_dim], in the storage dtype (fp16 by default).
This matches the recyclable-unit payload layout (kite_shared.recyclable_unit), so encoding a block is a
byte copy.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache


def extract_blocks(cache: DynamicCache, first_block: int, end_block: int, block_size: int,
                   storage_dtype: torch.dtype) -> list[torch.Tensor]:
    """Blocks [first_block, end_block) of `cache` (which must hold at least end_block * block_size tokens)."""
    if end_block <= first_block:
        return []
    start, stop = first_block * block_size, end_block * block_size
    keys = torch.stack([layer.keys[0, :, start:stop] for layer in cache.layers])
    values = torch.stack([layer.values[0, :, start:stop] for layer in cache.layers])
    kv = torch.stack([keys, values], dim=1).to(storage_dtype)  # [L, 2, H, T, D]
    return [kv[:, :, :, i * block_size:(i + 1) * block_size].contiguous()
            for i in range(end_block - first_block)]


def build_cache(blocks: Sequence[torch.Tensor], num_tokens: int, compute_dtype: torch.dtype) -> DynamicCache:
    """A DynamicCache holding the first `num_tokens` positions of the concatenated `blocks`."""
    kv = torch.cat(list(blocks), dim=3)[:, :, :, :num_tokens].to(compute_dtype)  # [L, 2, H, T, D]
    return DynamicCache([(kv[i, 0].unsqueeze(0).contiguous(), kv[i, 1].unsqueeze(0).contiguous())
                         for i in range(kv.shape[0])])
