"""KV blocks computed under other numerics than the model's fingerprint says: the fault that shadow
verification exists to catch (issue 16). They are valid units (correct hashes, HMAC and shape); only their
values are wrong, computed with another rope theta, as after a silent change of the model's config."""

from __future__ import annotations

import copy

import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kite_shared.config import ModelConfig
from kite_shared.fingerprint import block_hash_chain
from kite_shared.messages import SamplingParams, TokenizedRequest
from kite_shared.model_store import LocalModel, ModelIdentity, load_causal_lm, load_tokenizer
from kite_worker.engines.reference.block_cache import BlockCache
from kite_worker.engines.reference.model import NewBlock, ReferenceModel, ReferenceOptions

WRONG_ROPE_THETA = 10_000.0  # SmolLM2-135M's is 100,000


def wrong_rope_model(local: LocalModel, cfg: ModelConfig, rope_theta: float = WRONG_ROPE_THETA):
    """The model with its rotary embedding rebuilt for another theta (weights unchanged)."""
    model = load_causal_lm(local, cfg)
    config = copy.deepcopy(model.config)
    config.rope_parameters = {**config.rope_parameters, "rope_theta": rope_theta}
    model.model.rotary_emb = LlamaRotaryEmbedding(config=config)
    return model


def wrong_numerics_blocks(local: LocalModel, cfg: ModelConfig, identity: ModelIdentity,
                          prompt_ids: list[int], storage_dtype: torch.dtype = torch.float16,
                          cache_salt: str = "") -> list[NewBlock]:
    """The full blocks of `prompt_ids` under `identity`'s hashes (with `cache_salt`: through the gateway,
    the tenant's derived salt), their KV computed with the wrong rope."""
    engine = ReferenceModel(wrong_rope_model(local, cfg), load_tokenizer(local), identity, BlockCache(1 << 30),
                            ReferenceOptions(block_size=cfg.block_size, storage_dtype=storage_dtype),
                            local.max_context_tokens)
    request = TokenizedRequest(
        request_id="planted", model=local.name, prompt_token_ids=prompt_ids, reuse=True,
        sampling=SamplingParams(max_tokens=1, temperature=0), model_fingerprint=identity.fingerprint_hex,
        block_size=cfg.block_size, stream_subject="s", created_at=0.0, cache_salt=cache_salt,
        block_hashes=[bytes(h) for h in block_hash_chain(prompt_ids, cfg.block_size, identity.root, cache_salt)])
    seq = engine.new_sequence(request)
    while engine.prefill_step(seq) is None:
        pass
    return engine.store_prompt_blocks(seq)
