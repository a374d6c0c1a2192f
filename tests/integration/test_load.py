"""Load: 200 concurrent streaming requests on the default model and two workers (the full stack: ru-pool,
arbitrator and redis when installed). Every request must complete, NATS must report no slow consumer in
any log, and worker memory must stay bounded."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx

from tests.integration.conftest import MODEL

NUM_REQUESTS = 200
# The worker-local cache is what legitimately grows with distinct prompts; a small budget makes the RSS
# bound below meaningful (anything else growing per request would be a leak).
CACHE_BYTES = 64 * 1024 * 1024
RSS_GROWTH_LIMIT_BYTES = 256 * 1024 * 1024


def _rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) * 1024


async def _one(client: httpx.AsyncClient, i: int, reuse: bool = True) -> dict:
    body = {"model": MODEL, "temperature": 0, "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}, "kite": {"reuse": reuse},
            "messages": [{"role": "user", "content": f"Say the number {i}."}]}
    out = {"status": 0, "done": False, "error": None, "finish_reason": None, "usage": None, "text": "",
           "worker": ""}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        out["status"] = r.status_code
        out["worker"] = r.headers.get("X-Kite-Worker", "")
        if r.status_code != 200:
            await r.aread()
            out["error"] = r.text
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                out["done"] = True
                break
            event = json.loads(data)
            if "error" in event:
                out["error"] = event["error"]
                continue
            if event.get("usage"):
                out["usage"] = event["usage"]
            for choice in event["choices"]:
                out["text"] += choice["delta"].get("content", "")
                out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
    return out


async def _burst(url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=NUM_REQUESTS + 10, max_keepalive_connections=NUM_REQUESTS + 10)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900, connect=60), limits=limits) as client:
        return await asyncio.gather(*(_one(client, i) for i in range(NUM_REQUESTS)))


def test_two_hundred_concurrent_streams_all_complete(fresh_stack_factory):
    # One torch thread per worker: two workers on a 2-core machine must not oversubscribe it.
    stack = fresh_stack_factory(num_workers=2, env={"KITE_WORKER_CACHE_BYTES": str(CACHE_BYTES),
                                                    "KITE_WORKER_NUM_THREADS": "1"})
    stack.wait_workers(2)
    # Warm both workers (first-request allocations are not growth), then measure.
    asyncio.run(_warm_every_worker(stack.http_url, 2))
    workers = stack.workers()
    rss_before = {w.log_path.stem: _rss_bytes(w.process.pid) for w in workers}

    started = time.monotonic()
    results = asyncio.run(_burst(stack.http_url))
    elapsed = time.monotonic() - started

    failed = [r for r in results if r["status"] != 200 or not r["done"] or r["error"]
              or r["finish_reason"] not in ("stop", "length") or not r["usage"]]
    assert not failed, f"{len(failed)} of {NUM_REQUESTS} failed, e.g. {failed[:3]}"
    assert all(r["usage"]["completion_tokens"] >= 1 for r in results)

    rss_after = {w.log_path.stem: _rss_bytes(w.process.pid) for w in workers}
    growth = {k: rss_after[k] - rss_before[k] for k in rss_before}
    print(f"{NUM_REQUESTS} streams in {elapsed:.1f} s; worker RSS before {rss_before}, growth {growth}")
    assert all(g < RSS_GROWTH_LIMIT_BYTES for g in growth.values()), growth

    slow = []
    for log in stack.log_dir.glob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if "slow consumer" in line.lower():
                slow.append(f"{log.name}: {line[:200]}")
    assert not slow, "\n".join(slow[:10])


async def _warm_every_worker(url: str, num_workers: int) -> None:
    """A few requests on each worker. Without reuse, so the router spreads them by load alone: with
    reuse, cache-aware routing may send them all to the worker that holds the chat template's prefix,
    and the other worker's first allocations would then count as growth."""
    served: set[str] = set()
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for _ in range(5):
            results = await asyncio.gather(*(_one(client, i, reuse=False) for i in range(8)))
            served.update(r["worker"] for r in results if r["status"] == 200)
            if len(served) >= num_workers:
                return
    raise AssertionError(f"warm-up reached only {sorted(served)}")
