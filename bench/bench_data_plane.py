"""Benchmark of KITE's KV data plane (issue 15): how fast a worker gets verified block bytes from each
tier, side by side with the floor each path is measured against, in one run.

    .venv/bin/python bench/bench_data_plane.py [--chain 128] [--repeat 5]

Starts its own nats-server, redis-server and moto S3 server on free ports, and the ru-pool as a real
process (`python -m kite_ru_pool`, hot tier in files of its hand-off folder on /dev/shm). Blocks have
SmolLM2-135M's geometry (30 layers, 3 KV heads, head dim 64) as the default deployment stores them: one
vLLM block of 32 tokens in the compute dtype, float32, 1,474,560 payload bytes (`--block-tokens`, `--dtype`
for others: before 2026-12-06 the figures were of 16-token float16 blocks, 368,640 bytes).
Every KITE path ends with the units verified as a worker verifies them before loading: format, HMAC
under the cluster key, payload tag (GMAC), block hash, model and tenant (`check_units`: the headers on
one thread, then the payloads a share per core, as the worker's pool loader verifies a fetch).

| path | what a worker does | floor |
|---|---|---|
| hot, same host, fetched again | `PoolClient.get`: one NATS request, the reply lends the pool's hot files, the worker maps them and keeps the mappings (`handoff.KeptMappings`), so the rounds after the first find them mapped | one memcpy of the same bytes |
| hot, same host, first fetch | the same with nothing kept: every file mapped afresh, as for units the worker never fetched before | the same memcpy |
| hot, another host | the same request; the reply carries a ticket, the worker reads the units from the pool's block stream (TCP, loopback here) | the same memcpy |
| hot, over NATS | the same, units inline in the reply (the fallback when the stream is off or unreachable) | the same memcpy |
| warm, direct | `RedisTier.get_units`: MGETs of 16 keys, then the batch verified a share per core off the event loop | one raw MGET of all the keys (redis-py + hiredis), nothing verified; and the same MGETs of 16, nothing verified |
| cold S3, direct | `S3Tier.get_units` (as the worker's loader): every block read at once, then the batch verified a share per core off the event loop | raw `get_object` + read of the same objects, same threads, nothing verified |
| cold folder, direct | `LocalDirTier.get_units`, the same way | raw reads of the same files |

Each measurement is the median of `--repeat` rounds; in each round the path and its floor run back to back,
so drift on this noisy machine hits both alike. Ratios are path / floor of the same run. Each timing ends
after one turn of the event loop, so what a path leaves to free (the asyncio future of its last thread
call holds the units until then: munmaps, for mapped files) is counted in its own time, not the next's.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Awaitable, Callable

import nats

from bench_pool_lookup import make_chain, wait_for_pool
from kite_cli.local_servers import free_port, start_nats, start_redis, wait_for_port
from kite_shared.config import ENGINE_BLOCK_SIZES
from kite_shared.recyclable_unit import TORCH_DTYPE_TO_CODEC, RecyclableUnit
from kite_shared.security import ANONYMOUS_TENANT_TAG, ru_key
from kite_shared.tiers.base import check_units
from kite_shared.tiers.cold import LocalDirTier, S3Tier
from kite_shared.tiers.keys import BlockKey, object_key, redis_key
from kite_shared.tiers.pool_client import PoolClient
from kite_shared.tiers.warm import READ_BATCH_KEYS, RedisTier

HOT_TARGET_MB_S = 2000.0  # issue 15: same-host hot path, verified
RATIO_TARGET = 0.8  # issue 15: warm and cold paths against their raw floors, verified


class Rounds:
    """Times of one path over the rounds; MB/s from the median."""

    def __init__(self, num_bytes: int) -> None:
        self.num_bytes = num_bytes
        self.seconds: list[float] = []

    async def time(self, fn: Callable[[], Awaitable[int]], expect: int) -> None:
        started = time.perf_counter()
        got = await fn()
        await asyncio.sleep(0)  # the frees this call left (see the module docstring) happen now
        self.seconds.append(time.perf_counter() - started)
        if got != expect:
            raise SystemExit(f"a path returned {got} of {expect} blocks: the benchmark is invalid")

    @property
    def mb_s(self) -> float:
        return self.num_bytes / statistics.median(self.seconds) / 1e6


def verify_all(units, hashes: list[bytes], fp: str, key: bytes) -> int:
    """What a worker does with units from the pool before loading them (`PoolLoader._verified`)."""
    outcomes = check_units(list(units), hashes, fp, key, ANONYMOUS_TENANT_TAG)
    bad = [o for o in outcomes if not isinstance(o, RecyclableUnit)]
    if bad:
        raise SystemExit(f"{len(bad)} units failed verification: {bad[0]!r}")
    return len(outcomes)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chain", type=int, default=128, help="blocks per fetch")
    ap.add_argument("--repeat", type=int, default=5, help="rounds per path (the median is reported)")
    ap.add_argument("--block-tokens", type=int, default=ENGINE_BLOCK_SIZES["vllm"], help="tokens per block")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                    help="dtype of the stored KV (the default: the default model's compute dtype)")
    args = ap.parse_args()
    shape = (30, 2, 3, args.block_tokens, 64)  # SmolLM2-135M: layers, key and value, KV heads, tokens, head dim
    codec = TORCH_DTYPE_TO_CODEC[args.dtype]
    n = args.chain
    key = ru_key()

    nats_srv = start_nats()
    redis_srv = start_redis()
    s3_port = free_port()
    moto = Path(sys.executable).parent / "moto_server"
    s3_proc = subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", str(s3_port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_port(s3_port, s3_proc, 30, "moto_server")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    s3_url = f"http://127.0.0.1:{s3_port}"
    prefix = f"bench-{uuid.uuid4().hex[:6]}/"
    fp_hot, fp_warm, fp_cold = (hashlib.sha256(uuid.uuid4().bytes).hexdigest() for _ in range(3))
    chain_hot, chain_warm, chain_cold = (make_chain(fp, n, shape, codec) for fp in (fp_hot, fp_warm, fp_cold))
    unit_bytes = len(chain_hot[0][1])
    total = n * unit_bytes
    print(f"{n} blocks of {unit_bytes:,} bytes per fetch ({total / 1e6:.1f} MB); {args.repeat} rounds; "
          f"cpus {os.cpu_count()}")

    env = dict(os.environ, KITE_NATS_URL=nats_srv.url, KITE_REDIS_URL="", KITE_S3_ENDPOINT="",
               KITE_COLD_DIR=tempfile.mkdtemp(prefix="kite-bench-cold-"),
               KITE_POOL_HOT_BYTES=str((n + 2) * unit_bytes), KITE_LOG_LEVEL="WARNING",
               KITE_METRICS_PORT=str(free_port()))
    pool = subprocess.Popen([sys.executable, "-m", "kite_ru_pool"], env=env)
    nc = await nats.connect(nats_srv.url)
    warm = RedisTier(redis_srv.url + "/0", timeout_s=5.0)
    warm.ru_key = key
    s3 = S3Tier(s3_url, "kite-bench", prefix, threads=16)
    s3.ru_key = key
    cold_dir = tempfile.mkdtemp(prefix="kite-bench-local-")
    local = LocalDirTier(cold_dir, threads=4)
    local.ru_key = key
    try:
        await wait_for_pool(nc)
        lent = PoolClient(nc, get_timeout_s=10.0)
        fresh = PoolClient(nc, get_timeout_s=10.0, keep_mapped_bytes=0)
        inline = PoolClient(nc, get_timeout_s=10.0, handoff=False, stream=False)
        streamed = PoolClient(nc, get_timeout_s=10.0, handoff=False)  # a worker on another host
        for _, data in chain_hot:
            await lent.put(data)
        await nc.flush()
        hashes_hot = [h for h, _ in chain_hot]
        while (r := await lent.lookup(fp_hot, hashes_hot)) is None or r.hot < n:
            await asyncio.sleep(0.05)
        hashes_warm = [h for h, _ in chain_warm]
        for h, data in chain_warm:
            await warm.put(BlockKey.of(fp_warm, h), data)
        hashes_cold = [h for h, _ in chain_cold]
        await s3.ensure_bucket()
        await asyncio.gather(*(s3.put(BlockKey.of(fp_cold, h), d) for h, d in chain_cold))
        await asyncio.gather(*(local.put(BlockKey.of(fp_cold, h), d) for h, d in chain_cold))
        payloads = [d for _, d in chain_hot]
        warm_names = [redis_key(BlockKey.of(fp_warm, h)) for h in hashes_warm]
        s3_names = [object_key(prefix, BlockKey.of(fp_cold, h)) for h in hashes_cold]
        local_paths = [Path(cold_dir) / object_key(local.prefix, BlockKey.of(fp_cold, h)) for h in hashes_cold]
        raw_threads = ThreadPoolExecutor(max_workers=16)
        loop = asyncio.get_running_loop()

        async def hot_lent() -> int:
            return verify_all(await lent.get(fp_hot, hashes_hot), hashes_hot, fp_hot, key)

        async def hot_fresh() -> int:
            return verify_all(await fresh.get(fp_hot, hashes_hot), hashes_hot, fp_hot, key)

        async def hot_inline() -> int:
            return verify_all(await inline.get(fp_hot, hashes_hot), hashes_hot, fp_hot, key)

        async def hot_streamed() -> int:
            return verify_all(await streamed.get(fp_hot, hashes_hot), hashes_hot, fp_hot, key)

        async def memcpy() -> int:
            return len([bytearray(d) for d in payloads])

        async def warm_path() -> int:
            return sum(found is not None for found in await warm.get_units(fp_warm, hashes_warm))

        async def warm_floor() -> int:
            return sum(v is not None for v in await warm._redis.mget(warm_names))

        async def warm_floor_parts() -> int:  # the same MGETs the path sends, nothing verified
            found = 0
            for start in range(0, n, READ_BATCH_KEYS):
                found += sum(v is not None for v in await warm._redis.mget(warm_names[start:start + READ_BATCH_KEYS]))
            return found

        async def s3_path() -> int:
            return sum(f is not None for f in await s3.get_units(fp_cold, hashes_cold))

        def s3_raw_one(name: str) -> bytes:
            return s3._s3.get_object(Bucket="kite-bench", Key=name)["Body"].read()

        async def s3_floor() -> int:
            found = await asyncio.gather(*(loop.run_in_executor(raw_threads, s3_raw_one, name) for name in s3_names))
            return sum(len(f) > 0 for f in found)

        async def local_path() -> int:
            return sum(f is not None for f in await local.get_units(fp_cold, hashes_cold))

        async def local_floor() -> int:
            found = await asyncio.gather(*(loop.run_in_executor(raw_threads, p.read_bytes) for p in local_paths))
            return sum(len(f) > 0 for f in found)

        async def verify_only() -> int:
            return verify_all(payloads, hashes_hot, fp_hot, key)

        pairs = {name: (Rounds(total), Rounds(total))
                 for name in ("hot", "hot_fresh", "hot_stream", "hot_inline", "warm", "warm_parts", "s3", "local")}
        verification = Rounds(total)
        floors = {"hot": memcpy, "hot_fresh": memcpy, "hot_stream": memcpy, "hot_inline": memcpy,
                  "warm": warm_floor, "warm_parts": warm_floor_parts, "s3": s3_floor, "local": local_floor}
        paths = {"hot": hot_lent, "hot_fresh": hot_fresh, "hot_stream": hot_streamed, "hot_inline": hot_inline,
                 "warm": warm_path, "warm_parts": warm_path, "s3": s3_path, "local": local_path}
        for name in paths:  # one unmeasured round each: connections, page cache, the pool's first replies
            await paths[name]()
            await floors[name]()
        for _ in range(args.repeat):
            for name, (path_rounds, floor_rounds) in pairs.items():
                await path_rounds.time(paths[name], n)
                if name.startswith("warm"):  # the hits' expiry refresh (off the reader's path) ends untimed
                    await warm.settle()
                await floor_rounds.time(floors[name], n)
            await verification.time(verify_only, n)

        rows = [
            ("hot, same host, fetched again (kept)", "hot", "memcpy of the same bytes",
             f">= {HOT_TARGET_MB_S:,.0f} MB/s"),
            ("hot, same host, first fetch (mapped)", "hot_fresh", "memcpy of the same bytes",
             f">= {HOT_TARGET_MB_S:,.0f} MB/s"),
            ("hot, another host: block stream (TCP)", "hot_stream", "memcpy of the same bytes", "(cross-host)"),
            ("hot, over NATS (inline reply)", "hot_inline", "memcpy of the same bytes", "(fallback)"),
            ("warm, direct (batched MGETs)", "warm", "one raw MGET (hiredis)", f">= {RATIO_TARGET}x floor"),
            ("warm, direct (batched MGETs)", "warm_parts", f"raw MGETs of {READ_BATCH_KEYS} keys", "(same commands)"),
            ("cold S3, direct (concurrent GETs)", "s3", "raw GETs, 16 threads", f">= {RATIO_TARGET}x floor"),
            ("cold folder, direct", "local", "raw file reads", ""),
        ]
        print(f"\nside by side, verified (format + HMAC + payload tag + hash/model/tenant), "
              f"median of {args.repeat} rounds:")
        print(f"{'path':<42}{'MB/s':>9}  {'floor':<26}{'MB/s':>9}{'ratio':>7}  target   met")
        for label, name, floor_label, target in rows:
            path_rounds, floor_rounds = pairs[name]
            ratio = path_rounds.mb_s / floor_rounds.mb_s
            met = ""
            if name in ("hot", "hot_fresh"):
                met = "yes" if path_rounds.mb_s >= HOT_TARGET_MB_S else "NO"
            elif name in ("warm", "s3"):
                met = "yes" if ratio >= RATIO_TARGET else "NO"
            print(f"{label:<42}{path_rounds.mb_s:>9,.0f}  {floor_label:<26}{floor_rounds.mb_s:>9,.0f}"
                  f"{ratio:>7.2f}  {target:<22} {met}")
        print(f"{'verification alone (decode, in memory)':<42}{verification.mb_s:>9,.0f}")
        print(f"kept mappings: {lent.kept.num_hits} lent files found mapped, {lent.kept.num_mapped} mapped")
        raw_threads.shutdown()
    finally:
        await nc.close()
        await warm.close()
        await s3.close()
        await local.close()
        pool.send_signal(signal.SIGTERM)
        pool.wait(15)
        s3_proc.terminate()
        s3_proc.wait(10)
        redis_srv.stop()
        nats_srv.stop()


if __name__ == "__main__":
    asyncio.run(main())
