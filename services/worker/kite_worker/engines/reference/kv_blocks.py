"""Convert between a transformers DynamicCache and per-block KV tensors.

A block tensor holds `block_size` positions for every layer: shape
[num_layers, 2 (key, value), num_kv_heads, block_size, head_dim], in the storage dtype. This matches the
recyclable-unit payload layout (kite_shared.recyclable_unit), so encoding a block is a byte copy.

Devices: the cache lives where the model computes (CPU or GPU); blocks live in host memory (the worker's
block cache, the pool's units), so extracting copies to the host and building copies to the model's device,
each once per block, in the storage dtype (the narrower side of the conversion where it is lossy).
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def extract_blocks(cache: DynamicCache, first_block: int, end_block: int, block_size: int,
                   storage_dtype: torch.dtype) -> list[torch.Tensor]:
    """Blocks [first_block, end_block) of `cache` (which must hold at least end_block * block_size tokens),
    in `storage_dtype`, in host memory (converted where the cache is, then copied to the host at once)."""
    if end_block <= first_block:
        return []
    start, stop = first_block * block_size, end_block * block_size
    keys = torch.stack([layer.keys[0, :, start:stop] for layer in cache.layers])
    values = torch.stack([layer.values[0, :, start:stop] for layer in cache.layers])
    kv = torch.stack([keys, values], dim=1).to(storage_dtype).cpu()  # [L, 2, H, T, D]; .cpu(): free on the host
    return [kv[:, :, :, i * block_size:(i + 1) * block_size].contiguous()
            for i in range(end_block - first_block)]


INITIAL_SPARE_POSITIONS = 256  # room a new cache keeps beyond the prompt, before its first growth
GROWTH = 1.5  # a full layer buffer grows to this many times the positions it needs


def new_cache(capacity: int) -> DynamicCache:
    """An empty cache whose layers (created on first use) preallocate `capacity` positions."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = lambda: GrowingLayer(capacity)
    return cache


def build_cache(blocks: Sequence[torch.Tensor], num_tokens: int, compute_dtype: torch.dtype,
                capacity: int = 0, device: torch.device | str = "cpu") -> DynamicCache:
    """A cache on `device` (the model's) holding the first `num_tokens` positions of the concatenated
    `blocks` (from anywhere: host memory, as the block cache keeps them), with room for `capacity`
    positions in all (at least num_tokens).

    This is on the path of every hit's time to first token, so it copies each byte once: every block is
    converted straight into its slice of one preallocated [L, 2, H, capacity, D] tensor, whose per-layer
    slices become the layers' buffers. (`torch.cat`, `.to` and `DynamicCache(pairs)`, whose layers start
    empty and concatenate, copied three times: 67 ms for 2,048 tokens of SmolLM2 on the 2-vCPU VM.) On a
    GPU a block crosses once, in its storage dtype, and is converted there.
    """
    num_layers, two, num_heads, block_size, head_dim = blocks[0].shape
    capacity = max(capacity, num_tokens)
    kv = torch.empty(num_layers, two, num_heads, capacity, head_dim, dtype=compute_dtype, device=device)
    for i, block in enumerate(blocks):
        start = i * block_size
        if start >= num_tokens:
            break
        stop = min(start + block_size, num_tokens)
        kv[:, :, :, start:stop].copy_(block[:, :, :, :stop - start].to(kv.device))  # no copy on the host
    cache = new_cache(capacity)
    cache.layers = [GrowingLayer.holding(kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0), num_tokens)
                    for i in range(num_layers)]
    return cache


class GrowingLayer(DynamicLayer):
    """A DynamicLayer that appends into preallocated buffers instead of concatenating.

    transformers' DynamicLayer.update builds new key and value tensors with torch.cat on every step, so
    each decode step copies the whole context (at 2,048 positions of SmolLM2 in fp32, 94 MB per token).
    Here `keys` / `values` are views of the first `length` positions of buffers with spare room: an update
    copies only the new positions, and a full buffer grows by GROWTH (amortized O(1) per position), as a
    vector does. The views are what attention reads, exactly the values a DynamicLayer would hold.
    Only what the engine uses is supported: update, and the length and mask queries (batch size 1; no
    crop, reorder or offload).
    """

    def __init__(self, capacity: int = INITIAL_SPARE_POSITIONS) -> None:
        super().__init__()
        self.capacity = max(1, capacity)
        self.length = 0
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    @classmethod
    def holding(cls, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int) -> "GrowingLayer":
        """A layer over existing buffers [1, H, capacity, D] whose first `length` positions are filled."""
        layer = cls(key_buffer.shape[-2])
        layer.lazy_initialization(key_buffer, value_buffer)
        layer._key_buffer, layer._value_buffer, layer.length = key_buffer, value_buffer, length
        layer.keys, layer.values = key_buffer[..., :length, :], value_buffer[..., :length, :]
        return layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if self._key_buffer is None or end > self._key_buffer.shape[-2]:
            self._grow(end, key_states, value_states)
        self._key_buffer[..., self.length:end, :].copy_(key_states)
        self._value_buffer[..., self.length:end, :].copy_(value_states)
        self.length = end
        self.keys = self._key_buffer[..., :end, :]
        self.values = self._value_buffer[..., :end, :]
        return self.keys, self.values

    def _grow(self, needed: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        size = max(needed, self.capacity if self._key_buffer is None else int(needed * GROWTH))
        keys = key_states.new_empty((*key_states.shape[:-2], size, key_states.shape[-1]))
        values = value_states.new_empty((*value_states.shape[:-2], size, value_states.shape[-1]))
        if self.length:
            keys[..., :self.length, :].copy_(self._key_buffer[..., :self.length, :])
            values[..., :self.length, :].copy_(self._value_buffer[..., :self.length, :])
        self._key_buffer, self._value_buffer, self.capacity = keys, values, size
