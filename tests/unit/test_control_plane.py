"""Pure parts of the control plane: the router's live-worker set, the worker's write-policy filter, the
gateway's request stats and admission gate (issue 5)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kite_fingerprinter.router import LiveWorkers
from kite_gateway.control import AdmissionGate, RequestStats
from kite_gateway.errors import ApiError
from kite_shared import subjects
from kite_shared.messages import GenerateRequest, Heartbeat, SamplingParams
from kite_shared.messages import Decision, WorkerTelemetry
from kite_worker.write_policy import WritePolicyFilter


def beat(name: str, draining: bool = False) -> Heartbeat:
    return Heartbeat(service="worker", instance_id=name, started_at=0, sent_at=0, draining=draining)


def test_live_workers_need_telemetry_leave_when_silent_and_rejoin():
    live = LiveWorkers(timeout_s=5.0)
    live.heartbeat(beat("w1"), now=0.0)
    assert live.candidates(0.0) == []  # heartbeat only: maybe an old build, the queue group serves it
    live.telemetry(WorkerTelemetry(instance_id="w1", sent_at=100.0), now=0.0)
    live.telemetry(WorkerTelemetry(instance_id="w2", sent_at=100.0, standby=True), now=0.0)
    assert [w.worker_id for w in live.candidates(1.0)] == ["w1"]  # standby is not a candidate
    assert live.candidates(5.5) == []  # silent > 5 s: out of the routing set
    live.heartbeat(beat("w1"), now=6.0)
    assert [w.worker_id for w in live.candidates(6.0)] == ["w1"]  # back with its next message
    live.heartbeat(beat("w1", draining=True), now=7.0)
    assert live.candidates(7.0) == []


def test_live_workers_count_requests_sent_since_the_last_telemetry():
    live = LiveWorkers(timeout_s=5.0)
    live.telemetry(WorkerTelemetry(instance_id="w1", sent_at=100.0), now=0.0)
    live.sent("w1", "r1", 300, at=100.5)
    live.sent("w1", "r2", 200, at=100.6)
    w = live.candidates(0.1)[0]
    assert (w.pending_tokens, w.pending_requests) == (500, 2)
    live.telemetry(WorkerTelemetry(instance_id="w1", sent_at=100.7, queue_depth=2,
                                   admitted_request_ids=["r1", "r2"]), now=0.2)
    w = live.candidates(0.2)[0]
    assert (w.pending_tokens, w.queue_depth) == (0, 2)  # now in the worker's own numbers


def test_a_request_is_pending_until_the_telemetry_that_counts_it():
    """The router counts a request as pending from its decision, before the admission's round trip, until
    the worker's telemetry names it as admitted (and so counts it itself): never both at once, however the
    admission's reply and the telemetry message interleave; a refusal takes it back; a telemetry message
    that was lost leaves it until it is 5 s old."""
    live = LiveWorkers(timeout_s=5.0)
    live.telemetry(WorkerTelemetry(instance_id="w1", sent_at=100.0), now=0.0)
    live.sent("w1", "admitted", 300, at=100.500)
    live.sent("w1", "on its way", 200, at=100.501)
    live.sent("w1", "refused", 100, at=100.502)
    live.refused("w1", "refused")
    assert live.candidates(0.1)[0].pending_tokens == 500
    live.telemetry(WorkerTelemetry(instance_id="w1", sent_at=100.9, prefill_backlog_tokens=300,
                                   admitted_request_ids=["admitted"]), now=0.2)
    w = live.candidates(0.2)[0]
    assert (w.pending_tokens, w.pending_requests, w.backlog_tokens) == (200, 1, 300)
    live.telemetry(WorkerTelemetry(instance_id="w1", sent_at=105.6), now=0.3)
    assert live.candidates(0.3)[0].pending_tokens == 0


def block(h: bytes):
    return SimpleNamespace(block_hash=h)


@pytest.mark.parametrize("policy,expected", [("write_through", [b"a", b"b"]), ("off", []), ("selective", [])])
def test_write_policy_filter(policy, expected):
    f = WritePolicyFilter(policy)
    assert [b.block_hash for b in f.filter([block(b"a"), block(b"b")])] == expected


def test_selective_writes_blocks_seen_twice():
    f = WritePolicyFilter("selective")
    f.seen([b"a", b"b"])  # first request with blocks a, b: computed here, held back
    assert f.filter([block(b"a"), block(b"b")]) == []
    released = f.seen([b"a"])  # a second request needs a: now worth sharing
    assert [b.block_hash for b in released] == [b"a"]
    f.seen([b"c"])
    f.seen([b"c"])
    assert [b.block_hash for b in f.filter([block(b"c")])] == [b"c"]  # seen twice before it was computed
    f.set_policy("off")
    assert f.seen([b"b"]) == [] and f.filter([block(b"c")]) == []
    with pytest.raises(ValueError):
        f.set_policy("sometimes")


def test_request_stats_window():
    s = RequestStats(window_s=10)
    for i in range(10):
        s.observe("/v1/chat/completions", 200 if i < 8 else 503, now=float(i))
    s.observe("/health", 503, now=5.0)  # probes are not traffic
    s.rejected(now=9.0)
    rate, errors, rejected = s.rates(now=9.5)
    assert (rate, errors, rejected) == (1.0, 0.2, 0.1)
    assert s.rates(now=30.0) == (0.0, 0.0, 0.0)


def test_admission_gate_rejects_early_with_retry_after():
    gate = AdmissionGate()
    gate.check()  # no decision yet: open
    gate.apply(Decision(decision_id="1", action="admission", reason="r", admit=False, retry_after_s=3,
                        predicted_ttft_s=4.2))
    with pytest.raises(ApiError) as err:
        gate.check()
    assert err.value.status == 503 and err.value.code == "overloaded"
    assert err.value.headers()["Retry-After"] == "3" and "4.2 s" in err.value.message
    gate.apply(Decision(decision_id="2", action="admission", reason="r", admit=True))
    gate.check()


def test_session_id_travels_and_per_worker_subjects_are_valid():
    req = GenerateRequest(request_id="r", model="m", prompt="x", sampling=SamplingParams(), stream_subject="s",
                          session_id="chat-42")
    assert GenerateRequest.decode(req.encode()).session_id == "chat-42"
    assert subjects.worker_generate("worker-host.example.com-12") == "kite.v1.worker.worker-host_example_com-12.generate"
