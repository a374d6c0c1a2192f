"""The gateway's side of the semantic cache that needs no store: which requests may be looked up (and why
the others bypass), what goes into a namespace, and when two computed answers count as the same."""

from __future__ import annotations

import pytest

from kite_cli.local_servers import free_port
from kite_gateway.fleet import Fleet
from kite_gateway.semantic import SemanticResponses, request_key, same_answer
from kite_shared.config import ConfigError, GatewayConfig, load
from kite_shared.messages import ChatMessage, Heartbeat, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
SYSTEM = ChatMessage(role="system", content="You are terse.")


def test_the_namespace_key_holds_everything_but_the_embedded_text():
    key = request_key("chat", [SYSTEM], GREEDY)
    assert key == request_key("chat", [ChatMessage(role="system", content="You are terse.")], GREEDY)
    assert len({key, request_key("completion", [SYSTEM], GREEDY), request_key("chat", [], GREEDY),
                request_key("chat", [SYSTEM], GREEDY.model_copy(update={"max_tokens": 17})),
                request_key("chat", [SYSTEM], GREEDY.model_copy(update={"stop": ["\n"]})),
                request_key("chat", [SYSTEM], GREEDY.model_copy(update={"ignore_eos": True}))}) == 6


def test_answers_are_the_same_up_to_whitespace_and_case_only():
    assert same_answer("Paris is the capital.", "  paris   is the\ncapital. ")
    assert not same_answer("Paris.", "Paris")
    assert not same_answer("It is safe.", "It is not safe.")


@pytest.fixture()
def semantic():
    fleet = Fleet(dead_after_s=60)
    fleet.observe(Heartbeat(service="fingerprinter", instance_id="f1", started_at=0, sent_at=0, model="m",
                            model_fingerprints={"m": "ab" * 32}))
    cfg = load(GatewayConfig, {}, redis_url=f"redis://127.0.0.1:{free_port()}", semantic_cache_tenants="acme")
    responses = SemanticResponses.from_config(cfg, fleet, origin="test")
    responses.embed = lambda texts: pytest.fail("a bypassed request is never embedded")
    return responses


@pytest.mark.parametrize("tenant, model, messages, prompt, sampling, num_choices, reason", [
    ("globex", "m", [], "Hi", GREEDY, 1, "not enabled for this tenant"),
    ("acme", "m", [], "Hi", GREEDY.model_copy(update={"temperature": 0.7}), 1, "temperature is not 0"),
    ("acme", "m", [], "Hi", GREEDY, 2, "one choice"),
    ("acme", "m", [ChatMessage(role="user", content="Hi"), ChatMessage(role="assistant", content="Hello")], "",
     GREEDY, 1, "last message is not the user's"),
    ("acme", "m", [], "", GREEDY, 1, "only text prompts"),  # a prompt of token ids
    ("acme", "other-model", [], "Hi", GREEDY, 1, "fingerprint is not known"),
])
async def test_requests_whose_answer_is_not_a_function_of_the_prompt_bypass(semantic, tenant, model, messages,
                                                                            prompt, sampling, num_choices, reason):
    try:
        consulted = await semantic.consult(tenant, model, "chat", messages, prompt, sampling, num_choices)
        assert consulted.outcome == "bypass" and reason in consulted.reason
        assert consulted.report() == {"outcome": "bypass", "reason": consulted.reason}
    finally:
        await semantic.close()


def test_the_cache_needs_its_store_and_sane_knobs():
    with pytest.raises(ConfigError, match="KITE_REDIS_URL"):
        load(GatewayConfig, {}, semantic_cache_tenants="*", redis_url="")
    with pytest.raises(ConfigError, match="DELTA"):
        load(GatewayConfig, {}, semantic_cache_delta=1.0)
    assert load(GatewayConfig, {}).semantic_cache_tenant_set() == frozenset()
    assert load(GatewayConfig, {}, semantic_cache_tenants=" acme, globex ,", redis_url="redis://x"
                ).semantic_cache_tenant_set() == {"acme", "globex"}
