"""A client that disconnects before its non-streaming answer (http_api._unless_disconnected) or in the
middle of its stream: every generation of the request is cancelled and closed (close() tells its worker to
stop), promptly, and the gateway answers nothing more; a client that stays gets its answer. Driven as raw ASGI, so the disconnect is the
message a server (uvicorn) hands the app, at the moment the test chooses."""

from __future__ import annotations

import asyncio
import json

import pytest

from kite_shared.messages import StreamEnd, Usage
from kite_gateway.http_api import CLIENT_CLOSED_REQUEST, create_app
from tests.helpers import wait_until_async


class HangingGeneration:
    """A generation whose worker never answers until told to stop."""

    worker_id = "worker-1"
    ttft_s = None

    def __init__(self, started: asyncio.Event, answer: bool) -> None:
        self.started = started
        self.answer = answer
        self.num_closes = 0
        self.cancelled = False

    async def events(self):
        self.started.set()
        if self.answer:
            yield StreamEnd(request_id="r", seq=0, finish_reason="stop", text="ok",
                            usage=Usage(prompt_tokens=3, completion_tokens=2))
            return
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        yield  # pragma: no cover - unreachable: makes this an async generator

    async def close(self) -> None:
        self.num_closes += 1


class Fleet:
    def alive(self, service: str) -> list[str]:
        return ["worker-1"]

    def models(self) -> list[str]:
        return []


class Client:
    fleet = Fleet()

    def __init__(self, answer: bool, generation_class: type[HangingGeneration] = HangingGeneration) -> None:
        self.answer = answer
        self.generation_class = generation_class
        self.started = asyncio.Event()
        self.generations: list[HangingGeneration] = []

    async def open(self, params):
        generation = self.generation_class(self.started, self.answer)
        self.generations.append(generation)
        return generation

    async def ping(self, service: str) -> bool:
        return True


async def call(client: Client, path: str, body: dict, disconnect: bool) -> list[dict]:
    """The ASGI messages the app sends for one POST; with `disconnect`, the client goes away once a
    generation has started."""
    app = create_app(lambda: client, "m", 8, 1 << 16)
    request_body = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(request_body)).encode())],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
    messages = [{"type": "http.request", "body": request_body, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        if disconnect:
            await client.started.wait()
            return {"type": "http.disconnect"}
        await asyncio.Event().wait()  # a client that stays sends nothing more
        raise AssertionError("unreachable")

    async def send(message: dict) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), 5)
    return sent


async def within_2_s(condition, what: str) -> None:
    await wait_until_async(condition, 2.0, what, interval_s=0.05)  # before: 40 tries 0.05 s apart


BODIES = {"/v1/chat/completions": {"model": "m", "n": 2, "messages": [{"role": "user", "content": "hi"}]},
          "/v1/completions": {"model": "m", "n": 2, "prompt": "hi"}}


@pytest.mark.parametrize("path", BODIES)
async def test_a_client_gone_before_its_answer_cancels_and_closes_every_generation(path):
    client = Client(answer=False)
    sent = await call(client, path, BODIES[path], disconnect=True)
    assert len(client.generations) == 2
    assert all(g.cancelled for g in client.generations)
    assert [g.num_closes for g in client.generations] == [1, 1]
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert [m["status"] for m in starts] in ([], [CLIENT_CLOSED_REQUEST])  # nobody is there to read it


@pytest.mark.parametrize("path", BODIES)
async def test_a_client_that_stays_gets_its_answer_and_each_generation_is_closed_once(path):
    client = Client(answer=True)
    sent = await call(client, path, BODIES[path], disconnect=False)
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [200]
    body = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
    assert len(body["choices"]) == 2 and body["usage"]["completion_tokens"] == 4
    assert [g.num_closes for g in client.generations] == [1, 1]
    assert not any(g.cancelled for g in client.generations)


@pytest.mark.parametrize("path", BODIES)
async def test_a_streaming_client_gone_mid_stream_cancels_and_closes_every_generation(path):
    client = Client(answer=False)
    sent = await call(client, path, {**BODIES[path], "stream": True}, disconnect=True)
    assert all(g.cancelled for g in client.generations) and len(client.generations) == 2
    assert [g.num_closes for g in client.generations] == [1, 1]
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [200]  # the stream had begun
    streamed = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert b"[DONE]" not in streamed  # cut short, not ended as if complete


class StubbornGeneration(HangingGeneration):
    """A generation whose wait swallows the first cancel, as Python 3.11's asyncio.wait_for does when the
    cancel and the awaited result arrive together: only a second cancel ends it."""

    async def events(self):
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            pass  # swallowed: the task goes on
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        yield  # pragma: no cover - unreachable: makes this an async generator


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", BODIES)
async def test_a_generation_that_swallows_a_cancel_is_cancelled_again_and_closed(path, stream):
    client = Client(answer=False, generation_class=StubbornGeneration)
    await call(client, path, {**BODIES[path], "stream": stream}, disconnect=True)
    assert len(client.generations) == 2
    assert [g.num_closes for g in client.generations] == [1, 1]  # each worker told to stop at once
    # A stream's pumps may still be ending (the response's cancel scope does not wait for them): the
    # second cancel comes within cancel_and_wait's interval (0.5 s).
    await within_2_s(lambda: all(g.cancelled for g in client.generations), "every generation cancelled")


class SlowClosingGeneration(HangingGeneration):
    """A generation whose close suspends (its cancel message waits for the connection's buffer): a caller
    cancelled meanwhile must not leave it, or the generations after it, unclosed."""

    async def close(self) -> None:
        await asyncio.sleep(0.05)
        self.num_closes += 1


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", BODIES)
async def test_generations_whose_close_suspends_are_all_closed_when_the_client_goes(path, stream):
    client = Client(answer=False, generation_class=SlowClosingGeneration)
    await call(client, path, {**BODIES[path], "stream": stream}, disconnect=True)
    assert len(client.generations) == 2
    # The closes go on after the response's cancel scope gave up on them.
    await within_2_s(lambda: [g.num_closes for g in client.generations] == [1, 1], "each generation closed once")
