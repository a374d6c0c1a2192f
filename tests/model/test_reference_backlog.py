"""Admission control's input on the reference engine: the prefill backlog counts only the prompt tokens the
engine will compute. A request whose system prompt is cached adds its uncached tail, not its whole prompt
(the arbitrator sheds on backlog / prefill speed, and counting cached tokens refused lone requests)."""

from __future__ import annotations

import threading

import pytest
import torch

from kite_shared.config import ModelConfig, load
from kite_shared.fingerprint import block_hash_chain
from kite_shared.messages import SamplingParams, StreamEnd, TokenizedRequest
from kite_shared.model_store import identity, load_causal_lm, load_tokenizer, prepare
from kite_worker.engines.reference.block_cache import BlockCache
from kite_worker.engines.reference.model import ReferenceModel, ReferenceOptions
from kite_worker.engines.reference.scheduler import Scheduler

BLOCK = 16
SYSTEM = {"role": "system", "content": "You answer questions about rivers in one short sentence. " * 12}


@pytest.fixture(scope="module")
def scheduler():
    cfg = load(ModelConfig, engine="transformers", block_size=BLOCK)
    local = prepare(cfg)
    ident, tok = identity(local, cfg), load_tokenizer(local)
    model = ReferenceModel(load_causal_lm(local, cfg), tok, ident, BlockCache(1 << 30),
                           ReferenceOptions(block_size=BLOCK, storage_dtype=torch.float32), local.max_context_tokens)
    ends: dict[str, StreamEnd] = {}
    done = threading.Condition()

    def emit(subject, message) -> None:
        if isinstance(message, StreamEnd):
            with done:
                ends[message.request_id] = message
                done.notify_all()

    s = Scheduler(model, 4, 16)
    s.start(emit=emit, on_new_blocks=lambda blocks: None)
    s.test_ends, s.test_done, s.test_tok, s.test_identity = ends, done, tok, ident
    yield s
    s.stop()


def _request(s, request_id: str, question: str, reuse: bool = True) -> TokenizedRequest:
    ids = s.test_tok.apply_chat_template([SYSTEM, {"role": "user", "content": question}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
    return TokenizedRequest(
        request_id=request_id, model="m", prompt_token_ids=ids, reuse=reuse,
        sampling=SamplingParams(max_tokens=2, temperature=0), model_fingerprint=s.test_identity.fingerprint_hex,
        block_size=BLOCK, stream_subject="s", created_at=0,
        block_hashes=[bytes(h) for h in block_hash_chain(ids, BLOCK, s.test_identity.root)])


def _run(s, request: TokenizedRequest) -> StreamEnd:
    s.submit(request)
    with s.test_done:
        assert s.test_done.wait_for(lambda: request.request_id in s.test_ends, timeout=120)
    return s.test_ends[request.request_id]


def test_a_cached_prefix_is_not_backlog(scheduler):
    first = _request(scheduler, "a", "Which river flows through Paris?")
    assert scheduler.load_snapshot()[1] == 0
    _run(scheduler, first)
    cold = len(first.prompt_token_ids)

    second = _request(scheduler, "b", "Which river flows through Vienna?")
    reserved = scheduler.reserve(second)
    a, b = first.prompt_token_ids, second.prompt_token_ids
    num_shared_blocks = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) // BLOCK
    assert num_shared_blocks >= 8
    expected = len(second.prompt_token_ids) - num_shared_blocks * BLOCK
    assert scheduler.load_snapshot()[1] == expected
    scheduler.enqueue(reserved)
    with scheduler.test_done:
        assert scheduler.test_done.wait_for(lambda: "b" in scheduler.test_ends, timeout=120)
    assert scheduler.test_ends["b"].usage.cached_tokens == num_shared_blocks * BLOCK
    assert scheduler.load_snapshot()[1] == 0

    # Reuse off computes everything: the whole prompt is backlog.
    off = scheduler.reserve(_request(scheduler, "c", "Which river flows through Paris?", reuse=False))
    assert scheduler.load_snapshot()[1] == cold
    scheduler.enqueue(off)
    with scheduler.test_done:
        assert scheduler.test_done.wait_for(lambda: "c" in scheduler.test_ends, timeout=120)
