"""API keys and tenants: who is calling, decided once per request by the HTTP and gRPC front ends.

Keys are configured only as SHA-256 hex digests (`kite keys hash`), never in plaintext:

    KITE_API_KEYS_FILE   YAML or JSON: {tenant: [sha256hex, ...], ...}
    KITE_API_KEYS        comma list `tenant:sha256hex` (added to the file's)

A presented key is hashed and compared with every configured digest in constant time (no early exit,
`hmac.compare_digest`), so response time says nothing about which digest came close. With
KITE_AUTH_ENABLED=off every caller is tenant `anonymous`. The tenant decides the cache salt
(`kite_shared.security.tenant_cache_salt`): KV blocks are shared only within a tenant.

Error messages never contain a presented key or a configured digest.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from pathlib import Path
from typing import Iterable

import yaml

from kite_shared.config import ConfigError, GatewayConfig
from kite_shared.security import ANONYMOUS_TENANT
from kite_gateway.errors import ApiError

_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")
_DIGEST = re.compile(r"(?:sha256:)?([0-9a-fA-F]{64})")


def _digest(value: object, where: str) -> bytes:
    match = _DIGEST.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None:
        # Do not echo the value: it may be a plaintext key someone pasted by mistake.
        raise ConfigError(f"{where}: expected a SHA-256 hex digest of an API key (make one with "
                          f"`kite keys hash`); plaintext keys are not accepted")
    return bytes.fromhex(match.group(1))


def _tenant(value: object, where: str) -> str:
    if not isinstance(value, str) or not _TENANT.fullmatch(value):
        raise ConfigError(f"{where}: a tenant name is 1-128 characters of letters, digits and ._@- "
                          f"starting with a letter or digit")
    return value


def parse_keys_file(path: str | Path) -> list[tuple[str, bytes]]:
    """(tenant, digest) pairs of a YAML/JSON keys file."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"KITE_API_KEYS_FILE: cannot read {path}: {exc.strerror}") from None
    try:
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError):
        raise ConfigError(f"KITE_API_KEYS_FILE: {path} is not valid YAML/JSON") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ConfigError("KITE_API_KEYS_FILE: expected a mapping tenant -> list of SHA-256 digests")
    pairs = []
    for tenant, digests in data.items():
        name = _tenant(tenant, "KITE_API_KEYS_FILE")
        if isinstance(digests, str):
            digests = [digests]
        if not isinstance(digests, list):
            raise ConfigError(f"KITE_API_KEYS_FILE: tenant {name}: expected a list of SHA-256 digests")
        pairs += [(name, _digest(d, f"KITE_API_KEYS_FILE: tenant {name}")) for d in digests]
    return pairs


def parse_keys_env(raw: str) -> list[tuple[str, bytes]]:
    """(tenant, digest) pairs of KITE_API_KEYS (`tenant:sha256hex,...`)."""
    pairs = []
    for i, item in enumerate(p.strip() for p in raw.split(",")):
        if not item:
            continue
        tenant, sep, digest = item.partition(":")
        if not sep:
            raise ConfigError(f"KITE_API_KEYS entry {i + 1}: expected tenant:sha256hex")
        name = _tenant(tenant.strip(), f"KITE_API_KEYS entry {i + 1}")
        pairs.append((name, _digest(digest, f"KITE_API_KEYS entry {i + 1} (tenant {name})")))
    return pairs


class Authenticator:
    def __init__(self, enabled: bool, keys: Iterable[tuple[str, bytes]] = ()) -> None:
        self.enabled = enabled
        self._keys: list[tuple[bytes, str]] = []
        seen: dict[bytes, str] = {}
        for tenant, digest in keys:
            if seen.get(digest, tenant) != tenant:
                raise ConfigError(f"an API key digest is configured for two tenants ({seen[digest]} and "
                                  f"{tenant})")
            if digest not in seen:
                seen[digest] = tenant
                self._keys.append((digest, tenant))
        if enabled and not self._keys:
            raise ConfigError("KITE_AUTH_ENABLED is on but no API keys are configured: set "
                              "KITE_API_KEYS_FILE or KITE_API_KEYS (digests from `kite keys hash`), or "
                              "KITE_AUTH_ENABLED=off for a trusted network")

    @classmethod
    def from_config(cls, cfg: GatewayConfig) -> "Authenticator":
        keys: list[tuple[str, bytes]] = []
        if cfg.api_keys_file:
            keys += parse_keys_file(cfg.api_keys_file)
        keys += parse_keys_env(cfg.api_keys)
        return cls(cfg.auth_enabled, keys)

    @classmethod
    def disabled(cls) -> "Authenticator":
        return cls(False)

    @property
    def tenants(self) -> set[str]:
        return {t for _, t in self._keys}

    def tenant_for_key(self, key: str | None) -> str:
        """The tenant owning `key`; raises ApiError 401 when auth is on and the key is missing or unknown."""
        if not self.enabled:
            return ANONYMOUS_TENANT
        if not key:
            raise ApiError(401, "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.",
                           code="missing_api_key")
        presented = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
        found: str | None = None
        for digest, tenant in self._keys:  # every digest is compared: no early exit
            if hmac.compare_digest(presented, digest):
                found = tenant
        if found is None:
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return found

    def tenant_for_authorization(self, header: str | None) -> str:
        """The tenant of an `Authorization: Bearer <key>` value (HTTP header or gRPC metadata)."""
        if not self.enabled:
            return ANONYMOUS_TENANT
        return self.tenant_for_key(bearer_token(header))


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None
