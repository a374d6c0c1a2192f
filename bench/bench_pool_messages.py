"""The ru-pool service's CPU per message it receives, by kind: what `kite simulate` charges a pool index
shard for each message beside its core's own work (`--pool-message-us`, `--pool-put-us`; issue 38).

    .venv/bin/python bench/bench_pool_messages.py [--count 1000] [--block-tokens 16] [--profile DIR]

Starts its own nats-server and redis-server on free ports and the ru-pool as a real process (`python -m
kite_ru_pool`, writing through to that Redis, as the default deployment). Then, for each kind, sends
`--count` messages as workers and routers send them and reads the pool process's CPU time (user + system,
/proc) over the run, less its idle rate over the same wall time:
- lookup: `PoolClient.lookup` of a 64-block chain the pool holds, with every worker's prefix (the router's);
- put: one encoded unit of SmolLM2-135M's KV (`--block-tokens` tokens, float32: 737,280 payload bytes at
  16, the simulator's block), a new block each time, written through to Redis
  (KITE_WORKER_POOL_WRITE_PATH=pool);
- direct write: the same unit written into Redis by the sender itself and named in a notice to the pool
  (UnitsWritten, one block each: a request's one new block; KITE_WORKER_POOL_WRITE_PATH=direct, the default);
- block event: a worker's BlockStored of 8 hashes (its cache's events).
Each figure covers the whole service path: NATS receive, decode, the core, Redis, the reply. Beside it, the
sender's own CPU per message (this process: what a worker spends to send it, the Redis write included for
a direct write).
`--profile DIR` samples the pool with py-spy (--gil, raw stacks) during each kind, one file per kind.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import nats

from bench_pool_lookup import make_chain, wait_for_pool
from kite_cli.local_servers import free_port, start_nats, start_redis
from kite_shared.config import TierConfig, load
from kite_shared.recyclable_unit import TORCH_DTYPE_TO_CODEC
from kite_shared.security import ru_key
from kite_shared.tiers.client import TierClient
from kite_shared.tiers.pool_client import PoolClient
from kite_shared.tiers.unit_writer import DirectToWarm

IDLE_S = 3.0
PUT_WINDOW = 32  # puts sent ahead of what the pool has stored
NUM_PREFIX = 64  # blocks of the chain that lookups ask for


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(pid: int, idle_rate: float, count: int, send, settle, profile: Path | None
                  ) -> tuple[float, float]:
    """Microseconds of the pool's CPU per message beyond idle, and of this process's (the sender's)."""
    spy = None
    if profile is not None:
        spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--gil", "--rate", "200",
                                "--format", "raw", "-o", str(profile), "--pid", str(pid)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await asyncio.sleep(1.0)  # attached
    wall, cpu, own = time.perf_counter(), cpu_s(pid), time.process_time()
    for i in range(count):
        await send(i)
    await settle()
    wall, cpu, own = time.perf_counter() - wall, cpu_s(pid) - cpu, time.process_time() - own
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=60)
    return max(0.0, cpu - idle_rate * wall) / count * 1e6, own / count * 1e6


def hash_chain(seed: bytes, n: int) -> list[bytes]:
    """Chained hashes with no unit behind them: what cache events carry."""
    out, parent = [], hashlib.sha256(seed).digest()
    for i in range(n):
        parent = hashlib.sha256(parent + i.to_bytes(4, "big")).digest()
        out.append(parent)
    return out


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=1000, help="messages of each kind")
    ap.add_argument("--block-tokens", type=int, default=16, help="tokens per stored block")
    ap.add_argument("--profile", type=Path, metavar="DIR", help="py-spy the pool during each kind")
    args = ap.parse_args()
    shape = (30, 2, 3, args.block_tokens, 64)  # SmolLM2-135M: layers, key and value, KV heads, tokens, head dim
    nats_srv, redis_srv = start_nats(), start_redis()
    env = dict(os.environ, KITE_NATS_URL=nats_srv.url, KITE_REDIS_URL=redis_srv.url + "/0", KITE_S3_ENDPOINT="",
               KITE_COLD_DIR=tempfile.mkdtemp(prefix="kite-bench-cold-"), KITE_LOG_LEVEL="ERROR",
               KITE_METRICS_PORT=str(free_port()))
    pool = subprocess.Popen([sys.executable, "-m", "kite_ru_pool"], env=env)
    nc = await nats.connect(nats_srv.url)
    try:
        await wait_for_pool(nc)
        client = PoolClient(nc, worker_id="bench-worker", lookup_timeout_s=10.0)
        fp = hashlib.sha256(uuid.uuid4().bytes).hexdigest()
        chain = make_chain(fp, NUM_PREFIX + 2 * args.count, shape, TORCH_DTYPE_TO_CODEC["float32"])
        all_hashes = [h for h, _ in chain]
        prefix = all_hashes[:NUM_PREFIX]
        event_hashes = hash_chain(b"events" + fp.encode(), 8 * args.count)

        async def stored_at_least(n: int) -> None:
            while (r := await client.lookup(fp, all_hashes[:n])) is None or r.pool < n:
                await asyncio.sleep(0.01)

        for _, data in chain[:NUM_PREFIX]:
            await client.put(data)
        await stored_at_least(NUM_PREFIX)
        await client.block_stored(fp, prefix)
        await asyncio.sleep(1.0)
        idle = cpu_s(pool.pid)
        await asyncio.sleep(IDLE_S)
        idle_rate = (cpu_s(pool.pid) - idle) / IDLE_S
        print(f"ru-pool idle: {idle_rate * 1e3:.1f} ms of CPU a second; {args.count} messages of each kind; "
              f"unit {len(chain[0][1]):,} bytes")

        async def lookup(i: int) -> None:
            if await client.lookup(fp, prefix) is None:
                raise SystemExit("a lookup got no answer: the benchmark is invalid")

        async def nothing() -> None:
            pass

        async def put(i: int) -> None:
            await client.put(chain[NUM_PREFIX + i][1])
            if i % PUT_WINDOW == PUT_WINDOW - 1:
                # Workers publish puts and go on; so does this, but at most PUT_WINDOW ahead of the pool:
                # a subscriber further behind than its pending limits has messages dropped by NATS.
                await stored_at_least(NUM_PREFIX + i + 1 - PUT_WINDOW)

        async def puts_stored() -> None:
            await nc.flush()
            await stored_at_least(NUM_PREFIX + args.count)

        tiers = TierClient.from_config(load(TierConfig, environ={}, redis_url=redis_srv.url + "/0"), with_cold=False)
        await tiers.start()
        writer = DirectToWarm(client, tiers.warm, ru_key())
        first_direct = NUM_PREFIX + args.count

        async def direct(i: int) -> None:
            if not await writer.put(chain[first_direct + i][1]) or writer.num_put:
                raise SystemExit("a direct write went by a put: the benchmark is invalid")
            await writer.flush()  # one notice per unit: a request's one new block
            if i % PUT_WINDOW == PUT_WINDOW - 1:
                await stored_at_least(first_direct + i + 1 - PUT_WINDOW)

        async def directs_indexed() -> None:
            await nc.flush()
            await stored_at_least(first_direct + args.count)

        async def event(i: int) -> None:
            await client.block_stored(fp, event_hashes[8 * i:8 * i + 8])

        async def events_applied() -> None:
            await nc.flush()
            while (r := await client.lookup(fp, event_hashes)) is None or \
                    dict(r.workers).get("bench-worker", 0) < len(event_hashes):
                await asyncio.sleep(0.05)

        def profile(kind: str) -> Path | None:
            if args.profile is None:
                return None
            args.profile.mkdir(parents=True, exist_ok=True)
            return args.profile / f"{kind}.txt"

        results = {
            f"lookup ({NUM_PREFIX} blocks, with workers)":
                await measure(pool.pid, idle_rate, args.count, lookup, nothing, profile("lookup")),
            f"put ({len(chain[0][1]):,}-byte unit, written through)":
                await measure(pool.pid, idle_rate, args.count, put, puts_stored, profile("put")),
            "direct write (a notice of 1 unit written to Redis)":
                await measure(pool.pid, idle_rate, args.count, direct, directs_indexed, profile("direct")),
            "block event (8 hashes)":
                await measure(pool.pid, idle_rate, args.count, event, events_applied, profile("event")),
        }
        await tiers.close()
        print(f"{'message':<52} {'ru-pool us':>10} {'sender us':>10}")
        for kind, (us, sender_us) in results.items():
            print(f"{kind:<52} {us:>10.0f} {sender_us:>10.0f}")
    finally:
        await nc.close()
        pool.terminate()
        pool.wait(timeout=30)
        redis_srv.stop()
        nats_srv.stop()


if __name__ == "__main__":
    asyncio.run(main())
