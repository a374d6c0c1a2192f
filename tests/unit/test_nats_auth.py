"""nats_auth_options: KITE_NATS_* credentials and TLS settings into nats.connect options, checked before any
connection (bad files and combinations are ConfigErrors naming the variable, never echoing a secret).
The same settings against real nats-servers: tests/integration/test_nats_credentials.py."""

from __future__ import annotations

import logging
import os
import ssl

import nkeys
import pytest

from kite_shared.config import CommonConfig, ConfigError, load
from kite_shared.service import nats_auth_options
from tests.tls_certs import TestCA


def opts(**env: str) -> dict:
    return nats_auth_options(load(CommonConfig, env))


def user_seed() -> bytes:
    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)


def test_nothing_set_means_no_options():
    assert opts() == {}
    assert nats_auth_options(None) == {}


def test_user_password_and_token():
    assert opts(KITE_NATS_USER="kite", KITE_NATS_PASSWORD="pw") == {"user": "kite", "password": "pw"}
    assert opts(KITE_NATS_TOKEN="tok") == {"token": "tok"}


@pytest.mark.parametrize("env, message", [
    ({"KITE_NATS_PASSWORD": "pw-only"}, "KITE_NATS_USER is empty"),
    ({"KITE_NATS_USER": "u", "KITE_NATS_PASSWORD": "pw-x", "KITE_NATS_TOKEN": "tok-x"}, "only one of"),
    ({"KITE_NATS_TOKEN": "tok-x", "KITE_NATS_NKEY_SEED_FILE": "/nonexistent"}, "only one of"),
    ({"KITE_NATS_TLS_CERT": "/c.pem"}, "go together"),
    ({"KITE_NATS_TLS_KEY": "/k.pem"}, "go together"),
])
def test_bad_combinations_are_config_errors_without_secrets(env, message):
    with pytest.raises(ConfigError, match=message) as info:
        opts(**env)
    for secret in ("pw-only", "pw-x", "tok-x"):
        assert secret not in str(info.value)


def test_nkey_seed_file(tmp_path, caplog):
    seed_file = tmp_path / "user.nk"
    seed_file.write_bytes(user_seed() + b"\n")
    seed_file.chmod(0o600)
    with caplog.at_level(logging.WARNING):
        assert opts(KITE_NATS_NKEY_SEED_FILE=str(seed_file)) == {"nkeys_seed": str(seed_file)}
    assert caplog.text == ""
    seed_file.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        opts(KITE_NATS_NKEY_SEED_FILE=str(seed_file))
    assert "can be read by other users" in caplog.text and "chmod 600" in caplog.text


def test_a_missing_or_bad_seed_file_is_a_config_error_that_never_echoes_the_file(tmp_path):
    with pytest.raises(ConfigError, match="KITE_NATS_NKEY_SEED_FILE=.*cannot read"):
        opts(KITE_NATS_NKEY_SEED_FILE=str(tmp_path / "missing.nk"))
    bad = tmp_path / "bad.nk"
    bad.write_text("SUnot-a-seed-but-maybe-a-secret\n")
    with pytest.raises(ConfigError, match="does not hold an NKey seed") as info:
        opts(KITE_NATS_NKEY_SEED_FILE=str(bad))
    assert "not-a-seed" not in str(info.value)


def test_tls_files_make_a_verifying_context(tmp_path):
    ca = TestCA(tmp_path)
    client = ca.issue("client", server=False)
    options = opts(KITE_NATS_TLS_CA=str(ca.pem), KITE_NATS_TLS_CERT=str(client.cert),
                   KITE_NATS_TLS_KEY=str(client.key))
    context = options["tls"]
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert opts(KITE_NATS_TLS_CA=str(ca.pem))["tls"].verify_mode == ssl.CERT_REQUIRED


def test_unreadable_tls_files_are_config_errors_naming_the_variable(tmp_path):
    ca = TestCA(tmp_path)
    client = ca.issue("client", server=False)
    with pytest.raises(ConfigError, match="KITE_NATS_TLS_CA="):
        opts(KITE_NATS_TLS_CA=str(tmp_path / "missing.pem"))
    (tmp_path / "junk.pem").write_text("junk")
    with pytest.raises(ConfigError, match="KITE_NATS_TLS_CA="):
        opts(KITE_NATS_TLS_CA=str(tmp_path / "junk.pem"))
    with pytest.raises(ConfigError, match="KITE_NATS_TLS_KEY="):
        opts(KITE_NATS_TLS_CERT=str(client.cert), KITE_NATS_TLS_KEY=str(tmp_path / "junk.pem"))


def test_an_encrypted_client_key_is_refused_at_once_not_prompted_for(tmp_path):
    ca = TestCA(tmp_path)
    client = ca.issue("client", server=False, key_password=b"hunter2")
    with pytest.raises(ConfigError, match="KITE_NATS_TLS_KEY is encrypted"):
        opts(KITE_NATS_TLS_CERT=str(client.cert), KITE_NATS_TLS_KEY=str(client.key))
