"""Shadow verification end to end (issue 16 fault test): blocks computed under other numerics (another rope
theta) but valid as units (correct hashes and HMAC) are planted in the ru-pool under the live base
namespace. A fresh worker loads them and answers wrongly; its shadow checks detect the divergence within a
bounded number of hits, the arbitrator quarantines the namespace, and from then on every answer equals
reuse off; an operator's clear brings reuse back, with correct blocks."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from kite_cli.arbitrator_admin import admin
from kite_shared.config import CommonConfig, ModelConfig, load
from kite_shared.model_store import identity, load_tokenizer, prepare
from kite_shared.security import ANONYMOUS_TENANT, ru_key, tenant_cache_salt
from kite_shared.service import connect_nats
from kite_shared.tiers.pool_client import PoolClient
from kite_worker.engines.reference.pool_outbox import encode_block
from tests.helpers import pool_stats, wait_until
from tests.integration import http_chat
from tests.integration.conftest import MODEL
from tests.integration.http_chat import answer, cached
from tests.planted_blocks import wrong_numerics_blocks

SYSTEM = {"role": "system", "content": "You are the verification test assistant. " +
          " ".join(f"Record {i}: the archive keeps ledger {i} in vault {i % 7}." for i in range(24))}
QUESTIONS = [f"Which vault keeps ledger {i}?" for i in range(40)]
SHADOW_FRACTION = 0.25  # P(no check in 40 hits) = 0.75^40 < 1e-5
MAX_HITS = 40
THINK_S = 0.5  # between requests; a worker checks only after KITE_SHADOW_IDLE_S (0.2 s) without requests


def chat(stack, question: str, reuse: bool = True) -> dict:
    return http_chat.chat(stack, SYSTEM, question, reuse=reuse)


def quarantines(stack) -> list:
    return [d for d in admin(stack.nats.url, "status").current if d.action == "quarantine"]


def the_quarantine(stack, namespace_fingerprint: str, hits: int, wrong: int, first_hit_at: float, label: str):
    """The one quarantine decision in force, once the arbitrator has made it: of this namespace, after
    planted hits that did change answers (the fault is real). Prints how fast it came."""
    [decision] = wait_until(lambda: quarantines(stack), 30, "the arbitrator's quarantine decision", interval_s=0.2)
    assert decision.target == namespace_fingerprint and decision.namespace == MODEL and hits >= 1
    print(f"\n{label}: {hits} planted hits served ({wrong} wrong answers) before quarantine, detected "
          f"{decision.issued_at - first_hit_at:.2f} s after the first hit")
    assert wrong >= 1
    return decision


def assert_no_reuse(stack, chat, references: dict[str, str], questions: list[str]) -> None:
    """Quarantined: every answer equals reuse off, and nothing is reused."""
    time.sleep(0.5)  # the decision reaches the worker and the pool
    for question in questions:
        response = chat(stack, question)
        assert answer(response) == references[question] and cached(response) == 0, question


async def plant(nats_url: str, units: list[bytes]) -> None:
    nc = await connect_nats(nats_url, "planter", load(CommonConfig), allow_reconnect=False)
    try:
        pool = PoolClient(nc)
        for unit in units:
            assert await pool.put(unit)
        await nc.flush()
    finally:
        await nc.close()


@pytest.mark.timeout(900)
def test_planted_divergent_blocks_are_caught_and_the_namespace_quarantined(fresh_stack_factory):
    stack = fresh_stack_factory(num_workers=1, env={"KITE_SHADOW_FRACTION": str(SHADOW_FRACTION)})
    cfg = load(ModelConfig, engine="transformers")
    local = prepare(cfg)
    base = identity(local, cfg)
    tok = load_tokenizer(local)
    prompt = tok.apply_chat_template([SYSTEM, {"role": "user", "content": QUESTIONS[0]}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    # The planted prefix covers the system prompt's full blocks, shared by every question.
    shared = len(tok.apply_chat_template([SYSTEM], tokenize=True, return_dict=False)) // cfg.block_size
    # Planted as the gateway would hash them: with the anonymous tenant's derived salt (auth is off).
    blocks = wrong_numerics_blocks(local, cfg, base, prompt, cache_salt=tenant_cache_salt(ANONYMOUS_TENANT))[:shared]
    assert len(blocks) >= 10
    asyncio.run(plant(stack.nats.url, [encode_block(b, ru_key()) for b in blocks]))
    wait_until(lambda: pool_stats(stack.nats.url, timeout_s=30.0), 30, f"the {len(blocks)} planted blocks in hot",
               done=lambda s: s.tiers["hot"].blocks >= len(blocks), interval_s=0.2)
    references = {q: answer(chat(stack, q, reuse=False)) for q in QUESTIONS[:MAX_HITS]}

    hits = wrong = 0
    first_hit_at = None
    for question in QUESTIONS[:MAX_HITS]:
        if quarantines(stack):
            break
        time.sleep(THINK_S)  # a user reading the last answer: idle time, in which workers run checks
        sent = time.time()
        response = chat(stack, question)
        if cached(response) >= len(blocks) * cfg.block_size:
            hits += 1
            first_hit_at = first_hit_at or sent
            wrong += answer(response) != references[question]
    the_quarantine(stack, base.fingerprint_hex, hits, wrong, first_hit_at, f"shadow fraction {SHADOW_FRACTION}")
    assert_no_reuse(stack, chat, references, QUESTIONS[:6])
    audit = pool_stats(stack.nats.url, timeout_s=30.0).namespaces[base.fingerprint_hex[:16]]
    assert audit.quarantined and audit.divergences >= 1 and audit.name == MODEL
    assert audit.blocks == 0  # purged

    # The quarantine outlives the arbitrator (kept in JetStream): a new one, started after a SIGKILL, has it.
    stack.kill("arbitrator")
    stack.start_arbitrator()
    wait_until(lambda: [d.target for d in quarantines(stack)], 30, "the new arbitrator to have the quarantine",
               done=lambda targets: targets == [base.fingerprint_hex], interval_s=0.3,
               ignore=(nats.errors.NoRespondersError, nats.errors.TimeoutError))  # not answering yet
    assert [d.target for d in quarantines(stack)] == [base.fingerprint_hex]

    # An operator clears it: blocks are computed anew (correctly) and reused again, once the clearing
    # has reached the worker (a decision over NATS: on a loaded 2-core VM it took longer than 0.5 s).
    assert admin(stack.nats.url, "clear_quarantine", model_fingerprint=base.fingerprint_hex).ok
    def answered_again() -> dict:
        assert answer(chat(stack, QUESTIONS[0])) == references[QUESTIONS[0]]
        again = chat(stack, QUESTIONS[1])
        assert answer(again) == references[QUESTIONS[1]]
        return again

    again = wait_until(answered_again, 30, "blocks reused again after the clearing",
                       done=lambda again: cached(again) > 0, interval_s=THINK_S)
    assert cached(again) > 0
    assert not quarantines(stack)
