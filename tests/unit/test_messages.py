"""NATS message schemas: round trip, version and kind checks, garbage rejected."""

from __future__ import annotations

import msgpack
import pytest

from kite_shared.messages import (SCHEMA_VERSION, Admission, ErrorInfo, GenerateRequest, MessageError,
                                  SamplingParams, StreamEnd, TokenChunk, Usage, decode_stream_event)


def test_round_trip_and_stream_event_dispatch():
    req = GenerateRequest(request_id="r1", model="m", prompt="hi", sampling=SamplingParams(max_tokens=5),
                          stream_subject="kite.v1.stream.g.r1")
    assert GenerateRequest.decode(req.encode()) == req
    end = StreamEnd(request_id="r1", seq=3, finish_reason="stop", usage=Usage(prompt_tokens=4, completion_tokens=2))
    assert decode_stream_event(end.encode()) == end
    chunk = TokenChunk(request_id="r1", seq=0, token_ids=[5], text="a")
    assert decode_stream_event(chunk.encode()) == chunk


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
        decode_stream_event(admission)


def test_unknown_fields_are_ignored_for_forward_compatibility():
    body = msgpack.unpackb(Admission(accepted=True, worker_id="w").encode())
    body["future_field"] = 1
    assert Admission.decode(msgpack.packb(body)).worker_id == "w"
