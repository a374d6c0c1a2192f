"""LoRA adapters through the whole stack (issue 16): the base and two adapters on two workers, requests
interleaved and concurrent; each model's greedy answer with reuse equals reuse off; a replacement worker
loads each adapter's blocks from the pool; the pool's warm tier keeps each model's blocks apart."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from kite_shared import adapters
from kite_shared.tiers.keys import REDIS_KEY_PREFIX
from tests.helpers import wait_until
from tests.integration import http_chat
from tests.integration.conftest import MODEL
from tests.integration.http_chat import answer, cached
from tests.integration.test_pool_reuse import replace_worker
from tests.lora_adapters import served_adapters

SYSTEM = {"role": "system", "content": "You are the adapter test assistant. " +
          " ".join(f"Note {i}: every adapter keeps its own cache of item {i}." for i in range(30))}
MODELS = (MODEL, "alpha", f"{MODEL}:beta")  # an adapter by its own name and one under its base


@pytest.fixture(scope="module")
def adapter_folders(tmp_path_factory):
    return served_adapters(tmp_path_factory.mktemp("adapters"), "transformers", {"alpha": 1, "beta": 2})


def chat(stack, model: str, question: str, reuse: bool = True) -> dict:
    return http_chat.chat(stack, SYSTEM, question, model=model, reuse=reuse)


def wait_for_models(stack, expected: set[str], timeout_s: float = 15.0) -> None:
    """The gateway lists adapters from the workers' heartbeats, which may come a moment after /health."""
    wait_until(lambda: {m["id"] for m in httpx.get(stack.http_url + "/v1/models", timeout=30).json()["data"]},
               timeout_s, f"the gateway to list {sorted(expected)}", done=lambda listed: expected <= listed,
               interval_s=0.2)


def warm_tags(stack) -> dict[str, int]:
    counts: dict[str, int] = {}
    for key in redis.Redis.from_url(stack.redis.url).scan_iter(REDIS_KEY_PREFIX + "*"):
        tag = key.decode().removeprefix(REDIS_KEY_PREFIX).split(":")[0]
        counts[tag] = counts.get(tag, 0) + 1
    return counts


def test_base_and_adapters_on_two_workers(fresh_stack_factory, adapter_folders):
    setting, tags = adapter_folders
    # A burst of 12 requests on a 2-core machine: admission control would answer some 503 (it predicts the
    # backlog's TTFT); this test is about adapters, so the service objective is out of its way.
    stack = fresh_stack_factory(num_workers=2, env={"KITE_ADAPTERS": setting, "KITE_ARBITRATOR_TTFT_SLO_S": "600"})
    assert stack.redis is not None, "this test needs redis-server installed"
    wait_for_models(stack, {MODEL, "alpha", "beta", f"{MODEL}:alpha", f"{MODEL}:beta"})

    questions = ("Which river flows through Paris?", "How long is the Danube?")
    references = {(m, q): answer(chat(stack, m, q, reuse=False)) for m in MODELS for q in questions}
    for adapter in MODELS[1:]:  # the adapters change answers
        assert any(references[(adapter, q)] != references[(MODEL, q)] for q in questions), references
    # Interleaved and concurrent: every model's requests at once, on both workers.
    jobs = [(m, q) for q in questions for m in MODELS] * 2
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda job: chat(stack, *job), jobs))
    for job, result in zip(jobs, results):
        assert answer(result) == references[job], job
    for job in jobs[:len(jobs) // 2]:  # once the burst is over, every model reuses its own blocks
        again = chat(stack, *job)
        assert cached(again) > 0 and answer(again) == references[job], job

    # Each model's blocks reach the pool under its own model tag, and only there.
    wait_until(lambda: set(warm_tags(stack)), 30, f"warm blocks under exactly the tags {sorted(tags.values())}",
               done=lambda found: found == set(tags.values()), interval_s=0.5)

    # Fresh workers never computed these prompts: each model's prefix comes from the pool, unchanged.
    replace_worker(stack)
    question = "Which river flows through Vienna?"
    for model in MODELS:
        on = chat(stack, model, question)
        assert cached(on) >= 16 * 10, model
        assert answer(on) == answer(chat(stack, model, question, reuse=False)), model


def test_an_adapter_refused_at_start_leaves_the_base_serving(fresh_stack_factory, adapter_folders, tmp_path):
    setting, _ = adapter_folders
    folder = dict(item.split("=") for item in setting.split(","))["alpha"]
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    declaration = json.loads((bad / adapters.DECLARATION_FILE).read_text())
    declaration["base"]["rope_theta"] = 10000.0
    (bad / adapters.DECLARATION_FILE).write_text(json.dumps(declaration))
    stack = fresh_stack_factory(num_workers=1, env={"KITE_ADAPTERS": f"bad={bad},alpha={folder}"})
    wait_for_models(stack, {MODEL, "alpha"})
    assert any("base.rope_theta" in stack.tail(p, 1_000_000) for p in stack.workers())
    r = httpx.post(stack.http_url + "/v1/chat/completions", timeout=60, json={
        "model": "bad", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert answer(chat(stack, MODEL, "Still there?"))
    assert answer(chat(stack, "alpha", "Still there?"))


def wait_until_refused(stack, model: str, timeout_s: float = 15.0) -> None:
    """An unloaded adapter: the gateway answers 404 model_not_found once the heartbeats say so."""
    r = wait_until(lambda: httpx.post(stack.http_url + "/v1/chat/completions", timeout=60, json={
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
        timeout_s, f"the gateway to refuse {model}", done=lambda r: r.status_code == 404, interval_s=0.3)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def adapter_cli(stack, *args: str) -> tuple[int, list[dict], str]:
    done = subprocess.run([sys.executable, "-m", "kite_cli.main", "adapter", *args, "--nats-url", stack.nats.url],
                          capture_output=True, text=True, timeout=60)
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines() if line.strip()], done.stderr


def test_adapters_load_and_unload_at_run_time(fresh_stack_factory, adapter_folders, tmp_path):
    setting, _ = adapter_folders
    folder = dict(item.split("=") for item in setting.split(","))["alpha"]
    stack = fresh_stack_factory(num_workers=1)
    code, replies, _ = adapter_cli(stack, "load", "alpha", folder)
    assert code == 0 and sorted(r["service"] for r in replies) == ["fingerprinter", "worker"]
    assert all(r["ok"] and r["adapters"] == ["alpha"] for r in replies)
    assert len({r["model_fingerprint"] for r in replies}) == 1  # both sides hash under one identity
    wait_for_models(stack, {"alpha", f"{MODEL}:alpha"})
    question = "Which river flows through Paris?"
    chat(stack, "alpha", question)
    on = chat(stack, "alpha", question)
    assert cached(on) > 0 and answer(on) == answer(chat(stack, "alpha", question, reuse=False))
    # A worker that starts later serves it too: the load was kept (JetStream bucket kite_adapters).
    replace_worker(stack)
    wait_for_models(stack, {"alpha"})
    assert answer(chat(stack, "alpha", question)) == answer(on)

    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    declaration = json.loads((bad / adapters.DECLARATION_FILE).read_text())
    declaration["base"]["kv_layout"]["num_kv_heads"] = 8
    (bad / adapters.DECLARATION_FILE).write_text(json.dumps(declaration))
    code, replies, _ = adapter_cli(stack, "load", "bad", str(bad))
    assert code == 1 and replies and all(not r["ok"] for r in replies)
    assert {r["error"]["param"] for r in replies} == {"base.kv_layout.num_kv_heads"}
    code, replies, _ = adapter_cli(stack, "load", "alpha", folder)  # served already
    assert code == 1 and {r["error"]["param"] for r in replies} == {"name"}

    code, replies, _ = adapter_cli(stack, "unload", "alpha")
    assert code == 0 and all(r["adapters"] == [] for r in replies)
    wait_until_refused(stack, "alpha")
    assert answer(chat(stack, MODEL, question))  # the base serves on
    replace_worker(stack)  # nor does a worker that starts after the unload serve it
    time.sleep(1.5)  # its first heartbeats
    wait_until_refused(stack, "alpha")
    # Loaded again: the same content, the same namespace, and the pool still holds its blocks.
    code, _, _ = adapter_cli(stack, "load", "alpha", folder)
    assert code == 0
    wait_for_models(stack, {"alpha"})
    assert answer(chat(stack, "alpha", question)) == answer(on)
