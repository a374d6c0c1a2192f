"""Moving a document's stored KV to another position with the default model (SmolLM2-135M, issue 40):
the moved KV equals the KV computed there, and greedy decoding from it gives the tokens a full prefill at
that position gives. This is the exact part of position-independent reuse: the document computed alone,
then moved (what it would attend to before it is the inexact part, left to selective recompute)."""

from __future__ import annotations

import pytest
import torch

from kite_shared.config import ModelConfig, load
from kite_shared.model_store import load_causal_lm, load_tokenizer, prepare
from kite_worker.engines.reference.kv_blocks import build_cache
from kite_worker.position_shift import PositionShift

pytestmark = pytest.mark.model

DOCUMENT = ("Document 7. In year 1949, station 217 of district 7 recorded 88 rentals and 3 repairs, and its "
            "manager number 7000 filed report 7-0. The district's council asked every station to report its "
            "repairs weekly, and station 217 answered that its bicycles were")


@pytest.fixture(scope="module")
def lm():
    cfg = load(ModelConfig, engine="transformers")
    local = prepare(cfg)
    return load_causal_lm(local, cfg), load_tokenizer(local)


def prefill(model, ids: list[int], first_position: int):
    positions = torch.arange(first_position, first_position + len(ids)).unsqueeze(0)
    with torch.no_grad():
        out = model(torch.tensor([ids]), position_ids=positions, use_cache=True)
    kv = torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in out.past_key_values.layers])
    return kv, out.logits[0, -1]


def greedy(model, cache, logits: torch.Tensor, next_position: int, num_tokens: int) -> list[int]:
    tokens = []
    for step in range(num_tokens):
        tokens.append(int(logits.argmax()))
        with torch.no_grad():
            out = model(torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[next_position + step]]),
                        past_key_values=cache, use_cache=True)
        logits = out.logits[0, -1]
    return tokens


def test_a_document_moved_to_another_position_decodes_as_if_computed_there(lm):
    model, tokenizer = lm
    ids = tokenizer(DOCUMENT, add_special_tokens=False)["input_ids"]
    n, there = len(ids), 913
    at_0, _ = prefill(model, ids, 0)
    at_there, logits_there = prefill(model, ids, there)
    assert (at_0[:, 0] - at_there[:, 0]).abs().max() > 1.0  # unmoved keys are far from right

    moved = PositionShift.of_model(model).blocks(at_0, there)
    key_error = ((moved[:, 0] - at_there[:, 0]).abs().max() / at_there[:, 0].abs().max()).item()
    value_error = ((moved[:, 1] - at_there[:, 1]).abs().max() / at_there[:, 1].abs().max()).item()
    print(f"\n{n} tokens moved 0 -> {there}: max relative error keys {key_error:.1e}, values {value_error:.1e}")
    assert key_error < 1e-4 and value_error < 1e-4

    # The last position's logits come from the prefill: decode on from the moved cache and from a full one.
    from_moved = greedy(model, build_cache([moved], n, torch.float32, capacity=n + 32), logits_there, there + n, 24)
    from_computed = greedy(model, build_cache([at_there], n, torch.float32, capacity=n + 32), logits_there,
                           there + n, 24)
    assert from_moved == from_computed, (tokenizer.decode(from_moved), tokenizer.decode(from_computed))
