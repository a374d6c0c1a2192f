"""Whole KV blocks in and out of vLLM's paged KV tensors, whatever the attention backend and the device.

Boundary: torch only (vLLM is never imported here, so these copies are tested without it, on every device
torch has). A block leaves the paged tensors into host memory and enters them from anywhere: the KV
connector moves blocks between processes through host memory (the staging arena, save files), so the one
device-to-host or host-to-device copy of a block happens here, explicitly, in the storage dtype.

vLLM 0.32 hands a connector one tensor per attention layer, the logical view [num_blocks, kv heads,
block_size, 2 * head dim] (vllm.v1.kv_cache_layout's [B, H, N, C]); its physical order may differ
(FlashAttention's default is [B, N, H, C]): strides are read, never assumed. What the last axis holds
depends on the backend, hence `kv_split`:
- KV_ROWS (CPU_ATTN): per head, the block's block_size key rows then its value rows (the CPU kernel views
  a block as [H, 2 * block_size, head dim]); the key rows may be in an ISA-specific order inside a block:
  a whole-block copy keeps it, and the execution-path fingerprint keeps such blocks away from any other
  engine;
- KV_CHANNELS (FLASH_ATTN, TRITON_ATTN, FLASHINFER): per token and head, head dim key channels then head
  dim value channels (those kernels split the view with `.split(head_size, dim=-1)`).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

KV_ROWS = "rows"
KV_CHANNELS = "channels"
# vLLM attention backend name -> how it splits keys and values (read from the 0.32 kernels' code). FlashInfer
# with NVFP4 KV keeps keys and values as separate heads; KITE never asks vLLM for a quantized KV cache.
BACKEND_KV_SPLITS = {"CPU_ATTN": KV_ROWS, "FLASH_ATTN": KV_CHANNELS, "TRITON_ATTN": KV_CHANNELS,
                     "FLASHINFER": KV_CHANNELS}


def kv_split_of(backend: str) -> str:
    """How the attention backend named `backend` lays out keys and values; ValueError for one whose layout
    KITE has not read (a wrong guess would store values as keys: refused, never guessed)."""
    try:
        return BACKEND_KV_SPLITS[backend]
    except KeyError:
        raise ValueError(f"the KITE KV connector does not know how vLLM's {backend} attention backend lays out "
                         f"keys and values (known: {', '.join(sorted(BACKEND_KV_SPLITS))})") from None


class PagedLayer:
    """One attention layer's paged KV tensor, its blocks read and written as [2, kv heads, block_size, head
    dim] (see the module docstring for the layouts)."""

    def __init__(self, tensor: torch.Tensor, kv_split: str) -> None:
        if tensor.dim() != 4 or tensor.shape[-1] % 2:
            raise ValueError(f"unsupported paged KV layout {tuple(tensor.shape)}: vLLM's per-layer view is "
                             "[num_blocks, kv heads, block_size, 2 * head dim]")
        if kv_split not in (KV_ROWS, KV_CHANNELS):
            raise ValueError(f"kv_split {kv_split!r}: expected {KV_ROWS!r} or {KV_CHANNELS!r}")
        _, heads, block_size, width = tensor.shape
        if kv_split == KV_ROWS and len(tensor) and not tensor[0].is_contiguous():
            # The rows split reinterprets a block's memory as [H, 2, block_size, D]: only a dense block can be.
            raise ValueError(f"a {KV_ROWS}-split paged KV tensor needs dense blocks, got strides {tensor.stride()}")
        self.tensor = tensor
        self.kv_split = kv_split
        self.block_shape = (heads, block_size, width // 2)

    def read(self, block_ids: torch.Tensor) -> torch.Tensor:
        """[n, 2, H, B, D] copies of these blocks (a view of one new tensor, on the paged tensor's device)."""
        heads, block_size, head_dim = self.block_shape
        blocks = self.tensor.index_select(0, block_ids.to(self.tensor.device))  # dense [n, H, B, 2 * D]
        if self.kv_split == KV_ROWS:
            return blocks.view(-1, heads, 2, block_size, head_dim).transpose(1, 2)
        return blocks.view(-1, heads, block_size, 2, head_dim).permute(0, 3, 1, 2, 4)

    def write(self, block_id: int, values: torch.Tensor) -> None:
        """Store one block given as [2, H, B, D] on the paged tensor's device (any dtype: converted there)."""
        heads, block_size, head_dim = self.block_shape
        target = self.tensor[block_id]  # [H, B, 2 * D], a view
        if self.kv_split == KV_ROWS:
            target.view(heads, 2, block_size, head_dim).copy_(values.transpose(0, 1))
        else:  # the last axis is innermost in every layout vLLM allocates: splitting it is a view
            target.unflatten(-1, (2, head_dim)).copy_(values.permute(1, 2, 0, 3))


class PagedCache:
    """A model's paged layers as whole blocks of every layer: [layers, 2, kv heads, block_size, head dim],
    the recyclable-unit layout."""

    def __init__(self, layers: Iterable[PagedLayer]) -> None:
        self.layers = list(layers)
        if not self.layers:
            raise ValueError("a paged KV cache needs at least one layer")
        first = self.layers[0]
        for layer in self.layers[1:]:
            if layer.block_shape != first.block_shape or layer.tensor.device != first.tensor.device:
                raise ValueError(f"paged KV layers differ: {layer.block_shape} on {layer.tensor.device} "
                                 f"beside {first.block_shape} on {first.tensor.device}")
        self.device = first.tensor.device
        self.unit_shape = (len(self.layers), 2, *first.block_shape)

    @classmethod
    def of(cls, tensors: Iterable[torch.Tensor], kv_split: str) -> "PagedCache":
        return cls(PagedLayer(t, kv_split) for t in tensors)

    def unit_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one block in `dtype`."""
        n = torch.empty(0, dtype=dtype).element_size()
        for dim in self.unit_shape:
            n *= dim
        return n

    def gather(self, block_ids: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """[n, layers, 2, H, B, D]: these blocks, converted to `dtype` where they are (on a GPU, fewer bytes
        then cross to the host), in host memory. Blocking: the copies are complete when it returns, so the
        paged blocks may be reused at once. On the host each element is copied twice: by the index select,
        and into the one dense result (converted on the way); the stack of dense per-layer copies this
        replaced took 3-4x as long for 35 blocks of the default model (fp32 to fp16, 2026-12-06)."""
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        out = torch.empty((len(ids), *self.unit_shape), dtype=dtype, device=self.device)
        for i, layer in enumerate(self.layers):
            out[:, i].copy_(layer.read(ids))
        return out.cpu()  # the same tensor when it is already on the host

    def write(self, block_id: int, block: torch.Tensor) -> None:
        """Store one block [layers, 2, H, B, D] of any dtype from any device: moved to the paged tensors'
        device in its own dtype (one copy for every layer; none on the host), converted there."""
        if tuple(block.shape) != self.unit_shape:
            raise ValueError(f"a block of this cache is {self.unit_shape}, got {tuple(block.shape)}")
        # From pageable host memory (a mapped arena slot) the copy has read its source when it returns, as
        # the connector's check that the slot still holds the block afterwards needs.
        block = block.to(self.device)
        for layer, values in zip(self.layers, block):
            layer.write(block_id, values)
