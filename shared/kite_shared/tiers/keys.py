"""How a block is named in every tier. One scheme, versioned, shared by the ru-pool and workers.

A block is identified by (model tag, block hash); its storage key also names the tenant that computed it.
The model tag is the first 16 hex digits of the model fingerprint: the block hash already chains on the
full model fingerprint (fingerprint.root_hash), so the tag only groups a model's blocks for listing and
purging; a tag collision cannot serve a wrong block because every read is verified against the full
fingerprint (recyclable_unit.decode(expected_model=)). The tenant tag (kite_shared.security.tenant_tag)
is redundant for identity too (block 0's hash chains on the tenant's cache salt, so two tenants never
share a hash), but being in the key lets the pool account, quota and clear a tenant's blocks from key
listings alone, including after a restart.

    warm (Redis):  kite:ru:v2:<model_tag>:<tenant_tag>:<block_hash_hex>
    cold (S3 / local folder):  <KITE_S3_PREFIX>ru/v2/<model_tag>/<tenant_tag>/<block_hash_hex>.kru

No Redis hash tags ({...}) on purpose: keys spread over all Redis Cluster slots instead of piling onto the
one node that would own a model's tag.
"""

from __future__ import annotations

import functools
import hashlib
import re
from typing import NamedTuple

from kite_shared.security import ANONYMOUS_TENANT_TAG, TENANT_TAG_CHARS

KEY_VERSION = "v2"
MODEL_TAG_CHARS = 16
REDIS_KEY_PREFIX = f"kite:ru:{KEY_VERSION}:"
OBJECT_SUFFIX = ".kru"
_HEX = re.compile(r"[0-9a-f]+")
_TAG = re.compile(rf"[0-9a-f]{{{MODEL_TAG_CHARS}}}")
_TENANT = re.compile(rf"[0-9a-f]{{{TENANT_TAG_CHARS}}}")
_HASH_HEX = re.compile(r"[0-9a-f]{64}")


@functools.lru_cache(maxsize=256)  # a pool serves a few models; a 128-block read builds 128 keys of one
def model_tag(model_fingerprint: str) -> str:
    """16 lowercase hex digits naming a model fingerprint in storage keys.

    A hex fingerprint (what the fingerprinter publishes) keeps its own first 16 digits, so keys are
    readable next to logs; anything else is hashed so it can never inject separators into a key.
    """
    fp = model_fingerprint.lower()
    if len(fp) >= MODEL_TAG_CHARS and _HEX.fullmatch(fp):
        return fp[:MODEL_TAG_CHARS]
    return hashlib.sha256(model_fingerprint.encode("utf-8")).hexdigest()[:MODEL_TAG_CHARS]


class BlockKey(NamedTuple):
    """Where a block is stored. Equality includes the tenant tag; the pool's index, which must find a
    block by (model tag, hash) alone, keeps the tenant tag beside the entry instead."""

    model_tag: str
    block_hash: bytes
    tenant_tag: str = ANONYMOUS_TENANT_TAG

    @classmethod
    def of(cls, model_fingerprint: str, block_hash: bytes,
           tenant_tag: str = ANONYMOUS_TENANT_TAG) -> "BlockKey":
        return cls(model_tag(model_fingerprint), bytes(block_hash), tenant_tag)

    def short(self) -> str:
        return f"{self.model_tag}:{self.tenant_tag[:6]}:{self.block_hash.hex()[:12]}"


def redis_key(key: BlockKey) -> str:
    return f"{REDIS_KEY_PREFIX}{key.model_tag}:{key.tenant_tag}:{key.block_hash.hex()}"


def redis_pattern(tag: str | None = None) -> str:
    """SCAN MATCH pattern for every block, or every block of one model tag."""
    return f"{REDIS_KEY_PREFIX}{tag}:*" if tag else f"{REDIS_KEY_PREFIX}*"


def parse_redis_key(name: str | bytes) -> BlockKey | None:
    """The key a Redis name holds, or None for names that are not well-formed block keys."""
    if isinstance(name, bytes):
        name = name.decode("ascii", "replace")
    if not name.startswith(REDIS_KEY_PREFIX):
        return None
    parts = name[len(REDIS_KEY_PREFIX):].split(":")
    if len(parts) != 3:
        return None
    tag, tenant, hash_hex = parts
    if not _TAG.fullmatch(tag) or not _TENANT.fullmatch(tenant) or not _HASH_HEX.fullmatch(hash_hex):
        return None
    return BlockKey(tag, bytes.fromhex(hash_hex), tenant)


def object_prefix(prefix: str, tag: str | None = None) -> str:
    base = f"{prefix}ru/{KEY_VERSION}/"
    return f"{base}{tag}/" if tag else base


def object_key(prefix: str, key: BlockKey) -> str:
    return f"{object_prefix(prefix, key.model_tag)}{key.tenant_tag}/{key.block_hash.hex()}{OBJECT_SUFFIX}"


def parse_object_key(prefix: str, name: str) -> BlockKey | None:
    base = object_prefix(prefix)
    if not name.startswith(base) or not name.endswith(OBJECT_SUFFIX):
        return None
    parts = name[len(base):-len(OBJECT_SUFFIX)].split("/")
    if len(parts) != 3:
        return None
    tag, tenant, hash_hex = parts
    if not _TAG.fullmatch(tag) or not _TENANT.fullmatch(tenant) or not _HASH_HEX.fullmatch(hash_hex):
        return None
    return BlockKey(tag, bytes.fromhex(hash_hex), tenant)
