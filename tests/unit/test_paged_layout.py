"""Whole-block copies in and out of vLLM's paged KV layouts (kite_worker.engines.vllm.paged_layout), on every device
(tests/devices.py): both backends' layouts, their kernels' view of keys and values, and the connector's
save -> host bytes -> staging arena -> load path. Needs no vLLM."""

from __future__ import annotations

import pytest
import torch

from kite_worker.engines.vllm.paged_layout import KV_CHANNELS, KV_ROWS, PagedCache, PagedLayer, kv_split_of
from kite_worker.engines.vllm.staging_arena import StagingArena
from tests.devices import DEVICES

H, B, D = 3, 32, 64
HASH = b"\x07" * 32


def block(seed: int, device: str = "cpu", shape: tuple[int, ...] = (2, H, B, D)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


def cpu_paged(num_blocks: int, device: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """vLLM-CPU's tensor: [num_blocks, kv heads, block size, 2 * head dim], dense (layout LBHNC)."""
    return torch.zeros(num_blocks, H, B, 2 * D, dtype=dtype, device=device)


def flash_paged(num_blocks: int, device: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FlashAttention's tensor: the same logical view over memory ordered [num_blocks, block size, kv heads,
    2 * head dim] (LBNHC, its default), so the view is not contiguous."""
    return torch.zeros(num_blocks, B, H, 2 * D, dtype=dtype, device=device).transpose(1, 2)


@pytest.mark.parametrize("device", DEVICES)
def test_cpu_attention_layout_round_trip_and_its_kernels_view_of_keys_and_values(device):
    paged = cpu_paged(5, device)
    layer = PagedLayer(paged, KV_ROWS)
    assert layer.block_shape == (H, B, D)
    values = block(1, device)
    layer.write(3, values)
    assert torch.equal(layer.read(torch.tensor([3]))[0], values)
    # the CPU attention kernel views a block as [H, 2 * B, D]: keys in the first B rows, values after
    kernel_view = paged.view(5, H, 2 * B, D)
    assert torch.equal(kernel_view[3, :, :B], values[0])
    assert torch.equal(kernel_view[3, :, B:], values[1])
    assert not paged[[0, 1, 2, 4]].any()  # other blocks untouched


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attention_layout_round_trip_and_its_kernels_view_of_keys_and_values(device):
    paged = flash_paged(5, device)
    assert not paged.is_contiguous()
    layer = PagedLayer(paged, KV_CHANNELS)
    values = block(2, device)
    layer.write(1, values)
    # FlashAttention splits the view as `kv_cache.transpose(1, 2).split(head_size, dim=-1)`: [B, N, H, D] each
    key_cache, value_cache = paged.transpose(1, 2).split(D, dim=-1)
    assert torch.equal(key_cache[1], values[0].transpose(0, 1))
    assert torch.equal(value_cache[1], values[1].transpose(0, 1))
    assert torch.equal(layer.read(torch.tensor([1, 1]))[1], values)
    assert not paged[[0, 2, 3, 4]].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_split, make", [(KV_ROWS, cpu_paged), (KV_CHANNELS, flash_paged)], ids=["rows", "channels"])
def test_reads_gather_blocks_in_the_order_asked_and_writes_convert_to_the_caches_dtype(device, kv_split, make):
    layer = PagedLayer(make(4, device), kv_split)
    first, second = block(3, device), block(4, device)
    layer.write(0, first.half())  # stored fp16 units are widened to the cache's dtype
    layer.write(2, second)
    out = layer.read(torch.tensor([2, 0]))  # the ids on the host, the cache anywhere
    assert out.device == layer.tensor.device
    assert torch.equal(out[0], second)
    assert torch.equal(out[1], first.half().float())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_split, make", [(KV_ROWS, cpu_paged), (KV_CHANNELS, flash_paged)], ids=["rows", "channels"])
@pytest.mark.parametrize("cache_dtype, storage_dtype", [
    (torch.float32, torch.float32), (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16)])
def test_the_connectors_save_and_load_path_through_host_bytes_and_the_staging_arena(
        tmp_path, device, kv_split, make, cache_dtype, storage_dtype):
    # What _WorkerSide.save and .load do (kv_connector.py), the staging arena standing in for the agent's
    # save files and slots: gather -> host bytes -> arena -> a tensor over the slot -> write into the cache.
    num_layers = 4
    cache = PagedCache.of([make(6, device, cache_dtype) for _ in range(num_layers)], kv_split)
    assert cache.unit_shape == (num_layers, 2, H, B, D)
    saved = [block(10 + i, device, (num_layers, 2, H, B, D)).to(cache_dtype) for i in range(2)]
    cache.write(1, saved[0])
    cache.write(4, saved[1])
    gathered = cache.gather([4, 1], storage_dtype)
    assert gathered.device.type == "cpu" and gathered.dtype == storage_dtype and gathered.is_contiguous()
    assert torch.equal(gathered[0], saved[1].cpu().to(storage_dtype))
    assert torch.equal(gathered[1], saved[0].cpu().to(storage_dtype))

    arena = StagingArena.create(tmp_path / "staged.arena", cache.unit_bytes(storage_dtype), num_slots=2)
    arena.write(0, HASH, gathered[1].view(torch.uint8).numpy())  # the bytes a save file holds
    assert arena.holds(0, HASH)
    slot = torch.frombuffer(arena.payload(0), dtype=storage_dtype).view(cache.unit_shape)  # no copy
    cache.write(5, slot)  # a host tensor into the cache's device and dtype
    loaded = cache.gather([5], cache_dtype)[0]
    assert torch.equal(loaded, saved[0].cpu().to(storage_dtype).to(cache_dtype))
    untouched = cache.gather([0, 2, 3], cache_dtype)
    assert not untouched.any()
    del slot
    arena.close()


def test_gathering_on_the_host_returns_host_memory_without_a_transfer():
    cache = PagedCache.of([cpu_paged(2, "cpu")], KV_ROWS)
    gathered = cache.gather([1], torch.float32)
    assert gathered.device.type == "cpu" and gathered.shape == (1, 1, 2, H, B, D)


def test_backends_map_to_their_key_value_split_and_unknown_ones_are_refused():
    assert kv_split_of("CPU_ATTN") == KV_ROWS
    assert kv_split_of("FLASH_ATTN") == kv_split_of("TRITON_ATTN") == kv_split_of("FLASHINFER") == KV_CHANNELS
    with pytest.raises(ValueError, match="FLASHMLA attention backend"):
        kv_split_of("FLASHMLA")


def test_unknown_layouts_and_mismatched_layers_are_refused():
    with pytest.raises(ValueError, match="unsupported paged KV layout"):
        PagedLayer(torch.zeros(4, 4, 4), KV_ROWS)
    with pytest.raises(ValueError, match="unsupported paged KV layout"):
        PagedLayer(torch.zeros(2, 5, B, H, D), KV_CHANNELS)  # FlashAttention's 5-D layout in earlier vLLMs
    with pytest.raises(ValueError, match="kv_split 'columns'"):
        PagedLayer(cpu_paged(2, "cpu"), "columns")
    with pytest.raises(ValueError, match="needs dense blocks"):  # rows reinterpret a block's memory
        PagedLayer(flash_paged(2, "cpu"), KV_ROWS)
    with pytest.raises(ValueError, match="paged KV layers differ"):
        PagedCache([PagedLayer(cpu_paged(2, "cpu"), KV_ROWS),
                    PagedLayer(torch.zeros(2, H + 1, B, 2 * D), KV_ROWS)])
    cache = PagedCache.of([cpu_paged(2, "cpu")], KV_ROWS)
    with pytest.raises(ValueError, match=r"a block of this cache is \(1, 2, 3, 32, 64\)"):
        cache.write(0, torch.zeros(2, 2, H, B, D))
