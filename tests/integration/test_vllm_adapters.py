"""LoRA adapters on the vLLM engine (issue 16), as real processes: nats-server, redis-server, the ru-pool,
the fingerprinter and a vLLM-CPU worker serving the base and two adapters (vLLM's LoRA layers).

Each model's greedy answer with reuse (vLLM's own prefix cache, then the pool after the worker is
replaced) equals reuse off; the pool's warm tier keeps each model's blocks under its own tag; an adapter
loaded at run time serves and reuses like a configured one; an unloaded one is refused. vLLM workers take
about a minute to start on two cores, so one stack walks through the phases in order.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from kite_cli.stack import StackOptions
from tests.helpers import wait_until
from tests.integration import http_chat
from tests.integration.conftest import MODEL, _start
from tests.integration.http_chat import answer, cached
from tests.integration.test_adapters_stack import MODELS, SYSTEM, adapter_cli, wait_for_models, wait_until_refused, \
    warm_tags
from tests.integration.test_vllm_worker import BLOCK, VLLM_ENV, replace_worker
from tests.lora_adapters import served_adapters

@pytest.fixture(scope="module")
def vllm_adapter_folders(tmp_path_factory):
    """alpha and beta configured at start, gamma for a run-time load; declared for vLLM's 32-token blocks."""
    folder = tmp_path_factory.mktemp("vllm-adapters")
    setting, tags = served_adapters(folder, "vllm", {"alpha": 1, "beta": 2})
    gamma, _ = served_adapters(folder, "vllm", {"gamma": 3})
    return setting, tags, gamma.split("=", 1)[1]


def worker_warnings(stack) -> list[str]:
    """What the workers logged at WARNING or above (why a prefix was computed rather than loaded)."""
    return [line for proc in stack.workers() for line in stack.tail(proc, 1_000_000).splitlines()
            if '"level": "WARNING"' in line or '"level": "ERROR"' in line]


def chat(stack, model: str, question: str, reuse: bool = True) -> dict:
    return http_chat.chat(stack, SYSTEM, question, model=model, reuse=reuse, max_tokens=16)


# Two vLLM starts (40-60 s each on 2 cores) and about 40 requests: 309 s on 2026-12-07, past the suite's
# 300 s default.
@pytest.mark.timeout(600)
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
        wait_until(lambda: warm_tags(stack), 60, "each model's blocks in warm under its own tag",
                   done=lambda found: set(found) == set(tags.values()), interval_s=0.5)
        assert set(warm_tags(stack)) == set(tags.values())
        assert all(count >= system_blocks for count in warm_tags(stack).values())

        # 2. A fresh worker never computed these prompts: each model's prefix comes from the pool.
        replace_worker(stack)
        wait_for_models(stack, {MODEL, "alpha", "beta"})
        question = "Which river flows through Vienna?"
        for model in MODELS:
            on = chat(stack, model, question)
            assert cached(on) >= system_blocks * BLOCK, (model, worker_warnings(stack))
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
        wait_until_refused(stack, "alpha")
        for model in (MODEL, f"{MODEL}:beta"):
            assert answer(chat(stack, model, question)) == answer(chat(stack, model, question, reuse=False))
    finally:
        stack.stop()
