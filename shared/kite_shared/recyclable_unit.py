"""Recyclable units (RUs): one KV block for all layers plus the metadata that proves what it is.

Binary format, version 6 (all integers big-endian; no pickle anywhere, so decoding untrusted bytes
cannot run code):

    offset 0   4 bytes   magic b"KRU" + format version byte (0x06)
    offset 4   4 bytes   header length H (uint32)
    offset 8   H bytes   msgpack map (the header):
                 block_hash        bin(32)  the block's CF hash (kite_shared.fingerprint)
                 parent_hash       bin(32)  hash of the previous block (the chain root for block 0)
                 model_fingerprint str      hex root digest of model state + execution path
                 tenant_tag        str      16 hex digits naming the tenant whose request computed the
                                            block (kite_shared.security.tenant_tag); the pool's per-tenant
                                            accounting and quotas read it
                 block_index       int      position of the block in its sequence (0-based)
                 num_tokens        int      tokens in the block (= block size; only full blocks are RUs)
                 created_at        float    unix seconds
                 codec             str      "fp16" | "bf16" | "fp32": element type of the payload;
                                            "int8" | "fp8_e4m3": a lossy payload (kite_shared.kv_codec),
                                            8-bit elements followed by their scales
                 shape             [int]*5  [num_layers, 2 (key, value), num_kv_heads, num_tokens, head_dim]
                 warm_codec        str      "" | "int8" | "fp8_e4m3": the codec the warm tier stores this
                                            unit in ("": as it is); the ru-pool transcodes it on its way
                                            down (kite_shared.tier_codecs)
                 cold_codec        str      the same for the cold tier
                 checksum          bin(32)  BLAKE3-256 of the payload bytes
                 mac               bin(32) | nil   HMAC-SHA256 with the cluster key (see below); nil
                                   when encoded without a key
    offset 8+H           payload: the tensor, C order, little-endian elements

Version 2 added `mac`; version 3 added `tenant_tag`; version 4 stopped feeding the payload to the MAC a
second time; version 5 hashes the payload with BLAKE3 instead of SHA-256; version 6 adds the tier codecs.
The MAC is HMAC-SHA256(key, "kite.ru.v6/mac" | block_hash | parent_hash | len32+model_fingerprint |
len32+tenant_tag | block_index u64 | num_tokens u64 | created_at f64 | len32+codec | shape 5 x u64 |
len32+warm_codec | len32+cold_codec | checksum): the tier codecs are signed, so only a holder of the
secret can make the pool store a unit lossily (in a namespace that chose it). The checksum (collision-
resistant) binds the payload, so verifying a unit hashes its payload once, and that hash is the whole cost
of verification (the MAC covers ~200 bytes). Why BLAKE3: verification is on the path of every reused
block, and on this machine (x86-64 with SHA-NI and AVX-512) SHA-256 hashes 369 KB payloads at about 2,000
MB/s, BLAKE3 at about 7,500 MB/s (one thread): with SHA-256 no verified read could go faster than 2 GB/s.
The fields are fed in this fixed binary form (not as the msgpack bytes), so the MAC does not depend on how
a msgpack library orders or sizes things. The key is derived from the cluster secret
(`kite_shared.security.ru_key`, KITE_CLUSTER_SECRET): a unit written by a process without the secret, or
altered after writing (checksum recomputed or not), fails with `RUAuthError`. Units of older versions are
refused as a format error: a cache entry of an old format is a miss, recomputed.

`decode` checks magic, version, header types, that the shape matches num_tokens and the codec's element
size matches the payload length, the checksum, the MAC (when a key is given; a unit without one then
fails), and (when given) that the block hash, model and tenant are the ones asked for. Anything else
raises a subclass of `RUError`: callers treat that as a miss, never as a load. `decode` copies nothing: the
unit's payload is a view into the bytes it was given (any buffer: bytes, a bytearray, a memory map), so a
reader that owns writable memory (a hand-off file read into a bytearray) can hand it to torch as it is.

Pure logic: no I/O, no torch (the worker turns payloads into tensors with `torch.frombuffer`).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct
import time
from dataclasses import dataclass, field

import msgpack
from blake3 import blake3

from kite_shared.security import ANONYMOUS_TENANT_TAG, TENANT_TAG_CHARS
from kite_shared.tier_codecs import LOSSY_CODECS

MAGIC = b"KRU"
FORMAT_VERSION = 6
_MAC_DOMAIN = b"kite.ru.v6/mac"
MAC_BYTES = 32
_PREAMBLE = struct.Struct(">3sBI")  # magic, version, header length
MAX_HEADER_BYTES = 4096
# BLAKE3 splits one payload over threads only from this size on, where the split pays. Measured on this
# 2-vCPU machine (two runs): a 369 KB unit (16 tokens of the default model) hashed at 3.0-3.2 GB/s on all
# threads against 3.5-3.9 on one; an 8 MiB unit (16 tokens of a 7B model) at 5.2-6.5 against 3.7-4.0.
MULTITHREAD_HASH_BYTES = 1 << 20

CODEC_ITEM_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}  # the lossless codecs: the elements as computed
TORCH_DTYPE_TO_CODEC = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def payload_bytes(codec: str, shape: tuple[int, ...]) -> int:
    """Bytes of a payload of `shape` = (layers, 2, heads, tokens, head dim) under `codec` (layouts in
    kite_shared.kv_codec). Torch-free, so that the ru-pool checks a lossy unit's size as any other's."""
    layers, _, heads, tokens, head_dim = shape
    elements = math.prod(shape)
    if codec in CODEC_ITEM_BYTES:
        return elements * CODEC_ITEM_BYTES[codec]
    if codec == "int8":  # fp16 scales: keys per (layer, head, channel), values per (layer, head, token)
        return elements + 2 * (layers * heads * head_dim + layers * heads * tokens)
    if codec == "fp8_e4m3":  # an fp32 scale per (layer, key/value, head)
        return elements + 4 * layers * 2 * heads
    raise RUFormatError(f"unknown codec {codec!r}")


class RUError(ValueError):
    """Bytes that are not a valid, intact recyclable unit."""


class RUFormatError(RUError):
    """Wrong magic, version, header, shape or size."""


class RUChecksumError(RUError):
    """The payload does not match its checksum: corrupted in storage or transit."""


class RUKeyMismatchError(RUError):
    """A valid unit, but not the block (or model) that was asked for."""


class RUAuthError(RUError):
    """The unit's HMAC is missing or wrong: not written by a holder of the cluster secret, or altered."""


@dataclass(frozen=True)
class RecyclableUnit:
    block_hash: bytes
    parent_hash: bytes
    model_fingerprint: str
    block_index: int
    num_tokens: int
    codec: str
    shape: tuple[int, int, int, int, int]
    # Raw tensor bytes (see module docstring): bytes when built by a writer, a memoryview into the decoded
    # buffer after `decode`.
    payload: bytes | memoryview
    created_at: float = field(default_factory=time.time)
    tenant_tag: str = ANONYMOUS_TENANT_TAG  # kite_shared.security.tenant_tag of the computing tenant
    # The codecs the warm and the cold tier store this unit in ("": as it is; kite_shared.tier_codecs).
    warm_codec: str = ""
    cold_codec: str = ""

    @property
    def num_bytes(self) -> int:
        return len(self.payload)

    def checksum(self, max_threads: int | None = None) -> bytes:
        """BLAKE3 of the payload on up to `max_threads` threads (None: several only for a payload of
        `MULTITHREAD_HASH_BYTES` or more). The GIL is released while it hashes."""
        if max_threads is None:
            max_threads = blake3.AUTO if len(self.payload) >= MULTITHREAD_HASH_BYTES else 1
        return blake3(self.payload, max_threads=max_threads).digest()

    def mac(self, key: bytes, checksum: bytes | None = None) -> bytes:
        """HMAC-SHA256 of the unit's identity, header fields and payload checksum (module docstring)."""
        if not 0 <= self.block_index < 2**64:
            raise RUFormatError("block index out of range")
        h = hmac.new(key, digestmod=hashlib.sha256)
        h.update(_MAC_DOMAIN + bytes(self.block_hash) + bytes(self.parent_hash)
                 + _sized(self.model_fingerprint) + _sized(self.tenant_tag)
                 + struct.pack(">QQd", self.block_index, self.num_tokens, float(self.created_at))
                 + _sized(self.codec) + struct.pack(">5Q", *self.shape)
                 + _sized(self.warm_codec) + _sized(self.cold_codec)
                 + (checksum if checksum is not None else self.checksum()))
        return h.digest()

    def encode(self, key: bytes | None = None) -> bytes:
        """The unit's bytes; with `key` (the cluster RU key) it carries an HMAC readers can verify."""
        _check_geometry(self.codec, self.shape, self.num_tokens, len(self.payload))
        _check_tenant_tag(self.tenant_tag)
        _check_tier_codecs(self.warm_codec, self.cold_codec)
        checksum = self.checksum()
        header = msgpack.packb({
            "block_hash": self.block_hash,
            "parent_hash": self.parent_hash,
            "model_fingerprint": self.model_fingerprint,
            "tenant_tag": self.tenant_tag,
            "block_index": self.block_index,
            "num_tokens": self.num_tokens,
            "created_at": self.created_at,
            "codec": self.codec,
            "shape": list(self.shape),
            "warm_codec": self.warm_codec,
            "cold_codec": self.cold_codec,
            "checksum": checksum,
            "mac": None if key is None else self.mac(key, checksum),
        }, use_bin_type=True)
        return _PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header)) + header + self.payload


def _sized(text: str) -> bytes:
    """`text` as the MAC takes a string: its UTF-8 length (uint32), then its bytes."""
    raw = text.encode("utf-8")
    return struct.pack(">I", len(raw)) + raw


def _check_tier_codecs(warm_codec: str, cold_codec: str) -> None:
    for name, codec in (("warm_codec", warm_codec), ("cold_codec", cold_codec)):
        if codec not in ("", *LOSSY_CODECS):
            raise RUFormatError(f"{name} must be empty or one of {', '.join(LOSSY_CODECS)}, got {codec!r}")


def _check_geometry(codec: str, shape: tuple[int, ...], num_tokens: int, payload_len: int) -> None:
    if codec not in CODEC_ITEM_BYTES and codec not in LOSSY_CODECS:
        raise RUFormatError(f"unknown codec {codec!r}")
    if len(shape) != 5 or any(not isinstance(d, int) or d <= 0 for d in shape):
        raise RUFormatError(f"shape must be 5 positive ints, got {shape!r}")
    if shape[1] != 2:
        raise RUFormatError("shape[1] must be 2 (key and value)")
    if shape[3] != num_tokens:
        raise RUFormatError(f"shape says {shape[3]} tokens, header says {num_tokens}")
    expected = payload_bytes(codec, shape)
    if payload_len != expected:
        raise RUFormatError(f"payload is {payload_len} bytes, shape and codec need {expected}")


def _check_tenant_tag(tag: object) -> None:
    if not (isinstance(tag, str) and len(tag) == TENANT_TAG_CHARS
            and all(c in "0123456789abcdef" for c in tag)):
        raise RUFormatError(f"tenant_tag must be {TENANT_TAG_CHARS} lowercase hex digits")


def decode(data: bytes | bytearray | memoryview, expected_hash: bytes | None = None, expected_model: str | None = None,
           key: bytes | None = None, expected_tenant_tag: str | None = None,
           hash_threads: int | None = None) -> RecyclableUnit:
    """Parse and verify `data`; see the module docstring for what is checked. With `key`, a unit whose
    MAC is absent or wrong raises RUAuthError. `hash_threads`: as `RecyclableUnit.checksum`'s
    `max_threads` (1 where the caller verifies several units at once, one per thread)."""
    header, header_len = _read_header(data)
    try:
        unit = RecyclableUnit(
            block_hash=_typed(header, "block_hash", bytes),
            parent_hash=_typed(header, "parent_hash", bytes),
            model_fingerprint=_typed(header, "model_fingerprint", str),
            tenant_tag=_typed(header, "tenant_tag", str),
            block_index=_typed(header, "block_index", int),
            num_tokens=_typed(header, "num_tokens", int),
            created_at=float(_typed(header, "created_at", (int, float))),
            codec=_typed(header, "codec", str),
            shape=tuple(_typed(header, "shape", list)),  # type: ignore[arg-type]
            warm_codec=_typed(header, "warm_codec", str),
            cold_codec=_typed(header, "cold_codec", str),
            payload=memoryview(data)[_PREAMBLE.size + header_len:],
        )
        checksum = _typed(header, "checksum", bytes)
        if "mac" not in header:
            raise ValueError("header lacks 'mac'")
        mac = header["mac"]
        if mac is not None and (not isinstance(mac, bytes) or len(mac) != MAC_BYTES):
            raise ValueError("header field 'mac' has the wrong type")
    except (TypeError, ValueError) as exc:
        raise RUFormatError(str(exc)) from None
    if len(unit.block_hash) != 32 or len(unit.parent_hash) != 32:
        raise RUFormatError("block and parent hashes must be 32 bytes")
    if unit.block_index < 0:
        raise RUFormatError("negative block index")
    _check_geometry(unit.codec, unit.shape, unit.num_tokens, len(unit.payload))
    _check_tenant_tag(unit.tenant_tag)
    _check_tier_codecs(unit.warm_codec, unit.cold_codec)
    if unit.checksum(hash_threads) != checksum:
        raise RUChecksumError("payload checksum mismatch")
    if key is not None:
        if mac is None:
            raise RUAuthError("unit carries no MAC")
        if not hmac.compare_digest(unit.mac(key, checksum), mac):
            raise RUAuthError("unit MAC mismatch: not written with this cluster secret, or altered")
    if expected_hash is not None and unit.block_hash != expected_hash:
        raise RUKeyMismatchError("unit holds a different block than requested")
    if expected_model is not None and unit.model_fingerprint != expected_model:
        raise RUKeyMismatchError("unit belongs to a different model fingerprint")
    if expected_tenant_tag is not None and unit.tenant_tag != expected_tenant_tag:
        raise RUKeyMismatchError("unit belongs to a different tenant")
    return unit


def stored_codecs(data: bytes | bytearray | memoryview) -> tuple[str, str, str]:
    """(codec, warm_codec, cold_codec) from a unit's header, unverified: what the ru-pool reads to decide
    whether a unit it verified when it arrived needs transcoding on its way down (the transcoding then
    verifies it again). Raises RUFormatError."""
    header, _ = _read_header(data)
    try:
        return (_typed(header, "codec", str), _typed(header, "warm_codec", str),
                _typed(header, "cold_codec", str))
    except ValueError as exc:
        raise RUFormatError(str(exc)) from None


def _read_header(data: bytes | bytearray | memoryview) -> tuple[dict, int]:
    """The header map and its length in bytes, after the preamble's checks."""
    if len(data) < _PREAMBLE.size:
        raise RUFormatError("too short for a recyclable unit")
    magic, version, header_len = _PREAMBLE.unpack_from(data)
    if magic != MAGIC:
        raise RUFormatError("bad magic: not a recyclable unit")
    if version != FORMAT_VERSION:
        raise RUFormatError(f"unsupported format version {version}")
    if header_len > MAX_HEADER_BYTES or _PREAMBLE.size + header_len > len(data):
        raise RUFormatError("header length out of range")
    try:
        header = msgpack.unpackb(data[_PREAMBLE.size:_PREAMBLE.size + header_len], raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise RUFormatError(f"header is not msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise RUFormatError("header must be a map")
    return header, header_len


def _typed(header: dict, key: str, kind: type | tuple[type, ...]):
    if key not in header:
        raise ValueError(f"header lacks {key!r}")
    value = header[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"header field {key!r} has the wrong type")
    return value
