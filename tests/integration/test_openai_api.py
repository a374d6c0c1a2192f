"""The OpenAI-compatible API through the real stack, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers import wait_until
from tests.integration.conftest import MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(kite_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=kite_stack.http_url + "/v1", api_key="unused", max_retries=0)


def test_chat_completion_answers_paris(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_yields_chunks_usage_and_done(kite_stack, client):
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 3
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    raw = httpx.post(kite_stack.http_url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 5, "stream": True})
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_streamed_text_equals_non_streamed(client):
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=30, stream=True) if c.choices)
    assert streamed == full.choices[0].message.content


def test_completions_text_and_stream(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8)
    assert r.choices[0].text and r.usage.completion_tokens <= 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8, stream=True) if c.choices)
    assert streamed == r.choices[0].text


def test_max_tokens_gives_length_finish(client):
    r = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", temperature=0, max_tokens=3)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_stop_string_cuts_output(client):
    base = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", temperature=0, max_tokens=12)
    text = base.choices[0].text
    assert "," in text
    stop = text[text.index(",") - 1:text.index(",") + 1] if text.index(",") > 0 else ","
    r = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", temperature=0, max_tokens=12, stop=[stop])
    assert stop not in r.choices[0].text
    assert text.startswith(r.choices[0].text) and r.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_n_choices(client):
    kwargs = dict(model=MODEL, messages=QUESTION, temperature=0.9, top_p=0.9, seed=1234, max_tokens=15)
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    b = client.chat.completions.create(**kwargs).choices[0].message.content
    assert a == b
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=1.0, max_tokens=5, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]


def served_length(stack) -> int:
    """/v1/models' max_model_len of the default model, once a worker's heartbeat has told the gateway (a
    worker's first beats, sent while it sets up, name no model yet)."""
    listed = wait_until(lambda: {m["id"]: m for m in httpx.get(stack.http_url + "/v1/models").json()["data"]},
                        10, f"/v1/models to give {MODEL}'s max_model_len",
                        done=lambda listed: "max_model_len" in listed[MODEL], interval_s=0.2)
    return listed[MODEL]["max_model_len"]


def test_models_lists_the_default_model(kite_stack, client):
    assert MODEL in [m.id for m in client.models.list().data]
    assert served_length(kite_stack) == 8192  # the checkpoint's window, as the workers serve it


def test_a_shorter_served_length_is_the_one_every_check_uses(fresh_stack_factory):
    """KITE_MAX_MODEL_LEN (issue 36): /v1/models reports it, the fingerprinter admits by it."""
    stack = fresh_stack_factory(num_workers=1, env={"KITE_MAX_MODEL_LEN": "512"})
    assert served_length(stack) == 512
    url = stack.http_url + "/v1/chat/completions"
    err = _error(httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "hello " * 600}]},
                            timeout=60), 400)
    assert err["code"] == "context_length_exceeded" and "maximum context length is 512 tokens" in err["message"]
    ok = httpx.post(url, json={"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 5}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5


def test_health_and_metrics(kite_stack):
    assert httpx.get(kite_stack.http_url + "/health").status_code == 200
    metrics = httpx.get(kite_stack.http_url + "/metrics").text
    assert "kite_requests_total" in metrics and "kite_ttft_seconds_bucket" in metrics


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("payload, param", [
    ({"model": MODEL, "messages": "hello"}, "messages"),
    ({"model": MODEL, "messages": QUESTION, "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "messages": QUESTION, "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "messages": QUESTION, "max_tokens": -5}, "max_tokens"),
    ({"model": MODEL, "messages": QUESTION, "n": 1000}, "n"),
    ({"model": MODEL, "messages": QUESTION, "top_p": 0}, "top_p"),
    ({"messages": QUESTION}, "model"),
])
def test_bad_parameters_get_400(kite_stack, payload, param):
    err = _error(httpx.post(kite_stack.http_url + "/v1/chat/completions", json=payload), 400)
    assert err["type"] == "invalid_request_error" and param in (err["param"] or "")


def test_invalid_json_unknown_model_and_context(kite_stack, client):
    url = kite_stack.http_url + "/v1/chat/completions"
    _error(httpx.post(url, content=b"{not json", headers={"Content-Type": "application/json"}), 400)
    err = _error(httpx.post(url, json={"model": "gpt-17", "messages": QUESTION}), 404)  # as OpenAI and vLLM
    assert err["code"] == "model_not_found" and err["param"] == "model"
    with pytest.raises(openai.NotFoundError):  # what the openai client raises for OpenAI's own answer
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
    err = _error(httpx.post(url, json={"model": MODEL, "messages": QUESTION, "max_tokens": 100_000}), 400)
    assert err["code"] == "context_length_exceeded"
    huge = [{"role": "user", "content": "hello " * 9000}]
    err = _error(httpx.post(url, json={"model": MODEL, "messages": huge}, timeout=60), 400)
    assert err["code"] == "context_length_exceeded"
    # a valid request right after the bad ones succeeds
    ok = httpx.post(url, json={"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 5}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


def test_oversized_body_gets_413(kite_stack):
    big = b'{"model": "x", "messages": [], "pad": "' + b"a" * 5_000_000 + b'"}'
    _error(httpx.post(kite_stack.http_url + "/v1/chat/completions", content=big,
                      headers={"Content-Type": "application/json"}), 413)
