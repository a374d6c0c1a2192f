"""Whole KV blocks in and out of vLLM's paged KV tensors, whatever the attention backend's layout."""

from __future__ import annotations

import torch


class PagedLayer:
    """One attention layer's paged KV tensor, read and written as [2, kv heads, block_size, head dim] per
    block, whatever the backend's physical layout (strides are read, never assumed):
    - vLLM-CPU (CPU_ATTN): [num_blocks, kv heads, block_size, 2 * head dim]; per head, the block's key
      rows then its value rows (the kernel views it as [num_blocks, H, 2 * block_size, D]);
    - FlashAttention-style GPU backends: [2, num_blocks, block_size, kv heads, head dim].
    The key rows may be in an ISA-specific order inside a block: a whole-block copy keeps it, and the
    execution-path fingerprint keeps such blocks away from any other engine."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        if tensor.dim() == 4:  # CPU_ATTN
            _, heads, block_size, width = tensor.shape
            self.kv_first = False
            self.block_shape = (heads, block_size, width // 2)
        elif tensor.dim() == 5 and tensor.shape[0] == 2:
            _, _, block_size, heads, head_dim = tensor.shape
            self.kv_first = True
            self.block_shape = (heads, block_size, head_dim)
        else:
            raise ValueError(f"unsupported paged KV layout {tuple(tensor.shape)}")

    def read(self, block_ids: torch.Tensor) -> torch.Tensor:
        """[n, 2, H, B, D] copies of these blocks."""
        heads, block_size, head_dim = self.block_shape
        if self.kv_first:
            return self.tensor.index_select(1, block_ids).permute(1, 0, 3, 2, 4).contiguous()
        blocks = self.tensor.index_select(0, block_ids).view(-1, heads, 2, block_size, head_dim)
        return blocks.transpose(1, 2).contiguous()

    def write(self, block_id: int, values: torch.Tensor) -> None:
        """Store one block given as [2, H, B, D] (any dtype; converted to the cache's)."""
        heads, block_size, head_dim = self.block_shape
        if self.kv_first:
            self.tensor[:, block_id].copy_(values.permute(0, 2, 1, 3))
        else:
            self.tensor[block_id].view(heads, 2, block_size, head_dim).copy_(values.transpose(0, 1))
