"""LoRA adapters on the vLLM engine (issue 16), as real processes: nats-server, redis-server, the ru-pool,
the fingerprinter and a vLLM-CPU worker serving the base and two adapters (vLLM's LoRA layers).

Each model's greedy answer with reuse (vLLM's own prefix cache, then the pool after the worker is
replaced) equals reuse off; the pool's warm tier keeps each model's blocks under its own tag; an adapter
loaded at run time serves and reuses like a configured one; an unloaded one is refused. vLLM workers take
about a minute to start on two cores, so one stack walks through the phases in order.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kite_cli.stack import StackOptions
from kite_shared import adapters
from kite_shared.config import ModelConfig, load
from kite_shared.model_store import identity, prepare
from kite_shared.tiers.keys import model_tag
from tests.integration import http_chat
from tests.integration.conftest import MODEL, _start
from tests.integration.http_chat import answer, cached
from tests.integration.test_adapters_stack import adapter_cli, wait_for_models, warm_tags
from tests.integration.test_vllm_worker import BLOCK, VLLM_ENV, replace_worker
from tests.lora_adapters import make_lora_adapters

SYSTEM = {"role": "system", "content": "You are the vLLM adapter test assistant. " +
          " ".join(f"Note {i}: every adapter keeps its own cache of item {i}." for i in range(30))}
MODELS = (MODEL, "alpha", f"{MODEL}:beta")  # an adapter by its own name and one under its base


@pytest.fixture(scope="module")
def vllm_adapter_folders(tmp_path_factory):
    """alpha and beta configured at start, gamma for a run-time load; declared for vLLM's 32-token blocks."""
    folder = tmp_path_factory.mktemp("vllm-adapters")
    cfg = load(ModelConfig, engine="vllm", block_size=BLOCK)
    local = prepare(cfg)
    make_lora_adapters(local, cfg, {folder / "alpha": 1, folder / "beta": 2, folder / "gamma": 3})
    setting = f"alpha={folder / 'alpha'},beta={folder / 'beta'}"
    served = adapters.load_configured(load(ModelConfig, engine="vllm", block_size=BLOCK, adapters=setting),
                                      local, identity(local, cfg))
    tags = {name: model_tag(a.identity.fingerprint_hex) for name, a in served.items()}
    tags[""] = model_tag(identity(local, cfg).fingerprint_hex)
    return setting, tags, folder / "gamma"


def chat(stack, model: str, question: str, reuse: bool = True) -> dict:
    return http_chat.chat(stack, SYSTEM, question, model=model, reuse=reuse, max_tokens=16)


def test_adapters_on_vllm_reuse_their_own_blocks_and_load_at_run_time(vllm_adapter_folders):
    setting, tags, gamma = vllm_adapter_folders
    # No arbitrator: its safe policy (selective writes while telemetry is stale) would make the pool's
    # content depend on timing.
    stack = _start(StackOptions(num_workers=1, services=("fingerprinter", "ru-pool", "gateway"),
                                env={**VLLM_ENV, "KITE_ADAPTERS": setting, "KITE_VLLM_MAX_LORAS": "2"}))
    try:
        wait_for_models(stack, {MODEL, "alpha", "beta", f"{MODEL}:alpha", f"{MODEL}:beta"})
        question = "Which river flows through Paris?"
        references = {m: chat(stack, m, question, reuse=False) for m in MODELS}
        assert all(cached(r) == 0 for r in references.values())
        other = "How long is the Danube?"
        for adapter in MODELS[1:]:  # the adapters change answers (not every answer: these are small adapters)
            assert answer(references[adapter]) != answer(references[MODEL]) or \
                answer(chat(stack, adapter, other, reuse=False)) != answer(chat(stack, MODEL, other, reuse=False))

        # 1. One worker, vLLM's own prefix cache, the three models interleaved and concurrent.
        jobs = list(MODELS) * 2
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda m: chat(stack, m, question), jobs))
        for model, result in zip(jobs, results):
            assert answer(result) == answer(references[model]), model
        system_blocks = (references[MODEL]["usage"]["prompt_tokens"] - 16) // BLOCK
        for model in MODELS:
            again = chat(stack, model, question)
            assert cached(again) >= system_blocks * BLOCK, model
            assert answer(again) == answer(references[model]), model

        # Each model's blocks reach the pool under its own model tag, and only there.
        deadline = time.monotonic() + 60
        while set(warm_tags(stack)) != set(tags.values()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert set(warm_tags(stack)) == set(tags.values())
        assert all(count >= system_blocks for count in warm_tags(stack).values())

        # 2. A fresh worker never computed these prompts: each model's prefix comes from the pool.
        replace_worker(stack)
        wait_for_models(stack, {MODEL, "alpha", "beta"})
        question = "Which river flows through Vienna?"
        for model in MODELS:
            on = chat(stack, model, question)
            assert cached(on) >= system_blocks * BLOCK, model
            assert answer(on) == answer(chat(stack, model, question, reuse=False)), model

        # 3. Run time: gamma loads into the running vLLM (its contract checked), serves and reuses; alpha
        #    unloads and is refused; the base and beta serve on.
        code, replies, stderr = adapter_cli(stack, "load", "gamma", str(gamma))
        assert code == 0 and all(r["ok"] for r in replies), (replies, stderr)
        assert sorted(r["service"] for r in replies) == ["fingerprinter", "worker"]
        wait_for_models(stack, {"gamma"})
        off = chat(stack, "gamma", question, reuse=False)
        assert answer(off) not in {answer(chat(stack, m, question, reuse=False)) for m in MODELS}
        chat(stack, "gamma", question)
        on = chat(stack, "gamma", question)
        assert cached(on) >= system_blocks * BLOCK and answer(on) == answer(off)
        code, replies, _ = adapter_cli(stack, "unload", "alpha")
        assert code == 0 and all("alpha" not in r["adapters"] for r in replies)
        deadline = time.monotonic() + 15
        while True:
            r = httpx.post(stack.http_url + "/v1/chat/completions", timeout=60, json={
                "model": "alpha", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
            if r.status_code == 404 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        for model in (MODEL, f"{MODEL}:beta"):
            assert answer(chat(stack, model, question)) == answer(chat(stack, model, question, reuse=False))
    finally:
        stack.stop()
