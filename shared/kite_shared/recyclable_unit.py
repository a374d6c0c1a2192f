"""Recyclable units (RUs): one KV block for all layers plus the metadata that proves what it is.

Binary format, version 7 (all integers big-endian; no pickle anywhere, so decoding untrusted bytes
cannot run code):

    offset 0   4 bytes   magic b"KRU" + format version byte (0x07)
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
                 checksum          bin(32) | nil   SHA-256 of the payload: units encoded without a key
                                            only (tests, tools); nil when keyed
                 payload_salt      bin(16) | nil   random, drawn at each encoding: names the one-time key
                                            of `payload_tag`; nil when encoded without a key
                 payload_tag       bin(16) | nil   GMAC of the payload under that one-time key (below)
                 mac               bin(32) | nil   last entry: HMAC-SHA256 with the cluster key of every
                                            byte before its value (below)
    offset 8+H           payload: the tensor, C order, little-endian elements

Version 2 added `mac`; version 3 added `tenant_tag`; version 4 stopped feeding the payload to the MAC a
second time; version 5 hashed the payload with BLAKE3 instead of SHA-256; version 6 added the tier codecs;
version 7 replaces the keyed units' checksum with a payload MAC that hashes twice as fast here, and signs
the header's bytes as written.

Keyed units (every unit a service writes: the key is derived from the cluster secret,
`kite_shared.security.ru_key`, KITE_CLUSTER_SECRET) carry two MACs:
- `payload_tag` = the tag of AES-128-GCM with an empty plaintext and the payload as associated data (that
  is GMAC), a zero nonce, under the one-time key HMAC-SHA256(key, "kite.ru.v7/payload" | payload_salt),
  first 16 bytes. A fresh random salt at every encoding gives every payload a key of its own, so GCM's
  one rule (never two messages under one key and nonce) holds without a nonce counter shared by writers.
- `mac` = HMAC-SHA256(key, "kite.ru.v7/mac" | the unit's bytes from offset 0 up to the MAC's own value):
  the preamble and every header field, the salt and tag among them, so it binds the whole header and,
  through the tag, the payload. It is computed over the bytes as written, so a reader never re-encodes
  anything to check it, and a field added later is covered without anyone listing it; in exchange the
  header must end with the "mac" entry and its 32 bytes (a reader refuses any other layout). The tier
  codecs are signed, so only a holder of the secret can make the pool store a unit lossily (in a
  namespace that chose it).
A unit written by a process without the secret, or with its header altered, fails with `RUAuthError`; a
payload altered or damaged after writing fails with `RUChecksumError` (its tag no longer matches).

Why GMAC: verification is on the path of every reused block, and hashing the payload is nearly all of it
(the header's MAC covers ~350 bytes). With AES-NI and carry-less multiplication (x86-64 servers for a
decade, ARMv8 with the crypto extension), OpenSSL's GHASH ran at 6.2-6.9 GB/s on one core of this 2-vCPU
machine and 13 GB/s on two threads in two runs (the `cryptography` package releases the GIL), against
3.2-3.3 and 5.0-6.3 GB/s for BLAKE3, which versions 5 and 6 used (AVX2 only here), and 1.5 GB/s for
SHA-256 (2026-12-04, 128 payloads of 369 KB; docs/benchmarks.md has the whole verification's figures). A
keyless checksum cannot be a fast universal hash (anyone could forge a payload for it); a keyed one can,
and every reader that verifies holds the key.

Units of older versions are refused as a format error: a cache entry of an old format is a miss,
recomputed.

`decode` checks magic, version, header types, that the shape matches num_tokens and the codec's element
size matches the payload length; with a key: the header MAC (a unit without one fails), then the payload
tag; without a key: the checksum (a keyed unit then fails: its payload cannot be checked without the key);
and (when given) that the block hash, model and tenant are the ones asked for. Anything else raises a
subclass of `RUError`: callers treat that as a miss, never as a load. `decode` copies nothing: the unit's
payload is a view into the bytes it was given (any buffer: bytes, a bytearray, a memory map), so a reader
that owns writable memory (a hand-off file read into a bytearray) can hand it to torch as it is.

Pure logic: no I/O (but the random salt), no torch (the worker turns payloads into tensors with
`torch.frombuffer`).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import math
import re
import secrets
import struct
import time
from dataclasses import dataclass, field

import msgpack
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kite_shared.security import ANONYMOUS_TENANT_TAG, TENANT_TAG_CHARS
from kite_shared.tier_codecs import LOSSY_CODECS

MAGIC = b"KRU"
FORMAT_VERSION = 7
_MAC_DOMAIN = b"kite.ru.v7/mac"
_PAYLOAD_KEY_DOMAIN = b"kite.ru.v7/payload"
MAC_BYTES = 32
SALT_BYTES = 16
TAG_BYTES = 16  # GCM's full tag
CHECKSUM_BYTES = 32
_ZERO_NONCE = bytes(12)  # safe: every payload tag has a one-time key (module docstring)
_TENANT_TAG = re.compile(f"[0-9a-f]{{{TENANT_TAG_CHARS}}}")
_PREAMBLE = struct.Struct(">3sBI")  # magic, version, header length
_MAC_ENTRY = b"\xa3mac\xc4\x20"  # msgpack: the key "mac", then the marker of 32 bytes of binary
# Each header field and its exact types (msgpack decodes to exact types; a bool is not an int here).
_HEADER_FIELDS = (("block_hash", (bytes,)), ("parent_hash", (bytes,)), ("model_fingerprint", (str,)),
                  ("tenant_tag", (str,)), ("block_index", (int,)), ("num_tokens", (int,)),
                  ("created_at", (int, float)), ("codec", (str,)), ("shape", (list,)),
                  ("warm_codec", (str,)), ("cold_codec", (str,)))
MAX_HEADER_BYTES = 4096

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
    """The payload does not match its tag (or, unkeyed, its checksum): damaged in storage or transit, or
    altered by something without the cluster key."""


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

    def checksum(self) -> bytes:
        """SHA-256 of the payload: the integrity of a unit encoded without a key."""
        return hashlib.sha256(self.payload).digest()

    def payload_tag(self, key: bytes, salt: bytes) -> bytes:
        """GMAC of the payload under the one-time key that `key` and `salt` name (module docstring). The
        GIL is released while it runs."""
        return _payload_gmac(key, salt).encrypt(_ZERO_NONCE, b"", self.payload)

    def encode(self, key: bytes | None = None) -> bytes:
        """The unit's bytes; with `key` (the cluster RU key) they carry the MACs readers verify (module
        docstring), else a checksum."""
        _check_geometry(self.codec, self.shape, self.num_tokens, len(self.payload))
        _check_tenant_tag(self.tenant_tag)
        _check_tier_codecs(self.warm_codec, self.cold_codec)
        if not 0 <= self.block_index < 2**64:
            raise RUFormatError("block index out of range")
        if key is None:
            salt = tag = None
            checksum: bytes | None = self.checksum()
        else:
            salt = secrets.token_bytes(SALT_BYTES)
            tag = self.payload_tag(key, salt)
            checksum = None
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
            "payload_salt": salt,
            "payload_tag": tag,
            "mac": None if key is None else bytes(MAC_BYTES),  # last: replaced by the MAC of what precedes it
        }, use_bin_type=True)
        signed = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header)) + header
        if key is not None:
            signed = signed[:-MAC_BYTES] + _header_mac(key, signed[:-MAC_BYTES])
        return signed + self.payload


def _header_mac(key: bytes, signed: bytes | memoryview) -> bytes:
    h = _keyed_sha256(key)
    h.update(_MAC_DOMAIN)
    h.update(signed)
    return h.digest()


def _payload_gmac(key: bytes, salt: bytes) -> AESGCM:
    h = _keyed_sha256(key)
    h.update(_PAYLOAD_KEY_DOMAIN + salt)
    return AESGCM(h.digest()[:16])


@functools.lru_cache(maxsize=8)
def _keyed_sha256_state(key: bytes) -> hmac.HMAC:
    return hmac.new(key, digestmod=hashlib.sha256)


def _keyed_sha256(key: bytes) -> hmac.HMAC:
    """A fresh HMAC-SHA256 under `key`: a copy of a keyed state, cheaper than keying again (measured here:
    1.8-3.4 us against 3.3-4.6 for `hmac.digest` of ~200 bytes), which counts at two per unit read."""
    return _keyed_sha256_state(key).copy()


class PayloadCheck:
    """What is left of a unit's verification once `decode_header` has passed its header: hashing the
    payload, nearly all the cost, with the GIL released. Pure; `failure` runs on any thread, and its
    Python is a few steps per unit, so that several threads hashing payloads seldom wait for each
    other's GIL."""

    __slots__ = ("_payload", "_gmac", "_expected")

    def __init__(self, payload: memoryview, gmac: AESGCM | None, expected: bytes) -> None:
        self._payload = payload
        self._gmac = gmac  # None: a unit encoded without a key, checked against its SHA-256
        self._expected = expected

    def failure(self) -> RUChecksumError | None:
        """None if the payload is the one the header names, else the error."""
        if self._gmac is None:
            if hmac.compare_digest(hashlib.sha256(self._payload).digest(), self._expected):
                return None
            return RUChecksumError("payload checksum mismatch")
        if hmac.compare_digest(self._gmac.encrypt(_ZERO_NONCE, b"", self._payload), self._expected):
            return None
        return RUChecksumError("payload does not match its tag: damaged or altered after writing")


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
    if not (isinstance(tag, str) and _TENANT_TAG.fullmatch(tag)):
        raise RUFormatError(f"tenant_tag must be {TENANT_TAG_CHARS} lowercase hex digits")


def decode(data: bytes | bytearray | memoryview, expected_hash: bytes | None = None, expected_model: str | None = None,
           key: bytes | None = None, expected_tenant_tag: str | None = None) -> RecyclableUnit:
    """Parse and verify `data`; see the module docstring for what is checked. With `key`, a unit whose
    MAC is absent or wrong raises RUAuthError; without, so does a keyed unit (its payload cannot be
    checked)."""
    unit, payload_check = decode_header(data, expected_hash, expected_model, key, expected_tenant_tag)
    failure = payload_check.failure()
    if failure is not None:
        raise failure
    return unit


def decode_header(data: bytes | bytearray | memoryview, expected_hash: bytes | None = None,
                  expected_model: str | None = None, key: bytes | None = None,
                  expected_tenant_tag: str | None = None) -> tuple[RecyclableUnit, PayloadCheck]:
    """`decode` up to the payload: every check but the payload's hash, which the returned PayloadCheck
    does (the unit is not verified until its `failure()` is None). For callers that verify many units
    at once: headers on one thread, payloads on all cores (`kite_shared.tiers.base.check_units`).
    Written for speed (it runs for every block a worker loads, holding the GIL): 26-34 us a unit on
    this machine, against 53-66 with a helper per field and the MAC over fields re-encoded one by one."""
    header, header_len = _read_header(data)
    try:
        values = [header[name] for name, _ in _HEADER_FIELDS]
    except KeyError as exc:
        raise RUFormatError(f"header lacks {exc.args[0]!r}") from None
    for (name, kinds), value in zip(_HEADER_FIELDS, values):
        if value.__class__ not in kinds:
            raise RUFormatError(f"header field {name!r} has the wrong type")
    block_hash, parent_hash, model, tenant, index, num_tokens, created_at, codec, shape, warm, cold = values
    try:
        salt = _optional_bytes(header, "payload_salt", SALT_BYTES)
        tag = _optional_bytes(header, "payload_tag", TAG_BYTES)
        mac = _optional_bytes(header, "mac", MAC_BYTES)
        checksum = _optional_bytes(header, "checksum", CHECKSUM_BYTES)
    except ValueError as exc:
        raise RUFormatError(str(exc)) from None
    keyed = mac is not None
    if not (salt is not None and tag is not None and checksum is None if keyed
            else salt is None and tag is None and checksum is not None):
        raise RUFormatError("a unit carries payload_salt, payload_tag and mac (keyed) or a checksum, not both")
    if len(block_hash) != 32 or len(parent_hash) != 32:
        raise RUFormatError("block and parent hashes must be 32 bytes")
    if index < 0:
        raise RUFormatError("negative block index")
    end = _PREAMBLE.size + header_len
    unit = RecyclableUnit(block_hash=block_hash, parent_hash=parent_hash, model_fingerprint=model,
                          tenant_tag=tenant, block_index=index, num_tokens=num_tokens,
                          created_at=float(created_at), codec=codec, shape=tuple(shape), warm_codec=warm,
                          cold_codec=cold, payload=memoryview(data)[end:])
    _check_geometry(codec, unit.shape, num_tokens, len(unit.payload))
    _check_tenant_tag(tenant)
    _check_tier_codecs(warm, cold)
    if key is not None:
        if not keyed:
            raise RUAuthError("unit carries no MAC")
        # The MAC covers every byte before its own value, and only counts if that value ends the header.
        signed = end - MAC_BYTES
        if bytes(data[signed - len(_MAC_ENTRY):end]) != _MAC_ENTRY + mac:
            raise RUFormatError("the header's last field must be its MAC")
        if not hmac.compare_digest(_header_mac(key, memoryview(data)[:signed]), mac):
            raise RUAuthError("unit MAC mismatch: not written with this cluster secret, or altered")
        payload_check = PayloadCheck(unit.payload, _payload_gmac(key, salt), tag)
    elif keyed:
        raise RUAuthError("a keyed unit: its payload can only be checked with the cluster key")
    else:
        payload_check = PayloadCheck(unit.payload, None, checksum)
    if expected_hash is not None and block_hash != expected_hash:
        raise RUKeyMismatchError("unit holds a different block than requested")
    if expected_model is not None and model != expected_model:
        raise RUKeyMismatchError("unit belongs to a different model fingerprint")
    if expected_tenant_tag is not None and tenant != expected_tenant_tag:
        raise RUKeyMismatchError("unit belongs to a different tenant")
    return unit, payload_check


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


def _optional_bytes(header: dict, key: str, size: int) -> bytes | None:
    if key not in header:
        raise ValueError(f"header lacks {key!r}")
    value = header[key]
    if value is not None and (not isinstance(value, bytes) or len(value) != size):
        raise ValueError(f"header field {key!r} has the wrong type")
    return value


def _typed(header: dict, key: str, kind: type | tuple[type, ...]):
    if key not in header:
        raise ValueError(f"header lacks {key!r}")
    value = header[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"header field {key!r} has the wrong type")
    return value
