"""The reference engine's model (kite_worker.engines.reference.model) on every device (tests/devices.py), with
a tiny Llama built from its config (random weights: no model package, nothing loaded): greedy answers with
reuse on equal reuse off, kept blocks live in host memory whatever device computes, and seeded sampling
draws on the host. The real model's equivalence, in more dtypes: tests/model/test_reuse_equivalence.py."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kite_shared.fingerprint import ExecutionPathFingerprint, KVLayout, ModelFingerprint, root_hash
from kite_shared.model_store import ModelIdentity
from kite_worker.engines.reference.block_cache import BlockCache
from kite_worker.engines.reference.model import ReferenceModel, ReferenceOptions
from tests.devices import DEVICES
from tests.reference_engine import run

BLOCK = 8
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rope_scaling="", norm_eps=1e-5,
                  block_size=BLOCK)
MODEL = ModelFingerprint(weights_digest="ab" * 32, adapter_digest="", dtype="float32", quantization="",
                         layout=LAYOUT)
EXEC = ExecutionPathFingerprint(attn_impl="sdpa", kv_storage_dtype="float32", engine="transformers",
                                device_class="test")
IDENTITY = ModelIdentity(model=MODEL, execution=EXEC, root=root_hash(MODEL, EXEC))


class _Tokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def tiny_engine(device: str) -> ReferenceModel:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval().to(device)
    return ReferenceModel(model, _Tokenizer(), IDENTITY, BlockCache(1 << 26),
                          ReferenceOptions(block_size=BLOCK, storage_dtype=torch.float32, keep_first_logits=True,
                                           prefill_chunk_tokens=16), max_context_tokens=256)


@pytest.mark.parametrize("device", DEVICES)
def test_reuse_on_a_device_answers_as_recomputation_and_keeps_blocks_in_host_memory(device):
    engine = tiny_engine(device)
    assert engine.device.type == device
    prompt = [(7 * i) % 90 + 3 for i in range(37)]  # 4 full blocks and a partial one
    first = run(engine, prompt, reuse=True)  # computes, keeps the prompt's and the answer's blocks
    assert len(engine.block_cache) >= 4
    for block_hash in first.prompt_hashes:
        assert engine.block_cache.get_prefix([block_hash])[0].device.type == "cpu"
    off = run(engine, prompt, reuse=False)
    on = run(engine, prompt, reuse=True)
    assert on.num_cached_tokens == 32  # the whole blocks of the prompt, built into a cache on the device
    assert on.generated == off.generated == first.generated
    assert on.first_token_logits.device.type == "cpu"
    assert torch.allclose(on.first_token_logits, off.first_token_logits, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_on_a_device_draws_on_the_host_and_repeats(device):
    engine = tiny_engine(device)
    prompt = list(range(3, 20))
    a = run(engine, prompt, reuse=False, temperature=1.0, seed=11)
    b = run(engine, prompt, reuse=False, temperature=1.0, seed=11)
    assert a.generated == b.generated and len(a.generated) == 16


@pytest.mark.parametrize("device", DEVICES)
def test_the_codec_guard_measures_on_the_models_device(device):
    from kite_worker import codec_guard

    engine = tiny_engine(device)
    prompts = [[(5 * i + j) % 90 + 3 for i in range(26)] for j in range(2)]  # 3 full blocks each
    qualities = codec_guard.compare(engine.model, prompts, None, ["fp32", "int8"], 6, BLOCK)
    exact = qualities["fp32"]  # a lossless round trip of float32 KV: the continuations as computed
    assert exact.agreement == 1.0 and exact.num_identical == exact.num_prompts == 2
    assert exact.kl_max <= 1e-6
    assert qualities["int8"].num_prompts == 2  # the lossy path ran too: encoded on the host, decoded back
