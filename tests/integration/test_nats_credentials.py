"""NATS credentials and TLS against real nats-servers (issue 7): every KITE_NATS_* auth setting, through
KITE's own connect_nats with a CommonConfig loaded from the registry, is accepted when right and refused
when wrong, fast, with the specific error, and without a secret in the logs or the error text.

Each test starts its own nats-server(s) on free ports (kite_cli.local_servers.start_nats with an extra
config block), never the machine's NATS on 4222. Refusals use allow_reconnect=False and a bounded connect
timeout, and must not be that timeout; services themselves reconnect forever (connect_nats' default).
"""

from __future__ import annotations

import logging
import os
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import nats
import nkeys
import pytest

from kite_cli.local_servers import LocalServer, free_port, start_nats
from kite_shared.config import CommonConfig, load
from kite_shared.messages import PoolAdminReply
from kite_shared.service import connect_nats
from tests.helpers import pool_stats_async, wait_for_log, wait_until_async
from tests.tls_certs import CertFiles, TestCA

# Distinctive values, so a leak anywhere is found by a plain substring search.
PASSWORD = "pw-Kite-7f3a91d0"
WRONG_PASSWORD = "pw-Wrong-c2d4e6f8"
TOKEN = "tok-Kite-5b8e20aa"
WRONG_TOKEN = "tok-Wrong-913ab7cc"
SECRETS = (PASSWORD, WRONG_PASSWORD, TOKEN, WRONG_TOKEN)
# A refusal fails at once and is not retried. The timeout only bounds a hang: a TLS handshake on this 2-core
# machine under a full test run has taken over 2 s (the client then gave up and the server saw only EOF).
CONNECT_TIMEOUT_S = 8
FAST = {"allow_reconnect": False, "connect_timeout": CONNECT_TIMEOUT_S}


@pytest.fixture()
def nats_factory(tmp_path):
    """Start nats-servers with an extra config block (authorization, tls); all stopped after the test.
    A server's log is tmp_path/nats-<port>.log (server_log)."""
    servers: list[LocalServer] = []

    def start(extra_config: str, jetstream: bool = False) -> LocalServer:
        port = free_port()
        server = start_nats(port=port, jetstream=jetstream, extra_config=extra_config,
                            log_file=tmp_path / f"nats-{port}.log")
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    """A CA with a server cert (SAN 127.0.0.1, localhost) and a client cert; a second, unrelated CA with
    its own client cert; and a server cert of the right CA for another host name."""
    folder = tmp_path_factory.mktemp("pki")
    ca, other_ca = TestCA(folder, "kite-ca"), TestCA(folder, "other-ca")
    return {"ca": ca.pem, "server": ca.issue("nats-server", server=True),
            "client": ca.issue("kite-client", server=False),
            "other_ca": other_ca.pem, "other_client": other_ca.issue("intruder", server=False),
            "wrong_host_server": ca.issue("elsewhere", server=True, hosts=("nats.elsewhere.example",))}


def server_log(tmp_path: Path, srv: LocalServer) -> str:
    return (tmp_path / f"nats-{srv.port}.log").read_text(errors="replace")


def tls_block(server: CertFiles, ca: Path) -> str:
    return (f'tls {{ cert_file: "{server.cert}", key_file: "{server.key}", ca_file: "{ca}", '
            f'verify: true, timeout: {CONNECT_TIMEOUT_S} }}')


def tls_env(pki: dict, client: str = "client", ca: str = "ca") -> dict[str, str]:
    return {"KITE_NATS_TLS_CA": str(pki[ca]), "KITE_NATS_TLS_CERT": str(pki[client].cert),
            "KITE_NATS_TLS_KEY": str(pki[client].key)}


def common(url: str, **env: str) -> CommonConfig:
    return load(CommonConfig, {"KITE_NATS_URL": url, **env})


async def assert_connects(url: str, cfg: CommonConfig) -> None:
    """connect_nats works and a request/reply round trip goes through the server."""
    nc = await connect_nats(url, "kite-credentials-test", cfg, **FAST)
    try:
        async def echo(msg) -> None:
            await msg.respond(b"echo:" + msg.data)

        await nc.subscribe("kite.test.echo", cb=echo)
        reply = await nc.request("kite.test.echo", b"ping", timeout=2)
        assert reply.data == b"echo:ping"
    finally:
        await nc.close()


async def refusal(url: str, cfg: CommonConfig, caplog,
                  expected: type[BaseException] | tuple[type[BaseException], ...]) -> BaseException:
    """connect_nats fails at once with `expected`; nothing KITE logged or raised holds a secret."""
    caplog.clear()
    started = time.monotonic()
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(expected) as info:
            await connect_nats(url, "kite-credentials-test", cfg, **FAST)
    assert time.monotonic() - started < CONNECT_TIMEOUT_S + 2
    assert not isinstance(info.value, TimeoutError), "no refusal: the connection attempt timed out"
    assert f"NATS error: {info.value}" in caplog.text  # KITE's error_cb logged this very error
    for secret in SECRETS:
        assert secret not in caplog.text and secret not in str(info.value) and secret not in repr(info.value)
    return info.value


def assert_auth_violation(exc: BaseException) -> None:
    assert type(exc) is nats.errors.Error and str(exc) == "nats: 'Authorization Violation'", repr(exc)


async def test_user_and_password(nats_factory, caplog):
    srv = nats_factory(f'authorization {{ user: kite, password: "{PASSWORD}" }}')
    await assert_connects(srv.url, common(srv.url, KITE_NATS_USER="kite", KITE_NATS_PASSWORD=PASSWORD))
    with_url_creds = srv.url.replace("nats://", f"nats://kite:{PASSWORD}@")
    await assert_connects(with_url_creds, common(with_url_creds))

    wrong = common(srv.url, KITE_NATS_USER="kite", KITE_NATS_PASSWORD=WRONG_PASSWORD)
    assert_auth_violation(await refusal(srv.url, wrong, caplog, nats.errors.Error))
    wrong_in_url = srv.url.replace("nats://", f"nats://kite:{WRONG_PASSWORD}@")
    assert_auth_violation(await refusal(wrong_in_url, common(wrong_in_url), caplog, nats.errors.Error))
    assert_auth_violation(await refusal(srv.url, common(srv.url), caplog, nats.errors.Error))


async def test_token(nats_factory, caplog):
    srv = nats_factory(f'authorization {{ token: "{TOKEN}" }}')
    await assert_connects(srv.url, common(srv.url, KITE_NATS_TOKEN=TOKEN))
    assert_auth_violation(await refusal(srv.url, common(srv.url, KITE_NATS_TOKEN=WRONG_TOKEN), caplog,
                                        nats.errors.Error))
    assert_auth_violation(await refusal(srv.url, common(srv.url), caplog, nats.errors.Error))


async def test_nkey_seed_file(nats_factory, tmp_path, caplog):
    def seed_file(name: str) -> tuple[Path, bytes, str]:
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        path = tmp_path / name
        path.write_bytes(seed + b"\n")
        path.chmod(0o600)
        return path, seed, nkeys.from_seed(bytearray(seed)).public_key.decode()

    user_file, user_seed, user_public = seed_file("user.nk")
    other_file, other_seed, _ = seed_file("other.nk")
    assert user_public.startswith("U") and user_seed.startswith(b"SU")
    srv = nats_factory(f'authorization {{ users = [ {{ nkey: "{user_public}" }} ] }}')
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        await assert_connects(srv.url, common(srv.url, KITE_NATS_NKEY_SEED_FILE=str(user_file)))
    assert "can be read by other users" not in caplog.text  # 0600: no permission warning

    exc = await refusal(srv.url, common(srv.url, KITE_NATS_NKEY_SEED_FILE=str(other_file)), caplog,
                        nats.errors.Error)
    assert_auth_violation(exc)
    for seed in (user_seed.decode(), other_seed.decode()):
        assert seed not in caplog.text and seed not in str(exc)


@pytest.mark.parametrize("scheme, host", [("nats", "127.0.0.1"), ("tls", "127.0.0.1"), ("nats", "localhost")])
async def test_mutual_tls_connects(nats_factory, pki, scheme, host):
    srv = nats_factory(tls_block(pki["server"], pki["ca"]))
    url = f"{scheme}://{host}:{srv.port}"
    await assert_connects(url, common(url, **tls_env(pki)))


async def test_mutual_tls_refusals(nats_factory, pki, caplog, tmp_path):
    srv = nats_factory(tls_block(pki["server"], pki["ca"]))
    url = srv.url
    await assert_connects(url, common(url, **tls_env(pki)))  # the control: right CA, cert and key
    # The server (verify: true) refuses a client without a certificate, or with one from a CA it does not
    # trust. In TLS 1.3 the client's side of the handshake is over before the server checks, so what the
    # client sees depends on a race with the server's alert (SSLError "certificate required" / "unknown
    # ca", ConnectionResetError, BrokenPipeError: all OSErrors); the server's log says which check failed.
    await refusal(url, common(url, KITE_NATS_TLS_CA=str(pki["ca"])), caplog, OSError)
    assert "TLS handshake error: tls: client didn't provide a certificate" in server_log(tmp_path, srv)
    await refusal(url, common(url, **tls_env(pki, client="other_client")), caplog, OSError)
    assert "certificate signed by unknown authority" in server_log(tmp_path, srv)
    # The wrong CA for the server: KITE does not trust the server's certificate.
    exc = await refusal(url, common(url, **tls_env(pki, ca="other_ca")), caplog, ssl.SSLCertVerificationError)
    assert "unable to get local issuer certificate" in str(exc)
    # No TLS settings at all: the system CAs do not know the test CA either.
    await refusal(url, common(url), caplog, ssl.SSLCertVerificationError)


async def test_tls_checks_the_server_host_name(nats_factory, pki, caplog):
    srv = nats_factory(tls_block(pki["wrong_host_server"], pki["ca"]))  # right CA, SAN nats.elsewhere.example
    exc = await refusal(srv.url, common(srv.url, **tls_env(pki)), caplog, ssl.SSLCertVerificationError)
    assert "IP address mismatch" in str(exc), repr(exc)


@pytest.mark.parametrize("scheme", ["nats", "tls"])
async def test_tls_settings_never_fall_back_to_plaintext(nats_factory, pki, caplog, scheme):
    """nats-py alone would send CONNECT, password included, in the clear to a server without TLS even with a
    tls= context or a tls:// URL; KITE's client refuses the server before any credential is sent."""
    srv = nats_factory(f'authorization {{ user: kite, password: "{PASSWORD}" }}')  # no tls block
    url = f"{scheme}://127.0.0.1:{srv.port}"
    cfg = common(url, KITE_NATS_USER="kite", KITE_NATS_PASSWORD=PASSWORD, **tls_env(pki))
    exc = await refusal(url, cfg, caplog, nats.errors.SecureConnWantedError)
    assert str(exc) == "nats: secure connection not available"


# --- one real KITE service over TLS + user/password ------------------------------------------------------

def service_env(srv: LocalServer, pki: dict, tmp_path: Path, password: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KITE_")}
    env.update(KITE_NATS_URL=srv.url, KITE_NATS_USER="kite", KITE_NATS_PASSWORD=password, **tls_env(pki),
               KITE_REDIS_URL="", KITE_S3_ENDPOINT="", KITE_COLD_DIR=str(tmp_path / "cold"),
               KITE_CLUSTER_SECRET="credentials-test-cluster-secret", KITE_METRICS_PORT="0",
               KITE_LOG_LEVEL="DEBUG")
    return env


async def test_ru_pool_process_over_tls_with_user_and_password(nats_factory, pki, tmp_path):
    srv = nats_factory(tls_block(pki["server"], pki["ca"])
                       + f'\nauthorization {{ user: kite, password: "{PASSWORD}" }}', jetstream=True)

    # A wrong password: the service keeps retrying (as it must) and logs why, without the password.
    wrong_log = tmp_path / "ru-pool-wrong.log"
    with wrong_log.open("wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kite_ru_pool"], stdout=subprocess.DEVNULL, stderr=err,
                                env=service_env(srv, pki, tmp_path, WRONG_PASSWORD))
    try:
        wait_for_log(wrong_log, "Authorization Violation", proc, timeout_s=20.0)
        proc.send_signal(signal.SIGTERM)  # still connecting: it stops at once (test_service_startup_signals)
        assert proc.wait(5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log = wrong_log.read_text(errors="replace")
    assert "ru-pool stopping before NATS connected" in log
    assert WRONG_PASSWORD not in log and PASSWORD not in log

    env = service_env(srv, pki, tmp_path, PASSWORD)
    good_log = tmp_path / "ru-pool.log"
    with good_log.open("wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kite_ru_pool"], stdout=subprocess.DEVNULL, stderr=err,
                                env=env)
    nc = await connect_nats(srv.url, "kite-credentials-test", load(CommonConfig, env), **FAST)
    try:
        async def stats() -> PoolAdminReply:
            assert proc.poll() is None, good_log.read_text()
            return await pool_stats_async(nc, timeout_s=0.5)

        reply = await wait_until_async(stats, 30, "the ru-pool answering stats", interval_s=0.1,
                                       ignore=(nats.errors.TimeoutError, nats.errors.NoRespondersError),
                                       context=lambda: good_log.read_text()[-3000:])
        assert reply.ok and "hot" in reply.tiers, reply
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, good_log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await nc.close()
    log = good_log.read_text()
    assert "ru-pool ready" in log and "ru-pool stopped" in log
    assert PASSWORD not in log
