"""The worker service's handlers and drain without NATS or a model (kite_worker.service): admission through
the generate endpoint as the entrypoint declares it, cancellation, stream events after telemetry, the drain.
The bus and the engine (kite_worker.engines.base.Engine) are stand-ins; over real NATS and a real model:
tests/integration/test_faults.py."""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace

import pytest

from kite_shared import subjects
from kite_shared.config import CommonConfig, WorkerConfig, load
from kite_shared.endpoints import Endpoint
from kite_shared.messages import (STREAM_EVENT, Admission, Cancel, SamplingParams, StreamBatch, StreamEnd, TokenChunk,
                                  TokenizedRequest, Usage, WorkerTelemetry)
from kite_shared.service import ServiceRuntime
from kite_worker.engines.base import EngineLoad, RequestRejected
from kite_worker.service import LoadedModel, WorkerService


class Bus:
    """What the service uses of a nats-py client."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []
        self.subscribed: dict[str, object] = {}
        self.is_connected = True
        self.fail_telemetry = False

    async def flush(self, timeout: float | None = None) -> None:  # serve waits for the server to have the SUBs
        return None

    async def publish(self, subject: str, data: bytes) -> None:
        if self.fail_telemetry and subject == subjects.telemetry("worker"):
            raise RuntimeError("telemetry broke")
        self.published.append((subject, data))

    async def subscribe(self, subject: str, queue: str = "", cb=None):
        bus = self

        class Subscription:
            async def unsubscribe(self) -> None:
                bus.subscribed.pop(subject)

        self.subscribed[subject] = cb
        return Subscription()


class StandInEngine:
    """The engine contract, recording what the service asks of it."""

    max_running = 2
    num_shadow_checks_waiting = 0
    shadow = None  # no shadow verification
    pool_read = False
    adapters: dict = {}

    def __init__(self) -> None:
        self.enqueued: list[str] = []
        self.cancelled: list[str] = []
        self.active: set[str] = set()
        self.stopped = False
        self.ttft_samples: deque[float] = deque()
        self.alive = True

    num_queued = property(lambda self: 0)
    num_running = property(lambda self: len(self.active))

    def load(self) -> EngineLoad:
        return EngineLoad(running_tokens=0, prefill_backlog_tokens=0, cache_bytes=0, cache_capacity_bytes=1,
                          prompt_tokens_reused=0, prompt_tokens_computed=0, prefill_seconds_per_token=0.0,
                          decode_seconds_per_token=0.0)

    def reserve(self, request: TokenizedRequest):
        if request.request_id.startswith("overload"):
            raise RequestRejected("overloaded", "worker queue is full")
        self.active.add(request.request_id)
        return SimpleNamespace(request=request, request_id=request.request_id)

    def submit(self, seq) -> None:
        self.enqueued.append(seq.request_id)

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    def cancel_all(self) -> None:
        self.cancelled.append("*")
        self.active.clear()

    def idle(self) -> bool:
        return not self.active

    async def start(self, hooks) -> None:
        pass

    async def close(self, bus_connected: bool) -> None:
        self.stopped = True


@pytest.fixture()
async def worker() -> WorkerService:
    rt = ServiceRuntime("worker", load(CommonConfig, instance_id="w1"))
    rt.nc = Bus()
    loaded = LoadedModel(SimpleNamespace(name="m", max_context_tokens=64), SimpleNamespace(fingerprint_hex="ab" * 32),
                         StandInEngine())  # the stand-in engine checks nothing
    service = WorkerService(rt, loaded, load(WorkerConfig, standby=False))
    await service.start()
    generate = Endpoint(subjects.WORKER_GENERATE, service.generate, span="kite.worker.admit")
    service.take_requests_on(generate)
    await service.control.start()
    return service


def request(request_id: str, batch_subject: str = "") -> bytes:
    return TokenizedRequest(request_id=request_id, model="m", prompt_token_ids=[1, 2, 3],
                            sampling=SamplingParams(max_tokens=4), reuse=True, model_fingerprint="ab" * 32,
                            block_size=16, block_hashes=[], stream_subject=subjects.stream("g", request_id),
                            stream_batch_subject=batch_subject, created_at=0.0).encode()


async def admit(worker: WorkerService, data: bytes) -> Admission:
    endpoint = Endpoint(subjects.WORKER_GENERATE, worker.generate)
    return await endpoint.answer(data)


async def test_admission_accepts_refuses_and_rejects_bad_messages(worker):
    assert subjects.WORKER_GENERATE in worker.rt.nc.subscribed  # joined: not standing by
    reply = await admit(worker, request("r1"))
    assert reply.accepted and reply.worker_id == "w1" and reply.prompt_tokens == 3
    assert worker.engine.enqueued == ["r1"] and worker.control.snapshot().requests_accepted == 1
    reply = await admit(worker, request("overloaded-1"))
    assert not reply.accepted and reply.error.code == "overloaded"
    reply = await admit(worker, b"\x00 not a request")
    assert not reply.accepted and reply.error.code == "invalid_message"
    worker.rt.draining = True
    reply = await admit(worker, request("r2"))
    assert not reply.accepted and reply.error.code == "shutting_down"
    await worker.cancel(Cancel(request_id="r1"))
    assert worker.engine.cancelled == ["r1"]


async def test_a_streams_last_event_follows_telemetry_even_when_telemetry_fails(worker):
    bus = worker.rt.nc
    bus.published.clear()  # (the ru-pool heard at start that this worker's cache is empty)
    end = StreamEnd(request_id="r1", seq=1, finish_reason="length",
                    usage=Usage(prompt_tokens=3, completion_tokens=1))
    worker._emit_from_engine("s", TokenChunk(request_id="r1", seq=0, token_ids=[5], text="x"))
    await worker.publish_stream_events()
    worker._emit_from_engine("s", end)
    await worker.publish_stream_events()
    assert [s for s, _ in bus.published] == ["s", subjects.telemetry("worker"), "s"]
    assert WorkerTelemetry.decode(bus.published[1][1]).instance_id == "w1"
    bus.fail_telemetry = True
    worker._emit_from_engine("s", end)
    with pytest.raises(RuntimeError):  # reported by the runtime's loop ...
        await worker.publish_stream_events()
    assert bus.published[-1][0] == "s" and worker._unsent == 0  # ... and the stream still ends


async def test_events_ready_at_once_go_to_each_gateway_in_one_batch_in_order(worker):
    bus = worker.rt.nc
    batch_g1, batch_g2 = subjects.stream_batch("g1"), subjects.stream_batch("g2")
    for request_id, batch_subject in [("a", batch_g1), ("b", batch_g2), ("c", batch_g1), ("old", "")]:
        assert (await admit(worker, request(request_id, batch_subject))).accepted
    bus.published.clear()
    step = [TokenChunk(request_id=r, seq=0, token_ids=[5], text="x") for r in ("a", "b", "c", "old")]
    for event in step + [StreamEnd(request_id="a", seq=1, finish_reason="stop",
                                   usage=Usage(prompt_tokens=3, completion_tokens=1))]:
        worker._emit_from_engine(subjects.stream("g", event.request_id), event)
    await worker.publish_stream_events()  # everything ready goes in one round
    assert [s for s, _ in bus.published] == [subjects.telemetry("worker"), subjects.stream("g", "old"),
                                            batch_g1, batch_g2]
    g1 = StreamBatch.decode(bus.published[2][1])
    assert g1.request_ids == ["a", "c", "a"]
    assert [STREAM_EVENT.decode(e).seq for e in g1.events] == [0, 0, 1]  # each request's events in order
    assert StreamBatch.decode(bus.published[3][1]).request_ids == ["b"]
    assert "a" not in worker._batch_subjects and worker._unsent == 0  # its stream ended


async def test_drain_leaves_first_and_cancels_everything_once_the_bus_is_gone(worker):
    bus = worker.rt.nc
    assert (await admit(worker, request("r1"))).accepted
    worker.rt.draining = True
    drain = asyncio.ensure_future(worker.drain())
    await asyncio.sleep(0.2)
    assert subjects.WORKER_GENERATE not in bus.subscribed and not drain.done()  # waits for r1
    bus.is_connected = False
    await asyncio.wait_for(drain, 2)
    assert worker.engine.cancelled == ["*"] and worker.engine.stopped
