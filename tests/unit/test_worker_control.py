"""The worker's control plane without a bus or an engine (kite_worker.control): decisions, activation latency,
telemetry figures, and when telemetry goes out. The worker is a stand-in for the `Worker` protocol."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from kite_shared import subjects
from kite_shared.messages import Decision, WorkerTelemetry
from kite_worker.control import WorkerControl, WorkerLoad
from kite_worker.write_policy import WritePolicyFilter


class StandInWorker:
    def __init__(self) -> None:
        self.queued = self.running = 0
        self.reused = self.computed = 0
        self.ttft: list[float] = []
        self.calls: list[str] = []
        self.num_occupancy_reads = 0

    def occupancy(self) -> tuple[int, int]:
        self.num_occupancy_reads += 1
        return self.queued, self.running

    def load(self) -> WorkerLoad:
        samples, self.ttft = tuple(self.ttft), []
        return WorkerLoad(queue_depth=self.queued, num_running=self.running, max_running=4, running_tokens=10,
                          prefill_backlog_tokens=20, cache_bytes=1, cache_capacity_bytes=2,
                          prompt_tokens_reused=self.reused, prompt_tokens_computed=self.computed,
                          prefill_seconds_per_token=0.001, decode_seconds_per_token=0.0, healthy=True,
                          pool_read=True, new_ttft_samples=samples)

    async def join(self) -> None:
        self.calls.append("join")

    async def leave(self) -> None:
        self.calls.append("leave")


class Bus:
    def __init__(self) -> None:
        self.sent: list[WorkerTelemetry] = []
        self.fail: Exception | None = None

    async def publish(self, subject: str, data: bytes) -> None:
        if self.fail is not None:
            raise self.fail
        assert subject == subjects.telemetry("worker")
        self.sent.append(WorkerTelemetry.decode(data))


def make(standby: bool = False, policy: str = "write_through",
         interval_s: float = 60.0) -> tuple[WorkerControl, StandInWorker, Bus]:
    worker, bus = StandInWorker(), Bus()
    rt = SimpleNamespace(instance_id="w1", draining=False, nc=bus)
    return WorkerControl(rt, worker, WritePolicyFilter(policy), standby, interval_s, 60.0), worker, bus


def decision(action: str, target: str = "w1", **fields) -> Decision:
    return Decision(decision_id="d1", action=action, target=target, reason="test", issued_at=time.time() - 0.25,
                    **fields)


async def test_write_policy_decisions_for_this_worker_or_all_apply_others_do_not():
    control, _, _ = make()
    await control.on_decision(decision("write_policy", target="w2", write_policy="off"))
    assert control.writes.policy == "write_through"
    await control.on_decision(decision("write_policy", target="*", write_policy="selective"))
    assert control.writes.policy == "selective"


async def test_activation_joins_and_the_first_accepted_request_measures_its_latency():
    control, worker, _ = make(standby=True)
    await control.start()
    assert worker.calls == []  # standing by: no generate subscriptions
    await control.on_decision(decision("warm_capacity", standby=False, refresh=True))
    assert worker.calls == []  # a refresh of the current state changes nothing
    control.rt.draining = True
    await control.on_decision(decision("warm_capacity", standby=False))
    assert worker.calls == []  # a draining worker is not activated
    control.rt.draining = False
    await control.on_decision(decision("warm_capacity", standby=False))
    assert worker.calls == ["join"] and control.standby is False
    control.accepted("r1")
    t = control.snapshot()
    assert t.activation_decision_id == "d1" and 0.2 < t.activation_latency_s < 5 and t.requests_accepted == 1
    await control.on_decision(decision("warm_capacity", standby=True))
    assert worker.calls == ["join", "leave"] and control.snapshot().standby is True


async def test_snapshot_reports_the_window_hit_rate_and_ttft():
    control, worker, _ = make()
    control.snapshot()  # the window starts here
    worker.reused, worker.computed, worker.ttft = 30, 10, [0.1, 0.2, 0.3]
    t = control.snapshot()
    assert (t.local_hit_rate, t.prompt_tokens_window) == (0.75, 40)
    assert (t.ttft_p50_s, t.ttft_samples, t.prefill_tokens_per_s) == (0.2, 3, 1000.0)
    assert t.healthy and not t.draining and t.write_policy == "write_through"
    control.rt.draining = True
    assert control.snapshot().healthy is False


async def test_telemetry_goes_out_at_start_on_a_change_and_when_asked_not_otherwise():
    control, worker, bus = make()
    await asyncio.wait_for(control.publish_when_due(), 1)  # the first one at once
    assert len(bus.sent) == 1
    round_ = asyncio.ensure_future(control.publish_when_due())
    await asyncio.sleep(0.3)
    assert not round_.done()  # nothing changed, the interval (60 s) is far
    worker.running = 1
    started = time.monotonic()
    control.accepted("r1")  # an idle worker admits a request: at once, not at the next poll
    await asyncio.wait_for(round_, 1)
    assert time.monotonic() - started < 0.05 and bus.sent[-1].num_running == 1
    round_ = asyncio.ensure_future(control.publish_when_due())
    await asyncio.sleep(0.3)
    assert not round_.done()
    worker.queued = 2
    await asyncio.wait_for(round_, 1)  # a busy worker's change: within the 100 ms poll
    assert bus.sent[-1].queue_depth == 2
    round_ = asyncio.ensure_future(control.publish_when_due())
    await asyncio.sleep(0.05)
    started = time.monotonic()
    control.publish_soon()
    await asyncio.wait_for(round_, 1)
    assert time.monotonic() - started < 0.05 and len(bus.sent) == 4  # woken, not polled


async def test_an_idle_worker_is_not_polled_between_intervals():
    control, worker, bus = make(interval_s=0.6)
    await control.publish_when_due()
    reads = worker.num_occupancy_reads
    round_ = asyncio.ensure_future(control.publish_when_due())
    await asyncio.sleep(0.4)
    assert not round_.done() and worker.num_occupancy_reads - reads <= 1  # polled, it would be 4 or more
    await asyncio.wait_for(round_, 1)  # the interval
    assert len(bus.sent) == 2


async def test_host_memory_is_read_at_most_once_a_second(monkeypatch):
    import kite_worker.control as control_module
    reads = []
    monkeypatch.setattr(control_module, "memory_used_fraction", lambda: reads.append(1) or 0.5)
    control, _, _ = make()
    assert [control.snapshot().memory_used_fraction for _ in range(5)] == [0.5] * 5
    assert len(reads) == 1


async def test_the_interval_alone_makes_telemetry_due():
    control, _, bus = make(interval_s=0.2)
    await control.publish_when_due()
    started = time.monotonic()
    await asyncio.wait_for(control.publish_when_due(), 1)
    assert 0.15 < time.monotonic() - started < 0.5 and len(bus.sent) == 2


async def test_a_failed_publish_raises_for_the_runtimes_loop_and_is_not_retried_in_a_spin():
    control, _, bus = make()
    bus.fail = RuntimeError("boom")
    with pytest.raises(RuntimeError):
        await control.publish_when_due()
    round_ = asyncio.ensure_future(control.publish_when_due())
    await asyncio.sleep(0.3)
    assert not round_.done()  # waits for the next change or interval
    round_.cancel()
