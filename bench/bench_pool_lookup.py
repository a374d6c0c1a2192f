"""Benchmark of the ru-pool's lookups: latency under a steady request rate, against a bare NATS echo.
(Block bytes per tier, the data plane, are bench_data_plane.py's.)

Starts its own nats-server and redis-server on free ports, and the ru-pool as a real process
(`python -m kite_ru_pool`). Blocks have SmolLM2-135M's geometry (30 layers, 3 KV heads, head dim 64, 16
tokens, fp16: 368,640 payload bytes).

    .venv/bin/python bench/bench_pool_lookup.py [--rate 1000] [--seconds 5] [--chain 128]
        [--client-gc freeze|default] [--index-blocks N] [--sweep-interval S]
    .venv/bin/python bench/bench_pool_lookup.py --replicas 2 [--rate 1000] [--seconds 30] [--chain 128]

Lookup latency is reported from send and from the scheduled send time, with this client's own loop lag
and full GC passes, and the pool's loop lag (kite_pool_event_loop_lag_seconds) over the runs
(docs/ru-pool.md, "The stalls (issue 4)").

`--replicas N` (N >= 2) measures ru-pool replicas instead (docs/ru-pool.md, "Replicas"): one nats-server,
one Redis, a cold folder; a bare NATS echo, then lookups through the `ru-pool` queue group with one
replica, then with N (the others started in between, each with its own instance id and metrics port),
then the echo again, each run `--seconds` long at `--rate`. It prints, side by side, each run's p50/p99,
the pool's added latency over the echo (the mean of the two echo runs), and the lookups each replica
answered per second (its own `stats`, asked on its own subject). `--paired` adds one run, with the N
replicas, of lookups and echo requests interleaved (each at `--rate`), so that both see the same moments
of the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import nats

from kite_shared.security import ru_key

from kite_cli.local_servers import free_port, start_nats, start_redis
from kite_shared import kv_codec, subjects
from kite_shared.messages import PoolAdminReply, PoolAdminRequest, PoolLookupReply, PoolLookupRequest
from kite_shared.recyclable_unit import RecyclableUnit
from kite_shared.tiers.keys import BlockKey, redis_key
from kite_shared.tiers.pool_client import PoolClient

SHAPE = (30, 2, 3, 16, 64)
PAYLOAD = 30 * 2 * 3 * 16 * 64 * 2


def make_chain(fp: str, n: int, shape: tuple[int, ...] = SHAPE, codec: str = "fp16") -> list[tuple[bytes, bytes]]:
    """`n` chained units of `shape` ([layers, 2, kv heads, tokens, head dim]) in a lossless `codec`."""
    out, parent = [], hashlib.sha256(fp.encode()).digest()
    payload = os.urandom(kv_codec.payload_bytes(codec, shape))
    for i in range(n):
        h = hashlib.sha256(parent + i.to_bytes(4, "big")).digest()
        unit = RecyclableUnit(block_hash=h, parent_hash=parent, model_fingerprint=fp, block_index=i,
                              num_tokens=shape[3], codec=codec, shape=shape, payload=payload)
        out.append((h, unit.encode(key=ru_key())))  # the pool refuses units without the cluster HMAC
        parent = h
    return out


async def wait_for_pool(nc, timeout_s: float = 60.0) -> None:
    """Until an ru-pool answers on the queue group (a process just started)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await nc.request(subjects.POOL_ADMIN, PoolAdminRequest(op="stats").encode(), timeout=0.5)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no ru-pool answered within {timeout_s} s") from None
            await asyncio.sleep(0.1)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


ECHO = """
import asyncio, sys, nats
async def main():
    nc = await nats.connect(sys.argv[1])
    reply = bytes(64)
    async def cb(msg):
        await msg.respond(reply)
    await nc.subscribe("bench.echo", cb=cb)
    await asyncio.Event().wait()
asyncio.run(main())
"""


class LoopWatch:
    """This process's own stalls while a run lasts: a 1 ms timer's lateness (event-loop lag) and the
    full (generation 2) GC passes, which hold the loop like any other synchronous work."""

    def __init__(self) -> None:
        self.lag: list[float] = []
        self.gen2: list[float] = []
        self._gc_started = 0.0
        self._task: asyncio.Task | None = None

    def _on_gc(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gen2.append(time.perf_counter() - self._gc_started)

    async def _probe(self) -> None:
        while True:
            due = time.perf_counter() + 0.001
            await asyncio.sleep(0.001)
            self.lag.append(max(0.0, time.perf_counter() - due))

    def __enter__(self) -> "LoopWatch":
        gc.callbacks.append(self._on_gc)
        self._task = asyncio.create_task(self._probe())
        return self

    def __exit__(self, *exc) -> None:
        self._task.cancel()
        gc.callbacks.remove(self._on_gc)

    def summary(self) -> str:
        gen2 = f"max {max(self.gen2) * 1e3:.1f} ms" if self.gen2 else "none"
        return (f"client loop lag p99={pct(self.lag, 0.99) * 1e3:.3f} ms max={max(self.lag) * 1e3:.3f} ms, "
                f"full GCs {len(self.gen2)} ({gen2})")


async def bench_lookup(client: PoolClient, fp: str, hashes: list[bytes], rate: float, seconds: float,
                       echo: bool = False) -> None:
    """Open-loop lookups; with echo=True the same request goes to a do-nothing responder process
    instead, which is the floor this machine's NATS + Python client put under any answer.

    Latency is reported twice: from the moment a request was sent, and from the moment it was due by
    the schedule; the second also counts the time a stalled client held a request back (coordinated
    omission), so a client-side stall cannot hide. Finished requests are not kept (thousands of live
    tasks would make the client's own full GC passes long and frequent)."""
    sent: list[float] = []
    due_lat: list[float] = []
    errors = 0
    from kite_shared.messages import PoolLookupRequest
    payload = PoolLookupRequest(model_fingerprint=fp, block_hashes=hashes).encode()

    async def one(due: float) -> None:
        nonlocal errors
        started = time.perf_counter()
        if echo:
            try:
                await client.nc.request("bench.echo", payload, timeout=1.0)
            except Exception:
                errors += 1
                return
        else:
            r = await client.lookup(fp, hashes, timeout_s=1.0)
            if r is None or r.pool != len(hashes):
                errors += 1
                return
        done = time.perf_counter()
        sent.append(done - started)
        due_lat.append(done - due)

    pending: set[asyncio.Task] = set()
    n = int(rate * seconds)
    t0 = time.perf_counter()
    with LoopWatch() as watch:
        for i in range(n):  # open loop: requests leave on schedule whether or not earlier ones returned
            due = t0 + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(due))
            pending.add(task)
            task.add_done_callback(pending.discard)
        while pending:
            await asyncio.gather(*list(pending))
    elapsed = time.perf_counter() - t0
    label = "echo  " if echo else "lookup"
    print(f"{label}  chain={len(hashes)} blocks  offered {rate:.0f}/s  achieved {n / elapsed:.0f}/s  "
          f"n={len(sent)} errors={errors}  p50={pct(sent, 0.5) * 1e3:.3f} ms  "
          f"p99={pct(sent, 0.99) * 1e3:.3f} ms  max={max(sent) * 1e3:.3f} ms")
    print(f"        from schedule: p50={pct(due_lat, 0.5) * 1e3:.3f} ms  p99={pct(due_lat, 0.99) * 1e3:.3f} ms  "
          f"max={max(due_lat) * 1e3:.3f} ms;  {watch.summary()}")
    return {"p50": pct(sent, 0.5), "p99": pct(sent, 0.99), "n": len(sent), "errors": errors,
            "elapsed": elapsed}


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--chain", type=int, default=128)
    ap.add_argument("--client-gc", choices=("freeze", "default"), default="freeze",
                    help="freeze (default): collect, then gc.freeze() this client's setup objects before "
                         "the lookup runs, so its own full GC passes stay short; default: leave the GC "
                         "as it is (as earlier runs of this bench did)")
    ap.add_argument("--index-blocks", type=int, default=0,
                    help="also index this many more warm blocks (small stand-ins written straight to "
                         "Redis before the pool starts; its rebuild lists them), so the pool's sweeps and "
                         "stats walk an index of realistic size")
    ap.add_argument("--sweep-interval", type=float, default=None,
                    help="KITE_POOL_SWEEP_INTERVAL_S for the pool (default: the pool's own, 30 s)")
    ap.add_argument("--replicas", type=int, default=1,
                    help="N >= 2: compare lookups through one ru-pool replica and through N (module docstring)")
    ap.add_argument("--paired", action="store_true",
                    help="with --replicas: also one run of lookups and echoes interleaved (bench_paired)")
    args = ap.parse_args()
    if args.replicas >= 2:
        await compare_replicas(args)
        return

    nats_srv = start_nats()
    redis_srv = start_redis()
    metrics_port = free_port()
    fp_a = hashlib.sha256(uuid.uuid4().bytes).hexdigest()
    n = args.chain
    chain_a = make_chain(fp_a, n)
    unit_bytes = len(chain_a[0][1])
    print(f"unit {unit_bytes} bytes; nats max_payload 8 MiB; cpus {os.cpu_count()}")
    if args.index_blocks:
        seed_index(redis_srv.port, args.index_blocks)

    env = dict(os.environ, KITE_NATS_URL=nats_srv.url, KITE_REDIS_URL=redis_srv.url + "/0",
               KITE_S3_ENDPOINT="", KITE_COLD_DIR=tempfile.mkdtemp(prefix="kite-bench-cold-"),
               KITE_POOL_HOT_BYTES=str((n + 2) * unit_bytes), KITE_LOG_LEVEL="WARNING",
               KITE_METRICS_PORT=str(metrics_port))
    if args.sweep_interval is not None:
        env["KITE_POOL_SWEEP_INTERVAL_S"] = str(args.sweep_interval)
    pool = subprocess.Popen([sys.executable, "-m", "kite_ru_pool"], env=env)
    nc = await nats.connect(nats_srv.url)
    client = PoolClient(nc, lookup_timeout_s=1.0, get_timeout_s=10.0)
    try:
        while True:
            try:
                raw = await nc.request(subjects.POOL_ADMIN, PoolAdminRequest(op="stats").encode(), timeout=0.5)
                counters = PoolAdminReply.decode(raw.data).counters
                if counters["rebuilding"] == 0:
                    print(f"pool index: {counters['index_blocks']} blocks after its rebuild")
                    break
            except Exception:
                pass
            await asyncio.sleep(0.1)
        for _, d in chain_a:
            await client.put(d)
        await nc.flush()
        while (await client.lookup(fp_a, [h for h, _ in chain_a])).warm < n:
            await asyncio.sleep(0.05)

        hashes_a = [h for h, _ in chain_a]
        echo = subprocess.Popen([sys.executable, "-c", ECHO, nats_srv.url])
        await asyncio.sleep(1.0)
        if args.client_gc == "freeze":
            gc.collect()
            gc.freeze()
        lag_before = scrape_histogram(metrics_port, "kite_pool_event_loop_lag_seconds")[:2]
        await bench_lookup(client, fp_a, hashes_a, args.rate, 1.0)  # warm-up
        await bench_lookup(client, fp_a, hashes_a, args.rate, args.seconds)
        print_server_side(metrics_port, lag_before)
        await bench_lookup(client, fp_a, hashes_a, args.rate, args.seconds, echo=True)
        echo.terminate()
        echo.wait(5)
    finally:
        await nc.close()
        pool.send_signal(signal.SIGTERM)
        pool.wait(15)
        redis_srv.stop()
        nats_srv.stop()


async def bench_paired(client: PoolClient, fp: str, hashes: list[bytes], rate: float, seconds: float) -> dict:
    """Lookups at `rate`/s and, interleaved half an interval after each, the same request to the echo
    responder: both kinds of request see the same moments of the machine, so the difference of their
    p99s is not also the difference between two stretches of time (as lookup and echo runs one after
    the other are). The machine carries twice the requests of a plain run."""
    from kite_shared.messages import PoolLookupRequest
    payload = PoolLookupRequest(model_fingerprint=fp, block_hashes=hashes).encode()
    latencies: dict[str, list[float]] = {"lookup": [], "echo": []}
    errors = {"lookup": 0, "echo": 0}

    async def one(kind: str) -> None:
        started = time.perf_counter()
        try:
            if kind == "echo":
                await client.nc.request("bench.echo", payload, timeout=1.0)
            else:
                r = await client.lookup(fp, hashes, timeout_s=1.0)
                if r is None or r.pool != len(hashes):
                    raise RuntimeError("lookup failed")
        except Exception:
            errors[kind] += 1
            return
        latencies[kind].append(time.perf_counter() - started)

    pending: set[asyncio.Task] = set()
    t0 = time.perf_counter()
    for i in range(int(rate * seconds) * 2):
        delay = t0 + i / (2 * rate) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one("lookup" if i % 2 == 0 else "echo"))
        pending.add(task)
        task.add_done_callback(pending.discard)
    while pending:
        await asyncio.gather(*list(pending))
    out = {kind: {"p50": pct(v, 0.5), "p99": pct(v, 0.99), "n": len(v), "errors": errors[kind]}
           for kind, v in latencies.items()}
    print(f"paired  {rate:.0f} lookups/s + {rate:.0f} echoes/s interleaved, {seconds:.0f} s: "
          + ";  ".join(f"{k} n={r['n']} errors={r['errors']} p50={r['p50'] * 1e3:.3f} ms p99={r['p99'] * 1e3:.3f} ms"
                       for k, r in out.items()))
    return out


def start_replica(env: dict[str, str], name: str, metrics_port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kite_ru_pool"],
                            env=dict(env, KITE_INSTANCE_ID=name, KITE_METRICS_PORT=str(metrics_port)))


async def replica_counters(nc, name: str) -> dict[str, int]:
    raw = await nc.request(subjects.pool_replica(name, "admin"), PoolAdminRequest(op="stats").encode(), timeout=5)
    return PoolAdminReply.decode(raw.data).counters


async def wait_serving(nc, name: str, timeout_s: float = 60.0) -> None:
    """Until the replica has rebuilt its index and answers the queue group."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            c = await replica_counters(nc, name)
            if c.get("rebuilding") == 0 and c.get("serving") == 1:
                return
        except Exception:
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError(f"replica {name} not serving within {timeout_s} s")


async def compare_replicas(args) -> None:
    """One replica, then N, through the queue group, between two bare echo runs (module docstring)."""
    nats_srv = start_nats()
    redis_srv = start_redis()
    cold_dir = tempfile.mkdtemp(prefix="kite-bench-cold-")
    n = args.chain
    fp = hashlib.sha256(uuid.uuid4().bytes).hexdigest()
    chain = make_chain(fp, n)
    hashes = [h for h, _ in chain]
    unit_bytes = len(chain[0][1])
    env = dict(os.environ, KITE_NATS_URL=nats_srv.url, KITE_REDIS_URL=redis_srv.url + "/0", KITE_S3_ENDPOINT="",
               KITE_COLD_DIR=cold_dir, KITE_POOL_HOT_BYTES=str((n + 2) * unit_bytes), KITE_LOG_LEVEL="WARNING")
    names = [f"ru-pool-{i + 1}" for i in range(args.replicas)]
    ports = {name: free_port() for name in names}
    pools = [start_replica(env, names[0], ports[names[0]])]
    nc = await nats.connect(nats_srv.url)
    client = PoolClient(nc, lookup_timeout_s=1.0)
    echo = subprocess.Popen([sys.executable, "-c", ECHO, nats_srv.url])
    results: dict[str, dict] = {}
    per_replica: dict[str, dict[str, float]] = {}

    async def lookups(label: str, replicas: list[str]) -> None:
        await bench_lookup(client, fp, hashes, args.rate, 1.0)  # warm-up
        before = {r: (await replica_counters(nc, r))["lookups"] for r in replicas}
        results[label] = await bench_lookup(client, fp, hashes, args.rate, args.seconds)
        after = {r: (await replica_counters(nc, r))["lookups"] for r in replicas}
        per_replica[label] = {r: (after[r] - before[r]) / results[label]["elapsed"] for r in replicas}
        for r in replicas:
            print(f"        {r}: ", end="")
            print_server_side(ports[r])

    try:
        await wait_serving(nc, names[0])
        for _, data in chain:
            await client.put(data)
        await nc.flush()
        while (r := await client.lookup(fp, hashes)) is None or r.warm < n:
            await asyncio.sleep(0.05)
        if args.client_gc == "freeze":
            gc.collect()
            gc.freeze()
        print(f"{n}-block chain in warm; {args.rate:.0f} lookups/s for {args.seconds:.0f} s per run; "
              f"cpus {os.cpu_count()}")
        await bench_lookup(client, fp, hashes, args.rate, 1.0, echo=True)  # warm-up
        results["echo before"] = await bench_lookup(client, fp, hashes, args.rate, args.seconds, echo=True)
        await lookups("1 replica", names[:1])
        for name in names[1:]:
            pools.append(start_replica(env, name, ports[name]))
        for name in names[1:]:
            await wait_serving(nc, name)
        # Every replica indexed the chain (from its rebuild or the first one's index changes).
        for name in names:
            raw = await nc.request(subjects.pool_replica(name, "lookup"),
                                   PoolLookupRequest(model_fingerprint=fp, block_hashes=hashes).encode(), timeout=5)
            assert PoolLookupReply.decode(raw.data).pool == n, name
        await lookups(f"{args.replicas} replicas", names)
        results["echo after"] = await bench_lookup(client, fp, hashes, args.rate, args.seconds, echo=True)
        paired = await bench_paired(client, fp, hashes, args.rate, args.seconds) if args.paired else None

        echo_p50 = (results["echo before"]["p50"] + results["echo after"]["p50"]) / 2
        echo_p99 = (results["echo before"]["p99"] + results["echo after"]["p99"]) / 2
        print(f"\nside by side ({args.rate:.0f} lookups/s offered, {n} blocks each, {args.seconds:.0f} s per run; "
              f"pool's added latency = lookup - echo, echo = mean of the two echo runs: "
              f"p50 {echo_p50 * 1e3:.3f} ms, p99 {echo_p99 * 1e3:.3f} ms)")
        print(f"{'run':<14}{'p50 ms':>9}{'p99 ms':>9}{'added p50':>11}{'added p99':>11}{'errors':>8}  "
              "lookups/s per replica")
        for label, res in results.items():
            added = "" if label.startswith("echo") else \
                f"{(res['p50'] - echo_p50) * 1e3:>11.3f}{(res['p99'] - echo_p99) * 1e3:>11.3f}"
            shares = ", ".join(f"{r} {v:.0f}" for r, v in per_replica.get(label, {}).items())
            print(f"{label:<14}{res['p50'] * 1e3:>9.3f}{res['p99'] * 1e3:>9.3f}{added or ' ' * 22}"
                  f"{res['errors']:>8}  {shares}")
        if paired is not None:
            lk, ec = paired["lookup"], paired["echo"]
            print(f"paired, {args.replicas} replicas (lookups and echoes interleaved in one run): lookup p99 "
                  f"{lk['p99'] * 1e3:.3f} ms, echo p99 {ec['p99'] * 1e3:.3f} ms, added p99 "
                  f"{(lk['p99'] - ec['p99']) * 1e3:.3f} ms, added p50 {(lk['p50'] - ec['p50']) * 1e3:.3f} ms; "
                  f"errors {lk['errors']} + {ec['errors']}")
    finally:
        await nc.close()
        echo.terminate()
        echo.wait(5)
        for pool in pools:
            pool.send_signal(signal.SIGTERM)
        for pool in pools:
            pool.wait(15)
        redis_srv.stop()
        nats_srv.stop()


def scrape_histogram(port: int, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """(cumulative buckets as (upper bound, count), count, sum) of one histogram on the pool's /metrics."""
    import urllib.request
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    buckets, count, total = [], 0.0, 0.0
    for line in body.splitlines():
        if line.startswith(f"{name}_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
        elif line.startswith(f"{name}_count"):
            count = float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_sum"):
            total = float(line.rsplit(" ", 1)[1])
    return buckets, count, total


def print_server_side(port: int, lag_before=None) -> None:
    """Pool-side time per lookup (decode, index walk, encode, respond) from its histogram, and how late
    the pool's event loop ran during the lookup runs (kite_pool_event_loop_lag_seconds, when exported)."""
    buckets, count, total = scrape_histogram(port, "kite_pool_lookup_seconds")

    def upper(bs: list[tuple[float, float]], n: float, q: float) -> float:
        return next(le for le, c in bs if c >= q * n)
    print(f"server  lookups={count:.0f}  mean={total / count * 1e3:.3f} ms  "
          f"p50<={upper(buckets, count, 0.5) * 1e3:.3f} ms  p99<={upper(buckets, count, 0.99) * 1e3:.3f} ms "
          f"(histogram bucket bounds)")
    if lag_before is None:
        return
    buckets, count, _ = scrape_histogram(port, "kite_pool_event_loop_lag_seconds")
    if not buckets:
        print("server  (no kite_pool_event_loop_lag_seconds: this pool has no loop-lag probe)")
        return
    before = dict((le, c) for le, c in lag_before[0])
    diff = [(le, c - before.get(le, 0.0)) for le, c in buckets]
    n = count - lag_before[1]
    over = {ms: n - next(c for le, c in diff if le >= ms / 1e3) for ms in (2, 5, 10, 50)}
    worst = next(le for le, c in diff if c >= n)
    print(f"server  event-loop lag over the lookup runs: {n:.0f} probes (every 10 ms), "
          + ", ".join(f">{ms} ms: {k:.0f}" for ms, k in over.items())
          + f", max<={worst * 1e3:.0f} ms")


def seed_index(redis_port: int, count: int) -> None:
    """`count` stand-in warm blocks of another model (tiny values with the usual TTL): the pool indexes
    them at start and never reads them, so they only make its index bigger."""
    import redis
    fp = hashlib.sha256(b"bench index filler").hexdigest()
    r = redis.Redis(port=redis_port, db=0)
    for start in range(0, count, 10_000):
        pipe = r.pipeline(transaction=False)
        for i in range(start, min(count, start + 10_000)):
            pipe.set(redis_key(BlockKey.of(fp, hashlib.sha256(i.to_bytes(8, "big")).digest())), b"x" * 64,
                     ex=3600)
        pipe.execute()
    r.close()
    print(f"index: {count} more warm blocks seeded in Redis")


if __name__ == "__main__":
    asyncio.run(main())
