"""LoRA adapters on the reference engine with the real default model (issue 16): the base and two
adapters serve interleaved requests; each one's greedy answer with reuse equals reuse off; the adapters
really change answers; no block crosses from one model to another."""

from __future__ import annotations

import pytest
import torch

from kite_shared import adapters
from kite_shared.config import ModelConfig, load
from kite_shared.fingerprint import block_hash_chain
from kite_shared.messages import SamplingParams, TokenizedRequest
from kite_shared.model_store import identity, load_causal_lm, load_tokenizer, prepare
from kite_worker.engines.base import RequestRejected
from kite_worker.engines.reference.block_cache import BlockCache
from kite_worker.engines.reference.model import ReferenceModel, ReferenceOptions
from tests.lora_adapters import make_lora_adapters

BLOCK = 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    base_cfg = load(ModelConfig, engine="transformers", block_size=BLOCK)
    local = prepare(base_cfg)
    make_lora_adapters(local, base_cfg, {folder / "alpha": 1, folder / "beta": 2})
    cfg = load(ModelConfig, engine="transformers", block_size=BLOCK,
               adapters=f"alpha={folder / 'alpha'},beta={folder / 'beta'}")
    base = identity(local, cfg)
    served = adapters.load_configured(cfg, local, base)
    assert sorted(served) == ["alpha", "beta"]
    return local, base, served, load_tokenizer(local), load_causal_lm(local, cfg)


def make_engine(setup) -> ReferenceModel:
    local, base, served, tok, model = setup
    return ReferenceModel(model, tok, base, BlockCache(1 << 30),
                          ReferenceOptions(block_size=BLOCK, storage_dtype=torch.float16, prefill_chunk_tokens=512),
                          local.max_context_tokens, adapters=served)


def request(engine: ReferenceModel, ids: list[int], adapter: str, reuse: bool) -> TokenizedRequest:
    ident = engine.adapters[adapter].identity if adapter else engine.identity
    return TokenizedRequest(
        request_id="t", model="m", prompt_token_ids=ids, reuse=reuse, adapter=adapter,
        sampling=SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        model_fingerprint=ident.fingerprint_hex, block_size=BLOCK, stream_subject="s", created_at=0,
        block_hashes=[bytes(h) for h in block_hash_chain(ids, BLOCK, ident.root)])


def run(engine: ReferenceModel, ids: list[int], adapter: str, reuse: bool, stored: list | None = None):
    seq = engine.new_sequence(request(engine, ids, adapter, reuse))
    while (token := engine.prefill_step(seq)) is None:
        pass
    new_blocks = engine.store_prompt_blocks(seq)
    while not engine.accept_token(seq, token)[1]:
        token = engine.decode_step(seq)
    new_blocks += engine.store_generated_blocks(seq)
    if stored is not None:
        stored.extend(new_blocks)
    return seq


def test_base_and_adapters_interleaved_reuse_equals_recompute(setup):
    engine = make_engine(setup)
    tok = setup[3]
    system = {"role": "system", "content": "You answer questions about rivers in one short sentence. " * 12}
    stored = []
    answers: dict[str, list[list[int]]] = {}
    for question in ("Which river flows through Paris?", "How long is the Danube?"):
        ids = tok.apply_chat_template([system, {"role": "user", "content": question}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        for adapter in ("", "alpha", "beta"):  # interleaved: each turn switches the active adapter
            off = run(engine, ids, adapter, reuse=False)
            on = run(engine, ids, adapter, reuse=True, stored=stored)
            again = run(engine, ids, adapter, reuse=True, stored=stored)
            assert on.generated == off.generated == again.generated, f"adapter {adapter!r}"
            assert again.num_cached_tokens >= len(ids) - BLOCK  # the second turn hit its own blocks
            answers.setdefault(adapter, []).append(off.generated)
    # The adapters are strong enough to matter: each answers differently from the base and each other.
    assert answers[""] != answers["alpha"] and answers[""] != answers["beta"] and answers["alpha"] != answers["beta"]
    # No block crosses models: each stored block carries its model's fingerprint, and hashes are disjoint.
    by_model: dict[str, set[bytes]] = {}
    for block in stored:
        by_model.setdefault(block.model_fingerprint, set()).add(bytes(block.block_hash))
    fingerprints = {engine.identity.fingerprint_hex,
                    *(a.identity.fingerprint_hex for a in engine.adapters.values())}
    assert set(by_model) == fingerprints
    models = list(by_model.values())
    assert all(not (a & b) for i, a in enumerate(models) for b in models[i + 1:])


def test_an_adapter_the_worker_does_not_serve_is_refused(setup):
    engine = make_engine(setup)
    bad = request(engine, [1] * 20, "alpha", reuse=True).model_copy(update={"adapter": "gamma"})
    with pytest.raises(RequestRejected) as refused:
        engine.new_sequence(bad)
    assert refused.value.code == "model_not_found"
    # An adapter's request hashed under the base's fingerprint is refused too (the hashes would poison it).
    crossed = request(engine, [1] * 20, "", reuse=True).model_copy(update={"adapter": "alpha"})
    with pytest.raises(RequestRejected) as refused:
        engine.new_sequence(crossed)
    assert refused.value.code == "model_mismatch"


def test_an_adapter_loaded_at_run_time_answers_as_a_configured_one_also_after_a_reload(setup):
    local, base, served, tok, _ = setup
    configured = make_engine(setup)
    ids = tok.apply_chat_template([{"role": "user", "content": "Which river flows through Paris?"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = {name: run(configured, ids, name, reuse=False).generated for name in ("", "alpha", "beta")}
    engine = ReferenceModel(load_causal_lm(local, load(ModelConfig, engine="transformers", block_size=BLOCK)), tok,
                            base, BlockCache(1 << 30),
                            ReferenceOptions(block_size=BLOCK, storage_dtype=torch.float16, prefill_chunk_tokens=512),
                            local.max_context_tokens)
    assert run(engine, ids, "", reuse=False).generated == expected[""]  # a plain model, no peft yet
    engine.add_adapter(served["alpha"])
    engine.add_adapter(served["beta"])
    for name in ("alpha", "", "beta"):
        assert run(engine, ids, name, reuse=False).generated == expected[name], name
    stored = []
    run(engine, ids, "alpha", reuse=True, stored=stored)
    engine.remove_adapter("alpha")
    with pytest.raises(RequestRejected):
        engine.new_sequence(request(configured, ids, "alpha", reuse=True))
    assert stored and not {bytes(b.block_hash) for b in stored} & set(engine.block_cache.keys())  # dropped
    engine.add_adapter(served["alpha"])  # peft drops the old weights and loads them anew
    for name in ("alpha", "beta", ""):
        assert run(engine, ids, name, reuse=False).generated == expected[name], name
