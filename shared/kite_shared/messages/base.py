"""The wire rules every KITE message follows, and the decoders built on them.

Each message is a frozen pydantic model with a `KIND` tag. On the wire a message is a msgpack map holding
its fields plus `"v"` (SCHEMA_VERSION) and `"kind"`. Decoding checks both and validates every field type,
so a malformed or foreign message is a `MessageError`, never a half-built object. Unknown extra fields are
ignored so a newer sender can add optional fields without breaking an older receiver.

A subject that carries several kinds (a request's stream, block events, telemetry) names them with one
`OneOf`, which decodes whichever arrived.
"""
from __future__ import annotations

import logging
from typing import Callable, ClassVar, Generic, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, ValidationError

SCHEMA_VERSION = 1


class MessageError(ValueError):
    """Bytes that are not a valid KITE message of the expected kind and version."""


class Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")
    KIND: ClassVar[str]

    def encode(self) -> bytes:
        body = self.model_dump(mode="python")
        body["v"] = SCHEMA_VERSION
        body["kind"] = self.KIND
        return msgpack.packb(body, use_bin_type=True)

    @classmethod
    def decode(cls: type[M], data: bytes) -> M:
        body = _unpack(data)
        if body.get("kind") != cls.KIND:
            raise MessageError(f"expected a {cls.KIND!r} message, got {body.get('kind')!r}")
        return _validate(cls, body)


M = TypeVar("M", bound=Message)


def _unpack(data: bytes) -> dict:
    try:
        body = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise MessageError(f"not msgpack: {exc}") from None
    if not isinstance(body, dict):
        raise MessageError("a message must be a msgpack map")
    if body.get("v") != SCHEMA_VERSION:
        raise MessageError(f"unsupported schema version {body.get('v')!r} (this build speaks {SCHEMA_VERSION})")
    return body


def _validate(cls: type[M], body: dict) -> M:
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        raise MessageError(f"invalid {cls.KIND!r} message: {exc}") from None


T = TypeVar("T")


def decode_or_log(decode: Callable[[bytes], T], data: bytes, log: logging.Logger, what: str, *args: object,
                  level: int = logging.WARNING) -> T | None:
    """`decode(data)`, or None after logging `what % args` and the MessageError at `level`.

    For a subscriber that drops a bad message (there is no one to reply to) and goes on; `decode` is a
    Message class's decode or a decode_* function:

        beat = decode_or_log(Heartbeat.decode, msg.data, log, "bad heartbeat on %s", msg.subject)
        if beat is None:
            return
    """
    try:
        return decode(data)
    except MessageError as exc:
        log.log(level, what + ": %s", *args, exc)
        return None


class OneOf(Generic[M]):
    """The kinds of message one subject carries: `decode` returns whichever arrived, and refuses any other.

        STREAM_EVENT = OneOf(TokenChunk, StreamEnd, StreamError)
        event = STREAM_EVENT.decode(msg.data)
    """

    def __init__(self, name: str, *classes: type[M]) -> None:
        self.name = name  # what the kinds are together, for errors ("stream event")
        self.classes = classes
        self._by_kind: dict[str, type[M]] = {c.KIND: c for c in classes}

    def decode(self, data: bytes) -> M:
        body = _unpack(data)
        cls = self._by_kind.get(body.get("kind"))
        if cls is None:
            raise MessageError(f"not a {self.name}: kind {body.get('kind')!r}")
        return _validate(cls, body)
