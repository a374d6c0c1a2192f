"""kite_gateway.normalize: the HTTP and the gRPC API turn the same request into the same GenerationParams
(one set of rules, one salt derivation), and a gRPC field that breaks a rule is named as in the proto."""

from __future__ import annotations

import pytest

from kite_gateway.normalize import InvalidArgument, chat_params, completion_params, grpc_params
from kite_gateway.openai_protocol import ChatCompletionRequest, CompletionRequest
from kite_shared.grpc_gen import kite_pb2
from kite_shared.security import tenant_cache_salt


def test_a_chat_means_the_same_over_http_and_grpc():
    http = chat_params(ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": -5, "stop": ["\n"], "cache_salt": "s",
        "kite": {"reuse": False}}), "acme")
    grpc = grpc_params(kite_pb2.GenerateRequest(
        model="m", messages=kite_pb2.ChatMessages(messages=[kite_pb2.Message(role="developer", content="Be brief."),
                                                            kite_pb2.Message(role="user", content="Hi")]),
        max_tokens=7, temperature=0.5, top_p=0.9, seed=-5, stop=["\n"], cache_salt="s", disable_reuse=True), "acme")
    assert http == grpc
    assert grpc.cache_salt == tenant_cache_salt("acme", "s") and grpc.tenant == "acme"
    assert grpc.sampling.seed == -5 % 2**63 and [m.role for m in grpc.messages] == ["system", "user"]


def test_completions_over_http_and_grpc_and_seeds_only_grpc_can_carry():
    http = completion_params(CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2], [3]]}), "t")
    assert [p.prompt_token_ids for p in http] == [[1, 2], [3]]
    assert {p.cache_salt for p in http} == {tenant_cache_salt("t", "")}
    grpc = grpc_params(kite_pb2.GenerateRequest(model="m", prompt_token_ids=kite_pb2.TokenIds(ids=[1, 2]),
                                                seed=2**62), "t")
    assert (grpc.prompt_token_ids, grpc.cache_salt) == (http[0].prompt_token_ids, http[0].cache_salt)
    assert grpc.sampling.seed == 2**62  # beyond a JSON double's exact range: exact over gRPC


@pytest.mark.parametrize("fields, message", [
    (dict(prompt="x"), "model: "),
    (dict(model="m"), "one of messages, prompt or prompt_token_ids is required"),
    (dict(model="m", messages=kite_pb2.ChatMessages()), "messages: "),
    (dict(model="m", messages=kite_pb2.ChatMessages(messages=[kite_pb2.Message(role="robot", content="x")])),
     "messages[0].role: Input should be 'system', 'developer', 'user' or 'assistant'"),
    (dict(model="m", prompt_token_ids=kite_pb2.TokenIds()), "prompt_token_ids: "),
    (dict(model="m", prompt="x", temperature=float("nan")), "temperature: "),
    (dict(model="m", prompt="x", top_p=0.0), "top_p: Input should be greater than 0"),
    (dict(model="m", prompt="x", max_tokens=0), "max_tokens: Input should be greater than or equal to 1"),
    (dict(model="m", prompt="x", stop=["a", "b", "c", "d", "e"]), "stop: "),
    (dict(model="m", prompt="x", cache_salt="s" * 257), "cache_salt: String should have at most 256 characters"),
])
def test_a_grpc_field_that_breaks_a_rule_is_named_as_in_the_proto(fields, message):
    with pytest.raises(InvalidArgument) as refused:
        grpc_params(kite_pb2.GenerateRequest(**fields), "t")
    assert str(refused.value).startswith(message), str(refused.value)
