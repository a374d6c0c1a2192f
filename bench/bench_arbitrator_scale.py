"""Benchmark of the arbitrator's decision core and the worker's load plan at fleet size (issue 38): the
previous cores (tests/unit/reference_cores.py, a full rescan per evaluation and a quadratic plan) beside
the current ones, in one run, on the same seeded inputs. Pure CPU, no services.

    .venv/bin/python bench/bench_arbitrator_scale.py [--workers 100,1000,10000] [--seed 1]

Two telemetry patterns, the built-in rules (kite_arbitrator/default_rules.yaml), every worker reporting
once a second with its queue, backlog, running requests and hit rate changing and its memory pressure
rarely (so a few write-policy rules fire):
- per message: one telemetry message, then an evaluation (the service evaluates on telemetry); the
  figures are `evaluate` CPU time (this thread's) p50 / p99 and `observe` CPU time per message;
- per tick: every worker reports, then one evaluation (the simulator's pattern, cli/kite_cli/simulate).
Both cores get the same messages; their decisions are compared (they must be identical).
Then `CostModel.plan` on 64 / 512 / 4,096 missing blocks of mixed tiers, old and new.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.unit.reference_cores

from kite_arbitrator.core import ArbitratorCore  # noqa: E402
from kite_arbitrator.rules import load_rules  # noqa: E402
from kite_shared.messages import WorkerTelemetry  # noqa: E402
from kite_worker.pool_loader import CostModel  # noqa: E402
from tests.unit.reference_cores import ReferenceArbitratorCore, reference_plan  # noqa: E402


def telemetry(rng: random.Random, wid: str, now: float, memory: dict[str, float]) -> WorkerTelemetry:
    if rng.random() < 0.002:  # memory pressure moves rarely: a write-policy rule fires now and then
        memory[wid] = rng.choice([0.5, 0.6, 0.9, 0.97])
    queue = rng.choice([0, 0, 0, 1, 2, 4])
    return WorkerTelemetry(
        instance_id=wid, sent_at=now, queue_depth=queue, num_running=rng.randint(0, 4), max_running=4,
        running_tokens=rng.randint(0, 8000), prefill_backlog_tokens=queue * rng.randint(200, 1200),
        cache_bytes=rng.randint(0, 1 << 30), cache_capacity_bytes=1 << 30,
        memory_used_fraction=memory.setdefault(wid, 0.5), local_hit_rate=rng.random(),
        prompt_tokens_window=1000, prefill_tokens_per_s=2000.0, decode_tokens_per_s=40.0,
        ttft_p50_s=rng.random() * 0.3, ttft_p99_s=rng.random(), requests_accepted=rng.randint(0, 100))


# CPU time of this thread: on a shared machine wall time measures the neighbours as much as the core
clock = time.thread_time


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(core_cls, n: int, seed: int, steps: int, ticks: int) -> dict:
    rules, version = load_rules(None)
    core = core_cls(rules=rules, rules_version=version, min_hold_s=1.0, stale_s=3.0, started_at=0.0)
    core._nonce = "bench"  # the same decision ids in both cores, so their decisions compare
    rng = random.Random(seed)
    memory: dict[str, float] = {}
    ids = [f"w{i:05d}" for i in range(n)]
    for wid in ids:
        core.observe(telemetry(rng, wid, 0.0, memory), 0.0)
    gc.collect()
    started = clock()
    decisions = [core.evaluate(0.0)]
    first_s = clock() - started
    now, dt = 0.0, 1.0 / n  # every worker once a second
    evaluate_s, observe_s = [], []
    for i in range(steps):
        now += dt
        message = telemetry(rng, ids[i % n], now, memory)
        started = clock()
        core.observe(message, now)
        observed = clock()
        decisions.append(core.evaluate(now))
        evaluate_s.append(clock() - observed)
        observe_s.append(observed - started)
    tick_s = []
    for _ in range(ticks):
        now += 1.0
        for wid in ids:
            core.observe(telemetry(rng, wid, now, memory), now)
        started = clock()
        decisions.append(core.evaluate(now))
        tick_s.append(clock() - started)
    return {"first": first_s, "evaluate": evaluate_s, "observe": observe_s, "tick": tick_s,
            "decisions": decisions, "judged": getattr(core, "num_judged", None)}


def bench_plan(sizes: list[int], seed: int) -> list[tuple[int, float, float, bool]]:
    rng = random.Random(seed)
    cost = CostModel(block_size=32, block_bytes=368_640, prefill_seconds_per_token=1e-4)
    rows = []
    for size in sizes:
        letters = bytes(rng.choices(b"hwc", weights=(2, 1, 1), k=size))
        reps_old = max(1, 2000 // size)
        started = clock()
        for _ in range(reps_old):
            want = reference_plan(cost, letters)
        old_s = (clock() - started) / reps_old
        reps_new = max(3, 200_000 // size)
        started = clock()
        for _ in range(reps_new):
            got = cost.plan(letters)
        new_s = (clock() - started) / reps_new
        rows.append((size, old_s, new_s, got == want))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="100,1000,10000")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=2000, help="per-message evaluations of the new core")
    p.add_argument("--plan-blocks", default="64,512,4096")
    args = p.parse_args()
    print(f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}; built-in rules; CPU ms (thread time)")
    print(f"{'workers':>8} {'core':>4} | {'first eval':>10} | {'per message: eval p50':>21} {'p99':>7} "
          f"{'observe us/msg':>14} | {'per tick: eval p50':>18} {'p99':>7} | same decisions")
    for n in [int(x) for x in args.workers.split(",")]:
        # The old core rescans the fleet per evaluation: fewer samples at 10,000 workers keep this short.
        old_steps = max(20, min(args.steps, 200_000 // n))
        old = run(ReferenceArbitratorCore, n, args.seed, old_steps, ticks=3 if n >= 10_000 else 5)
        new = run(ArbitratorCore, n, args.seed, args.steps, ticks=3 if n >= 10_000 else 5)
        same = old["decisions"][:old_steps + 1] == new["decisions"][:old_steps + 1]
        for name, r in (("old", old), ("new", new)):
            print(f"{n:>8} {name:>4} | {1e3 * r['first']:>10.2f} | {1e3 * pct(r['evaluate'], 0.5):>21.3f} "
                  f"{1e3 * pct(r['evaluate'], 0.99):>7.3f} {1e6 * statistics.fmean(r['observe']):>14.1f} | "
                  f"{1e3 * pct(r['tick'], 0.5):>18.3f} {1e3 * pct(r['tick'], 0.99):>7.3f} | "
                  f"{'yes' if same else 'NO'}" + (f" ({len(r['evaluate'])} evaluations)" if name == "old" else
                                                  f" ({len(r['evaluate'])} evaluations, {r['judged']} judged)"))
        ratio = pct(old["evaluate"], 0.5) / pct(new["evaluate"], 0.5)
        print(f"{n:>8} per-message evaluate p50 old/new: {ratio:.0f}x; observe new/old: "
              f"{statistics.fmean(new['observe']) / statistics.fmean(old['observe']):.1f}x")
        if not same:
            sys.exit("the cores decided differently")
    print(f"\n{'plan blocks':>11} | {'old ms':>9} | {'new ms':>9} | ratio | same answer")
    for size, old_s, new_s, same in bench_plan([int(x) for x in args.plan_blocks.split(",")], args.seed):
        print(f"{size:>11} | {1e3 * old_s:>9.3f} | {1e3 * new_s:>9.3f} | {old_s / new_s:>4.0f}x | "
              f"{'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
