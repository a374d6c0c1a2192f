"""Shadow verification on the vLLM engine (issue 16 fault test), as real processes: blocks the vLLM worker
saved are rewritten in the warm tier with other values (negated K and V: what another kernel, layout or rope
would give) but stay valid units (correct hashes and HMAC). A fresh vLLM worker loads them through its KV
connector and answers wrongly; its shadow checks (the first token's top log-probabilities, recomputed from
scratch while idle) detect the divergence, the arbitrator quarantines the namespace, and from then on
every answer equals reuse off; an operator's clear brings reuse back, with correct blocks."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import redis

from kite_cli.arbitrator_admin import admin
from kite_cli.stack import StackOptions
from kite_shared import recyclable_unit
from kite_shared.config import ModelConfig, load
from kite_shared.model_store import identity, prepare
from kite_shared.security import ru_key
from kite_shared.tiers.keys import REDIS_KEY_PREFIX, model_tag
from tests.helpers import pool_stats
from tests.integration import http_chat
from tests.integration.conftest import _start
from tests.integration.http_chat import answer, cached
from tests.integration.test_shadow_quarantine import assert_no_reuse, quarantines, the_quarantine
from tests.integration.test_vllm_worker import BLOCK, VLLM_ENV, replace_worker, restart_pool, wait_for_pool

SYSTEM = {"role": "system", "content": "You are the vLLM verification test assistant. " +
          " ".join(f"Record {i}: the archive keeps ledger {i} in vault {i % 7}." for i in range(24))}
QUESTIONS = [f"Which vault keeps ledger {i}?" for i in range(12)]
# A vLLM recomputation of this prompt takes about a second on two cores and a request arriving meanwhile
# aborts it: the simulated user reads each answer for longer than that.
THINK_S = 2.0


def chat(stack, question: str, reuse: bool = True) -> dict:
    return http_chat.chat(stack, SYSTEM, question, reuse=reuse)


def negate_warm_blocks(redis_url: str, model_fingerprint: str) -> int:
    """Rewrite every warm unit of the namespace with negated values, re-signed: valid units, wrong KV."""
    client = redis.Redis.from_url(redis_url)
    key = ru_key()
    count = 0
    for name in client.scan_iter(f"{REDIS_KEY_PREFIX}{model_tag(model_fingerprint)}:*"):
        unit = recyclable_unit.decode(client.get(name), key=key)
        # Flip each value's sign bit (fp16 and bf16: 16-bit words, fp32: 32-bit).
        words, sign = (np.uint32, 0x80000000) if unit.codec == "fp32" else (np.uint16, 0x8000)
        negated = (np.frombuffer(bytes(unit.payload), dtype=words) ^ words(sign)).tobytes()
        client.set(name, dataclasses.replace(unit, payload=negated).encode(key=key), keepttl=True)
        count += 1
    return count


@pytest.mark.timeout(1200)
def test_divergent_blocks_loaded_by_vllm_are_caught_and_the_namespace_quarantined():
    cfg = load(ModelConfig, engine="vllm", block_size=BLOCK)
    base = identity(prepare(cfg), cfg)
    stack = _start(StackOptions(num_workers=1, env={**VLLM_ENV, "KITE_SHADOW_FRACTION": "1.0"}))
    try:
        assert stack.redis is not None, "this test needs redis-server installed"
        references = {q: answer(chat(stack, q, reuse=False)) for q in QUESTIONS}
        first = chat(stack, QUESTIONS[0])
        system_blocks = (first["usage"]["prompt_tokens"] - 16) // BLOCK
        wait_for_pool(stack, lambda stats: stats.tiers["warm"].blocks >= system_blocks, "warm blocks")

        # The pool's memory is emptied (restart: its index comes from Redis) and the worker replaced, so the
        # next requests load the rewritten blocks from the warm tier.
        assert negate_warm_blocks(stack.redis.url, base.fingerprint_hex) >= system_blocks
        restart_pool(stack)
        replace_worker(stack)

        hits = wrong = 0
        first_hit_at = None
        for question in QUESTIONS[1:]:
            if quarantines(stack):
                break
            sent = time.time()
            response = chat(stack, question)
            if cached(response) >= system_blocks * BLOCK:
                hits += 1
                first_hit_at = first_hit_at or sent
                wrong += answer(response) != references[question]
            time.sleep(THINK_S)  # a user reading the answer: idle time, in which the worker checks
        the_quarantine(stack, base.fingerprint_hex, hits, wrong, first_hit_at, "vLLM, shadow fraction 1.0")
        assert_no_reuse(stack, chat, references, QUESTIONS[:4])  # vLLM's prefix cache included
        audit = pool_stats(stack.nats.url, timeout_s=30.0).namespaces[base.fingerprint_hex[:16]]
        assert audit.quarantined and audit.divergences >= 1 and audit.blocks == 0

        # An operator clears it: blocks are computed anew (correctly) and reused again.
        assert admin(stack.nats.url, "clear_quarantine", model_fingerprint=base.fingerprint_hex).ok
        time.sleep(0.5)
        chat(stack, QUESTIONS[0])
        again = chat(stack, QUESTIONS[1])
        assert cached(again) >= system_blocks * BLOCK and answer(again) == references[QUESTIONS[1]]
        assert not quarantines(stack)
    finally:
        stack.stop()
