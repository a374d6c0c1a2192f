"""Failures, with real processes: a worker SIGKILLed mid-stream (request migration), saturation (fast 503),
a NATS restart (services reconnect by themselves), SIGTERM mid-stream (graceful drain).

Each test starts its own small stack (gateway + fingerprinter + workers, no ru-pool / arbitrator / redis:
they play no part here and the machine has few cores).
"""

from __future__ import annotations

import json
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx

from tests.helpers import wait_until
from tests.integration.conftest import MODEL

SMALL = ("fingerprinter", "gateway")
# Faster failure detection than the defaults, still far above heartbeat jitter on a loaded machine.
FAST_LIVENESS = {"KITE_HEARTBEAT_INTERVAL_S": "0.5", "KITE_GATEWAY_WORKER_DEAD_AFTER_S": "2.0"}


def _greedy_body(max_tokens: int = 64) -> dict:
    # Counting: large logit margins, so greedy tokens are the same whether the KV of a position came from
    # one long prefill (after a migration) or from token-by-token decoding. ignore_eos: exactly max_tokens.
    return {"model": MODEL, "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "kite": {"reuse": False, "ignore_eos": True},
            "messages": [{"role": "user", "content": "Count from 1 to 100, separated by commas."}]}


@dataclass
class StreamResult:
    status: int = 0
    worker: str = ""
    text: str = ""
    chunks: int = 0  # content chunks
    finish_reason: str | None = None
    usage: dict | None = None
    error: dict | None = None
    done: bool = False
    chunk_times: list[float] = field(default_factory=list)
    error_at: float | None = None


def stream_chat(url: str, body: dict, on_chunk=None, timeout_s: float = 300) -> StreamResult:
    """POST a streaming chat completion and read the SSE stream to its end; on_chunk(n, result) is called
    after each content chunk."""
    result = StreamResult()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout_s) as r:
        result.status = r.status_code
        result.worker = r.headers.get("X-Kite-Worker", "")
        if r.status_code != 200:
            r.read()
            result.error = r.json().get("error")
            return result
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                result.done = True
                break
            event = json.loads(data)
            if "error" in event:
                result.error, result.error_at = event["error"], time.monotonic()
                continue
            if event.get("usage"):
                result.usage = event["usage"]
            for choice in event["choices"]:
                content = choice["delta"].get("content", "")
                if choice["finish_reason"]:
                    result.finish_reason = choice["finish_reason"]
                if content:
                    result.text += content
                    result.chunks += 1
                    result.chunk_times.append(time.monotonic())
                    if on_chunk is not None:
                        on_chunk(result.chunks, result)
    return result


def _process(stack, instance: str):
    return next(p for p in stack.processes if p.log_path.stem == instance)


def _migrations(stack, outcome: str) -> float:
    text = httpx.get(stack.http_url + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(f'kite_gateway_migrations_total{{outcome="{outcome}"}}'):
            return float(line.split()[-1])
    return 0.0


def _ask(url: str, max_tokens: int = 2, timeout_s: float = 60) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=timeout_s, json={
        "model": MODEL, "temperature": 0, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Say hi."}]})


# --- request migration ------------------------------------------------------------------------------


def test_sigkill_of_the_serving_worker_mid_stream_migrates_without_losing_a_token(fresh_stack_factory):
    stack = fresh_stack_factory(num_workers=2, services=SMALL, with_redis=False, env=dict(FAST_LIVENESS))
    stack.wait_workers(2)
    reference = stream_chat(stack.http_url, _greedy_body())
    assert reference.error is None and reference.finish_reason == "length"
    assert reference.usage["completion_tokens"] == 64

    killed: dict = {}

    def kill_after_five(n: int, result: StreamResult) -> None:
        if n == 5:
            stack.stop_process(_process(stack, result.worker), sig=signal.SIGKILL)
            killed["at"] = time.monotonic()

    faulty = stream_chat(stack.http_url, _greedy_body(), on_chunk=kill_after_five)
    assert killed, "the stream ended before the worker could be killed"
    assert faulty.error is None, faulty.error
    assert faulty.done and faulty.finish_reason == "length"
    assert faulty.text == reference.text  # nothing lost, nothing repeated
    assert faulty.usage["completion_tokens"] == 64
    assert faulty.usage["prompt_tokens"] == reference.usage["prompt_tokens"]
    resumed_at = next(t for t in faulty.chunk_times if t > killed["at"])
    assert resumed_at - killed["at"] < 10.0
    assert _migrations(stack, "ok") == 1


def test_sigkill_of_the_only_worker_ends_the_stream_with_a_clean_error(fresh_stack_factory):
    stack = fresh_stack_factory(num_workers=1, services=SMALL, with_redis=False, env=dict(FAST_LIVENESS))
    killed: dict = {}

    def kill_after_three(n: int, result: StreamResult) -> None:
        if n == 3:
            stack.stop_process(_process(stack, result.worker), sig=signal.SIGKILL)
            killed["at"] = time.monotonic()

    result = stream_chat(stack.http_url, _greedy_body(), on_chunk=kill_after_three)
    assert killed and result.error is not None and result.done
    assert result.error["code"] == "worker_lost"
    assert result.error_at - killed["at"] < 10.0
    assert _migrations(stack, "failed") == 1


# --- saturation ---------------------------------------------------------------------------------------


def test_a_saturated_worker_gets_a_fast_503_with_retry_after(fresh_stack_factory):
    stack = fresh_stack_factory(num_workers=1, services=SMALL, with_redis=False, env={
        "KITE_WORKER_MAX_RUNNING": "1", "KITE_WORKER_MAX_QUEUED": "0"})
    _ask(stack.http_url)  # warm up every process on the path
    running = threading.Event()
    results: list[StreamResult] = []

    def long_stream() -> None:
        results.append(stream_chat(stack.http_url, _greedy_body(32),
                                   on_chunk=lambda n, _: running.set()))

    thread = threading.Thread(target=long_stream)
    thread.start()
    try:
        assert running.wait(120)
        timings = []
        # One client, connected beforehand: creating an httpx client alone takes ~100 ms here.
        with httpx.Client(base_url=stack.http_url, timeout=60) as client:
            client.get("/health")
            for _ in range(5):
                started = time.monotonic()
                r = client.post("/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Say hi."}]})
                timings.append(time.monotonic() - started)
                assert r.status_code == 503
                assert r.json()["error"]["code"] == "overloaded" and r.headers["Retry-After"]
        # gateway -> fingerprinter -> worker refuses -> back, while that worker computes a stream on a
        # busy 2-core machine: the median must be under 100 ms, and none may wait for a timeout.
        assert statistics.median(timings) < 0.1, timings
        assert max(timings) < 1.0, timings
    finally:
        thread.join(300)
    assert results and results[0].error is None and results[0].finish_reason == "length"


# --- NATS restart ----------------------------------------------------------------------------------------


def test_services_reconnect_after_nats_restarts_on_the_same_port(fresh_stack_factory):
    stack = fresh_stack_factory(num_workers=1, services=SMALL, with_redis=False, env=dict(FAST_LIVENESS))
    assert _ask(stack.http_url).status_code == 200
    pids = {p.log_path.stem: p.process.pid for p in stack.processes}
    stack.restart_nats(down_s=1.0)
    started = time.monotonic()
    status = wait_until(lambda: _ask(stack.http_url, timeout_s=10).status_code, 30,
                        "an answer after the NATS restart", done=lambda status: status == 200, interval_s=0.25,
                        ignore=(httpx.HTTPError,))
    assert status == 200, f"no answer within 30 s of the NATS restart (last status {status})"
    print(f"answering again {time.monotonic() - started:.1f} s after nats-server was back")
    assert stack.health_status() == 200
    # Nobody was restarted: the same processes serve.
    assert all(p.process.poll() is None for p in stack.processes)
    assert {p.log_path.stem: p.process.pid for p in stack.processes} == pids


# --- graceful shutdown ------------------------------------------------------------------------------------


def test_sigterm_mid_stream_drains_the_worker_and_the_gateway(fresh_stack_factory):
    stack = fresh_stack_factory(num_workers=2, services=SMALL, with_redis=False, env=dict(FAST_LIVENESS))
    stack.wait_workers(2)
    side: dict = {}

    def terminate_worker_after_three(n: int, result: StreamResult) -> None:
        if n == 3:
            proc = _process(stack, result.worker)
            proc.process.send_signal(signal.SIGTERM)
            side["worker"] = proc
            time.sleep(0.5)  # the signal is handled asynchronously
            # While it drains, new requests go to the other worker.
            r = _ask(stack.http_url)
            side["other"] = (r.status_code, r.headers.get("X-Kite-Worker"))

    result = stream_chat(stack.http_url, _greedy_body(32), on_chunk=terminate_worker_after_three)
    assert result.error is None and result.finish_reason == "length"
    assert result.usage["completion_tokens"] == 32
    assert side["other"][0] == 200 and side["other"][1] != result.worker
    assert side["worker"].process.wait(60) == 0
    assert _migrations(stack, "ok") == 0  # drained, not migrated

    gateway = _process(stack, "gateway")

    def terminate_gateway_after_three(n: int, result: StreamResult) -> None:
        if n == 3:
            gateway.process.send_signal(signal.SIGTERM)

    result = stream_chat(stack.http_url, _greedy_body(32), on_chunk=terminate_gateway_after_three)
    assert result.error is None and result.done and result.finish_reason == "length"
    assert result.usage["completion_tokens"] == 32
    assert gateway.process.wait(60) == 0
