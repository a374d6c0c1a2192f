"""NATS message schemas: round trip, version and kind checks, garbage rejected."""

from __future__ import annotations

import logging

import msgpack
import pytest

from kite_shared.messages import (SCHEMA_VERSION, Admission, ErrorInfo, GenerateRequest, Heartbeat,
                                  MessageError, SamplingParams, StreamEnd, TokenChunk, Usage, decode_or_log,
                                  STREAM_EVENT)


def test_round_trip_and_stream_event_dispatch():
    req = GenerateRequest(request_id="r1", model="m", prompt="hi", sampling=SamplingParams(max_tokens=5),
                          stream_subject="kite.v1.stream.g.r1")
    assert GenerateRequest.decode(req.encode()) == req
    end = StreamEnd(request_id="r1", seq=3, finish_reason="stop", usage=Usage(prompt_tokens=4, completion_tokens=2))
    assert STREAM_EVENT.decode(end.encode()) == end
    chunk = TokenChunk(request_id="r1", seq=0, token_ids=[5], text="a")
    assert STREAM_EVENT.decode(chunk.encode()) == chunk


def test_wrong_kind_version_and_garbage_are_message_errors():
    admission = Admission(accepted=False, error=ErrorInfo(code="no_worker", message="none")).encode()
    with pytest.raises(MessageError, match="expected"):
        GenerateRequest.decode(admission)
    body = msgpack.unpackb(admission)
    body["v"] = SCHEMA_VERSION + 1
    with pytest.raises(MessageError, match="version"):
        Admission.decode(msgpack.packb(body))
    for garbage in (b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"v": 1, "kind": "admission",
                                                                         "accepted": "yes?"})):
        with pytest.raises(MessageError):
            Admission.decode(garbage)
    with pytest.raises(MessageError):
        STREAM_EVENT.decode(admission)


def test_unknown_fields_are_ignored_for_forward_compatibility():
    body = msgpack.unpackb(Admission(accepted=True, worker_id="w").encode())
    body["future_field"] = 1
    assert Admission.decode(msgpack.packb(body)).worker_id == "w"


def test_decode_or_log_returns_the_message_or_none_after_logging_at_the_given_level(caplog):
    log = logging.getLogger("kite.test.decode_or_log")
    beat = Heartbeat(service="worker", instance_id="w1", started_at=1.0, sent_at=2.0)
    chunk = TokenChunk(request_id="r1", seq=0, token_ids=[5], text="a")
    with caplog.at_level(logging.DEBUG, logger=log.name):
        assert decode_or_log(Heartbeat.decode, beat.encode(), log, "bad heartbeat") == beat
        assert decode_or_log(STREAM_EVENT.decode, chunk.encode(), log, "bad stream event") == chunk
        assert caplog.records == []
        assert decode_or_log(Heartbeat.decode, chunk.encode(), log, "bad heartbeat on %s", "kite.x") is None
        assert decode_or_log(Heartbeat.decode, b"\xc1", log, "bad heartbeat", level=logging.DEBUG) is None
    (wrong_kind, garbage) = caplog.records
    assert (wrong_kind.levelno, garbage.levelno) == (logging.WARNING, logging.DEBUG)
    assert wrong_kind.getMessage() == ("bad heartbeat on kite.x: expected a 'heartbeat' message, "
                                       "got 'token_chunk'")
    assert garbage.getMessage().startswith("bad heartbeat: not msgpack")
    with pytest.raises(ValueError):  # only MessageError is caught
        decode_or_log(lambda data: int(data), b"x", log, "bad number")
