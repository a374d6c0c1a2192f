"""One chat completion through a test stack's HTTP API, and what the tests read of its answer."""

from __future__ import annotations

import httpx

from tests.integration.conftest import MODEL


def chat(stack, system: dict, question: str, model: str = MODEL, reuse: bool = True, max_tokens: int = 10) -> dict:
    """A greedy answer to `question` after the `system` message; asserts a 200."""
    r = httpx.post(stack.http_url + "/v1/chat/completions", timeout=180, json={
        "model": model, "temperature": 0, "max_tokens": max_tokens, "kite": {"reuse": reuse},
        "messages": [system, {"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    return r.json()


def answer(response: dict) -> str:
    return response["choices"][0]["message"]["content"]


def cached(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]
