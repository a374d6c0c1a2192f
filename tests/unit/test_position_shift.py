"""kite_worker.position_shift on a tiny random Llama (no weights to load): keys computed at one position,
moved, equal the keys computed at the other; values unchanged; a round trip returns the keys; models
whose RoPE does not compose are refused."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kite_worker.position_shift import PositionShift


def tiny_llama(rope_parameters: dict | None = None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    return LlamaForCausalLM(config).eval()


def kv_at(model: LlamaForCausalLM, ids: list[int], first_position: int) -> torch.Tensor:
    """The KV of `ids` computed alone at positions first_position.., as [layers, 2, kv_heads, tokens, dim]."""
    positions = torch.arange(first_position, first_position + len(ids)).unsqueeze(0)
    with torch.no_grad():
        cache = model(torch.tensor([ids]), position_ids=positions, use_cache=True).past_key_values
    return torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 10000.0},
                                  {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}])
def test_keys_moved_equal_keys_computed_there(rope):
    model = tiny_llama(rope)
    ids = [5, 17, 3, 88, 41, 41, 9, 60, 2, 33]
    at_3, at_250 = kv_at(model, ids, 3), kv_at(model, ids, 250)
    assert (at_3[:, 0] - at_250[:, 0]).abs().max() > 0.1  # the keys do depend on the position
    moved = PositionShift.of_model(model).blocks(at_3, 247)
    torch.testing.assert_close(moved, at_250, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(moved[:, 1], at_3[:, 1], rtol=0, atol=0)  # values copied as they were


def test_a_round_trip_returns_the_keys_and_offset_zero_copies():
    model = tiny_llama()
    kv = kv_at(model, [1, 2, 3, 4], 0)
    shift = PositionShift.of_model(model)
    torch.testing.assert_close(shift.blocks(shift.blocks(kv, 1000), -1000), kv, rtol=1e-5, atol=1e-5)
    same = shift.keys(kv[:, 0], 0)
    assert torch.equal(same, kv[:, 0]) and same.data_ptr() != kv.data_ptr()


def test_the_storage_dtype_is_kept():
    model = tiny_llama()
    kv = kv_at(model, [7, 8, 9], 0).to(torch.float16)
    moved = PositionShift.of_model(model).blocks(kv, 31)
    assert moved.dtype == torch.float16
    torch.testing.assert_close(moved.float(), kv_at(model, [7, 8, 9], 31), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("rope, name", [
    ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, "'dynamic'"),
    ({"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0, "original_max_position_embeddings": 2048},
     "'yarn'"),
])
def test_a_rope_that_does_not_compose_is_refused(rope, name):
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope)
    with pytest.raises(ValueError, match=f"RoPE type {name}.*does not compose"):
        PositionShift(LlamaRotaryEmbedding(config))


def test_a_payload_of_another_layout_is_refused():
    shift = PositionShift.of_model(tiny_llama())
    with pytest.raises(ValueError, match=r"expected \[num_layers, 2, num_kv_heads, num_tokens, head_dim\]"):
        shift.blocks(torch.zeros(2, 3, 2, 4, 16), 5)
