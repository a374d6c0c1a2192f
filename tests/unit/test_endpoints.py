"""The service framework's message handling without a bus (kite_shared.endpoints): what each kind of
message and failure is answered with, what is counted, how periodic work survives failures, and what an
endpoint takes from the table of subjects. The same paths over a real nats-server:
tests/integration/test_service_framework.py."""

from __future__ import annotations

import asyncio
import logging

import nats.errors
import pytest

from kite_shared import subjects
from kite_shared.endpoints import (ENDPOINT_MESSAGES, Endpoint, Refusal, cancel_and_wait, request_id_var, run_every,
                                   tenant_var)
from kite_shared.messages import (AdapterAdminReply, AdapterAdminRequest, Admission, Cancel, ErrorInfo, GenerateRequest,
                                  PoolAdminReply, PoolAdminRequest, SamplingParams)


def generate(request_id: str) -> bytes:
    """What subjects.FINGERPRINT carries (its reply: Admission)."""
    return GenerateRequest(request_id=request_id, model="m", prompt="hi", sampling=SamplingParams(),
                           stream_subject=subjects.stream("g", request_id)).encode()


def count(endpoint: str, outcome: str) -> float:
    return ENDPOINT_MESSAGES.labels(endpoint, outcome)._value.get()


async def accept(request: GenerateRequest) -> Admission:
    return Admission(accepted=True, worker_id=f"for-{request.request_id}")


def test_a_decoded_request_gets_the_handlers_reply_and_is_counted_ok():
    ep = Endpoint(subjects.FINGERPRINT, accept, name="t.ok")
    before = count("t.ok", "ok")
    reply = asyncio.run(ep.answer(generate("r1")))
    assert reply == Admission(accepted=True, worker_id="for-r1")
    assert count("t.ok", "ok") == before + 1


def test_an_undecodable_message_is_refused_as_invalid_message_and_the_handler_never_runs():
    calls = []

    async def handle(request: GenerateRequest) -> Admission:
        calls.append(request)
        return Admission(accepted=True)

    ep = Endpoint(subjects.FINGERPRINT, handle, name="t.bad")  # the error reply: the table's Admission
    for data in (b"\xc1 not msgpack", PoolAdminRequest(op="stats").encode()):
        reply = asyncio.run(ep.answer(data))
        assert reply.accepted is False and reply.error.code == "invalid_message", reply
    assert calls == [] and count("t.bad", "invalid_message") == 2


def test_a_refusal_is_the_refuse_reply_with_the_handlers_error():
    async def handle(req: PoolAdminRequest) -> PoolAdminReply:
        raise Refusal(ErrorInfo(code="bad_request", message="pin needs model_fingerprint",
                                param="model_fingerprint"))

    ep = Endpoint(subjects.POOL_ADMIN, handle, name="t.refusal")
    reply = asyncio.run(ep.answer(PoolAdminRequest(op="pin").encode()))
    assert reply == PoolAdminReply(ok=False, error=ErrorInfo(code="bad_request", param="model_fingerprint",
                                                             message="pin needs model_fingerprint"))
    assert count("t.refusal", "bad_request") == 1


def test_a_handler_bug_is_logged_with_its_traceback_and_answered_internal_error(caplog):
    async def handle(request: GenerateRequest) -> Admission:
        raise KeyError("a bug")

    ep = Endpoint(subjects.FINGERPRINT, handle, name="bug endpoint")
    with caplog.at_level(logging.ERROR, logger="kite_shared.endpoints"):
        reply = asyncio.run(ep.answer(generate("r")))
    assert reply.error.code == "internal_error" and "bug endpoint" in reply.error.message
    assert "a bug" not in reply.error.message  # internals stay in the log
    assert any(r.exc_info and "KeyError" in caplog.text for r in caplog.records)
    assert count("bug endpoint", "internal_error") == 1


def test_an_event_endpoint_never_replies_even_when_the_message_is_bad_or_the_handler_fails(caplog):
    seen = []

    async def handle(cancel: Cancel) -> None:
        seen.append(cancel.request_id)
        if cancel.request_id == "boom":
            raise RuntimeError("boom")

    ep = Endpoint(subjects.WORKER_CANCEL, handle)  # published: nobody waits for a reply
    with caplog.at_level(logging.WARNING, logger="kite_shared.endpoints"):
        assert asyncio.run(ep.answer(b"junk")) is None
        assert asyncio.run(ep.answer(Cancel(request_id="boom").encode())) is None
        assert asyncio.run(ep.answer(Cancel(request_id="fine").encode())) is None
    assert seen == ["boom", "fine"]
    assert f"dropped a bad message on {subjects.WORKER_CANCEL}" in caplog.text
    assert f"handler for {subjects.WORKER_CANCEL} failed" in caplog.text


def test_the_request_context_is_set_for_the_handler():
    async def handle(cancel: Cancel) -> Admission:
        return Admission(accepted=True, worker_id=request_id_var.get())

    async def scenario() -> Admission:
        return await Endpoint(subjects.WORKER_CANCEL, handle).answer(Cancel(request_id="req-42").encode())

    assert asyncio.run(scenario()).worker_id == "req-42"
    assert tenant_var.get() == ""  # the handler's context did not leak out


def test_an_endpoint_takes_its_decoder_error_reply_and_queue_group_from_the_table_of_subjects():
    async def handle(request: object) -> None:
        return None

    fingerprint = Endpoint(subjects.FINGERPRINT, handle)
    assert (fingerprint.decode, fingerprint.queue) == (GenerateRequest.decode, subjects.FINGERPRINTER_QUEUE)
    assert fingerprint.refusal(ErrorInfo(code="c", message="m")) == Admission(
        accepted=False, error=ErrorInfo(code="c", message="m"))
    assert Endpoint(subjects.worker_generate("w.1"), handle).queue == ""  # one worker's own: no group
    assert Endpoint(subjects.ping("ru-pool"), handle).queue == "ru-pool"  # one replica of the service answers
    assert Endpoint(subjects.ping("ru-pool"), handle).refusal is None  # a Pong carries no error: dropped
    assert Endpoint(subjects.pool_replica("p", "put"), handle).decode is bytes  # raw units


def test_an_endpoint_refuses_a_subject_outside_the_table_and_a_refusal_nobody_waits_for():
    async def handle(request: object) -> None:
        return None

    with pytest.raises(ValueError, match="not in kite_shared.subjects.TABLE"):
        Endpoint("kite.v1.nowhere", handle)
    with pytest.raises(ValueError, match="published"):
        Endpoint(subjects.WORKER_CANCEL, handle, refuse=lambda error: Admission(accepted=False, error=error))


def test_an_endpoints_own_error_reply_names_its_responder():
    async def handle(request: object) -> None:
        raise Refusal(ErrorInfo(code="unsupported", message="no adapters here"))

    def refuse(error: ErrorInfo) -> AdapterAdminReply:
        return AdapterAdminReply(service="worker", instance_id="w1", ok=False, error=error)

    ep = Endpoint(subjects.ADAPTER_ADMIN, handle, refuse=refuse)
    bad = asyncio.run(ep.answer(b"junk"))
    assert (bad.instance_id, bad.ok, bad.error.code) == ("w1", False, "invalid_message")
    refused = asyncio.run(ep.answer(AdapterAdminRequest(op="unload", name="a").encode()))
    assert refused == refuse(ErrorInfo(code="unsupported", message="no adapters here"))


def test_periodic_work_goes_on_after_failures_and_logs_each_distinct_bug_once(caplog):
    rounds = []

    async def work() -> None:
        rounds.append(len(rounds))
        if len(rounds) <= 3:
            raise ValueError("broken stats")  # the same bug three rounds running: one traceback
        if len(rounds) == 4:
            raise nats.errors.ConnectionReconnectingError()  # the bus is away: no traceback at all

    async def scenario() -> None:
        task = asyncio.create_task(run_every(0.001, work, "test telemetry"))
        while len(rounds) < 6:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.DEBUG, logger="kite_shared.endpoints"):
        asyncio.run(scenario())
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1 and "test telemetry failed" in tracebacks[0].getMessage()
    assert "NATS unavailable" in caplog.text


def test_the_interval_can_be_a_setting_read_every_round():
    intervals = iter([0.001, 0.002, 0.003])
    stamps = []

    async def work() -> None:
        stamps.append(asyncio.get_running_loop().time())

    async def scenario() -> None:
        task = asyncio.create_task(run_every(lambda: next(intervals, 10.0), work, "w"))
        while len(stamps) < 4:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(scenario())
    assert len(stamps) == 4  # the fourth interval (10 s) had not passed


def test_without_tracing_and_trace_context_no_span_is_made_but_a_callers_trace_still_continues(monkeypatch):
    """Tracing off (no TracerProvider): a message without headers gets no span at all (nothing to record
    or pass on: the cheap path), while one carrying a traceparent still runs inside the caller's trace,
    so log lines and onward messages keep its trace id."""
    from opentelemetry import trace

    from kite_shared import tracing

    monkeypatch.setattr(tracing, "tracing_active", lambda: False)
    made = []
    real_start = tracing.start_span_from_headers
    monkeypatch.setattr(tracing, "start_span_from_headers",
                        lambda *a, **kw: made.append(a) or real_start(*a, **kw))
    seen = []

    async def handle(request: GenerateRequest) -> Admission:
        seen.append(tracing.current_trace_id())
        return Admission(accepted=True)

    ep = Endpoint(subjects.FINGERPRINT, handle, span="kite.test.span", name="t.span")
    assert asyncio.run(ep.answer(generate("r"))).accepted
    assert made == [] and seen == [""]

    trace_id = 0x0123456789abcdef0123456789abcdef
    caller = trace.NonRecordingSpan(trace.SpanContext(trace_id, 0x42, is_remote=False,
                                                      trace_flags=trace.TraceFlags(1)))
    headers = tracing.headers_with_context(caller)
    assert "traceparent" in headers
    assert asyncio.run(ep.answer(generate("r"), headers)).accepted
    assert len(made) == 1 and seen[1] == format(trace_id, "032x")


def test_outcomes_are_counted_per_endpoint_and_outcome_message_after_message():
    async def handle(request: GenerateRequest) -> Admission:
        if request.request_id == "no":
            raise Refusal(ErrorInfo(code="not_found", message="no such request"))
        return Admission(accepted=True)

    ep = Endpoint(subjects.FINGERPRINT, handle, name="t.counts")
    other = Endpoint(subjects.FINGERPRINT, handle, name="t.counts.other")
    for request_id in ("a", "no", "b", "no", "c"):
        asyncio.run(ep.answer(generate(request_id)))
    asyncio.run(other.answer(generate("a")))
    assert (count("t.counts", "ok"), count("t.counts", "not_found"), count("t.counts.other", "ok")) == (3, 2, 1)


def test_the_request_context_comes_from_fields_or_properties_and_raw_payloads_have_none():
    from kite_shared.endpoints import _set_request_context

    class WithProperty(PoolAdminRequest):
        @property
        def request_id(self) -> str:
            return f"admin-{self.op}"

    async def scenario(request: object) -> tuple[str, str]:
        _set_request_context(request)
        return request_id_var.get(), tenant_var.get()

    assert asyncio.run(scenario(WithProperty(op="stats", tenant="acme"))) == ("admin-stats", "acme")
    assert asyncio.run(scenario(PoolAdminRequest(op="stats"))) == ("", "")  # tenant "": left unset
    assert asyncio.run(scenario(Cancel(request_id="r9"))) == ("r9", "")
    assert asyncio.run(scenario(b"a raw unit")) == ("", "")


async def swallow_one_cancel() -> None:
    """As Python 3.11's asyncio.wait_for does when it is cancelled just as its inner future completes:
    the CancelledError is caught and the result returned, so the caller runs on."""
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        return


def test_periodic_work_ends_even_when_its_work_swallowed_the_cancel():
    rounds = []

    async def work() -> None:
        rounds.append(1)
        await swallow_one_cancel()

    async def scenario() -> None:
        task = asyncio.create_task(run_every(0.0, work, "swallowing work"))
        while not rounds:
            await asyncio.sleep(0.001)
        task.cancel()  # once: before the fix the loop went on forever and a stop hung on it
        done, _ = await asyncio.wait({task}, timeout=2.0)
        assert done == {task} and task.cancelled()

    asyncio.run(scenario())
    assert len(rounds) == 1


def test_cancel_and_wait_cancels_again_a_task_that_swallowed_the_first_cancel():
    async def stubborn() -> None:
        await swallow_one_cancel()  # the first cancel ends here and is lost
        await asyncio.sleep(10)  # the second one ends the task

    async def scenario() -> asyncio.Task:
        task = asyncio.create_task(stubborn())
        await asyncio.sleep(0.01)
        await asyncio.wait_for(cancel_and_wait([task], recancel_interval_s=0.05), 2.0)
        return task

    assert asyncio.run(scenario()).cancelled()
