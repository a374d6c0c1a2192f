"""What staging a pool load for vLLM's model runner costs: the staging arena against a file per block.

A vLLM worker's pool load ends with two steps beside the fetch itself: the KV agent stages each verified
block for the model runner, and the model runner copies it into its paged KV tensors. Timed here, side by
side in one process, on the default model's shapes (30 layers, 3 KV heads, head dim 64, vLLM-CPU's
32-token blocks: 737,280 bytes in fp16; a ~1,000-token prefix is 35 blocks):
- arena (since 2026-12-02, kite_worker/staging_arena.py): the agent copies the block into a slot of one
  shared mapping; the model runner copies from its own mapping into the paged KV (PagedLayer.write);
- files (before): the agent writes `bytes` of the block into a file of its own in /dev/shm (renamed into
  place), the model runner reads it into fresh memory, copies it into the paged KV, and the file is
  removed when evicted.
Both end in the same paged KV; the figure is per block and per 1,000-token prefix, median of --rounds.

    .venv/bin/python bench/bench_staging.py [--blocks 35] [--rounds 30] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kite_worker.engines.vllm.kv_agent import write_atomically
from kite_worker.engines.vllm.paged_layout import KV_ROWS, PagedLayer
from kite_worker.engines.vllm.staging_arena import ARENA_FILE, StagingArena

LAYERS, HEADS, BLOCK, HEAD_DIM = 30, 3, 32, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=35)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--dir", default="/dev/shm")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the model runner copies on its own thread; the measure is the copy, not OpenMP

    # vLLM-CPU's paged layout per layer: [num_blocks, heads, block_size, 2 * head_dim]
    paged = [torch.zeros(args.blocks * 2, HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.float16) for _ in range(LAYERS)]
    layers = [PagedLayer(t, KV_ROWS) for t in paged]
    unit_shape = (LAYERS, 2, HEADS, BLOCK, HEAD_DIM)
    # As the pool loader hands blocks over: tensors over the verified units' bytes.
    units = [torch.frombuffer(bytearray(os.urandom(LAYERS * 2 * HEADS * BLOCK * HEAD_DIM * 2)), dtype=torch.float16)
             .view(unit_shape) for _ in range(args.blocks)]
    hashes = [bytes([i % 255 + 1]) * 32 for i in range(args.blocks)]
    block_bytes = units[0].numel() * 2

    def copy_in(block_id: int, block: torch.Tensor) -> None:
        for layer, values in zip(layers, block.view(LAYERS, 2, HEADS, BLOCK, HEAD_DIM)):
            layer.write(block_id, values)

    folder = Path(tempfile.mkdtemp(prefix="kite-bench-staging-", dir=args.dir))
    agent_arena = StagingArena.create(folder / ARENA_FILE, block_bytes, args.blocks)
    runner_arena = StagingArena.open(folder / ARENA_FILE, block_bytes)

    def arena_round() -> tuple[float, float]:
        started = time.perf_counter()
        for slot, (block_hash, unit) in enumerate(zip(hashes, units)):
            agent_arena.write(slot, block_hash, unit.view(torch.uint8).numpy())
        staged = time.perf_counter()
        for slot, block_hash in enumerate(hashes):
            assert runner_arena.holds(slot, block_hash)
            copy_in(slot, torch.frombuffer(runner_arena.payload(slot), dtype=torch.float16))
            assert runner_arena.holds(slot, block_hash)
        return staged - started, time.perf_counter() - staged

    def files_round() -> tuple[float, float]:
        paths = [folder / f"in-{h.hex()}.kv" for h in hashes]
        started = time.perf_counter()
        for path, unit in zip(paths, units):
            write_atomically(path, unit.view(torch.uint8).numpy().tobytes())
        staged = time.perf_counter()
        for block_id, path in enumerate(paths):
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(data)
            copy_in(block_id, torch.frombuffer(data, dtype=torch.float16))
        loaded = time.perf_counter()
        for path in paths:  # evicted later, off the request's path: not counted
            path.unlink()
        return staged - started, loaded - staged

    results: dict[str, list[tuple[float, float]]] = {"arena": [], "files": []}
    for _ in range(2):  # warm both: first-touch faults of the arena and the paged KV
        arena_round()
        files_round()
    for _ in range(args.rounds):
        results["arena"].append(arena_round())
        results["files"].append(files_round())
    agent_arena.close()
    runner_arena.close()
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()

    total_mb = args.blocks * block_bytes / 1e6
    print(f"{args.blocks} blocks of {block_bytes:,} bytes ({total_mb:.1f} MB, ~{args.blocks * BLOCK:,} tokens), "
          f"median of {args.rounds} rounds, in {args.dir}")
    medians = {}
    for name, rounds in results.items():
        stage = statistics.median(r[0] for r in rounds)
        load = statistics.median(r[1] for r in rounds)
        both = statistics.median(r[0] + r[1] for r in rounds)
        medians[name] = both
        print(f"  {name:6} stage {1e3 * stage:6.2f} ms  copy into the paged KV {1e3 * load:6.2f} ms  "
              f"both {1e3 * both:6.2f} ms ({total_mb / both:,.0f} MB/s)")
    print(f"  files / arena: {medians['files'] / medians['arena']:.2f}x the time")


if __name__ == "__main__":
    main()
