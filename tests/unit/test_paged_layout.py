"""Whole-block copies in and out of vLLM's paged KV layouts (kite_worker.paged_layout)."""

from __future__ import annotations

import pytest
import torch

from kite_worker.paged_layout import PagedLayer

H, B, D = 3, 32, 64


def block(seed: int) -> torch.Tensor:
    return torch.randn(2, H, B, D, generator=torch.Generator().manual_seed(seed))


def test_cpu_layout_round_trip_and_the_kernels_view_of_keys_and_values():
    paged = torch.zeros(5, H, B, 2 * D)  # vLLM-CPU: [num_blocks, kv heads, block size, 2 * head dim]
    layer = PagedLayer(paged)
    assert layer.block_shape == (H, B, D)
    values = block(1)
    layer.write(3, values)
    assert torch.equal(layer.read(torch.tensor([3]))[0], values)
    # the CPU attention kernel views a block as [H, 2 * B, D]: keys in the first B rows, values after
    kernel_view = paged.view(5, H, 2 * B, D)
    assert torch.equal(kernel_view[3, :, :B], values[0])
    assert torch.equal(kernel_view[3, :, B:], values[1])
    assert not paged[[0, 1, 2, 4]].any()  # other blocks untouched


def test_flash_attention_layout_round_trip():
    paged = torch.zeros(2, 5, B, H, D)  # [2, num_blocks, block size, kv heads, head dim]
    layer = PagedLayer(paged)
    values = block(2)
    layer.write(1, values)
    assert torch.equal(paged[0, 1].permute(1, 0, 2), values[0])
    assert torch.equal(layer.read(torch.tensor([1, 1]))[1], values)


def test_reads_gather_several_blocks_in_the_order_asked_and_convert_on_write():
    layer = PagedLayer(torch.zeros(4, H, B, 2 * D))
    first, second = block(3), block(4)
    layer.write(0, first.half())  # stored fp16 units are widened to the cache's dtype
    layer.write(2, second)
    out = layer.read(torch.tensor([2, 0]))
    assert torch.equal(out[0], second)
    assert torch.equal(out[1], first.half().float())


def test_unknown_layouts_are_refused():
    with pytest.raises(ValueError, match="unsupported paged KV layout"):
        PagedLayer(torch.zeros(4, 4, 4))
