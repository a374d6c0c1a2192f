"""Benchmark of the ru-pool's block index (issue 38): memory per block and the longest event-loop hold of
a lifecycle sweep, the index as it was before issue 38 (tests/unit/ru_pool_oracle: one Entry object per
block, tenant ledgers of (model tag, hash) tuples, a sweep that copies each tag's keys and sorts every
decision at once) beside today's (kite_ru_pool.index: per-tag parallel arrays, interned owners, a sweep
that walks slots and merges sorted runs lazily), on the same blocks, in one run.

    .venv/bin/python bench/bench_pool_index.py [--blocks 100000 1000000] [--due 0.25] [--seed 1]

Blocks: 32-byte hashes over 2 model tags and 4 tenants, each key built as a put decodes it (its own
tenant-tag string), SmolLM2-135M unit sizes, depth in a 128-block chain, tiers hot / warm / cold /
warm+cold, last hits spread so that about `--due` of them are due for archival, renewal or expiry.

Memory: tracemalloc's traced bytes still held once the index is built and the caller's keys are gone
(the hashes count: the index keeps them), divided by the blocks.

Sweep: run as maintenance.Maintenance.sweep_once runs it on an event loop (slices of
SWEEP_STEP_ENTRIES, `asyncio.sleep(0)` between them, then the decisions carried out FETCH_CONCURRENCY at
a time, each a stand-in tier call that yields once), with a probe task that measures how long the loop
went without giving it a turn: the worst of those is the longest hold a lookup could have waited behind,
in CPU time of this thread (what the code itself holds) and in wall time (which adds whatever else the
machine ran meanwhile: on a loaded machine, read the CPU figure).
The old index's decisions are carried out as that code did (sort all, one task per decision behind a
semaphore). Then the per-request calls' CPU time, old and new (`op_costs`). Time figures move with the
machine; the ratios are the point.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import sys
import time
import timeit
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the oracle lives in the tests folder

from kite_ru_pool import index as new_index  # noqa: E402
from kite_ru_pool import lifecycle as new_lifecycle  # noqa: E402
from kite_ru_pool import tenants as new_tenants  # noqa: E402
from kite_ru_pool.maintenance import SWEEP_ACTIONS_PER_TURN, SWEEP_STEP_ENTRIES  # noqa: E402
from kite_ru_pool.tier_io import FETCH_CONCURRENCY  # noqa: E402
from kite_shared.tiers.hot import HotLRU  # noqa: E402
from kite_shared.tiers.keys import BlockKey  # noqa: E402
from tests.unit.ru_pool_oracle import index as old_index  # noqa: E402
from tests.unit.ru_pool_oracle import lifecycle as old_lifecycle  # noqa: E402
from tests.unit.ru_pool_oracle import tenants as old_tenants  # noqa: E402

UNIT_BYTES = 368_640  # SmolLM2-135M, 16 tokens, fp16
FPS = ["a1" * 32, "b2" * 32]
TENANTS = [b"anonymous", b"7f3a9c01d2e4b5a6", b"0c1d2e3f4a5b6c7d", b"9e8d7c6b5a4f3e2d"]
NOW = 1_000_000.0
ARCHIVE_AFTER_S, RENEW_AFTER_S, COLD_TTL_S = 3600.0, 3000.0, 86_400.0
HOT, WARM, COLD = new_index.HOT, new_index.WARM, new_index.COLD
TIER_CHOICES = (HOT, WARM, WARM, COLD, WARM | COLD, HOT | WARM)


def puts(n: int, due: float, seed: int):
    """The blocks' stores, each as the index's note_stored takes it (a fresh key, as decoded from a put)."""
    rng = random.Random(seed)
    for i in range(n):
        tiers = TIER_CHOICES[rng.randrange(len(TIER_CHOICES))]
        is_due = rng.random() < due
        idle = rng.uniform(COLD_TTL_S, 2 * COLD_TTL_S) if is_due else rng.uniform(0.0, 0.5 * RENEW_AFTER_S)
        key = BlockKey.of(FPS[i % 2], rng.randbytes(32), TENANTS[rng.randrange(len(TENANTS))].decode())
        yield key, tiers, UNIT_BYTES - rng.randrange(4) * 4096, NOW - idle, i % 128


def build(module, tenants_module, n: int, due: float, seed: int):
    """The index with `n` blocks, and the bytes tracemalloc says it holds."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = module.BlockIndex(tenants_module.Tenants())
    for key, tiers, size, last_hit, depth in puts(n, due, seed):
        for bit in (HOT, WARM, COLD):
            if tiers & bit:
                index.note_stored(key, bit, size, last_hit, last_hit=last_hit, depth=depth)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return index, held


async def sweep_holds(lifecycle_module, index, lazy: bool) -> dict:
    """One sweep as the service runs it (module docstring); its wall time, the longest the loop went
    without turning, and how many decisions it carried out."""
    sweep = lifecycle_module.SweepPass(index, HotLRU(1 << 30), NOW, True, True, archive_after_s=ARCHIVE_AFTER_S,
                                       renew_after_s=RENEW_AFTER_S, cold_ttl_s=COLD_TTL_S, has_cold=True)
    worst = worst_cpu = 0.0
    running = True

    async def probe() -> None:
        nonlocal worst, worst_cpu
        while running:
            t0, c0 = time.perf_counter(), time.thread_time()
            await asyncio.sleep(0)
            worst = max(worst, time.perf_counter() - t0)
            worst_cpu = max(worst_cpu, time.thread_time() - c0)

    async def tier_call() -> None:
        await asyncio.sleep(0)

    probing = asyncio.ensure_future(probe())
    await asyncio.sleep(0)
    started = time.perf_counter()
    while not sweep.step(SWEEP_STEP_ENTRIES):
        await asyncio.sleep(0)
    walked = time.perf_counter() - started
    carried = 0
    if lazy:  # maintenance.Maintenance.sweep_once today
        pending = sweep.ordered_actions()

        async def carry() -> None:
            nonlocal carried
            for n, _ in enumerate(pending, 1):
                await tier_call()
                carried += 1
                if n % SWEEP_ACTIONS_PER_TURN == 0:
                    await asyncio.sleep(0)
        await asyncio.gather(*(carry() for _ in range(FETCH_CONCURRENCY)))
    else:  # before issue 38
        actions = sweep.actions()
        sem = asyncio.Semaphore(FETCH_CONCURRENCY)

        async def run(_) -> None:
            nonlocal carried
            async with sem:
                await tier_call()
                carried += 1
        await asyncio.gather(*(run(a) for a in actions))
    total = time.perf_counter() - started
    running = False
    await probing
    return {"walk_s": walked, "total_s": total, "worst_hold_ms": worst * 1e3, "worst_hold_cpu_ms": worst_cpu * 1e3,
            "actions": carried}


def measure(n: int, due: float, seed: int) -> dict:
    out = {}
    for name, module, tenants_module, lifecycle_module, lazy in (
            ("old", old_index, old_tenants, old_lifecycle, False),
            ("new", new_index, new_tenants, new_lifecycle, True)):
        index, held = build(module, tenants_module, n, due, seed)
        gc.freeze()  # as the pool does after its rebuild (gc_freeze): no full collection inside the sweep
        sweep = asyncio.run(sweep_holds(lifecycle_module, index, lazy))
        gc.unfreeze()
        out[name] = dict(sweep, bytes_per_block=held / index.num_blocks(), blocks=index.num_blocks())
        del index
        gc.collect()
    if out["old"]["actions"] != out["new"]["actions"]:
        raise SystemExit(f"the two sweeps decided differently: {out['old']['actions']} vs {out['new']['actions']}")
    return out


def op_costs(module, tenants_module, seed: int) -> dict:
    """CPU time of the index's per-request calls: a 128-block chain's `prefixes` in a 50,000-block index
    (best of 7 x 2,000), `note_stored` of a new block and `note_hit` (mean over 20,000)."""
    rng = random.Random(seed)
    index = module.BlockIndex(tenants_module.Tenants())
    for _ in range(50_000):
        index.note_stored(BlockKey.of(FPS[0], rng.randbytes(32)), WARM, UNIT_BYTES, NOW)
    chain = [rng.randbytes(32) for _ in range(128)]
    for h in chain:
        index.note_stored(BlockKey.of(FPS[0], h), HOT | WARM, UNIT_BYTES, NOW)
    tag = BlockKey.of(FPS[0], chain[0]).model_tag
    best = min(timeit.repeat(lambda: index.prefixes(tag, chain, HOT | WARM | COLD), number=2000, repeat=7,
                             timer=time.thread_time)) / 2000
    keys = [BlockKey.of(FPS[0], rng.randbytes(32)) for _ in range(20_000)]
    t0 = time.thread_time()
    for k in keys:
        index.note_stored(k, HOT, UNIT_BYTES, NOW, last_hit=NOW, depth=3)
    put = (time.thread_time() - t0) / len(keys)
    t0 = time.thread_time()
    for k in keys:
        index.note_hit(k, NOW + 1)
    hit = (time.thread_time() - t0) / len(keys)
    return {"prefixes_us": best * 1e6, "put_us": put * 1e6, "hit_us": hit * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--due", type=float, default=0.25, help="fraction of blocks due for a sweep action")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}; sweep slices of {SWEEP_STEP_ENTRIES} entries, "
          f"{FETCH_CONCURRENCY} carriers; {args.due:.0%} of blocks due")
    print(f"{'blocks':>9} | {'bytes/block old':>15} {'new':>6} {'ratio':>6} | {'worst hold, CPU old':>19} {'new':>8} "
          f"{'ratio':>6} | {'wall old':>11} {'new':>8} | {'walk old':>8} {'new':>7} | {'sweep old':>9} {'new':>7} "
          f"| {'actions':>8}")
    for n in args.blocks:
        r = measure(n, args.due, args.seed)
        o, w = r["old"], r["new"]
        print(f"{o['blocks']:>9,} | {o['bytes_per_block']:>15.0f} {w['bytes_per_block']:>6.0f} "
              f"{w['bytes_per_block'] / o['bytes_per_block']:>6.2f} | {o['worst_hold_cpu_ms']:>16.1f} ms "
              f"{w['worst_hold_cpu_ms']:>5.1f} ms {w['worst_hold_cpu_ms'] / o['worst_hold_cpu_ms']:>6.2f} | "
              f"{o['worst_hold_ms']:>8.1f} ms {w['worst_hold_ms']:>5.1f} ms | "
              f"{o['walk_s']:>7.2f}s {w['walk_s']:>6.2f}s | {o['total_s']:>8.2f}s {w['total_s']:>6.2f}s | "
              f"{w['actions']:>8,}", flush=True)
    o, w = op_costs(old_index, old_tenants, args.seed), op_costs(new_index, new_tenants, args.seed)
    print(f"per call, CPU: prefixes of a 128-block chain {o['prefixes_us']:.1f} -> {w['prefixes_us']:.1f} us; "
          f"note_stored (new block) {o['put_us']:.2f} -> {w['put_us']:.2f} us; "
          f"note_hit {o['hit_us']:.2f} -> {w['hit_us']:.2f} us (old -> new)")


if __name__ == "__main__":
    main()
