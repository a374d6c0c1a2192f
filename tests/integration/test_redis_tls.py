"""The warm tier against a real redis-server with AUTH (requirepass) and TLS only (no plain port): the
CA reaches redis-py through KITE_REDIS_URL's `ssl_ca_certs` query parameter, the password through the
URL's userinfo; a wrong password, a missing CA or a plain redis:// URL is a down tier, cleanly, and no
password ever shows in a log record or an exception."""

from __future__ import annotations

import hashlib
import logging
import time
import urllib.parse
from pathlib import Path

import pytest
import redis

from kite_cli.local_servers import ServerStartError, find_binary, free_port, start_redis
from kite_shared.config import TierConfig, load
from kite_shared.recyclable_unit import RecyclableUnit
from kite_shared.tiers.client import TierClient
from kite_shared.tiers.keys import BlockKey
from kite_shared.tiers.warm import RedisTier
from tests.tls_certs import TestCA

PASSWORD = "kite-tls-S3cret/with:odd@chars"  # URL-quoted in the URL, as an operator must
WRONG_PASSWORD = "kite-wrong-Pa55word"
RU_KEY = hashlib.sha256(b"redis-tls-test-ru-key").digest()
FP = hashlib.sha256(b"redis-tls-test-model").hexdigest()
SHAPE = (2, 2, 1, 16, 4)


class TlsRedis:
    def __init__(self, folder: Path, client_certs: bool = False) -> None:
        self.ca = TestCA(folder)
        cert = self.ca.issue("redis-server", server=True)
        self.client_cert = self.ca.issue("kite-client", server=False) if client_certs else None
        self.port = free_port()
        # --port 0: no plain-text port at all. --tls-auth-clients: whether clients need a certificate.
        self.server = start_redis(self.port, log_file=folder / "redis-server.log", extra_args=[
            "--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(cert.cert),
            "--tls-key-file", str(cert.key), "--tls-ca-cert-file", str(self.ca.pem),
            "--tls-auth-clients", "yes" if client_certs else "no", "--requirepass", PASSWORD])

    def url(self, password: str | None = PASSWORD, scheme: str = "rediss", ca: bool = True,
            client_cert: bool = False) -> str:
        auth = f":{urllib.parse.quote(password, safe='')}@" if password else ""
        query = {"ssl_ca_certs": str(self.ca.pem)} if ca else {}
        if client_cert:
            query.update(ssl_certfile=str(self.client_cert.cert), ssl_keyfile=str(self.client_cert.key))
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0" + (f"?{urllib.parse.urlencode(query)}" if query else "")

    def client(self) -> redis.Redis:
        """A synchronous client for checks from the test side."""
        return redis.Redis(host="127.0.0.1", port=self.port, password=PASSWORD, ssl=True,
                           ssl_ca_certs=str(self.ca.pem))

    def stop(self) -> None:
        self.server.stop()


def _start(folder: Path, client_certs: bool = False) -> TlsRedis:
    if find_binary("redis-server") is None:
        pytest.skip("needs redis-server (apt-get install redis-server)")
    try:
        return TlsRedis(folder, client_certs)
    except ServerStartError as exc:  # a build without TLS exits at once on --tls-port
        pytest.skip(f"this redis-server cannot serve TLS (built without BUILD_TLS=yes?): {exc}")


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    server = _start(tmp_path_factory.mktemp("redis-tls"))
    yield server
    server.stop()


def _unit(i: int) -> tuple[bytes, bytes]:
    block_hash = hashlib.sha256(f"{FP}/{i}".encode()).digest()
    payload = bytes((i + j) % 256 for j in range(2 * 2 * 1 * 16 * 4 * 2))
    unit = RecyclableUnit(block_hash=block_hash, parent_hash=b"\0" * 32, model_fingerprint=FP, block_index=i,
                          num_tokens=16, codec="fp16", shape=SHAPE, payload=payload)
    return block_hash, unit.encode(key=RU_KEY)


def _no_secret_in(text: str) -> None:
    for secret in (PASSWORD, urllib.parse.quote(PASSWORD, safe=""), WRONG_PASSWORD):
        assert secret not in text


async def test_rediss_url_with_password_and_ca_serves_the_warm_tier(tls_redis, caplog):
    """KITE_REDIS_URL=rediss://:<password>@host:port/0?ssl_ca_certs=<ca.pem>, as the services read it."""
    caplog.set_level(logging.DEBUG)
    cfg = load(TierConfig, environ={"KITE_REDIS_URL": tls_redis.url(), "KITE_TIER_TIMEOUT_S": "2.0"})
    _no_secret_in(repr(cfg))  # KITE_REDIS_URL is a secret setting: never in the config's repr
    client = TierClient.from_config(cfg, with_cold=False, ru_key=RU_KEY)
    tier = client.warm
    try:
        await client.start()
        assert tier.up
        units = [_unit(i) for i in range(3)]
        for block_hash, data in units:
            assert await tier.put(BlockKey.of(FP, block_hash), data)
        for block_hash, data in units:
            key = BlockKey.of(FP, block_hash)
            assert await tier.exists(key)
            assert await tier.get(key) == data
            assert await tier.get_verified(FP, block_hash) == data  # decoded, hash and HMAC checked
        listed = {item.key async for item in tier.iter_keys()}
        assert listed == {BlockKey.of(FP, h) for h, _ in units}
        assert await tier.set_pinned(BlockKey.of(FP, units[0][0]), True)
        assert await tier.delete_many([BlockKey.of(FP, h) for h, _ in units]) == 3
        assert tier.up and tier.health.failures == 0
        with tls_redis.client() as r:  # the test's own TLS client agrees: nothing left
            assert r.dbsize() == 0
    finally:
        await client.close()
    _no_secret_in(caplog.text)


async def test_a_wrong_password_is_a_down_tier_and_never_logged(tls_redis, caplog):
    caplog.set_level(logging.DEBUG)
    tier = RedisTier(tls_redis.url(password=WRONG_PASSWORD), timeout_s=2.0)
    block_hash, data = _unit(0)
    try:
        assert not await tier.ping()
        assert not tier.up
        assert await tier.get(BlockKey.of(FP, block_hash)) is None  # down: a miss, no exception
        assert not await tier.put(BlockKey.of(FP, block_hash), data)
        # What redis-py raised (and the tier logged with %r): an authentication error, no password.
        with pytest.raises(redis.exceptions.AuthenticationError) as raised:
            await tier._redis.ping()
        _no_secret_in(str(raised.value) + repr(raised.value))
        _no_secret_in(repr(tier._redis))  # redis-py redacts the password in its reprs
    finally:
        await tier.close()
    assert "tier down" in caplog.text
    _no_secret_in(caplog.text)
    no_password = RedisTier(tls_redis.url(password=None), timeout_s=2.0)
    try:
        assert not await no_password.ping()  # NOAUTH: down as well
    finally:
        await no_password.close()


async def test_tls_without_the_ca_fails_verification_cleanly(tls_redis, caplog):
    """Certificate verification is on: without the test CA (not in the system store) the handshake
    fails, and that is a down tier like any other failure."""
    caplog.set_level(logging.DEBUG)
    tier = RedisTier(tls_redis.url(ca=False), timeout_s=2.0)
    try:
        assert not await tier.ping()
        assert not tier.up
        # Why: the handshake's verification, not the network. (The tier's log line shows only the
        # exception's repr, which redis-py 8 reduces to "network:ConnectionError".)
        with pytest.raises(redis.exceptions.ConnectionError) as raised:
            await tier._redis.ping()
        assert "certificate verify failed" in str(raised.value).lower()
        _no_secret_in(str(raised.value))
    finally:
        await tier.close()
    _no_secret_in(caplog.text)


async def test_a_plain_url_against_the_tls_port_is_a_down_tier(tls_redis, caplog):
    caplog.set_level(logging.DEBUG)
    tier = RedisTier(tls_redis.url(scheme="redis", ca=False), timeout_s=1.0)
    block_hash, _ = _unit(0)
    try:
        started = time.monotonic()
        assert not await tier.ping()
        assert time.monotonic() - started < 5.0  # bounded by the tier's timeout, not hung
        assert not tier.up
        started = time.monotonic()
        assert await tier.get(BlockKey.of(FP, block_hash)) is None  # down: answered without I/O
        assert time.monotonic() - started < 0.1
    finally:
        await tier.close()
    _no_secret_in(caplog.text)


async def test_client_certificates_go_in_the_url_too(tmp_path):
    """Mutual TLS (--tls-auth-clients yes): ssl_certfile and ssl_keyfile query parameters."""
    server = _start(tmp_path, client_certs=True)
    with_cert = RedisTier(server.url(client_cert=True), timeout_s=2.0)
    without = RedisTier(server.url(), timeout_s=2.0)
    block_hash, data = _unit(0)
    try:
        assert await with_cert.put(BlockKey.of(FP, block_hash), data)
        assert await with_cert.get(BlockKey.of(FP, block_hash)) == data
        assert not await without.ping()  # the server refuses a client without a certificate
        assert with_cert.up and not without.up
    finally:
        await with_cert.close()
        await without.close()
        server.stop()
