"""What shadow verification costs a user: mean time to first token with KITE_SHADOW_FRACTION off, at the
default 1%, and at 100% (every hit re-checked: the worst case), side by side in one run (issue 16).

Starts one stack per fraction (one worker each, on --engine; they stay up for the whole run) and
sends each the same load: the `system-prompt` workload of `kite bench` (one shared system prompt, distinct
questions), streamed, at --concurrency. Rounds alternate which stack goes first, and every (round, stack)
gets a fresh cache salt, so each round computes its system prompt once and then hits it. Shadow checks run
only once a worker has had no request for KITE_SHADOW_IDLE_S, so what they can cost is the chunk
(KITE_SHADOW_CHUNK_TOKENS) a request arriving meanwhile waits behind. `--think-s` makes each user wait a
random time (exponential, that mean) before its next request, as people do: requests then arrive in the
middle of idle periods, where checks run, which is the case that costs. Concurrency 1 leaves the most idle
time for checks to fill.

Prints per fraction: requests, mean and p50 TTFT, the ratio of mean TTFT to the run without shadow (pooled
and per round), the shadow checks the worker ran and dropped (its /metrics), and whether every answer
equalled the run without shadow.

    .venv/bin/python bench/bench_shadow.py [--engine transformers|vllm] [--rounds 6] [--requests 16]
        [--concurrency 1] [--think-s 0] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import uuid

import httpx

from kite_cli.bench import workloads
from kite_cli.bench.runner import run_workload
from kite_cli.bench.systems import KiteSystem
from kite_cli.stack import LocalStack, StackOptions

FRACTIONS = {"off": "0", "1%": "0.01", "100%": "1.0"}
ENGINE_ENV = {
    "transformers": {"KITE_ENGINE": "transformers"},
    # Eager (no torch.compile): three vLLM workers start in minutes on two cores, not a quarter of an hour.
    "vllm": {"KITE_ENGINE": "vllm", "KITE_VLLM_ENFORCE_EAGER": "on", "KITE_VLLM_KV_CACHE_GIB": "0.5"},
}


def worker_counter(stack: LocalStack, name: str) -> float:
    """Sum of one counter's samples on the stack's worker /metrics."""
    [worker] = stack.workers()
    text = httpx.get(f"http://127.0.0.1:{worker.metrics_port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + " ", name + "{")))


def wait_until_checked(stack: LocalStack, timeout_s: float = 300.0) -> None:
    """Until the worker has no shadow check queued or running (its gauge, refreshed with its heartbeat)."""
    deadline = time.monotonic() + timeout_s
    time.sleep(1.5)  # one heartbeat: the gauge has seen the last request's check
    while worker_counter(stack, "kite_shadow_checks_waiting") > 0 and time.monotonic() < deadline:
        time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=sorted(ENGINE_ENV), default="transformers")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=16, help="requests per round and stack")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--shared-tokens", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--think-s", type=float, default=0.0, help="mean think time before each request")
    parser.add_argument("--json", default="", help="also write the figures here")
    args = parser.parse_args()

    stacks: dict[str, LocalStack] = {}
    try:
        for label, fraction in FRACTIONS.items():
            stack = LocalStack(StackOptions(num_workers=1, metrics=True, env={
                **ENGINE_ENV[args.engine], "KITE_SHADOW_FRACTION": fraction}))
            stack.start(timeout_s=400)
            stacks[label] = stack
        ttfts: dict[str, list[float]] = {label: [] for label in FRACTIONS}
        round_means: dict[str, list[float]] = {label: [] for label in FRACTIONS}
        answers: dict[str, list[str]] = {label: [] for label in FRACTIONS}
        failures = 0
        rng = random.Random(0)
        for r in range(args.rounds):
            workload = workloads.system_prompt(seed=r, requests=args.requests, shared_tokens=args.shared_tokens)
            order = list(FRACTIONS) if r % 2 == 0 else list(reversed(FRACTIONS))
            # The same think times for every stack in a round (TTFT counts from the request's send).
            pauses = [rng.expovariate(1 / args.think_s) if args.think_s else 0.0 for _ in range(args.requests)]
            for label in order:
                system = KiteSystem(stacks[label].http_url, reuse=True, salt=f"shadow-bench-{uuid.uuid4().hex}")

                def after_thinking(messages, max_tokens, system=system, pauses=iter(pauses)):
                    time.sleep(next(pauses, 0.0))
                    return system(messages, max_tokens)

                results, _ = run_workload(after_thinking, workload, args.concurrency, args.max_tokens)
                failures += sum(1 for res in results if res.error)
                # The first request of a round computes the system prompt: TTFT over the hits that follow.
                hits = [res for res in results if res.cached_tokens > 0 and res.ttft is not None]
                ttfts[label] += [res.ttft for res in hits]
                round_means[label].append(statistics.fmean(res.ttft for res in hits))
                answers[label] += [res.text for res in sorted(results, key=lambda res: res.request_id)]
                wait_until_checked(stacks[label])  # its checks would take the CPU from the next stack's round
        base_mean = statistics.fmean(ttfts["off"])
        figures = {}
        print(f"\nshadow verification on {args.engine}: {args.rounds} rounds x {args.requests} requests, concurrency "
              f"{args.concurrency}, think time {args.think_s} s, system prompt ~{args.shared_tokens} tokens, "
              f"{failures} failed requests")
        print(f"{'fraction':>9} {'hits':>5} {'mean TTFT':>10} {'p50 TTFT':>9} {'mean / off':>11} "
              f"{'per round (min-max)':>20} {'checks run':>11} {'dropped':>8} {'answers = off':>14}")
        for label in FRACTIONS:
            mean = statistics.fmean(ttfts[label])
            per_round = [m / o for m, o in zip(round_means[label], round_means["off"])]
            checks = worker_counter(stacks[label], "kite_shadow_checks_total")
            dropped = worker_counter(stacks[label], "kite_shadow_dropped_total")
            same = answers[label] == answers["off"]
            figures[label] = {"hits": len(ttfts[label]), "mean_ttft_s": mean,
                              "p50_ttft_s": statistics.median(ttfts[label]), "ratio": mean / base_mean,
                              "per_round": per_round, "checks": checks, "dropped": dropped, "same_answers": same}
            print(f"{label:>9} {len(ttfts[label]):>5} {mean * 1000:>8.1f}ms {statistics.median(ttfts[label]) * 1000:>7.1f}ms "
                  f"{mean / base_mean:>11.3f} {min(per_round):>9.3f}-{max(per_round):<10.3f} {checks:>11.0f} "
                  f"{dropped:>8.0f} {str(same):>14}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "figures": figures}, f, indent=2)
        return 0 if failures == 0 and all(f["same_answers"] for f in figures.values()) else 1
    finally:
        for stack in stacks.values():
            stack.stop()


if __name__ == "__main__":
    raise SystemExit(main())
