"""How a block is named in every tier. One scheme, versioned, shared by the ru-pool and workers.

A block is identified by (model tag, block hash). The model tag is the first 16 hex digits of the model
fingerprint: the block hash already chains on the full model fingerprint (fingerprint.root_hash), so the
tag only groups a model's blocks for listing and purging; a tag collision cannot serve a wrong block
because every read is verified against the full fingerprint (recyclable_unit.decode(expected_model=)).

    warm (Redis):  kite:ru:v1:<model_tag>:<block_hash_hex>
    cold (S3 / local folder):  <KITE_S3_PREFIX>ru/v1/<model_tag>/<block_hash_hex>.kru

No Redis hash tags ({...}) on purpose: keys spread over all Redis Cluster slots instead of piling onto the
one node that would own a model's tag.
"""

from __future__ import annotations

import hashlib
import re
from typing import NamedTuple

KEY_VERSION = "v1"
MODEL_TAG_CHARS = 16
REDIS_KEY_PREFIX = f"kite:ru:{KEY_VERSION}:"
OBJECT_SUFFIX = ".kru"
_HEX = re.compile(r"[0-9a-f]+")
_TAG = re.compile(rf"[0-9a-f]{{{MODEL_TAG_CHARS}}}")
_HASH_HEX = re.compile(r"[0-9a-f]{64}")


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
    model_tag: str
    block_hash: bytes

    @classmethod
    def of(cls, model_fingerprint: str, block_hash: bytes) -> "BlockKey":
        return cls(model_tag(model_fingerprint), bytes(block_hash))

    def short(self) -> str:
        return f"{self.model_tag}:{self.block_hash.hex()[:12]}"


def redis_key(key: BlockKey) -> str:
    return f"{REDIS_KEY_PREFIX}{key.model_tag}:{key.block_hash.hex()}"


def redis_pattern(tag: str | None = None) -> str:
    """SCAN MATCH pattern for every block, or every block of one model tag."""
    return f"{REDIS_KEY_PREFIX}{tag}:*" if tag else f"{REDIS_KEY_PREFIX}*"


def parse_redis_key(name: str | bytes) -> BlockKey | None:
    """The key a Redis name holds, or None for names that are not well-formed block keys."""
    if isinstance(name, bytes):
        name = name.decode("ascii", "replace")
    if not name.startswith(REDIS_KEY_PREFIX):
        return None
    tag, _, hash_hex = name[len(REDIS_KEY_PREFIX):].partition(":")
    if not _TAG.fullmatch(tag) or not _HASH_HEX.fullmatch(hash_hex):
        return None
    return BlockKey(tag, bytes.fromhex(hash_hex))


def object_prefix(prefix: str, tag: str | None = None) -> str:
    base = f"{prefix}ru/{KEY_VERSION}/"
    return f"{base}{tag}/" if tag else base


def object_key(prefix: str, key: BlockKey) -> str:
    return f"{object_prefix(prefix, key.model_tag)}{key.block_hash.hex()}{OBJECT_SUFFIX}"


def parse_object_key(prefix: str, name: str) -> BlockKey | None:
    base = object_prefix(prefix)
    if not name.startswith(base) or not name.endswith(OBJECT_SUFFIX):
        return None
    tag, _, rest = name[len(base):-len(OBJECT_SUFFIX)].partition("/")
    if not _TAG.fullmatch(tag) or not _HASH_HEX.fullmatch(rest):
        return None
    return BlockKey(tag, bytes.fromhex(rest))
