"""Cache-aware routing and the arbitrator with real processes (issue 5).

- cache-aware routing reuses more of a multi-turn workload than round robin over 2 workers;
- overload gives fast 503s with Retry-After, not timeouts, and admission reopens afterwards;
- a standby worker takes no traffic until the arbitrator activates it under load, then serves;
- a rules-file change takes effect without a restart, and a broken file changes nothing.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kite_arbitrator.rules import DEFAULT_RULES_PATH
from kite_cli.arbitrator_admin import admin
from tests.integration.conftest import MODEL, _start
from kite_cli.stack import StackOptions
from tests.helpers import wait_until


def chat(url: str, messages: list[dict], max_tokens: int = 8, timeout: float = 180, **kite) -> httpx.Response:
    body = {"model": MODEL, "temperature": 0, "max_tokens": max_tokens, "messages": messages}
    if kite:
        body["kite"] = kite
    return httpx.post(url + "/v1/chat/completions", timeout=timeout, json=body)


def sessions_hit_rate(url: str, seed: int, sessions: int = 3, turns: int = 3) -> float:
    """Cached / prompt tokens over turns 2.. of `sessions` chats, turns interleaved across sessions."""
    rng = random.Random(seed)
    words = ["river", "stone", "cloud", "maple", "copper", "violet", "harbor", "lantern", "meadow", "falcon"]
    chats = [[{"role": "system", "content": " ".join(rng.choice(words) for _ in range(150))}]
             for _ in range(sessions)]
    cached = prompt = 0
    for turn in range(turns):
        for messages in chats:
            messages.append({"role": "user", "content": f"Question {turn}: name a {rng.choice(words)}."})
            r = chat(url, messages)
            assert r.status_code == 200, r.text
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
            if turn:
                usage = r.json()["usage"]
                cached += usage["prompt_tokens_details"]["cached_tokens"]
                prompt += usage["prompt_tokens"]
    return cached / prompt


def test_cache_aware_routing_beats_round_robin_on_multi_turn_chats(fresh_stack_factory):
    # Pool reads off: a worker reuses only what its own cache holds, which is what routing decides.
    stack = fresh_stack_factory(num_workers=2, env={"KITE_WORKER_POOL_READ": "off"})
    wait_until(lambda: len(admin(stack.nats.url, "status").current) >= 4, 120, "both workers' telemetry")
    assert admin(stack.nats.url, "set_routing_mode", "round_robin").ok
    time.sleep(0.5)
    round_robin = sessions_hit_rate(stack.http_url, seed=1)
    assert admin(stack.nats.url, "set_routing_mode", "cache_aware").ok
    time.sleep(0.5)
    cache_aware = sessions_hit_rate(stack.http_url, seed=2)
    print(f"hit rate over turns 2-3: round robin {round_robin:.3f}, cache-aware {cache_aware:.3f}")
    assert cache_aware > 0.8
    assert cache_aware > round_robin + 0.1


def _flood(url: str, n: int, tokens: int) -> list[tuple[int, float, dict]]:
    def one(i: int) -> tuple[int, float, dict]:
        started = time.monotonic()
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": [random.randrange(1000, 30000) for _ in range(tokens)], "max_tokens": 2,
            "temperature": 0})
        return r.status_code, time.monotonic() - started, dict(r.headers)
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


@pytest.fixture(scope="module")
def rules_stack(tmp_path_factory):
    rules = tmp_path_factory.mktemp("rules") / "rules.yaml"
    shutil.copy(DEFAULT_RULES_PATH, rules)
    stack = _start(StackOptions(num_workers=1, env={
        "KITE_ARBITRATOR_RULES_FILE": str(rules), "KITE_ARBITRATOR_TTFT_SLO_S": "1.0",
        "KITE_WORKER_MAX_RUNNING": "2"}))
    stack.rules_path = rules
    yield stack
    stack.stop()


def test_rules_file_change_takes_effect_without_restart_and_a_broken_file_changes_nothing(rules_stack):
    stack, rules = rules_stack, rules_stack.rules_path
    url = stack.http_url
    ask = [{"role": "user", "content": "Say hi."}]
    assert chat(url, ask).status_code == 200
    before = admin(stack.nats.url, "status").rules_version

    rules.write_text(rules.read_text() + """
  - name: always-shed
    scope: fleet
    priority: 1000
    then: {admission: shed, retry_after_s: 7}
""")
    r = wait_until(lambda: (lambda x: x if x.status_code == 503 else None)(chat(url, ask)), 10, "the new rule")
    assert r.json()["error"]["code"] == "overloaded" and r.headers["Retry-After"] == "7"
    shed_version = admin(stack.nats.url, "status").rules_version
    assert shed_version != before

    rules.write_text("rules: [{name: broken, when: {no_such_signal: {gt: 1}}, then: {admission: open}}]\n")
    reply = admin(stack.nats.url, "reload")
    assert not reply.ok and "no_such_signal" in reply.error and reply.rules_version == shed_version
    time.sleep(2.5)  # the file watcher sees it too; still nothing changes
    assert admin(stack.nats.url, "status").rules_version == shed_version
    assert chat(url, ask).status_code == 503
    log = (stack.log_dir / "arbitrator.log").read_text()
    assert "rules_rejected" in log and "no_such_signal" in log

    shutil.copy(DEFAULT_RULES_PATH, rules)
    wait_until(lambda: chat(url, ask).status_code == 200, 10, "the default rules to reopen admission")
    entries = [json.loads(json.loads(line)["msg"]) for line in log.splitlines()
               if '"kite_arbitrator.decisions"' in line]
    assert any(e.get("event") == "decision" and e.get("rule") == "always-shed" and "reason" in e for e in entries)


def test_overload_gives_fast_503s_not_timeouts(rules_stack):
    url = rules_stack.http_url
    wait_until(lambda: chat(url, [{"role": "user", "content": "Ready?"}]).status_code == 200, 30, "admission open")
    with ThreadPoolExecutor(1) as background:
        flood = background.submit(_flood, url, 10, 1500)  # ~15,000 prompt tokens on one worker
        # Probe once the flood has reached the worker and its telemetry the arbitrator (published every
        # second): a probe sent before the flood would simply be first in an empty queue.
        time.sleep(1.5)
        probes = []  # (status, seconds) of new requests while the backlog is there
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not flood.done():
            t0 = time.monotonic()
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "Hello", "max_tokens": 1})
            probes.append((r.status_code, time.monotonic() - t0))
            if r.status_code == 503:
                assert r.json()["error"]["code"] == "overloaded" and int(r.headers["Retry-After"]) >= 1
                if len([p for p in probes if p[0] == 503]) >= 3:
                    break
            time.sleep(0.2)
        results = flood.result()
    statuses = sorted(s for s, _, _ in results)
    rejected = [d for s, d in probes if s == 503] + [d for s, d, _ in results if s == 503]
    print(f"flood statuses {statuses}; probes {[(s, round(d, 3)) for s, d in probes]}")
    assert set(statuses) <= {200, 503}, statuses  # never a timeout or another error
    probe_rejects = [d for s, d in probes if s == 503]
    assert rejected and probe_rejects, "nothing was shed"
    assert max(probe_rejects) < 1.0  # early rejection, not a wait
    wait_until(lambda: chat(url, [{"role": "user", "content": "Back?"}], timeout=60).status_code == 200, 90,
             "admission to reopen once the backlog drained")


def test_standby_worker_is_activated_under_load_and_takes_traffic(fresh_stack_factory):
    stack = fresh_stack_factory(num_workers=1)
    standby = stack.start_worker({"KITE_WORKER_STANDBY": "on"})
    wait_until(lambda: "standing by" in standby.log_path.read_text(), 120, "the standby worker to load")
    time.sleep(1.5)  # its telemetry reached the arbitrator and the router
    for i in range(3):  # light load: the standby worker gets nothing
        r = chat(stack.http_url, [{"role": "user", "content": f"Count to {i}."}])
        assert r.status_code == 200 and r.headers["X-Kite-Worker"] == "worker-1"

    stop = time.monotonic() + 90
    measured: list = []

    def client(i: int) -> list[tuple[int, str]]:  # steady traffic until the activation is measured
        out = []
        while time.monotonic() < stop and not measured:
            r = httpx.post(stack.http_url + "/v1/completions", timeout=300, json={
                "model": MODEL, "prompt": [random.randrange(1000, 30000) for _ in range(400)], "max_tokens": 2})
            out.append((r.status_code, r.headers.get("x-kite-worker", "")))
            if r.status_code == 503:
                time.sleep(float(r.headers.get("retry-after", "1")))
        return out

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client, i) for i in range(8)]
        status = wait_until(lambda: (lambda s: s if "worker-2" in s.activation_latencies_s else None)(
            admin(stack.nats.url, "status")), 90, "the activation to be measured", interval_s=0.5)
        measured.append(status)
        results = [x for f in futures for x in f.result()]
    statuses = {s for s, _ in results}
    served = {w for s, w in results if s == 200}
    latency = status.activation_latencies_s["worker-2"]
    print(f"activation latency (decision -> first accepted request): {1000 * latency:.0f} ms; "
          f"{len(results)} requests, statuses {sorted(statuses)}, served by {sorted(served)}")
    assert statuses <= {200, 503}
    assert "worker-2" in served
    log = (stack.log_dir / "arbitrator.log").read_text()
    assert "activation_measured" in log and "activate-standby-when" in log
