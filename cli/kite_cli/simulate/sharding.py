"""How many ru-pool index shards a simulated fleet needs, under two placement keys. Pure.

Placement (docs/architecture.md, "Sharding the pool index"): shard = crc32(key) mod N, with key
- `tenant`: the tenant's tag. A tenant's chains all start from its own salt, so every message about one
  request (the router's lookup, the worker's lookup, its puts, its cache events) goes to one shard. But a
  tenant is as hot as its traffic, and tenants are Zipf-popular;
- `segment`: the hash of the first block of the chain's segment of `segment_blocks` blocks (block d is
  placed by chain[d - d % segment_blocks]). A segment's blocks stay together, so a lookup asks one shard
  per segment it spans, all at once (the router and the worker have every hash of the prompt), and
  takes the longest prefix from the answers in order; a tenant's documents and conversations spread
  over the shards. A block removed from a worker's cache is charged by the first two bytes of its hash
  (the simulator does not track which segment an evicted block was in; its hash spreads the same way).
Inside a shard, replicas split the reads (lookups), and every replica applies every write (puts and cache
events reach the others as index changes), so replicas add read capacity, not write capacity.

Inputs (`LoadLedger`, one per key kind, filled by fleet.FleetSim): the pool's core time and its messages
over the trace's requests, each charged to a key, as if they came at the trace's arrival rate (the window
is requests / rate: the simulated end also holds the last sessions' later turns, straggling in for
minutes at a fraction of the rate). A removal event goes to the tenant of the request whose store
evicted the block, which is not always the block's tenant: the per-tenant split is that approximate, the
totals are exact. Each message also costs the service what its core's time leaves out (NATS receive,
decode, the unit's bytes, Redis, the reply: `ServiceCosts`, measured by bench/bench_pool_messages.py):
most of a real replica's CPU.

The rates can be scaled (`rate_scale`): a fleet whose prefill is 100x faster (GPUs) serves 100x the
requests, each with about the same pool work, if its caches hold what they hold at this speed (they turn
over faster, so this is a floor on the pool's work). Simulating that fleet directly would need its
sessions' later turns, 30 s of thinking apart, within the run: some 10^7 requests.

Output: each shard's busy fraction (CPU seconds per second) with one replica for N = 1, 2, 4, ... and the
least N whose busiest shard stays under `target_busy` (by bisection between the last two powers of two:
hashing makes the busiest shard's load only roughly fall as N grows). When the hottest key alone exceeds
the target, no N does (`shards_needed` None): its reads can go to replicas (`replicas_needed`) while its
writes fit one process; beyond that the key must be finer.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass
from typing import Any, Mapping

KEY_KINDS = ("tenant", "segment")


@dataclass(frozen=True)
class ServiceCosts:
    """The pool service's CPU per message beyond its core's work (receive, decode, tiers, reply), in
    microseconds; bench/bench_pool_messages.py measures them."""

    lookup_us: float  # a lookup (the router's or a worker's) or a get
    put_us: float  # a put: one unit's bytes received, verified, stored hot and written through to warm
    event_us: float  # a worker's BlockStored / BlockRemoved


@dataclass(slots=True)
class KeyLoad:
    """The pool work placed by one key over a run."""

    read_s: float = 0.0  # core seconds on lookups and hot reads
    write_s: float = 0.0  # core seconds on puts and cache events
    num_lookups: int = 0  # lookups and gets
    num_puts: int = 0
    num_events: int = 0

    def busy_s(self, costs: ServiceCosts) -> tuple[float, float]:
        """(read, write) CPU seconds including each message's service cost."""
        return (self.read_s + self.num_lookups * costs.lookup_us * 1e-6,
                self.write_s + (self.num_puts * costs.put_us + self.num_events * costs.event_us) * 1e-6)

    @property
    def num_messages(self) -> int:
        return self.num_lookups + self.num_puts + self.num_events


class LoadLedger(dict):
    """key (bytes) -> KeyLoad, created on first charge."""

    def __missing__(self, key: bytes) -> KeyLoad:
        load = self[key] = KeyLoad()
        return load

    def read(self, key: bytes, seconds: float, num_messages: int = 1) -> None:
        load = self[key]
        load.read_s += seconds
        load.num_lookups += num_messages

    def put(self, key: bytes, seconds: float) -> None:
        load = self[key]
        load.write_s += seconds
        load.num_puts += 1

    def event(self, key: bytes, seconds: float) -> None:
        load = self[key]
        load.write_s += seconds
        load.num_events += 1

    def totals(self) -> KeyLoad:
        out = KeyLoad()
        for load in self.values():
            out.read_s += load.read_s
            out.write_s += load.write_s
            out.num_lookups += load.num_lookups
            out.num_puts += load.num_puts
            out.num_events += load.num_events
        return out


def shard_of(key: bytes, num_shards: int) -> int:
    return zlib.crc32(key) % num_shards


def plan(loads: Mapping[bytes, KeyLoad], window_s: float, costs: ServiceCosts, target_busy: float = 0.5,
         rate_scale: float = 1.0, max_shards: int = 1 << 16) -> dict[str, Any]:
    """Busy fractions per shard count, the shards needed, and the per-shard message rates there, for the
    run's work done in `window_s`, arriving `rate_scale` times as fast (in 1 / rate_scale of the time)."""
    per_s = rate_scale / max(1e-9, window_s)
    keys = list(loads)
    busy = [loads[k].busy_s(costs) for k in keys]
    work = [(r + w) * per_s for r, w in busy]
    messages = [loads[k].num_messages * per_s for k in keys]
    lookups = [loads[k].num_lookups * per_s for k in keys]
    total = sum(work)
    hottest = max(range(len(keys)), key=work.__getitem__) if keys else -1
    out: dict[str, Any] = {
        "rate_scale": rate_scale, "costs_us": dataclasses.asdict(costs), "target_busy": target_busy,
        "num_keys": len(keys),
        "busy_one_process": round(total, 4),  # CPU seconds per second the whole index needs
        "core_only_busy": round(sum(loads[k].read_s + loads[k].write_s for k in keys) * per_s, 4),
        "messages_per_s": round(sum(messages), 1),
        "hottest_key": None, "by_shards": [], "shards_needed": None,
    }
    if not keys:
        return out
    read_hot, write_hot = busy[hottest][0] * per_s, busy[hottest][1] * per_s
    out["hottest_key"] = {"busy": round(work[hottest], 4), "write_busy": round(write_hot, 4),
                          "share": round(work[hottest] / total, 4) if total else 0.0}

    def busiest(n: int) -> dict[str, Any]:
        shard_work, shard_messages, shard_lookups = [0.0] * n, [0.0] * n, [0.0] * n
        for i, k in enumerate(keys):
            s = shard_of(k, n)
            shard_work[s] += work[i]
            shard_messages[s] += messages[i]
            shard_lookups[s] += lookups[i]
        b = max(range(n), key=shard_work.__getitem__)
        return {"shards": n, "max_busy": round(shard_work[b], 4), "mean_busy": round(total / n, 4),
                "busiest_messages_per_s": round(shard_messages[b], 1),
                "busiest_lookups_per_s": round(shard_lookups[b], 1), "fits": shard_work[b] <= target_busy}

    if work[hottest] > target_busy:
        # no shard count helps: show how far sharding gets, then what the hottest key's shard needs
        n = 1
        while n <= min(max_shards, 2 * len(keys)):
            out["by_shards"].append(busiest(n))
            n *= 2
        out["hottest_key"]["replicas_needed"] = (math.ceil(read_hot / (target_busy - write_hot))
                                                 if write_hot < target_busy else None)
        return out
    n = 1
    while True:
        row = busiest(n)
        out["by_shards"].append(row)
        if row["fits"] or n >= max_shards:
            break
        n *= 2
    if not row["fits"]:
        return out
    lo, hi, best = n // 2, n, row  # lo does not fit (or is 0), hi does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        candidate = busiest(mid)
        if candidate["fits"]:
            hi, best = mid, candidate
        else:
            lo = mid
    if best["shards"] != n:
        out["by_shards"].append(best)
    out["shards_needed"] = best["shards"]
    return out
