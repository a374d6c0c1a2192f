"""Blocks <-> DynamicCache: exact positions, dtype conversion, partial last block, round trip; a cache on
every device (tests/devices.py) with its blocks in host memory."""

import pytest
import torch

from kite_worker.engines.reference.kv_blocks import build_cache, extract_blocks
from tests.devices import DEVICES

L, H, B, D = 3, 2, 4, 5


def blocks(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(L, 2, H, B, D, generator=g).to(torch.float16) for _ in range(n)]


def test_build_cache_holds_the_concatenated_positions_in_the_compute_dtype():
    bs = blocks(3)
    cache = build_cache(bs, num_tokens=10, compute_dtype=torch.float32)  # the last block only in part
    expected = torch.cat(bs, dim=3)[:, :, :, :10].to(torch.float32)
    assert len(cache.layers) == L and cache.get_seq_length() == 10
    for i, layer in enumerate(cache.layers):
        assert layer.keys.dtype == torch.float32 and layer.keys.shape == (1, H, 10, D)
        assert torch.equal(layer.keys[0], expected[i, 0]) and torch.equal(layer.values[0], expected[i, 1])


def test_a_built_cache_grows_like_any_other_and_round_trips_to_blocks():
    bs = blocks(2)
    cache = build_cache(bs, num_tokens=8, compute_dtype=torch.float32)
    new = torch.ones(1, H, 1, D)
    for i in range(L):
        cache.update(new, new, i)
    assert cache.get_seq_length() == 9
    again = extract_blocks(cache, 0, 2, B, torch.float16)
    assert all(torch.equal(a, b) for a, b in zip(again, bs))


def test_growing_layers_append_in_place_and_grow_past_their_capacity():
    from kite_worker.engines.reference.kv_blocks import GROWTH, new_cache

    cache = new_cache(capacity=4)
    g = torch.Generator().manual_seed(1)
    steps = [torch.randn(1, H, n, D, generator=g) for n in (3, 1, 2, 5)]  # 3, 4, 6 (grows), 11 (grows)
    for step in steps:
        keys, values = cache.update(step, -step, 0)
    expected = torch.cat(steps, dim=2)
    assert torch.equal(keys, expected) and torch.equal(values, -expected)
    layer = cache.layers[0]
    assert cache.get_seq_length() == 11 and layer.length == 11
    assert layer.capacity == int(11 * GROWTH)  # grew to 1.5x what it needed, not to 11


def test_a_hit_cache_has_room_for_the_answer_without_copying_its_prefix():
    bs = blocks(2)
    cache = build_cache(bs, num_tokens=8, compute_dtype=torch.float32, capacity=12)
    buffer_before = cache.layers[0].keys.data_ptr()
    for _ in range(4):
        cache.update(torch.zeros(1, H, 1, D), torch.zeros(1, H, 1, D), 0)
    assert cache.layers[0].keys.data_ptr() == buffer_before  # appended in place: no reallocation
    assert cache.layers[0].length == 12 and cache.layers[0].capacity == 12


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compute_dtype, storage_dtype", [
    (torch.float32, torch.float16), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16)])
def test_a_cache_on_a_device_is_built_from_host_blocks_and_gives_its_blocks_back_in_host_memory(
        device, compute_dtype, storage_dtype):
    bs = [b.to(storage_dtype) for b in blocks(3)]  # as the block cache keeps them: host memory
    cache = build_cache(bs, num_tokens=10, compute_dtype=compute_dtype, capacity=16, device=device)
    layer = cache.layers[0]
    assert layer.keys.device.type == device and layer.keys.dtype == compute_dtype
    expected = torch.cat(bs, dim=3)[:, :, :, :10].to(compute_dtype)
    assert torch.equal(layer.values[0].cpu(), expected[0, 1])
    step = torch.full((1, H, 3, D), 0.5, dtype=compute_dtype, device=device)  # a prefill chunk after the hit
    for i in range(L):
        cache.update(step, -step, i)
    again = extract_blocks(cache, 0, 3, B, storage_dtype)
    assert all(b.device.type == "cpu" and b.dtype == storage_dtype and b.is_contiguous() for b in again)
    assert all(torch.equal(a, b.to(compute_dtype).to(storage_dtype)) for a, b in zip(again[:2], bs))
    assert torch.equal(again[2][:, 0, :, 2:], torch.full((L, H, 2, D), 0.5, dtype=storage_dtype))
