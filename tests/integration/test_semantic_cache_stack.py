"""The semantic response cache through a real stack (nats-server, redis-server, the five services as
processes, the real model, the real embedding model), two tenants with API keys:

- a tenant's repeated question is computed (miss), computed again and compared (explore), then answered
  from the cache (hit) with the computed answer, as JSON and as a stream, without a worker;
- the same question from the other tenant never gets the first tenant's entry (miss, computed) nor its
  threshold (explored), then hits its own;
- its negation, from the first tenant, is guarded (computed), however similar it embeds;
- requests that did not ask, or cannot be cached (temperature above 0), say nothing / bypass;
- gRPC calls learn and hit the same entries as HTTP requests (a hit: the text, no token ids, the
  computation's counts), tenants apart; token-id prompts bypass;
- the gateway's metrics count the outcomes.

The knobs make one same-answer observation enough for a threshold (delta 0.5, one observation, no
exploration of hits), so that the test needs three requests, not hundreds; the decisions themselves are
the ones measured at delta 2% in bench/eval_semantic_cache.py.
"""

from __future__ import annotations

import json
import secrets

import grpc
import httpx
import pytest

from kite_cli.stack import StackOptions
from kite_shared.grpc_gen import kite_pb2, kite_pb2_grpc
from kite_shared.security import hash_api_key
from tests.helpers import wait_until
from tests.integration.conftest import MODEL, _start

ALICE_KEY = "kite-alice-" + secrets.token_hex(12)
BOB_KEY = "kite-bob-" + secrets.token_hex(12)
# Unique per run: no earlier entry can answer it.
QUESTION = f"In one sentence, what is the capital city of France? (check {secrets.token_hex(3)})"
NEGATED = f"In one sentence, what is not the capital city of France? (check {QUESTION[-7:-1]})"


@pytest.fixture(scope="module")
def stack():
    stack = _start(StackOptions(num_workers=1, env={
        "KITE_AUTH_ENABLED": "on",
        "KITE_API_KEYS": f"alice:{hash_api_key(ALICE_KEY)},bob:{hash_api_key(BOB_KEY)}",
        "KITE_SEMANTIC_CACHE_TENANTS": "alice,bob",
        "KITE_SEMANTIC_CACHE_DELTA": "0.5",
        "KITE_SEMANTIC_CACHE_MIN_OBSERVATIONS": "1",
        "KITE_SEMANTIC_CACHE_EXPLORE_FRACTION": "0",
    }))
    yield stack
    stack.stop()


def ask(stack, key: str, question: str, stream: bool = False, **extra) -> httpx.Response:
    body = {"model": MODEL, "temperature": 0, "max_tokens": 12, "stream": stream,
            "messages": [{"role": "user", "content": question}], **extra}
    body.setdefault("kite", {"semantic_cache": True})
    response = httpx.post(stack.http_url + "/v1/chat/completions", timeout=120, json=body,
                          headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response


def outcome(response: httpx.Response) -> str:
    said = response.headers["X-Kite-Semantic-Cache"]
    assert response.json()["kite"]["semantic_cache"]["outcome"] == said
    return said


def answer(response: httpx.Response) -> str:
    return response.json()["choices"][0]["message"]["content"]


def stream_events(response: httpx.Response) -> list[dict]:
    lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_tenant_learns_then_hits_and_the_other_tenant_never_shares(stack):
    first = ask(stack, ALICE_KEY, QUESTION)
    assert outcome(first) == "miss" and first.headers.get("X-Kite-Worker")
    computed = answer(first)
    second = ask(stack, ALICE_KEY, QUESTION)  # no threshold yet: computed and compared with the entry
    assert outcome(second) == "explore" and answer(second) == computed
    assert second.json()["kite"]["semantic_cache"]["similarity"] == pytest.approx(1.0, abs=1e-3)

    # The label is written after the answer was sent: the next request may come before it landed.
    third = wait_until(lambda: ask(stack, ALICE_KEY, QUESTION), 10, "alice's question to be a hit",
                       done=lambda r: outcome(r) == "hit", interval_s=0.2, describe=lambda r: r.json())
    assert outcome(third) == "hit", third.json()
    assert answer(third) == computed and "X-Kite-Worker" not in third.headers  # no worker was asked
    assert third.json()["choices"][0]["finish_reason"] == first.json()["choices"][0]["finish_reason"]

    streamed = ask(stack, ALICE_KEY, QUESTION, stream=True, stream_options={"include_usage": True})
    assert streamed.headers["X-Kite-Semantic-Cache"] == "hit"
    events = stream_events(streamed)
    assert events[0]["kite"]["semantic_cache"]["outcome"] == "hit"
    assert "".join(c["delta"].get("content", "") for e in events for c in e["choices"]) == computed
    assert events[-1]["usage"] == first.json()["usage"]

    bob = ask(stack, BOB_KEY, QUESTION)  # the same question from another tenant: its own miss, computed
    assert outcome(bob) == "miss" and bob.headers.get("X-Kite-Worker")
    assert bob.json()["kite"]["semantic_cache"].get("similarity") is None  # bob has no entry near it
    # Nor do labels: alice's threshold does not serve bob, whose own entry is explored until his label
    # (written after the answer) teaches his threshold.
    bob_again = ask(stack, BOB_KEY, QUESTION)
    assert outcome(bob_again) == "explore" and answer(bob_again) == answer(bob)
    assert "threshold" not in bob_again.json()["kite"]["semantic_cache"]
    bob_third = wait_until(lambda: ask(stack, BOB_KEY, QUESTION), 10, "bob's question to be a hit",
                           done=lambda r: outcome(r) == "hit", interval_s=0.2, describe=lambda r: r.json())
    assert outcome(bob_third) == "hit" and answer(bob_third) == answer(bob)

    negated = ask(stack, ALICE_KEY, NEGATED)
    assert outcome(negated) == "guarded" and negated.headers.get("X-Kite-Worker")
    assert negated.json()["kite"]["semantic_cache"]["similarity"] > 0.8  # it does embed alike


def test_requests_that_do_not_ask_or_cannot_be_cached(stack):
    plain = ask(stack, ALICE_KEY, QUESTION, kite={})
    assert "X-Kite-Semantic-Cache" not in plain.headers and "kite" not in plain.json()
    sampled = ask(stack, ALICE_KEY, QUESTION, temperature=0.7, seed=1)
    assert outcome(sampled) == "bypass" and "temperature" in sampled.json()["kite"]["semantic_cache"]["reason"]
    metrics = httpx.get(stack.http_url + "/metrics", timeout=10).text
    counts = {line.split('"')[1]: float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith("kite_gateway_semantic_cache_lookups_total{")}
    assert counts.get("bypass", 0) >= 1 and counts.get("hit", 0) >= 1 and counts.get("guarded", 0) >= 1


def grpc_ask(stack, key: str, question: str | None = None, semantic_cache: bool = True,
             **fields) -> tuple[str, list[int], kite_pb2.End]:
    """(text, token ids, End) of one Generate call: `question` as a chat, or `fields`' input."""
    if question is not None:
        fields["messages"] = kite_pb2.ChatMessages(messages=[kite_pb2.Message(role="user", content=question)])
    request = kite_pb2.GenerateRequest(**{"model": MODEL, "temperature": 0, "max_tokens": 12,
                                          "semantic_cache": semantic_cache, **fields})
    with grpc.insecure_channel(stack.grpc_target) as channel:
        responses = list(kite_pb2_grpc.KiteStub(channel).Generate(
            request, timeout=120, metadata=(("authorization", f"Bearer {key}"),)))
    assert [r.WhichOneof("event") for r in responses][-1] == "end"
    chunks = [r.chunk for r in responses[:-1]]
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], responses[-1].end


def test_grpc_calls_learn_and_hit_the_entries_http_requests_share(stack):
    question = f"In one sentence, what is the capital city of Italy? (check {secrets.token_hex(3)})"
    computed, token_ids, end = grpc_ask(stack, ALICE_KEY, question)
    # Computed: no entry near it, or the nearest (France, when the test above ran) names another country.
    assert end.semantic_cache.outcome in ("miss", "guarded") and computed and token_ids

    # The gRPC answer became an entry: HTTP asks the same (explored first when no threshold exists yet; the
    # entry and the label are written after the answers were sent) until the entry answers.
    def asked_over_http():
        http = ask(stack, ALICE_KEY, question)
        assert answer(http) == computed, http.json()  # explored, or the hit: always the computed answer
        return http

    http = wait_until(asked_over_http, 10, "the gRPC call's entry to answer over HTTP",
                      done=lambda r: outcome(r) == "hit", interval_s=0.2, describe=lambda r: r.json())
    assert outcome(http) == "hit" and answer(http) == computed

    text, token_ids, hit = grpc_ask(stack, ALICE_KEY, question)
    assert hit.semantic_cache.outcome == "hit" and hit.semantic_cache.HasField("similarity")
    assert text == computed and token_ids == []  # the cache keeps answers as text
    # The counts of the computation behind the entry (cached tokens may differ: an HTTP run's entry may
    # be the nearest, computed with the prefix reused).
    assert (hit.usage.prompt_tokens, hit.usage.completion_tokens, hit.finish_reason) == \
        (end.usage.prompt_tokens, end.usage.completion_tokens, end.finish_reason)

    _, bob_token_ids, bob = grpc_ask(stack, BOB_KEY, question)  # never alice's entry (similarity 1)
    assert bob.semantic_cache.outcome in ("miss", "guarded") and bob_token_ids
    assert not bob.semantic_cache.HasField("similarity") or bob.semantic_cache.similarity < 0.999


def test_grpc_calls_that_do_not_ask_or_cannot_be_cached(stack):
    _, token_ids, plain = grpc_ask(stack, ALICE_KEY, QUESTION, semantic_cache=False)
    assert not plain.HasField("semantic_cache") and token_ids
    _, _, ids = grpc_ask(stack, ALICE_KEY, prompt_token_ids=kite_pb2.TokenIds(ids=[504, 3458, 314]))
    assert ids.semantic_cache.outcome == "bypass" and "text prompts" in ids.semantic_cache.reason
    _, _, sampled = grpc_ask(stack, ALICE_KEY, QUESTION, seed=1, temperature=0.7)
    assert sampled.semantic_cache.outcome == "bypass" and "temperature" in sampled.semantic_cache.reason
