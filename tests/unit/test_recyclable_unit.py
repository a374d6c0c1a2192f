"""The RU binary format: round trip, and every kind of damage rejected with a typed error."""

from __future__ import annotations

import hashlib
import struct

import msgpack
import numpy as np
import pytest

from kite_shared.recyclable_unit import (RecyclableUnit, RUAuthError, RUChecksumError, RUFormatError,
                                         RUKeyMismatchError, decode, decode_header, stored_codecs)
from kite_shared.security import ANONYMOUS_TENANT_TAG, tenant_tag

SHAPE = (2, 2, 1, 16, 4)
KEY = b"k" * 32


def unit(codec: str = "fp16") -> RecyclableUnit:
    dtype = {"fp16": np.float16, "fp32": np.float32, "bf16": np.uint16}[codec]
    payload = np.arange(np.prod(SHAPE), dtype=dtype).tobytes()
    return RecyclableUnit(block_hash=b"\x01" * 32, parent_hash=b"\x02" * 32, model_fingerprint="ff" * 32,
                          block_index=3, num_tokens=16, codec=codec, shape=SHAPE, payload=payload,
                          created_at=1700000000.5)


@pytest.mark.parametrize("codec", ["fp16", "fp32", "bf16"])
def test_round_trip(codec):
    original = unit(codec)
    assert decode(original.encode(), expected_hash=b"\x01" * 32, expected_model="ff" * 32) == original


def _header(data: bytes) -> dict:
    header_len = struct.unpack_from(">3sBI", data)[2]
    return msgpack.unpackb(data[8:8 + header_len])


def test_layout_is_magic_length_header_payload():
    data = unit().encode()
    magic, version, header_len = struct.unpack_from(">3sBI", data)
    assert (magic, version) == (b"KRU", 7)
    header = _header(data)
    assert header["shape"] == list(SHAPE) and header["codec"] == "fp16"
    assert data[8 + header_len:] == unit().payload
    assert header["checksum"] == hashlib.sha256(unit().payload).digest()
    assert header["payload_salt"] is header["payload_tag"] is header["mac"] is None


def test_a_keyed_unit_carries_a_payload_tag_under_a_key_of_its_own_and_no_checksum():
    first, second = _header(unit().encode(KEY)), _header(unit().encode(KEY))
    assert first["checksum"] is None
    assert (len(first["payload_salt"]), len(first["payload_tag"]), len(first["mac"])) == (16, 16, 32)
    # A new salt at every encoding: the same payload gets another one-time key and so another tag.
    assert first["payload_salt"] != second["payload_salt"] and first["payload_tag"] != second["payload_tag"]
    assert decode(unit().encode(KEY), key=KEY) == unit()


def test_a_keyed_unit_cannot_be_read_without_the_key():
    with pytest.raises(RUAuthError, match="cluster key"):
        decode(unit().encode(KEY))


def test_a_header_with_both_kinds_of_integrity_is_a_format_error():
    data = unit().encode(KEY)
    header = _header(data)
    header["checksum"] = hashlib.sha256(unit().payload).digest()
    packed = msgpack.packb(header, use_bin_type=True)
    with pytest.raises(RUFormatError, match="not both"):
        decode(data[:4] + struct.pack(">I", len(packed)) + packed + unit().payload, key=KEY)


def test_decode_header_leaves_only_the_payload_to_check():
    data = bytearray(unit().encode(KEY))
    data[-1] ^= 0x01
    header_unit, payload_check = decode_header(bytes(data), expected_hash=b"\x01" * 32, key=KEY)
    assert header_unit.block_index == 3
    assert isinstance(payload_check.failure(), RUChecksumError)
    assert decode_header(unit().encode(KEY), key=KEY)[1].failure() is None


def test_decode_views_the_payload_without_copying():
    """A reader that decodes into its own writable buffer can give the payload to torch as it is."""
    buffer = bytearray(unit().encode())
    payload = decode(buffer).payload
    assert isinstance(payload, memoryview) and not payload.readonly
    buffer[-1] ^= 0xFF
    assert payload[-1] == buffer[-1]


@pytest.mark.parametrize("key", [None, KEY])
def test_flipped_payload_byte_fails_checksum(key):
    data = bytearray(unit().encode(key))
    data[-5] ^= 0x40
    with pytest.raises(RUChecksumError):
        decode(bytes(data), key=key)


@pytest.mark.parametrize("damage", [
    lambda d: d[:7],  # truncated preamble
    lambda d: b"XRU" + d[3:],  # bad magic
    lambda d: d[:3] + b"\x08" + d[4:],  # unknown version
    lambda d: d[:3] + b"\x06" + d[4:],  # version 6 (BLAKE3 checksum under the MAC) is no longer read
    lambda d: d[:3] + b"\x05" + d[4:],  # version 5 (no tier codecs) is no longer read
    lambda d: d[:3] + b"\x04" + d[4:],  # version 4 (SHA-256 checksum) is no longer read
    lambda d: d[:3] + b"\x03" + d[4:],  # version 3 (MAC over the payload too) is no longer read
    lambda d: d[:3] + b"\x01" + d[4:],  # version 1 (no MAC) is no longer read
    lambda d: d[:3] + b"\x02" + d[4:],  # version 2 (no tenant tag) is no longer read
    lambda d: d[:-2],  # payload shorter than the shape needs
    lambda d: d + b"\x00\x00",  # payload longer
    lambda d: d[:4] + struct.pack(">I", 10**6) + d[8:],  # header length out of range
    lambda d: d[:8] + b"\xc1" * 10 + d[18:],  # header not msgpack
])
def test_damaged_bytes_are_format_errors(damage):
    with pytest.raises(RUFormatError):
        decode(damage(unit().encode()))


def test_wrong_block_or_model_is_a_key_mismatch():
    data = unit().encode()
    with pytest.raises(RUKeyMismatchError):
        decode(data, expected_hash=b"\x09" * 32)
    with pytest.raises(RUKeyMismatchError):
        decode(data, expected_model="00" * 32)
    with pytest.raises(RUKeyMismatchError):
        decode(data, expected_tenant_tag=tenant_tag("acme"))


def test_tenant_tag_round_trips_and_defaults_to_anonymous():
    assert decode(unit().encode()).tenant_tag == ANONYMOUS_TENANT_TAG == tenant_tag("anonymous")
    acme = RecyclableUnit(**{**unit().__dict__, "tenant_tag": tenant_tag("acme")})
    assert decode(acme.encode(), expected_tenant_tag=tenant_tag("acme")).tenant_tag == tenant_tag("acme")


@pytest.mark.parametrize("bad", ["", "ACME", "0123", "g" * 16, "0" * 17])
def test_malformed_tenant_tag_is_refused(bad):
    with pytest.raises(RUFormatError):
        RecyclableUnit(**{**unit().__dict__, "tenant_tag": bad}).encode()


def test_encode_refuses_inconsistent_geometry():
    bad = RecyclableUnit(**{**unit().__dict__, "shape": (2, 2, 1, 8, 4)})
    with pytest.raises(RUFormatError):
        bad.encode()


def test_tier_codecs_round_trip_and_are_read_without_verifying():
    lossy_below = RecyclableUnit(**{**unit().__dict__, "cold_codec": "int8"})
    data = lossy_below.encode()
    assert decode(data) == lossy_below
    assert stored_codecs(data) == ("fp16", "", "int8")
    with pytest.raises(RUFormatError):
        stored_codecs(data[:3] + b"\x05" + data[4:])


@pytest.mark.parametrize("field", ["warm_codec", "cold_codec"])
def test_a_tier_codec_that_is_not_lossy_is_refused(field):
    with pytest.raises(RUFormatError, match=field):
        RecyclableUnit(**{**unit().__dict__, field: "zstd"}).encode()
