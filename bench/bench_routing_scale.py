"""CPU time of one first-turn routing decision as the fleet grows, the code before issue 38 beside today's.

A decision here is what the fingerprinter's router does for a request with no bound session (Router._choose
in kite_fingerprinter/router.py, minus NATS): the candidate list, the ru-pool's lookup with each worker's
prefix (`PoolReads.lookup(include_workers=True)` on a real `PoolCore` fed the workers' BlockStored events),
and `routing.choose`. Old: `tests/routing_oracles.py` (the code before issue 38, verbatim): a WorkerState
rebuilt per live worker, every worker's cache set probed, every candidate costed. New: `LiveWorkers.view()`,
the inverted index, only holders and the least-loaded non-holders costed. Both run on the same state, one
right after the other (in alternating order) for every decision, and must pick the same worker: the bench
counts the decisions where they agree and fails if one differs. CPU time is `time.thread_time()`.

The fleet (seeded): `--tenants` system prompts of 32 blocks, each held by `--prompt-holders` workers; each
worker also holds one document of 64 blocks after one tenant's prompt. A request is a tenant's prompt, a
document (one some worker holds with probability 0.7, else a new one) and 8 blocks of its own. Every worker
reports random loads by telemetry; between decisions, workers / 100 telemetry messages arrive (each worker
sends one a second, at 100 decisions a second), and the chosen worker gets the request (`LiveWorkers.sent`).
Those updates are timed apart: they are what the new code pays instead of rebuilding per decision.

    .venv/bin/python bench/bench_routing_scale.py [--workers 10,100,1000,10000] [--decisions 2000]
        [--prompt-holders 16] [--tenants 100] [--seed 0]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.routing_oracles

from kite_fingerprinter.router import LiveWorkers  # noqa: E402
from kite_ru_pool.core import PoolCore  # noqa: E402
from kite_shared.messages import WorkerTelemetry  # noqa: E402
from kite_shared.routing import RouteRequest, RoutingKnobs, choose  # noqa: E402
from kite_shared.tiers.keys import model_tag  # noqa: E402
from tests import routing_oracles as oracle  # noqa: E402

FP = "ab" * 32
BS = 16
PROMPT_BLOCKS, DOC_BLOCKS, OWN_BLOCKS = 32, 64, 8


def blocks(name: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{name}/{i}".encode()).digest() for i in range(n)]


def telemetry(rng: random.Random, worker_id: str, sent_at: float) -> WorkerTelemetry:
    running = rng.choice((0, 1, 1, 2, 3))
    return WorkerTelemetry(instance_id=worker_id, sent_at=sent_at, num_running=running,
                           queue_depth=rng.choice((0, 0, 0, 1, 2)), running_tokens=running * rng.randrange(200, 2000),
                           prefill_backlog_tokens=rng.choice((0, 0, 400)), pool_read=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def run(num_workers: int, num_decisions: int, prompt_holders: int, num_tenants: int, seed: int) -> dict:
    rng = random.Random(seed)
    core = PoolCore(1 << 20, archive_after_s=604800.0, warm_ttl_s=3600.0, cold_ttl_s=2592000.0,
                    sweep_interval_s=30.0, has_warm=True, has_cold=False)
    tag = model_tag(FP)
    ids = [f"worker-{i:05d}" for i in range(num_workers)]
    prompts = [blocks(f"tenant-{t}", PROMPT_BLOCKS) for t in range(num_tenants)]
    docs: list[tuple[int, list[bytes]]] = []  # (tenant, document blocks) some worker holds
    seq = dict.fromkeys(ids, 0)

    def store(worker_id: str, hashes: list[bytes]) -> None:
        seq[worker_id] += 1
        core.worker_events.stored(worker_id, FP, hashes, seq[worker_id], 0.0)

    for t, prompt in enumerate(prompts):
        for worker_id in rng.sample(ids, min(prompt_holders, num_workers)):
            store(worker_id, prompt)
    for n, worker_id in enumerate(ids):
        t = rng.randrange(num_tenants)
        doc = blocks(f"doc-{n}", DOC_BLOCKS)
        docs.append((t, doc))
        store(worker_id, prompts[t] + doc)
    live = LiveWorkers(timeout_s=5.0)
    for worker_id in ids:
        live.telemetry(telemetry(rng, worker_id, 1000.0), 0.0)
    knobs = RoutingKnobs()
    old_s, new_s, view_s, lookup_s, choose_s, update_s = [], [], [], [], [], []
    same = 0
    updates_per_decision = max(1, num_workers // 100)
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        for k in range(num_decisions):
            now = 0.01 * (k + 1)
            for _ in range(updates_per_decision):
                message = telemetry(rng, rng.choice(ids), 1000.0 + now)
                started = time.thread_time()
                live.telemetry(message, now)
                update_s.append(time.thread_time() - started)
            if rng.random() < 0.7:
                t, doc = rng.choice(docs)
            else:
                t, doc = rng.randrange(num_tenants), blocks(f"new-{k}", DOC_BLOCKS)
            chain = prompts[t] + doc + blocks(f"own-{k}", OWN_BLOCKS)
            prompt_tokens = len(chain) * BS + rng.randrange(BS)

            def new() -> str:
                t0 = time.thread_time()
                view = live.view(now)
                t1 = time.thread_time()
                reply = core.reads.lookup(FP, chain, include_workers=True)
                t2 = time.thread_time()
                choice = choose(view, RouteRequest(prompt_tokens, BS, local_blocks=dict(reply.workers),
                                                   pool_blocks=reply.pool), knobs)
                t3 = time.thread_time()
                new_s.append(t3 - t0)
                view_s.append(t1 - t0)
                lookup_s.append(t2 - t1)
                choose_s.append(t3 - t2)
                return choice.worker_id

            def old() -> str:
                t0 = time.thread_time()
                candidates = oracle.candidates(live, now)
                reply = core.reads.lookup(FP, chain, include_workers=False)
                local = oracle.prefix_lengths(core.workers.held, tag, chain)
                choice = oracle.choose(candidates, RouteRequest(prompt_tokens, BS, local_blocks=local,
                                                                pool_blocks=reply.pool), knobs)
                old_s.append(time.thread_time() - t0)
                return choice.worker_id

            if k % 2:
                picked_old, picked_new = old(), new()
            else:
                picked_new, picked_old = new(), old()
            same += picked_old == picked_new
            started = time.thread_time()
            live.sent(picked_new, prompt_tokens, 1000.0 + now)
            update_s.append(time.thread_time() - started)
    finally:
        gc.enable()
        gc.unfreeze()
    ms = 1e3
    return {"workers": num_workers, "decisions": num_decisions, "same": same,
            "old_p50": percentile(old_s, 0.5) * ms, "old_p99": percentile(old_s, 0.99) * ms,
            "new_p50": percentile(new_s, 0.5) * ms, "new_p99": percentile(new_s, 0.99) * ms,
            "view_p50": percentile(view_s, 0.5) * ms, "lookup_p50": percentile(lookup_s, 0.5) * ms,
            "choose_p50": percentile(choose_s, 0.5) * ms, "update_p50": percentile(update_s, 0.5) * ms,
            "update_mean": statistics.fmean(update_s) * ms}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", default="10,100,1000,10000")
    ap.add_argument("--decisions", type=int, default=2000, help="per fleet size (a tenth at 10,000+ workers)")
    ap.add_argument("--prompt-holders", type=int, default=16)
    ap.add_argument("--tenants", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"first-turn routing decision, CPU ms per decision (thread_time); load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; {args.prompt_holders} holders per tenant prompt")
    print(f"{'workers':>8} {'decisions':>9} {'old p50':>8} {'old p99':>8} {'new p50':>8} {'new p99':>8} "
          f"{'p50 x':>6} {'same':>6} | new p50: {'view':>6} {'lookup':>6} {'choose':>6} | update p50 / mean")
    failed = False
    for n in (int(x) for x in args.workers.split(",")):
        decisions = args.decisions if n < 10_000 else max(1, args.decisions // 10)
        r = run(n, decisions, args.prompt_holders, args.tenants, args.seed)
        failed |= r["same"] != r["decisions"]
        print(f"{r['workers']:>8,} {r['decisions']:>9,} {r['old_p50']:>8.3f} {r['old_p99']:>8.3f} "
              f"{r['new_p50']:>8.3f} {r['new_p99']:>8.3f} {r['old_p50'] / max(r['new_p50'], 1e-9):>6.1f} "
              f"{r['same']:>6} | {'':>9}{r['view_p50']:>6.3f} {r['lookup_p50']:>6.3f} {r['choose_p50']:>6.3f} "
              f"| {r['update_p50']:.4f} / {r['update_mean']:.4f}", flush=True)
    if failed:
        print("old and new decided differently", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
