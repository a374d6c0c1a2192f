"""Do running requests keep decoding while a vLLM worker loads a prefix from the ru-pool? (issue 15)

One stack, one vLLM worker. Documents of --doc-tokens are computed once (their blocks go to the pool), and
the worker is replaced, so its own cache is empty. Then a long stream decodes (reuse off) while, one after
the other, each document is asked twice: first its prefix comes from the pool (the KV connector fetches and
stages its blocks), then from vLLM's own prefix cache (no fetch). Both requests compute the same suffix, so
what differs is the fetch and the copy into the paged cache. Printed, side by side in the run: the stream's
gaps between tokens while each kind of request was being admitted and prefilled (until its first token),
the stream's gaps with no other request, and those requests' times to first token.

If vLLM's scheduler waited for the pool, every gap during a pool load would grow by the fetch time; with
the fetch off its loop (kv_connector.py) the pool gaps should match the local ones but for the copy.

    .venv/bin/python bench/bench_load_overlap.py [--documents 6] [--doc-tokens 1000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time

import httpx

from kite_cli.bench import workloads
from kite_cli.stack import LocalStack, StackOptions

VLLM_ENV = {"KITE_ENGINE": "vllm", "KITE_VLLM_ENFORCE_EAGER": "on", "KITE_VLLM_KV_CACHE_GIB": "1.0",
            "KITE_WORKER_WRITE_POLICY": "write_through", "KITE_SHADOW_FRACTION": "0"}


def chat(url: str, messages: list[dict], max_tokens: int, reuse: bool = True) -> tuple[float, int, list[float]]:
    """(time to first token, cached tokens, arrival time of every streamed chunk)."""
    started = time.perf_counter()
    arrivals: list[float] = []
    cached = 0
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=600, json={
            "model": "smollm2-135m-instruct", "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "kite": {"reuse": reuse, "ignore_eos": True},
            "messages": messages}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("delta", {}).get("content"):
                arrivals.append(time.perf_counter())
            if event.get("usage"):
                cached = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return (arrivals[0] - started if arrivals else float("nan")), cached, arrivals


def gaps_within(arrivals: list[float], windows: list[tuple[float, float]]) -> list[float]:
    """Gaps between consecutive stream tokens that end inside one of the windows."""
    return [b - a for a, b in zip(arrivals, arrivals[1:]) if any(start <= b <= end for start, end in windows)]


def summary(values: list[float]) -> str:
    if not values:
        return "none"
    ordered = sorted(values)
    return (f"n {len(values):>3}  mean {statistics.fmean(values) * 1000:6.1f} ms  "
            f"p90 {ordered[int(0.9 * (len(ordered) - 1))] * 1000:6.1f} ms  max {ordered[-1] * 1000:6.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=6)
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    rng = random.Random(0)
    documents = [{"role": "system", "content": workloads.make_text(rng, args.doc_tokens)}
                 for _ in range(args.documents)]
    questions = [{"role": "user", "content": "Summarize the document in one line."},
                {"role": "user", "content": "Name the document's first subject."}]
    stack = LocalStack(StackOptions(num_workers=1, services=("fingerprinter", "ru-pool", "gateway"), env=VLLM_ENV))
    try:
        stack.start(timeout_s=400)
        for doc in documents:  # computed once: their blocks go to the pool
            chat(stack.http_url, [doc, questions[0]], 1)
        time.sleep(3.0)  # the last saves reach the pool
        for worker in stack.workers():
            stack.stop_process(worker)
        stack.start_worker()
        stack.wait_healthy(400)
        chat(stack.http_url, [{"role": "user", "content": "warm up"}], 4, reuse=False)

        stream: dict = {}

        def decode_long_story() -> None:
            _, _, stream["arrivals"] = chat(stack.http_url, [{"role": "user", "content": "Tell a long story."}],
                                            args.documents * 40 + 200, reuse=False)

        streaming = threading.Thread(target=decode_long_story)
        streaming.start()
        time.sleep(3.0)  # the stream is decoding; these seconds are its quiet baseline
        quiet = [(time.perf_counter() - 2.5, time.perf_counter())]
        windows: dict[str, list[tuple[float, float]]] = {"pool": [], "local": []}
        ttfts: dict[str, list[float]] = {"pool": [], "local": []}
        cached: dict[str, list[int]] = {"pool": [], "local": []}
        for doc in documents:
            for kind, q in (("pool", questions[1]), ("local", questions[0])):
                sent = time.perf_counter()
                ttft, num_cached, _ = chat(stack.http_url, [doc, q], 1)
                windows[kind].append((sent, sent + ttft))
                ttfts[kind].append(ttft)
                cached[kind].append(num_cached)
                time.sleep(1.0)  # the stream alone again between requests
        quiet.append((time.perf_counter() - 0.9, time.perf_counter()))
        streaming.join()
        arrivals = stream["arrivals"]
        figures = {
            "quiet_gaps_s": gaps_within(arrivals, quiet),
            "pool_gaps_s": gaps_within(arrivals, windows["pool"]),
            "local_gaps_s": gaps_within(arrivals, windows["local"]),
            "pool_ttft_s": ttfts["pool"], "local_ttft_s": ttfts["local"],
            "pool_cached_tokens": cached["pool"], "local_cached_tokens": cached["local"],
        }
        print(f"\nvLLM worker, a stream decoding while {args.documents} documents of ~{args.doc_tokens} tokens are "
              f"asked: first loaded from the pool, then hit in vLLM's own cache")
        print(f"  stream gaps, no other request    {summary(figures['quiet_gaps_s'])}")
        print(f"  stream gaps, during pool loads   {summary(figures['pool_gaps_s'])}")
        print(f"  stream gaps, during local hits   {summary(figures['local_gaps_s'])}")
        print(f"  TTFT of the pool loads           {summary(ttfts['pool'])}  cached tokens {cached['pool']}")
        print(f"  TTFT of the local hits           {summary(ttfts['local'])}  cached tokens {cached['local']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "figures": figures}, f, indent=2)
        return 0 if all(c > 0 for c in cached["pool"] + cached["local"]) else 1
    finally:
        stack.stop()


if __name__ == "__main__":
    raise SystemExit(main())
