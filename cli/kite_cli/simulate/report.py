"""Figures of `kite simulate`: from the fleet's raw results to the printed table and the JSON report,
plus the measurements taken on a loaded pool core (memory walk, lifecycle sweep) and on the router's
and arbitrator's bookkeeping at fleet size."""

from __future__ import annotations

import gc
import os
import platform
import resource
import statistics
import sys
import time
import types
from typing import Any

from kite_cli.simulate.fleet import ModeResult
from kite_cli.simulate.sharding import ServiceCosts, plan as shard_plan


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * (len(ordered) - 1)))))]


def _ms(values: list[float]) -> dict[str, float]:
    return {"p50": round(percentile(values, 0.5) * 1e3, 4), "p99": round(percentile(values, 0.99) * 1e3, 4),
            "max": round(max(values, default=0.0) * 1e3, 4), "count": len(values)}


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --- memory of the pool core -----------------------------------------------------------------------
_LEAF_TYPES = frozenset((bytes, str, int, float, bool, type(None), complex))
_SKIP_TYPES = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


class SizeWalker:
    """Bytes of every object reachable from the roots walked (sys.getsizeof: an object's own memory,
    a container's table and the GC header included; children found by gc.get_referents), each object
    counted once over all walks. Types, modules, functions and instances of `skip` are neither counted
    nor followed.

    Counting each object once without remembering 10^8 ids: an object popped while the only reference
    to it in the whole process is its container's (getrefcount then says 3: the container, the walk's
    variable, getrefcount's argument) cannot be reached again, so only objects with more references are
    remembered. In a pool index those are the block hashes (shared by the index, the tenant ledger and
    the worker maps) and a few tags and small ints; entries, tuples and their scalars are not."""

    def __init__(self, skip: tuple[type, ...] = ()) -> None:
        self.skip = _SKIP_TYPES + tuple(skip)
        self.seen: set[int] = set()

    def walk(self, root: object) -> int:
        getsizeof, getrefcount, referents = sys.getsizeof, sys.getrefcount, gc.get_referents
        seen, skip, leaves = self.seen, self.skip, _LEAF_TYPES
        total = 0
        stack = [root]
        pop, extend = stack.pop, stack.extend
        while stack:
            obj = pop()
            if getrefcount(obj) > 3:
                i = id(obj)
                if i in seen:
                    continue
                seen.add(i)
            if type(obj) in leaves:
                total += getsizeof(obj)
            elif isinstance(obj, dict):  # get_referents skips a str-keyed dict's keys (not GC objects)
                total += getsizeof(obj)
                extend(obj.keys())
                extend(obj.values())
            elif not isinstance(obj, skip):
                total += getsizeof(obj)
                extend(referents(obj))
        return total


def pool_memory(core: Any, skip: tuple[type, ...] = ()) -> dict[str, Any]:
    """The pool core's memory by part (the index's block map, the tenant ledgers, then the core's other
    attributes; an object shared by two parts counts in the first walked) and per index block."""
    started = time.perf_counter()
    walker = SizeWalker(skip)
    parts: dict[str, int] = {}
    # The index's stores first: a block hash they share with the worker map counts there; then the
    # tenant ledgers apart from the rest of the index that holds them.
    index = getattr(core, "index", None)
    roots = [("index.stores", getattr(index, "stores", None)), ("tenants", getattr(core, "tenants", None))]
    roots += [(name, value) for name, value in vars(core).items() if name != "tenants"]
    for name, value in roots:
        if value is not None:
            parts[name] = walker.walk(value)
    total = sum(parts.values()) + sys.getsizeof(core) + sys.getsizeof(vars(core))
    num_blocks = core.index.num_blocks()
    return {
        "method": "sys.getsizeof walk of every object reachable from the PoolCore, each counted once "
                  "(the hot tier's unit payloads excluded: they are the stored data, not the index)",
        "total_bytes": total,
        "index_blocks": num_blocks,
        "bytes_per_block": round(total / num_blocks, 1) if num_blocks else 0.0,
        "parts_bytes": parts,
        "walk_seconds": round(time.perf_counter() - started, 2),
        "note": "in the service each worker-map hash is its own bytes object decoded from a BlockStored "
                "message (here the index's): about 65 bytes more per worker-map entry",
    }


def time_sweep(core: Any, now: float, slice_entries: int = 1000) -> dict[str, Any]:
    """One lifecycle sweep over the whole index, walked in the service's slices (SWEEP_STEP_ENTRIES):
    its total time and the longest slice (how long it holds the pool's event loop at once)."""
    slices: list[float] = []
    started = time.perf_counter()
    sweep = core.maintenance.begin_sweep(now, warm_up=True, cold_up=False)
    done = False
    while not done:
        t0 = time.perf_counter()
        done = sweep.step(slice_entries)
        slices.append(time.perf_counter() - t0)
    return {"seconds": round(time.perf_counter() - started, 3), "slices": len(slices),
            "slice_ms": _ms(slices), "actions": len(sweep.actions()), "slice_entries": slice_entries}


def time_router_bookkeeping(num_workers: int, repeats: int = 200) -> dict[str, Any]:
    """kite_fingerprinter/router.py's LiveWorkers at this fleet size: `view()`, which the router calls for
    every decision (it takes out workers gone silent; the states are kept as telemetry comes), and one
    telemetry message folded in (each worker sends one a second)."""
    from kite_fingerprinter.router import LiveWorkers
    from kite_shared.messages import WorkerTelemetry

    live = LiveWorkers(timeout_s=5.0)
    now = time.time()
    messages = [WorkerTelemetry(instance_id=f"worker-{i:04d}", sent_at=now, num_running=1, running_tokens=1000 + i % 7)
                for i in range(num_workers)]
    for t in messages:
        live.telemetry(t, 1.0)
    views, updates = [], []
    for k in range(repeats):
        t0 = time.perf_counter()
        live.view(1.5 + k * 1e-4)
        views.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        live.telemetry(messages[k % num_workers], 1.5 + k * 1e-4)
        updates.append(time.perf_counter() - t0)
    return {"candidates_ms": _ms(views), "telemetry_ms": _ms(updates)}


def summarize_mode(r: ModeResult, service_telemetry_interval_s: float = 1.0) -> dict[str, Any]:
    pb = max(1, r.prompt_blocks)
    busy_mean = statistics.fmean(r.busy_s) if r.busy_s else 0.0
    served_mean = statistics.fmean(r.served) if r.served else 0.0
    eval_p50 = percentile(r.evaluate_cpu_s, 0.5)
    core_s = r.pool_put_s + r.pool_event_s + r.pool_read_s + sum(r.lookup_s)
    num_ticks = max(1, len(r.evaluate_s))
    return {
        "mode": r.mode,
        "requests": r.num_requests,
        "served": r.num_served,
        "shed_by_admission": r.num_shed,
        "refused_queues_full": r.num_refused,
        "queue_group_fallbacks": r.num_queue_group,
        "hit_rate": {  # fractions of prompt blocks by where their KV came from
            "local": round(r.local_blocks / pb, 4),
            "pool_hot": round(r.hot_blocks / pb, 4),
            "pool_warm": round(r.warm_blocks / pb, 4),
            "computed": round(r.computed_blocks / pb, 4),
            "reused_tokens": round(1 - r.computed_tokens / max(1, r.prompt_tokens), 4),
        },
        "ttft_s": {"p50": round(percentile(r.ttft_s, 0.5), 3), "p99": round(percentile(r.ttft_s, 0.99), 3)},
        "queue_wait_s": {"p50": round(percentile(r.queue_wait_s, 0.5), 3),
                         "p99": round(percentile(r.queue_wait_s, 0.99), 3)},
        "routing": {
            "reasons": dict(r.reasons),
            "decision_ms": _ms(r.route_s),  # lookup (when made) + choose, wall time
            "decision_cpu_ms": _ms(r.route_cpu_s),  # ... CPU time of the simulator's thread
            # decisions with a pool lookup (a session's first turn, in cache_aware): the costly kind
            "lookup_decision_ms": _ms(r.full_route_s),
            "lookup_decision_cpu_ms": _ms(r.full_route_cpu_s),
            "lookup_ms": _ms(r.lookup_s),  # PoolCore's reads.lookup(include_workers=True)
            "choose_ms": _ms(r.choose_s),  # routing.choose over every candidate
        },
        "session_affinity": round(r.followups_same_worker / r.followups, 4) if r.followups else None,
        "load_imbalance": {
            "busy_max_over_mean": round(max(r.busy_s) / busy_mean, 3) if busy_mean else 0.0,
            "served_max_over_mean": round(max(r.served) / served_mean, 3) if served_mean else 0.0,
            "busy_cv": round(statistics.pstdev(r.busy_s) / busy_mean, 3) if busy_mean else 0.0,
            "max_queue_depth": r.max_queue,
        },
        "arbitrator": {
            "evaluations": len(r.evaluate_s),
            "evaluate_ms": _ms(r.evaluate_s),
            "evaluate_cpu_ms": _ms(r.evaluate_cpu_s),
            "telemetry_ms_per_tick": round(r.telemetry_s / num_ticks * 1e3, 3),
            # what evaluating on every telemetry message (each worker's, every second) would cost; the
            # service folds messages into the evaluation already scheduled instead
            "per_message_trigger_cpu_s_per_s": round(eval_p50 * len(r.busy_s) / service_telemetry_interval_s, 2),
            "decisions": dict(r.decisions),
            "admission_closed_s": round(r.shed_s, 1),
        },
        "pool": {"index_blocks": r.pool_blocks, "hot_blocks": r.pool_hot_blocks,
                 "put_us": round(r.pool_put_s / max(1, r.pool_puts) * 1e6, 2), "puts": r.pool_puts,
                 "event_us_per_hash": round(r.pool_event_s / max(1, r.pool_event_hashes) * 1e6, 3),
                 "worker_lookup_us": round(r.pool_read_s / max(1, r.pool_reads) * 1e6, 1),
                 # the pool core's busy time over the simulated time (its NATS handling, decode and encode
                 # not counted), and over the time the requests take at the trace's arrival rate: one pool
                 # process's load at this fleet's rate (the simulated end trails off for minutes)
                 "core_busy_fraction": round(core_s / max(1e-9, r.sim_end_s), 4),
                 "core_busy_at_rate": round(core_s * r.arrival_rate / max(1, r.num_requests), 4),
                 "worker_map_entries": r.pool_worker_entries,
                 "counters": {k: v for k, v in r.pool_counters.items() if v}},
        "simulated_s": round(r.sim_end_s, 1),
        "wall_s": round(r.wall_s, 1),
        "requests_per_wall_s": round(r.num_requests / r.wall_s, 1) if r.wall_s else 0.0,
    }


def sharding(r: ModeResult, rate: float, costs: ServiceCosts, target_busy: float,
             rate_scales: tuple[float, ...]) -> dict[str, list[dict[str, Any]]]:
    """The pool work of this run at the trace's arrival `rate` times each scale: how many index shards it
    needs, placed by each key kind (sharding.py)."""
    return {kind: [shard_plan(loads, r.num_requests / rate, costs, target_busy, scale) for scale in rate_scales]
            for kind, loads in r.loads.items()}


def machine() -> dict[str, Any]:
    return {"python": platform.python_version(), "cpus": os.cpu_count(),
            "load_average_1m": round(os.getloadavg()[0], 2), "platform": platform.platform()}


def _format_sharding(kind: str, sh: dict[str, Any]) -> str:
    c, hot = sh["costs_us"], sh["hottest_key"] or {}
    last = sh["by_shards"][-1] if sh["by_shards"] else {}
    if sh["shards_needed"]:
        lookups, messages = last.get("busiest_lookups_per_s", 0), last.get("busiest_messages_per_s", 0)
        needed = (f"shards needed to keep the busiest under {_pct(sh['target_busy'])}: {sh['shards_needed']} "
                  f"(it takes {lookups:,.0f} lookups/s, {messages:,.0f} messages/s)")
    else:
        needed = (f"no shard count keeps the busiest under {_pct(sh['target_busy'])}: the hottest key alone needs "
                  f"{hot.get('busy', 0):.2f} CPU-s/s, {hot.get('write_busy', 0):.2f} of it writes; "
                  + (f"its shard needs {hot['replicas_needed']} replicas for its reads" if hot.get("replicas_needed")
                     else "its writes alone exceed that: the key must be finer"))
    return (f"  pool index by {kind} at {sh['rate_scale']:g}x this rate ({sh['num_keys']:,} keys; service CPU per "
            f"lookup {c['lookup_us']:.0f} us, put {c['put_us']:.0f} us, event {c['event_us']:.0f} us): "
            f"{sh['messages_per_s']:,.0f} messages/s, {sh['busy_one_process']:.2f} CPU-s/s in all "
            f"(core alone {sh['core_only_busy']:.3f}); {needed}")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def format_report(report: dict[str, Any]) -> str:
    """The human-readable report (the JSON has every figure)."""
    t = report["trace"]
    lines = [
        f"kite simulate: {report['fleet']['num_workers']:,} workers, {t['distinct_blocks']:,} distinct blocks "
        f"({t['requests']:,} requests in {t['sessions']:,} sessions of {t['tenants']} tenants, "
        f"{t['rate_per_s']:.1f} req/s, mean prompt {t['mean_prompt_tokens']:,.0f} tokens)",
        f"trace: generated in {t['generate_s']:.1f} s; fingerprint chains {t['hash_us_per_block']:.2f} us/block",
    ]
    for run in report["runs"]:
        lines.append("")
        lines.append(f"== {run['title']}")
        header = (f"{'mode':<13} {'local':>7} {'pool':>7} {'computed':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
                  f"{'route p50':>10} {'route p99':>10} {'busy max/mean':>13} {'sticky':>7} {'shed':>6} "
                  f"{'wall s':>7}")
        lines.append(header)
        for m in run["modes"]:
            h, rt = m["hit_rate"], m["routing"]["decision_ms"]
            sticky = "-" if m["session_affinity"] is None else _pct(m["session_affinity"])
            lines.append(
                f"{m['mode']:<13} {_pct(h['local']):>7} {_pct(h['pool_hot'] + h['pool_warm']):>7} "
                f"{_pct(h['computed']):>8} {m['ttft_s']['p50']:>8.2f}s {m['ttft_s']['p99']:>8.2f}s "
                f"{rt['p50']:>8.3f}ms {rt['p99']:>8.3f}ms {m['load_imbalance']['busy_max_over_mean']:>13.2f} "
                f"{sticky:>7} {m['shed_by_admission'] + m['refused_queues_full']:>6} {m['wall_s']:>7.1f}")
        for m in run["modes"]:
            if m["mode"] == "cache_aware":
                r = m["routing"]
                full = r["lookup_decision_ms"]
                lines.append(f"  cache_aware: decisions {r['reasons']}; with a pool lookup: p50 {full['p50']:.3f} ms "
                             f"p99 {full['p99']:.3f} ms (CPU p50 {r['lookup_decision_cpu_ms']['p50']:.3f} ms p99 "
                             f"{r['lookup_decision_cpu_ms']['p99']:.3f} ms), of which lookup p50 "
                             f"{r['lookup_ms']['p50']:.3f} ms; every decision: CPU p50 "
                             f"{r['decision_cpu_ms']['p50']:.3f} ms p99 {r['decision_cpu_ms']['p99']:.3f} ms")
                a = m["arbitrator"]
                lines.append(f"  arbitrator: {a['evaluations']} evaluations, CPU p50 "
                             f"{a['evaluate_cpu_ms']['p50']:.1f} ms p99 {a['evaluate_cpu_ms']['p99']:.1f} ms (one per "
                             f"telemetry message, every worker's each second, would need "
                             f"{a['per_message_trigger_cpu_s_per_s']:.1f} CPU-s/s); decisions {a['decisions']}")
                p = m["pool"]
                lines.append(f"  pool core: put {p['put_us']:.1f} us, worker event {p['event_us_per_hash']:.2f} us "
                             f"per hash, worker lookup {p['worker_lookup_us']:.0f} us; busy "
                             f"{_pct(p['core_busy_fraction'])} of the simulated time, "
                             f"{_pct(p['core_busy_at_rate'])} at the trace's arrival rate")
                for kind, plans in m["pool_sharding"].items():
                    lines.extend(_format_sharding(kind, sh) for sh in plans)
    mem = report.get("pool_memory")
    if mem:
        lines.append("")
        lines.append(f"pool index memory: {mem['bytes_per_block']:.0f} bytes per block "
                     f"({mem['total_bytes'] / 2**30:.2f} GiB for {mem['index_blocks']:,} blocks; {mem['method']}; "
                     f"walk {mem['walk_seconds']} s)")
        lines.append("  by part: " + ", ".join(f"{k} {v / 2**20:,.0f} MiB" for k, v in mem["parts_bytes"].items()
                                                if v >= 2**20))
    sweep = report.get("pool_sweep")
    if sweep:
        lines.append(f"pool lifecycle sweep: {sweep['seconds']} s over the index in {sweep['slices']:,} slices of "
                     f"{sweep['slice_entries']}; slice p50 {sweep['slice_ms']['p50']:.2f} ms, "
                     f"longest {sweep['slice_ms']['max']:.1f} ms")
    glue = report.get("router_bookkeeping")
    if glue:
        lines.append(f"router bookkeeping (LiveWorkers at {report['fleet']['num_workers']:,} workers): view() "
                     f"p50 {glue['candidates_ms']['p50']:.3f} ms per decision, on top of the routing above; "
                     f"a telemetry message p50 {glue['telemetry_ms']['p50']:.3f} ms")
    lines.append("")
    lines.append(f"simulator: {report['wall_s']:.0f} s wall, peak RSS {report['peak_rss_bytes'] / 2**30:.2f} GiB, "
                 f"load average {report['machine']['load_average_1m']} on {report['machine']['cpus']} CPUs")
    return "\n".join(lines)
