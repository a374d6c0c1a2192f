"""Shadow verification's pure parts: the divergence measure, sampling, the bounded queue, the verdict."""

from __future__ import annotations

import random

import pytest
import torch

from kite_shared.messages import SamplingParams, TokenizedRequest
from kite_worker.shadow import DEFAULT_TOLERANCES, ShadowCheck, ShadowVerifier, first_token_divergence

REQUEST = TokenizedRequest(request_id="r", model="m", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(), reuse=True,
                           model_fingerprint="ab" * 32, block_size=16, block_hashes=[], stream_subject="s",
                           created_at=0.0)


def check(logits: torch.Tensor) -> ShadowCheck:
    return ShadowCheck(REQUEST, "ab" * 32, num_reused_tokens=32, reused_logits=logits)


def test_divergence_is_kl_of_the_recomputed_from_the_reused_distribution():
    p = torch.tensor([2.0, 1.0, 0.0])
    assert first_token_divergence(p, p.clone()) == 0.0
    assert first_token_divergence(p, p + 5.0) == pytest.approx(0.0, abs=1e-12)  # a shift is the same distribution
    q = torch.tensor([0.0, 1.0, 2.0])
    log_p, log_q = torch.log_softmax(p.double(), -1), torch.log_softmax(q.double(), -1)
    assert first_token_divergence(p, q) == pytest.approx(float((log_p.exp() * (log_p - log_q)).sum()))


def test_a_fraction_of_requests_is_drawn():
    verifier = ShadowVerifier(0.25, 1e-4, rng=random.Random(7))
    drawn = sum(verifier.draw() for _ in range(4000))
    assert 900 < drawn < 1100
    assert not any(ShadowVerifier(0.0, 1e-4).draw() for _ in range(100))
    assert all(ShadowVerifier(1.0, 1e-4).draw() for _ in range(100))
    with pytest.raises(ValueError):
        ShadowVerifier(1.5, 1e-4)


def test_checks_wait_in_order_and_extra_ones_are_dropped():
    verifier = ShadowVerifier(1.0, 1e-4, max_pending=2)
    first, second, third = (check(torch.full((4,), float(i))) for i in range(3))
    for c in (first, second, third):
        verifier.offer(c)
    assert (verifier.num_sampled, verifier.num_dropped) == (3, 1)
    assert verifier.take() is first and verifier.take() is second and verifier.take() is None
    assert not verifier.has_pending()


def test_the_verdict_holds_the_divergence_to_the_storage_dtype_tolerance():
    verifier = ShadowVerifier.for_storage_dtype(1.0, "float16")
    assert verifier.tolerance == DEFAULT_TOLERANCES["float16"]
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    same = verifier.judge(check(logits), logits + 1e-4 * torch.randn(100))
    other = verifier.judge(check(logits), torch.randn(100))
    assert not same.diverged and other.diverged and other.divergence > 0.1
    assert (verifier.num_checked, verifier.num_diverged) == (2, 1)
    assert ShadowVerifier.for_storage_dtype(1.0, "float16", tolerance=0.5).tolerance == 0.5


def top_logprobs(logits: torch.Tensor, k: int) -> dict[int, float]:
    log_p = torch.log_softmax(logits.double(), -1)
    values, ids = log_p.topk(k)
    return {int(i): float(v) for i, v in zip(ids, values)}


def test_the_top_k_divergence_is_zero_for_one_distribution_and_never_above_the_full_kl():
    from kite_worker.shadow import top_logprobs_divergence

    generator = torch.Generator().manual_seed(1)
    p = torch.randn(500, generator=generator) * 3
    assert top_logprobs_divergence(top_logprobs(p, 20), top_logprobs(p, 20)) == pytest.approx(0.0, abs=1e-12)
    for scale in (1e-3, 0.1, 1.0):
        q = p + scale * torch.randn(500, generator=generator)
        coarse = top_logprobs_divergence(top_logprobs(p, 20), top_logprobs(q, 20))
        assert 0.0 <= coarse <= first_token_divergence(p, q) + 1e-12, scale
    # Other numerics (another distribution): far above every tolerance.
    other = torch.randn(500, generator=generator) * 3
    assert top_logprobs_divergence(top_logprobs(p, 20), top_logprobs(other, 20)) > 0.1


def test_a_vllm_check_is_judged_on_top_logprobs():
    verifier = ShadowVerifier.for_storage_dtype(1.0, "float16")
    logits = torch.randn(200, generator=torch.Generator().manual_seed(2)) * 3
    hit = ShadowCheck(REQUEST, "ab" * 32, num_reused_tokens=32, reused_top_logprobs=top_logprobs(logits, 20))
    assert not verifier.judge_top_logprobs(hit, top_logprobs(logits + 1e-4 * torch.randn(200), 20)).diverged
    assert verifier.judge_top_logprobs(hit, top_logprobs(torch.randn(200) * 3, 20)).diverged
    assert (verifier.num_checked, verifier.num_diverged) == (2, 1)


def test_the_top_k_divergence_of_a_near_tie_at_the_kth_token_is_finite_and_small():
    from kite_worker.shadow import top_logprobs_divergence

    # A confident first token and a tie at the 20th place that the two sides break differently: the
    # truncated lists name different tokens, which must read as agreement, not as an infinite divergence.
    logits = torch.full((23,), -40.0)
    logits[0], logits[1:19] = 25.0, 0.0
    reused, recomputed = logits.clone(), logits.clone()
    recomputed[19], recomputed[20] = 0.0, -1e-4
    reused[19], reused[20] = -1e-4, 0.0
    divergence = top_logprobs_divergence(top_logprobs(recomputed, 20), top_logprobs(reused, 20))
    assert 0.0 <= divergence < 1e-9
    assert top_logprobs_divergence(top_logprobs(recomputed, 20), {}) == float("inf")  # nothing to compare
