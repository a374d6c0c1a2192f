"""Round-robin vs cache-aware routing on one stack: hit rate and TTFT for concurrent multi-turn chats.

Starts a stack with 2 workers (unless --url/--nats are given), then runs the same workload twice: first
with the router in round_robin mode, then in cache_aware mode (switched at run time through the
arbitrator's admin subject, `kite.v1.arbitrator.admin` op=set_routing_mode; each phase uses fresh
conversations so the first phase's cache does not help the second). The workload: `--sessions`
concurrent chats (8), each `--turns` turns (4) with its own ~300-token system prompt; every turn resends
the whole conversation, as chat clients do. Hit rate = cached / prompt tokens over turns 2.. (turn 1 of a
conversation has nothing to reuse); TTFT is measured by the client over streamed responses, all turns.

By default workers do not read blocks from the ru-pool (KITE_WORKER_POOL_READ=off), so a hit means the
request reached a worker whose local cache holds its prefix, which is what routing decides; pass
--pool-read to measure with pool loading on (round robin then recovers part of the gap by fetching).

    .venv/bin/python bench/bench_routing.py [--sessions 8] [--turns 4] [--pool-read]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

from kite_cli.arbitrator_admin import admin_request
from kite_cli.stack import LocalStack, StackOptions

MODEL = "smollm2-135m-instruct"
WORDS = ("river stone cloud maple copper violet harbor lantern meadow falcon orchard glacier ember willow "
         "canyon beacon thistle quartz saffron tundra").split()


async def turn(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int) -> dict:
    for attempt in range(30):  # a 503 (admission control) is retried after its Retry-After
        try:
            result = await _turn(client, url, messages, max_tokens)
            result["retries"] = attempt
            return result
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code != 503:
                raise
            await asyncio.sleep(float(exc.response.headers.get("retry-after", "1")))
    raise RuntimeError("still refused after 30 attempts")


async def _turn(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int) -> dict:
    started = time.perf_counter()
    first = None
    text, usage = [], {}
    async with client.stream("POST", url + "/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        if r.status_code >= 400:
            await r.aread()
            r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices"):
                choice = event["choices"][0]
                content = choice["delta"].get("content") or ""
                # the first chunk only announces the role: the first token is the first content
                if first is None and (content or choice.get("finish_reason")):
                    first = time.perf_counter() - started
                text.append(content)
            if event.get("usage"):
                usage = event["usage"]
    return {"ttft": first, "text": "".join(text), "prompt": usage.get("prompt_tokens", 0),
            "cached": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
            "worker": r.headers.get("x-kite-worker", "")}


async def session(client, url: str, rng: random.Random, turns: int, max_tokens: int, rows: list) -> None:
    messages = [{"role": "system", "content": "You are a helpful assistant. Context: " +
                 " ".join(rng.choice(WORDS) for _ in range(280))}]
    await asyncio.sleep(rng.random() * 0.5)  # the sessions do not move in lockstep
    for t in range(turns):
        messages.append({"role": "user", "content": f"Turn {t}: tell me about the {rng.choice(WORDS)}."})
        result = await turn(client, url, messages, max_tokens)
        result["turn"] = t
        rows.append(result)
        messages.append({"role": "assistant", "content": result["text"]})


async def phase(url: str, seed: int, sessions: int, turns: int, max_tokens: int) -> dict:
    rows: list[dict] = []
    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()
        await asyncio.gather(*(session(client, url, random.Random(seed * 1000 + i), turns, max_tokens, rows)
                               for i in range(sessions)))
        elapsed = time.perf_counter() - started
    later = [r for r in rows if r["turn"] > 0]
    ttfts = sorted(r["ttft"] for r in rows if r["ttft"] is not None)
    return {
        "hit_rate": sum(r["cached"] for r in later) / max(1, sum(r["prompt"] for r in later)),
        "ttft_p50": statistics.median(ttfts),
        "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "requests": len(rows), "seconds": elapsed, "retries": sum(r["retries"] for r in rows),
        "per_worker": {w: sum(1 for r in rows if r["worker"] == w) for w in sorted({r["worker"] for r in rows})},
    }


async def run(url: str, nats_url: str, sessions: int, turns: int, max_tokens: int) -> dict:
    results = {}
    for seed, mode in enumerate(("round_robin", "cache_aware"), start=1):
        reply = await admin_request(nats_url, "set_routing_mode", mode)
        if not reply.ok:
            raise SystemExit(f"could not switch the routing mode: {reply.error}")
        await asyncio.sleep(1.0)
        results[mode] = await phase(url, seed, sessions, turns, max_tokens)
    status = await admin_request(nats_url, "status")
    results["decision_latency_ms"] = (status.decision_latency_p50_ms, status.decision_latency_p99_ms,
                                      status.decision_latency_samples)
    await admin_request(nats_url, "set_routing_mode", "")  # back to the configured mode
    return results


def wait_for_workers(stack: LocalStack, timeout_s: float) -> None:
    """Until every worker has logged that it is ready (a vLLM worker takes a minute or more to start)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all("worker ready" in stack.tail(w, 1_000_000) for w in stack.workers()):
            return
        time.sleep(1)
    raise TimeoutError("the workers were not ready in time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--pool-read", action="store_true", help="let workers load blocks from the ru-pool")
    parser.add_argument("--url", help="a running gateway (with --nats); default: start a 2-worker stack")
    parser.add_argument("--nats", help="the NATS URL of that stack")
    args = parser.parse_args()
    if args.url:
        results = asyncio.run(run(args.url, args.nats or "nats://127.0.0.1:4222", args.sessions, args.turns,
                                  args.max_tokens))
    else:
        # Admission control would shed part of this deliberate overload on a small machine: the bench
        # measures routing, so its stack's TTFT objective is out of reach (503s are retried anyway).
        env = {"KITE_ARBITRATOR_TTFT_SLO_S": "600"}
        if not args.pool_read:
            env["KITE_WORKER_POOL_READ"] = "off"
        with LocalStack(StackOptions(num_workers=2, env=env)) as stack:
            wait_for_workers(stack, timeout_s=900)  # the stack is healthy as soon as one worker is
            results = asyncio.run(run(stack.http_url, stack.nats.url, args.sessions, args.turns,
                                      args.max_tokens))
    print(f"\n{args.sessions} concurrent sessions x {args.turns} turns over 2 workers, "
          f"pool reads {'on' if args.pool_read else 'off'}")
    print("| routing | hit rate (turns 2..) | TTFT p50 (s) | TTFT p99 (s) | requests per worker | 503 retries | wall (s) |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for mode in ("round_robin", "cache_aware"):
        r = results[mode]
        print(f"| {mode} | {r['hit_rate']:.3f} | {r['ttft_p50']:.3f} | {r['ttft_p99']:.3f} | "
              f"{r['per_worker']} | {r['retries']} | {r['seconds']:.1f} |")
    p50, p99, n = results["decision_latency_ms"]
    print(f"arbitrator decision latency (telemetry received -> decision published): p50 {p50} ms, "
          f"p99 {p99} ms over {n} decisions")


if __name__ == "__main__":
    main()
