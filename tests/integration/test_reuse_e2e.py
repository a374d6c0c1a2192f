"""Upcycle through the whole stack: a shared system prompt is computed once, reported as cached_tokens,
and never changes an answer."""

from __future__ import annotations

import httpx

from tests.integration.conftest import MODEL

BLOCK_SIZE = 16
SYSTEM = {"role": "system", "content": "You are KITE's integration-test assistant. " +
          " ".join(f"Rule {i}: answer briefly and truthfully about geography item {i}." for i in range(40))}


def _chat(stack, question: str, reuse: bool = True) -> dict:
    r = httpx.post(stack.http_url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "temperature": 0, "max_tokens": 12, "kite": {"reuse": reuse},
        "messages": [SYSTEM, {"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    return r.json()


def _prompt_ids(question: str) -> list[int]:
    from kite_shared.config import ModelConfig, load
    from kite_shared.model_store import load_tokenizer, prepare

    tok = load_tokenizer(prepare(load(ModelConfig)))
    return tok.apply_chat_template([SYSTEM, {"role": "user", "content": question}],
                                   add_generation_prompt=True, tokenize=True, return_dict=False)


def test_second_request_reuses_shared_full_blocks(kite_stack):
    first = _chat(kite_stack, "What is the capital of Spain?")
    second = _chat(kite_stack, "What is the capital of Portugal?")
    a, b = _prompt_ids("What is the capital of Spain?"), _prompt_ids("What is the capital of Portugal?")
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    expected = (shared // BLOCK_SIZE) * BLOCK_SIZE
    assert expected >= 256
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == expected
    assert first["usage"]["prompt_tokens"] == len(a)


def test_reuse_on_equals_reuse_off(kite_stack):
    question = "Which river flows through Paris?"
    _chat(kite_stack, question)  # make sure its blocks are cached
    on = _chat(kite_stack, question, reuse=True)
    off = _chat(kite_stack, question, reuse=False)
    assert on["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert off["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert on["choices"][0]["message"]["content"] == off["choices"][0]["message"]["content"]
