"""Request migration, the pure parts: the fingerprinter appends the resumed tokens, the worker primes its
detokenizer and stop matcher with them so the text continues exactly where the dead worker left it."""

from __future__ import annotations

import pytest

from kite_fingerprinter.core import Fingerprinter, RequestError
from kite_shared.fingerprint import (ExecutionPathFingerprint, KVLayout, ModelFingerprint, block_hash_chain,
                                     root_hash)
from kite_shared.messages import GenerateRequest, SamplingParams, TokenizedRequest
from kite_shared.model_store import ModelIdentity
from kite_worker.engines.reference.detokenize import IncrementalDetokenizer, StopStringMatcher
from kite_worker.engines.reference.model import Sequence, _prime_resumed

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, rope_theta=10000.0, rope_scaling="",
                  norm_eps=1e-5, block_size=4)
MODEL = ModelFingerprint(weights_digest="cd" * 32, adapter_digest="", dtype="float32", quantization="",
                         layout=LAYOUT)
EXEC = ExecutionPathFingerprint(attn_impl="sdpa", kv_storage_dtype="float16", engine="transformers",
                                device_class="cpu-avx512")
ROOT = root_hash(MODEL, EXEC)
IDENTITY = ModelIdentity(model=MODEL, execution=EXEC, root=ROOT)


class _Vocab:
    def __len__(self) -> int:
        return 1000


def _fingerprinter() -> Fingerprinter:
    return Fingerprinter(tokenizer=_Vocab(), identity=ModelIdentity(MODEL, EXEC, ROOT), model_name="m",
                         block_size=4, max_context_tokens=64, default_max_tokens=20)


def _request(resume: list[int], max_tokens: int | None) -> GenerateRequest:
    return GenerateRequest(request_id="r", model="m", prompt_token_ids=[1, 2, 3, 4, 5, 6],
                           sampling=SamplingParams(max_tokens=max_tokens), stream_subject="s",
                           resume_token_ids=resume)


@pytest.mark.parametrize("max_tokens, expected", [(10, 7), (None, 17)])
def test_fingerprinter_appends_resumed_tokens_and_lowers_max_tokens(max_tokens, expected):
    t = _fingerprinter().tokenize(_request([7, 8, 9], max_tokens))
    assert t.prompt_token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert t.num_resumed_tokens == 3
    assert t.sampling.max_tokens == expected  # the original budget (default resolved first) minus 3
    assert t.block_hashes == [bytes(h) for h in block_hash_chain(t.prompt_token_ids, 4, ROOT)]


def test_fingerprinter_refuses_resumed_tokens_outside_the_vocabulary_or_budget():
    with pytest.raises(RequestError):
        _fingerprinter().tokenize(_request([7, 5000], 10))
    with pytest.raises(RequestError):
        _fingerprinter().tokenize(_request([7, 8, 9], 3))


def _decode(ids) -> str:  # byte-level "tokenizer": one token per UTF-8 byte
    return bytes(ids).decode("utf-8", errors="replace")


def _sequence(prompt: list[int], num_resumed: int, stop: list[str]) -> Sequence:
    request = TokenizedRequest(request_id="r", model="m", prompt_token_ids=prompt,
                               sampling=SamplingParams(max_tokens=100, stop=stop), reuse=False,
                               model_fingerprint=ROOT.hex(), block_size=4, block_hashes=[], stream_subject="s",
                               created_at=0.0, num_resumed_tokens=num_resumed)
    return Sequence(request=request, identity=IDENTITY, prompt_ids=prompt, prompt_hashes=[], reuse=False, generator=None,
                    detokenizer=IncrementalDetokenizer(_decode), stops=StopStringMatcher(stop))


def _run(seq: Sequence, tokens: list[int]) -> str:
    return "".join(seq.stops.feed(seq.detokenizer.add(t))[0] for t in tokens)


@pytest.mark.parametrize("stop", [[], ["XYZ"]])
def test_primed_worker_continues_the_text_exactly_at_every_split(stop):
    answer = list("añb € XY c XY".encode())  # multi-byte characters and partial stop strings
    prompt = [104, 105]
    whole = _sequence(prompt, 0, stop)
    reference = _run(whole, answer) + whole.stops.flush()
    for k in range(1, len(answer)):
        first = _sequence(prompt, 0, stop)
        sent = _run(first, answer[:k])  # what the client got before the worker died
        second = _sequence(prompt + answer[:k], k, stop)
        _prime_resumed(second)
        rest = _run(second, answer[k:]) + second.stops.flush()
        assert sent + rest == reference, k
