"""Gateway authentication: key configuration (digests only), Bearer parsing, constant-time matching, the
401 OpenAI error objects, UNAUTHENTICATED on gRPC, and the tenant-derived cache salt."""

from __future__ import annotations

import hmac
import json

import grpc
import pytest
from fastapi.testclient import TestClient

from kite_shared.config import ConfigError, GatewayConfig, load
from kite_shared.security import hash_api_key, tenant_cache_salt
from kite_gateway import auth as auth_mod
from kite_gateway.auth import Authenticator, bearer_token, parse_keys_env, parse_keys_file
from kite_gateway.errors import ApiError
from kite_gateway.grpc_api import KiteService, _Failure
from kite_gateway.http_api import create_app

ALICE_KEY, BOB_KEY = "kite-alice-secret-key", "kite-bob-secret-key"
ALICE, BOB = hash_api_key(ALICE_KEY), hash_api_key(BOB_KEY)


def authenticator() -> Authenticator:
    return Authenticator(True, parse_keys_env(f"alice:{ALICE},bob:sha256:{BOB}"))


def test_keys_file_yaml_and_json(tmp_path):
    y = tmp_path / "keys.yaml"
    y.write_text(f"alice:\n  - {ALICE}\nbob: [{BOB.upper()}]\n")
    j = tmp_path / "keys.json"
    j.write_text(json.dumps({"alice": [ALICE], "bob": BOB}))
    for path in (y, j):
        pairs = parse_keys_file(path)
        assert sorted(t for t, _ in pairs) == ["alice", "bob"]
        assert bytes.fromhex(ALICE) in [d for _, d in pairs]


def test_from_config_merges_file_and_env(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(f"alice: [{ALICE}]\n")
    cfg = load(GatewayConfig, {"KITE_API_KEYS_FILE": str(path), "KITE_API_KEYS": f"bob:{BOB}"})
    a = Authenticator.from_config(cfg)
    assert a.enabled and a.tenants == {"alice", "bob"}


@pytest.mark.parametrize("raw", [f"alice:{ALICE_KEY}", "alice:1234", f"{ALICE}", f"bad tenant:{ALICE}",
                                 f":{ALICE}"])
def test_bad_env_entries_are_refused_without_echoing_them(raw):
    with pytest.raises(ConfigError) as info:
        parse_keys_env(raw)
    assert ALICE_KEY not in str(info.value) and ALICE not in str(info.value)


def test_plaintext_key_in_a_file_is_refused_without_echo(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(f"alice: [{ALICE_KEY}]\n")
    with pytest.raises(ConfigError) as info:
        parse_keys_file(path)
    assert ALICE_KEY not in str(info.value)


def test_auth_on_without_keys_and_shared_digests_are_config_errors():
    with pytest.raises(ConfigError, match="no API keys"):
        Authenticator.from_config(load(GatewayConfig, {}))
    with pytest.raises(ConfigError, match="two tenants"):
        Authenticator(True, parse_keys_env(f"alice:{ALICE},bob:{ALICE}"))
    assert Authenticator.from_config(load(GatewayConfig, {"KITE_AUTH_ENABLED": "off"})).enabled is False


def test_tenant_lookup():
    a = authenticator()
    assert a.tenant_for_authorization(f"Bearer {ALICE_KEY}") == "alice"
    assert a.tenant_for_authorization(f"bearer   {BOB_KEY} ") == "bob"
    for header, code in ((None, "missing_api_key"), ("", "missing_api_key"), (f"Basic {ALICE_KEY}", "missing_api_key"),
                         ("Bearer nope", "invalid_api_key"), (f"Bearer {ALICE_KEY}x", "invalid_api_key")):
        with pytest.raises(ApiError) as info:
            a.tenant_for_authorization(header)
        assert info.value.status == 401 and info.value.code == code
        assert info.value.headers()["WWW-Authenticate"] == "Bearer"
        assert ALICE_KEY not in info.value.message
    assert Authenticator.disabled().tenant_for_authorization(None) == "anonymous"
    assert bearer_token("Bearer") is None


def test_every_digest_is_compared_in_constant_time(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(auth_mod.hmac, "compare_digest", counting)
    a = authenticator()
    a.tenant_for_key(ALICE_KEY)  # alice is the first digest: no early exit all the same
    assert len(calls) == 2
    with pytest.raises(ApiError):
        a.tenant_for_key("wrong")
    assert len(calls) == 4


class FakeClient:
    """Records what the HTTP API would send to the services, then refuses (no services here)."""

    def __init__(self) -> None:
        self.params = []

    async def open(self, params):
        self.params.append(params)
        raise ApiError(503, "no worker", type="service_unavailable", code="no_worker")


@pytest.fixture
def http():
    fake = FakeClient()
    app = create_app(lambda: fake, "m", 8, 1 << 20, authenticator())
    return TestClient(app), fake


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path, method", [("/v1/chat/completions", "post"), ("/v1/completions", "post"),
                                          ("/v1/models", "get")])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": ALICE_KEY}])
def test_http_401_is_an_openai_error_object(http, path, method, headers):
    client, fake = http
    r = getattr(client, method)(path, headers=headers, **({"json": CHAT} if method == "post" else {}))
    assert r.status_code == 401
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] in ("invalid_api_key", "missing_api_key")
    assert r.headers["www-authenticate"] == "Bearer"
    assert fake.params == []


def test_http_auth_comes_before_body_validation(http):
    client, _ = http
    assert client.post("/v1/chat/completions", content=b"{not json").status_code == 401
    r = client.post("/v1/chat/completions", content=b"{not json", headers={"Authorization": f"Bearer {ALICE_KEY}"})
    assert r.status_code == 400


def test_cache_salt_is_derived_from_the_tenant(http):
    client, fake = http
    for key, salt in ((ALICE_KEY, None), (BOB_KEY, None), (ALICE_KEY, "mine")):
        body = dict(CHAT, **({"cache_salt": salt} if salt else {}))
        r = client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 503
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x", "cache_salt": "bob"},
                    headers={"Authorization": f"Bearer {ALICE_KEY}"})
    assert r.status_code == 503
    salts = [p.cache_salt for p in fake.params]
    assert salts == [tenant_cache_salt("alice", ""), tenant_cache_salt("bob", ""),
                     tenant_cache_salt("alice", "mine"), tenant_cache_salt("alice", "bob")]
    # A client cannot reach another tenant's salt by sending it (or its name) as its own salt.
    assert tenant_cache_salt("alice", "bob") != tenant_cache_salt("bob", "")


def test_open_endpoints_and_schema_with_request_bodies(http):
    client, _ = http
    schema = client.get("/openapi.json").json()
    for path, field in (("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert field in body["properties"] and field in body["required"]
        assert "$ref" not in json.dumps(body)
    assert client.get("/metrics").status_code == 200


class FakeContext:
    def __init__(self, metadata) -> None:
        self._metadata = metadata

    def invocation_metadata(self):
        return self._metadata


def test_grpc_metadata_authentication():
    service = KiteService(None, authenticator())  # type: ignore[arg-type]
    assert service._tenant(FakeContext((("authorization", f"Bearer {BOB_KEY}"),))) == "bob"
    for metadata in ((), (("authorization", "Bearer wrong"),), (("x-api-key", ALICE_KEY),)):
        with pytest.raises(_Failure) as info:
            service._tenant(FakeContext(metadata))
        assert info.value.status == grpc.StatusCode.UNAUTHENTICATED
        assert info.value.code in ("invalid_api_key", "missing_api_key")
    assert KiteService(None)._tenant(FakeContext(())) == "anonymous"  # type: ignore[arg-type]


def test_keys_cli(capsys):
    from kite_cli import keys

    assert keys.main(["hash", ALICE_KEY]) == 0
    assert capsys.readouterr().out.strip() == ALICE
    assert keys.main(["new", "carol"]) == 0
    out = capsys.readouterr().out
    key = out.split("KITE keeps only its digest): ")[1].split()[0]
    assert f"carol:{hash_api_key(key)}" in out
    assert parse_keys_env(out.split("KITE_API_KEYS entry: ")[1].split()[0])[0][0] == "carol"
