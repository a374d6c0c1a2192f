"""Upcycle across workers and restarts through the ru-pool (issue 4 acceptance), with real processes,
a real redis-server and the cold tier in a folder."""

from __future__ import annotations

from pathlib import Path

import httpx
import redis

from tests.helpers import pool_stats, wait_until
from tests.integration.conftest import MODEL

SYSTEM = {"role": "system", "content": "You are the ru-pool test assistant. " +
          " ".join(f"Fact {i}: the pool keeps block {i} for every worker." for i in range(30))}


def chat(stack, question: str, reuse: bool = True) -> dict:
    r = httpx.post(stack.http_url + "/v1/chat/completions", timeout=180, json={
        "model": MODEL, "temperature": 0, "max_tokens": 10, "kite": {"reuse": reuse},
        "messages": [SYSTEM, {"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    return r.json()


def cached(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def wait_for_warm_blocks(stack, minimum: int, timeout_s: float = 30.0) -> None:
    wait_until(lambda: pool_stats(stack.nats.url, timeout_s=30.0), timeout_s,
               f"the pool's warm tier to reach {minimum} blocks", done=lambda s: s.tiers["warm"].blocks >= minimum,
               interval_s=0.5)


def replace_worker(stack) -> None:
    for worker in stack.workers():
        stack.stop_process(worker)
    stack.start_worker()
    stack.wait_healthy(120)


def test_blocks_travel_between_workers_and_survive_restarts(fresh_stack_factory):
    stack = fresh_stack_factory(num_workers=1)
    assert stack.redis is not None, "these tests need redis-server installed"
    first = chat(stack, "Which block does the pool keep first?")
    assert cached(first) == 0
    wait_for_warm_blocks(stack, minimum=first["usage"]["prompt_tokens"] // 16)

    # Worker B never computed this prompt: its prefix must come from the pool.
    replace_worker(stack)
    question = "Which block does the pool keep last?"
    on_b = chat(stack, question)
    assert cached(on_b) >= 16 * 10
    assert on_b["choices"][0]["message"]["content"] == chat(stack, question, reuse=False)["choices"][0]["message"]["content"]

    # Every KITE process restarts (nats-server and redis-server stay up): still a hit.
    stack.restart_services()
    after_restart = chat(stack, "Does the pool remember after a restart?")
    assert cached(after_restart) >= 16 * 10


def test_corrupted_blocks_are_detected_and_never_loaded(fresh_stack_factory):
    stack = fresh_stack_factory(num_workers=1)
    question = "Is a corrupted block ever served?"
    reference = chat(stack, question, reuse=False)["choices"][0]["message"]["content"]
    chat(stack, "Prime the pool with this system prompt.")
    wait_for_warm_blocks(stack, minimum=10)
    # Flip one byte in the payload of every stored block, in Redis and in the cold folder.
    client = redis.Redis.from_url(stack.redis.url)
    keys = list(client.scan_iter("kite:ru:*"))
    for key in keys:
        data = bytearray(client.get(key))
        data[-1] ^= 0xFF
        client.set(key, bytes(data), keepttl=True)
    cold_files = list(Path(stack.options.env["KITE_COLD_DIR"]).rglob("*.kru"))
    for path in cold_files:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    assert keys
    # Fresh processes: no worker cache and no pool memory hold a good copy.
    stack.restart_services()
    answer = chat(stack, question)
    assert answer["choices"][0]["message"]["content"] == reference
    assert cached(answer) == 0  # every corrupted block was a miss
    # Detected where they were read: by the pool (counted in its stats) or by the worker's direct reads.
    stats = pool_stats(stack.nats.url, timeout_s=30.0)
    pool_detections = sum(t.integrity_failures for t in stats.tiers.values())
    worker_detections = sum(stack.tail(p, 1_000_000).count("failed verification") for p in stack.workers())
    assert pool_detections + worker_detections >= 10


def test_requests_succeed_while_redis_is_down(fresh_stack_factory):
    stack = fresh_stack_factory(num_workers=1)
    chat(stack, "Warm the pool first.")
    stack.redis.stop()
    replace_worker(stack)  # empty local cache: the warm tier would be needed, and is down
    question = "Do requests survive a Redis outage?"
    down = chat(stack, question)
    assert down["choices"][0]["message"]["content"] == chat(stack, question, reuse=False)["choices"][0]["message"]["content"]
