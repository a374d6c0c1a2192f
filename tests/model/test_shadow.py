"""Shadow verification on the reference engine with the real model (issue 16): a correct hit matches its
recomputation; a hit on blocks computed under other numerics (planted, valid units) diverges; a quarantined
namespace drops its blocks and answers as reuse off; shadow work changes no statistic and stores nothing."""

from __future__ import annotations

import threading

import pytest
import torch

from kite_shared.config import ModelConfig, load
from kite_shared.fingerprint import block_hash_chain
from kite_shared.messages import SamplingParams, StreamEnd, StreamError, TokenChunk, TokenizedRequest
from kite_shared.model_store import identity, load_causal_lm, load_tokenizer, prepare
from kite_worker.engines.reference.block_cache import BlockCache
from kite_worker.engines.reference.model import ReferenceModel, ReferenceOptions
from kite_worker.engines.reference.scheduler import Scheduler
from kite_worker.shadow import DEFAULT_TOLERANCES, ShadowVerifier
from tests.planted_blocks import wrong_numerics_blocks

BLOCK = 16
SYSTEM = {"role": "system", "content": "You answer questions about the planets in one short sentence. " * 10}


@pytest.fixture(scope="module")
def setup():
    cfg = load(ModelConfig, engine="transformers", block_size=BLOCK)
    local = prepare(cfg)
    return cfg, local, identity(local, cfg), load_tokenizer(local), load_causal_lm(local, cfg)


class Harness:
    """A real Scheduler over the engine, every shadow outcome and stream end collected."""

    def __init__(self, setup, fraction: float = 1.0) -> None:
        cfg, local, ident, tok, model = setup
        self.cfg, self.local, self.identity, self.tok = cfg, local, ident, tok
        self.engine = ReferenceModel(model, tok, ident, BlockCache(1 << 30),
                                     ReferenceOptions(block_size=BLOCK, storage_dtype=torch.float16),
                                     local.max_context_tokens)
        self.outcomes, self.ends, self.texts = [], {}, {}
        self.done = threading.Condition()
        self.scheduler = Scheduler(self.engine, 4, 16, shadow=ShadowVerifier.for_storage_dtype(fraction, "float16"),
                                   shadow_chunk_tokens=32)
        self.scheduler.start(emit=self._emit, on_new_blocks=lambda blocks: None, on_shadow=self._shadow)

    def _emit(self, subject, message) -> None:
        with self.done:
            self.texts[message.request_id] = self.texts.get(message.request_id, "") + getattr(message, "text", "")
            if isinstance(message, (StreamEnd, StreamError)):
                self.ends[message.request_id] = message
                self.done.notify_all()
            else:
                assert isinstance(message, TokenChunk)

    def _shadow(self, outcome) -> None:
        with self.done:
            self.outcomes.append(outcome)
            self.done.notify_all()

    def ids(self, question: str) -> list[int]:
        return self.tok.apply_chat_template([SYSTEM, {"role": "user", "content": question}],
                                            add_generation_prompt=True, tokenize=True, return_dict=False)

    def ask(self, request_id: str, question: str, reuse: bool = True) -> tuple[StreamEnd, str]:
        """The request's end and its whole answer."""
        ids = self.ids(question)
        self.scheduler.submit(TokenizedRequest(
            request_id=request_id, model="m", prompt_token_ids=ids, reuse=reuse,
            sampling=SamplingParams(max_tokens=8, temperature=0), model_fingerprint=self.identity.fingerprint_hex,
            block_size=BLOCK, stream_subject="s", created_at=0,
            block_hashes=[bytes(h) for h in block_hash_chain(ids, BLOCK, self.identity.root)]))
        with self.done:
            assert self.done.wait_for(lambda: request_id in self.ends, timeout=120)
        end = self.ends[request_id]
        assert isinstance(end, StreamEnd), end
        return end, self.texts[request_id]

    def wait_outcomes(self, n: int) -> list:
        with self.done:
            assert self.done.wait_for(lambda: len(self.outcomes) >= n, timeout=120)
        return self.outcomes

    def stop(self) -> None:
        self.scheduler.stop()
        self.scheduler.join(10)


def test_a_correct_hit_matches_its_recomputation_and_shadow_work_leaves_no_trace(setup):
    h = Harness(setup)
    try:
        h.ask("a", "Which planet is largest?")
        computed = h.engine.num_prompt_tokens_computed
        num_blocks = len(h.engine.block_cache)
        hit, _ = h.ask("b", "Which planet is smallest?")
        assert hit.usage.cached_tokens > 0
        [outcome] = h.wait_outcomes(1)
        assert not outcome.diverged and outcome.divergence < DEFAULT_TOLERANCES["float16"] / 10
        assert outcome.check.request.request_id == "b"
        # The recomputation counted no computed prompt token and stored no block (only request b did).
        assert h.engine.num_prompt_tokens_computed == computed + len(h.ids("Which planet is smallest?")) \
            - hit.usage.cached_tokens
        assert len(h.engine.block_cache) >= num_blocks
        assert h.scheduler.shadow.num_checked == 1  # request a hit nothing: not checked
    finally:
        h.stop()


def test_planted_wrong_numerics_diverge_and_quarantine_restores_reuse_off_answers(setup):
    h = Harness(setup)
    try:
        question = "Which planet has rings?"
        _, reference = h.ask("ref", question, reuse=False)
        ids = h.ids(question)
        planted = wrong_numerics_blocks(h.local, h.cfg, h.identity, ids)
        for block in planted:  # as if loaded from the pool: valid units under the right hashes
            h.engine.block_cache.put(block.block_hash, block.kv, block.model_fingerprint)
        wrong, wrong_text = h.ask("hit", question)
        assert wrong.usage.cached_tokens == len(planted) * BLOCK
        assert wrong_text != reference  # the silent wrong answer
        [outcome] = h.wait_outcomes(1)
        assert outcome.diverged and outcome.divergence > 1.0, outcome.divergence
        h.scheduler.quarantine(h.identity.fingerprint_hex, True)
        after, text = h.ask("after", question)
        assert after.usage.cached_tokens == 0 and text == reference
        assert len(h.engine.block_cache) == 0  # dropped, and nothing stored while quarantined
        h.scheduler.quarantine(h.identity.fingerprint_hex, False)
        h.ask("recompute", question)
        lifted, text = h.ask("lifted", question)
        assert lifted.usage.cached_tokens > 0 and text == reference
    finally:
        h.stop()
