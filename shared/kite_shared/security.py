"""Secrets and identities shared by the services: API key hashes, tenant cache salts, the cluster secret
that keys the recyclable-unit MAC, and redaction of credentials in URLs before they are logged.

    hash_api_key(key)            SHA-256 hex of an API key: what key files and KITE_API_KEYS store
    tenant_cache_salt(t, salt)   the cache salt the gateway puts in GenerateRequest.cache_salt
    tenant_tag(t)                16 hex digits naming a tenant in storage keys and RU headers
    ru_key()                     HMAC key of recyclable units, from KITE_CLUSTER_SECRET or the per-install
                                 secret file (created once, 0600, under a file lock)
    semantic_cache_key()         HMAC key of the semantic response cache's shared records (the same secret,
                                 another domain: neither key can forge what the other signs)
    redact_url(url)              the URL with any user/password replaced by "***"

Pure except `ru_key` / `semantic_cache_key` / `load_cluster_secret` (they read the environment and may
create the secret file).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import hmac
import logging
import os
import secrets
import struct
import threading
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger(__name__)

ANONYMOUS_TENANT = "anonymous"
_SALT_DOMAIN = b"kite-tenant-salt/v1"
_TENANT_TAG_DOMAIN = b"kite-tenant-tag/v1"
TENANT_TAG_CHARS = 16
_RU_KEY_DOMAIN = b"kite-ru-hmac/v1"
_SEMANTIC_CACHE_KEY_DOMAIN = b"kite-semantic-cache-hmac/v1"
SECRET_BYTES = 32


def hash_api_key(key: str) -> str:
    """The SHA-256 hex digest of an API key (keys are stored and configured only as this)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_api_key() -> str:
    """A fresh random API key (256 bits), `kite-` prefixed so it is recognisable in a secret scanner."""
    return "kite-" + secrets.token_urlsafe(32)


def _field(value: str) -> bytes:
    raw = value.encode("utf-8")
    return struct.pack(">I", len(raw)) + raw


def tenant_cache_salt(tenant: str, client_salt: str = "") -> str:
    """hex(SHA-256("kite-tenant-salt/v1" | tenant | client_salt)), fields length-prefixed.

    Derived server-side: a client cannot pick another tenant's salt, and its own salt can only narrow
    sharing within its tenant (a different client salt gives a different derived salt).
    """
    return hashlib.sha256(_SALT_DOMAIN + _field(tenant) + _field(client_salt)).hexdigest()


@functools.lru_cache(maxsize=4096)  # called per block; a deployment has few tenants
def tenant_tag(tenant: str) -> str:
    """First 16 hex digits of SHA-256("kite-tenant-tag/v1" | tenant): names a tenant in storage keys and
    RU headers, so the pool can account, quota and clear a tenant's blocks (even after a restart, from
    key listings alone) without tenant names, which may be sensitive, ever reaching storage."""
    return hashlib.sha256(_TENANT_TAG_DOMAIN + _field(tenant)).hexdigest()[:TENANT_TAG_CHARS]


ANONYMOUS_TENANT_TAG = tenant_tag(ANONYMOUS_TENANT)


def redact_url(url: str) -> str:
    """`url` (or a comma-separated list of URLs) with the userinfo replaced by ***, for logs."""
    out = []
    for part in url.split(","):
        try:
            split = urlsplit(part.strip())
        except ValueError:
            out.append("***")
            continue
        if split.username is None and split.password is None:
            out.append(part.strip())
            continue
        host = split.hostname or ""
        if split.port is not None:
            host = f"{host}:{split.port}"
        out.append(urlunsplit((split.scheme, f"***@{host}", split.path, split.query, split.fragment)))
    return ",".join(out)


# --- cluster secret ----------------------------------------------------------------------------------
_lock = threading.Lock()
_cached: dict[tuple[bytes, str, str], bytes] = {}
_warned = False


def load_cluster_secret(secret: str, secret_file: Path) -> bytes:
    """The cluster secret: `secret` when set, else the per-install file, created (random, 0600) under
    an exclusive file lock so concurrent first starts of local processes agree on one secret."""
    global _warned
    if secret:
        return secret.encode("utf-8")
    path = Path(secret_file).expanduser()
    if not _warned:
        _warned = True
        log.warning("KITE_CLUSTER_SECRET is not set: using the per-install secret in %s (fine for one "
                    "machine; production must set KITE_CLUSTER_SECRET to the same value on every node)",
                    path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = path.with_name(path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            data = path.read_bytes().strip()
        except FileNotFoundError:
            data = b""
        if not data:
            data = secrets.token_hex(SECRET_BYTES).encode("ascii")
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            wfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(wfd, "wb") as f:
                f.write(data + b"\n")
            os.replace(tmp, path)
        os.chmod(path, 0o600)
        return data
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def derive_ru_key(secret: bytes) -> bytes:
    """The recyclable-unit HMAC key: a domain-separated derivation of the cluster secret."""
    return _derive(secret, _RU_KEY_DOMAIN)


def _derive(secret: bytes, domain: bytes) -> bytes:
    return hmac.new(secret, domain, hashlib.sha256).digest()


def ru_key(environ: dict[str, str] | None = None) -> bytes:
    """The RU HMAC key of this process (from SecurityConfig; computed once per configuration)."""
    return _cluster_key(_RU_KEY_DOMAIN, environ)


def semantic_cache_key(environ: dict[str, str] | None = None) -> bytes:
    """The HMAC key of the semantic cache's records in Redis (kite_gateway.semantic)."""
    return _cluster_key(_SEMANTIC_CACHE_KEY_DOMAIN, environ)


def _cluster_key(domain: bytes, environ: dict[str, str] | None) -> bytes:
    """A key for one use (`domain`), derived from the cluster secret: HMAC-SHA256(secret, domain)."""
    from kite_shared.config import SecurityConfig, load

    cfg = load(SecurityConfig, environ)
    cache_key = (domain, cfg.cluster_secret, str(cfg.cluster_secret_file))
    with _lock:
        key = _cached.get(cache_key)
        if key is None:
            secret = load_cluster_secret(cfg.cluster_secret, cfg.cluster_secret_file)
            key = _cached[cache_key] = _derive(secret, domain)
        return key
