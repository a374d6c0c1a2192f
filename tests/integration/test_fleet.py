"""Several workers, and losing them: queue-group load balancing, fast 503s, recovery without restarts."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.helpers import wait_until
from tests.integration.conftest import MODEL


def _ask(url: str, i: int) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=180, json={
        "model": MODEL, "temperature": 0, "max_tokens": 4,
        "messages": [{"role": "user", "content": f"Say the number {i}."}]})


def test_two_workers_share_twenty_concurrent_requests(fresh_stack_factory):
    stack = fresh_stack_factory(num_workers=2)
    wait_until(lambda: len(stack.workers()), 60, "two workers running", done=lambda n: n >= 2, interval_s=0.2)
    time.sleep(3)  # both workers loaded and subscribed (the stack is healthy as soon as one is)
    with ThreadPoolExecutor(20) as pool:
        responses = list(pool.map(lambda i: _ask(stack.http_url, i), range(20)))
    assert [r.status_code for r in responses] == [200] * 20
    served = {r.headers["X-Kite-Worker"] for r in responses}
    assert served == {"worker-1", "worker-2"}


def test_losing_the_only_worker_gives_fast_503_then_recovers(fresh_stack_factory):
    stack = fresh_stack_factory(num_workers=1)
    assert _ask(stack.http_url, 1).status_code == 200
    stack.stop_process(stack.workers()[0], sig=9)
    wait_until(stack.health_status, 5, "/health to answer 503 (no worker)", done=lambda status: status == 503)
    assert stack.health_status() == 503
    started = time.monotonic()
    r = _ask(stack.http_url, 2)
    assert r.status_code == 503 and time.monotonic() - started < 1.0
    assert r.json()["error"]["code"] == "no_worker" and r.headers["Retry-After"]
    stack.start_worker()
    wait_until(stack.health_status, 120, "/health to answer 200 again (a new worker)",
               done=lambda status: status == 200, interval_s=0.25)
    assert _ask(stack.http_url, 3).status_code == 200
