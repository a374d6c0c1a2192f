"""The MACs every unit carries (format v7: the header's HMAC and the payload's tag), their verification,
the cluster secret they are keyed with, and tiers treating a failed check as a counted miss (never a
load)."""

from __future__ import annotations

import multiprocessing
import os
import stat

import msgpack
import numpy as np
import pytest

from kite_shared import security
from kite_shared.recyclable_unit import (RecyclableUnit, RUAuthError, RUChecksumError, RUError, RUFormatError,
                                         decode)
from kite_shared.tiers import metrics
from kite_shared.tiers.cold import LocalDirTier
from kite_shared.tiers.keys import BlockKey

SHAPE = (2, 2, 1, 16, 4)
KEY = security.derive_ru_key(b"test-cluster-secret")
OTHER_KEY = security.derive_ru_key(b"another-cluster")
FP = "ab" * 32


def unit(block_hash: bytes = b"\x01" * 32, fp: str = FP) -> RecyclableUnit:
    payload = np.arange(np.prod(SHAPE), dtype=np.float16).tobytes()
    return RecyclableUnit(block_hash=block_hash, parent_hash=b"\x02" * 32, model_fingerprint=fp,
                          block_index=3, num_tokens=16, codec="fp16", shape=SHAPE, payload=payload,
                          created_at=1700000000.5)


def _rewrite_header(data: bytes, **changes) -> bytes:
    """Change header fields (as a forger without the key would: the MAC and payload tag stay) and
    re-frame."""
    header_len = int.from_bytes(data[4:8], "big")
    header = msgpack.unpackb(data[8:8 + header_len], raw=False)
    payload = changes.pop("payload", data[8 + header_len:])
    header.update(changes)
    packed = msgpack.packb(header, use_bin_type=True)
    return data[:4] + len(packed).to_bytes(4, "big") + packed + payload


def test_keyed_round_trip_and_no_read_without_the_key():
    data = unit().encode(key=KEY)
    assert decode(data, expected_hash=b"\x01" * 32, expected_model=FP, key=KEY) == unit()
    with pytest.raises(RUAuthError):  # the payload tag can only be checked with the key
        decode(data)


def test_wrong_key_missing_mac_and_forged_fields_are_auth_errors():
    with pytest.raises(RUAuthError):
        decode(unit().encode(key=OTHER_KEY), key=KEY)
    with pytest.raises(RUAuthError):
        decode(unit().encode(), key=KEY)  # a unit written without the secret
    good = unit().encode(key=KEY)
    for forged in (_rewrite_header(good, block_index=4),
                   _rewrite_header(good, model_fingerprint="cd" * 32),
                   _rewrite_header(good, tenant_tag=security.tenant_tag("mallory")),
                   _rewrite_header(good, block_hash=b"\x07" * 32),
                   _rewrite_header(good, created_at=1.0),
                   _rewrite_header(good, cold_codec="int8"),  # would make the pool store it lossily
                   _rewrite_header(good, warm_codec="fp8_e4m3"),
                   _rewrite_header(good, payload_salt=b"\x00" * 16),  # another one-time key
                   _rewrite_header(good, payload_tag=b"\x00" * 16)):
        with pytest.raises(RUAuthError):
            decode(forged, key=KEY)


def test_the_mac_must_end_the_header():
    """The MAC signs every byte before its value; a header that puts another field after it is refused,
    even when the MAC itself is intact."""
    good = unit().encode(key=KEY)
    header_len = int.from_bytes(good[4:8], "big")
    header = msgpack.unpackb(good[8:8 + header_len], raw=False)
    moved = {"mac": header.pop("mac"), **header}
    packed = msgpack.packb(moved, use_bin_type=True)
    with pytest.raises(RUFormatError, match="last field"):
        decode(good[:4] + len(packed).to_bytes(4, "big") + packed + good[8 + header_len:], key=KEY)


def test_a_replaced_payload_fails_its_tag():
    with pytest.raises(RUChecksumError):
        decode(_rewrite_header(unit().encode(key=KEY), payload=bytes(len(unit().payload))), key=KEY)


def test_damage_is_still_a_checksum_error_and_every_failure_is_an_ru_error():
    data = bytearray(unit().encode(key=KEY))
    data[-3] ^= 0x10
    with pytest.raises(RUChecksumError):
        decode(bytes(data), key=KEY)
    assert issubclass(RUAuthError, RUError)


def test_mac_field_of_the_wrong_type_is_a_format_error():
    with pytest.raises(RUFormatError):
        decode(_rewrite_header(unit().encode(key=KEY), mac=b"short"), key=KEY)


def test_tenant_salt_is_derived_and_unambiguous():
    a = security.tenant_cache_salt("alice", "")
    assert a == security.tenant_cache_salt("alice")
    assert len(a) == 64 and int(a, 16) >= 0
    assert a != security.tenant_cache_salt("bob", "")
    assert security.tenant_cache_salt("ab", "c") != security.tenant_cache_salt("a", "bc")
    assert security.tenant_cache_salt("alice", "x") != a  # a client salt narrows sharing


def test_cluster_secret_prefers_the_setting(tmp_path):
    path = tmp_path / "secret"
    assert security.load_cluster_secret("s3cr3t", path) == b"s3cr3t"
    assert not path.exists()


def _secret_in_child(path: str, out) -> None:
    out.put(security.load_cluster_secret("", security.Path(path)))


def test_per_install_secret_is_created_once_0600_and_shared_by_processes(tmp_path):
    path = tmp_path / "kite" / "cluster-secret"
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_secret_in_child, args=(str(path), out)) for _ in range(4)]
    for p in procs:
        p.start()
    secrets = {out.get(timeout=60) for _ in procs}
    for p in procs:
        p.join(30)
    assert len(secrets) == 1 and len(next(iter(secrets))) == 64
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert security.load_cluster_secret("", path) in secrets


def test_ru_key_follows_the_environment(tmp_path):
    env = {"KITE_CLUSTER_SECRET": "abc", "KITE_CLUSTER_SECRET_FILE": str(tmp_path / "unused")}
    assert security.ru_key(env) == security.derive_ru_key(b"abc")
    env2 = {"KITE_CLUSTER_SECRET_FILE": str(tmp_path / "f")}
    assert security.ru_key(env2) == security.derive_ru_key((tmp_path / "f").read_bytes().strip())


def test_secret_settings_are_not_in_config_reprs():
    from kite_shared.config import CommonConfig, SecurityConfig, load

    cfg = load(SecurityConfig, {"KITE_CLUSTER_SECRET": "do-not-print-me"})
    common = load(CommonConfig, {"KITE_NATS_PASSWORD": "pw-do-not-print", "KITE_NATS_TOKEN": "tok-do-not"})
    assert "do-not-print-me" not in repr(cfg)
    assert "pw-do-not-print" not in repr(common) and "tok-do-not" not in repr(common)


@pytest.mark.parametrize("url, shown", [
    ("nats://user:pw@host:4222", "nats://***@host:4222"),
    ("redis://:pw@127.0.0.1:6379/0", "redis://***@127.0.0.1:6379/0"),
    ("nats://a:1,nats://u:p@b:2", "nats://a:1,nats://***@b:2"),
    ("rediss://host:6380", "rediss://host:6380"),
])
def test_redact_url(url, shown):
    assert security.redact_url(url) == shown


async def test_tier_read_with_a_bad_mac_is_a_counted_deleted_miss(tmp_path):
    tier = LocalDirTier(tmp_path, "t/")
    tier.ru_key = KEY
    await tier.ensure_bucket()
    good, forged, unkeyed = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    await tier.put(BlockKey.of(FP, good), unit(good).encode(key=KEY))
    await tier.put(BlockKey.of(FP, forged), unit(forged).encode(key=OTHER_KEY))
    await tier.put(BlockKey.of(FP, unkeyed), unit(unkeyed).encode())
    before = metrics.TIER_INTEGRITY_FAILURES.labels("cold")._value.get()
    assert await tier.get_verified(FP, good) is not None
    assert await tier.get_verified(FP, forged) is None
    assert await tier.get_verified(FP, unkeyed) is None
    assert metrics.TIER_INTEGRITY_FAILURES.labels("cold")._value.get() - before == 2
    assert tier.integrity_failures == 2
    assert not await tier.exists(BlockKey.of(FP, forged)) and not await tier.exists(BlockKey.of(FP, unkeyed))
    await tier.close()
