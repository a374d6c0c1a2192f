"""Time to first token through the full stack (HTTP -> NATS -> worker): miss vs hit.

For each prompt length: a *miss* sends a prompt nobody has seen; a *hit* sends a prompt whose first
`length` tokens were sent before, plus a new 16-token suffix. Medians over the repetitions and the
hit/miss ratio are printed as a table. Starts its own stack unless --url is given.

    .venv/bin/python bench/bench_reuse_ttft.py [--lengths 256 1024 2048] [--reps 5] [--url http://...]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import httpx

from kite_cli.stack import LocalStack, StackOptions

MODEL = "smollm2-135m-instruct"
SUFFIX_TOKENS = 16


# One client for the whole run, as a real client keeps one: building an httpx.Client costs about 20 ms
# (its TLS context), which a per-request client would add to every TTFT measured here.
_HTTP = httpx.Client(timeout=300)


def ttft(url: str, ids: list[int]) -> tuple[float, int]:
    """Seconds to the first streamed token, and the cached_tokens the server reported."""
    started = time.perf_counter()
    first = None
    cached = -1
    with _HTTP.stream("POST", url + "/v1/completions", json={
            "model": MODEL, "prompt": ids, "max_tokens": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event.get("choices"):
                first = time.perf_counter() - started
            if event.get("usage"):
                cached = event["usage"]["prompt_tokens_details"]["cached_tokens"]
    return first, cached


def run(url: str, lengths: list[int], reps: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    ttft(url, [rng.randrange(1000, 40000) for _ in range(32)])  # warm-up
    for length in lengths:
        misses, hits, cached = [], [], []
        for _ in range(reps):
            prefix = [rng.randrange(1000, 40000) for _ in range(length)]
            misses.append(ttft(url, prefix + [rng.randrange(1000, 40000) for _ in range(SUFFIX_TOKENS)])[0])
            seconds, n_cached = ttft(url, prefix + [rng.randrange(1000, 40000) for _ in range(SUFFIX_TOKENS)])
            hits.append(seconds)
            cached.append(n_cached)
        miss, hit = statistics.median(misses), statistics.median(hits)
        rows.append({"prompt_tokens": length + SUFFIX_TOKENS, "miss_ttft_s": miss, "hit_ttft_s": hit,
                     "hit_over_miss": hit / miss, "cached_tokens": statistics.median(cached)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="an already running gateway; default: start a local stack")
    args = parser.parse_args()
    if args.url:
        rows = run(args.url, args.lengths, args.reps, args.seed)
    else:
        with LocalStack(StackOptions()) as stack:
            rows = run(stack.http_url, args.lengths, args.reps, args.seed)
    print(f"\nTTFT through HTTP -> NATS -> worker, medians of {args.reps} (new {SUFFIX_TOKENS}-token suffix on a hit)")
    print("| prompt tokens | miss TTFT (s) | hit TTFT (s) | hit / miss | cached tokens |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['prompt_tokens']} | {r['miss_ttft_s']:.3f} | {r['hit_ttft_s']:.3f} | "
              f"{r['hit_over_miss']:.3f} | {r['cached_tokens']:.0f} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
