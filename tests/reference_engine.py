"""Driving the reference engine's model (kite_worker.engines.reference.model) through one request, as its
scheduler does: the tests that compare reuse on and off, on the real model and on a tiny random one, share
it."""

from __future__ import annotations

from kite_shared.fingerprint import block_hash_chain
from kite_shared.messages import SamplingParams, TokenizedRequest
from kite_worker.engines.reference.model import ReferenceModel, Sequence


def run(engine: ReferenceModel, ids: list[int], reuse: bool, max_tokens: int = 16, temperature: float = 0.0,
        seed: int | None = None) -> Sequence:
    """Prefill, keep the prompt's blocks, decode `max_tokens` (EOS ignored), keep the answer's blocks."""
    block_size = engine.options.block_size
    request = TokenizedRequest(
        request_id="t", model="m", prompt_token_ids=ids, reuse=reuse,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True),
        model_fingerprint=engine.identity.fingerprint_hex, block_size=block_size, stream_subject="s",
        created_at=0, block_hashes=[bytes(h) for h in block_hash_chain(ids, block_size, engine.identity.root)])
    seq = engine.new_sequence(request)
    while (token := engine.prefill_step(seq)) is None:
        pass
    engine.store_prompt_blocks(seq)
    while not engine.accept_token(seq, token)[1]:
        token = engine.decode_step(seq)
    engine.store_generated_blocks(seq)
    return seq
