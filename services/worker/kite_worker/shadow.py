"""Shadow verification: a worker proves its cache hits by recomputing a sample of them (issue 16).

The algorithm:
  1. At admission each request draws once: with probability `fraction` (KITE_SHADOW_FRACTION, default 1%)
     it is sampled, and the engine keeps its first-token logits.
  2. After its prefill, a sampled request that reused KV is offered here with those logits. At most
     `max_pending` checks wait; more are dropped and counted (a busy worker has no idle time to spend).
  3. When the engine has nothing else to run, the scheduler takes the oldest check and recomputes the same
     prompt from scratch, without reuse and without storing, a few tokens per step
     (KITE_SHADOW_CHUNK_TOKENS) so that a request arriving meanwhile waits one small chunk at most.
  4. The two first-token distributions are compared: KL(recomputed || reused) in nats. A divergence above
     the tolerance of the KV storage dtype means the reused blocks were not the KV this model computes
     (another layout, rope, epsilon, engine or adapter under the same fingerprint, or a planted block);
     the result goes to the arbitrator, which quarantines the namespace fleet-wide.

Why the first token's distribution: it depends on every reused position through attention, costs no extra
forward pass on the served request, and is what decides the answer. On vLLM the engine hands out the
first token's top-K log-probabilities (K = TOP_LOGPROBS), not its logits: the divergence is then the KL of
the distributions coarsened to those tokens plus one bucket for the rest of the vocabulary
(`top_logprobs_divergence`); coarsening never increases a KL, so a tolerance set for the full KL holds
for it (tokens the reused top K lacks are given the most they can have there, which can only understate
their share). Why KL and these tolerances: storing
KV rounds it; measured on SmolLM2-135M over 16 prompts with reuse against recompute, the largest KL was
1.1e-6 (float16 storage), 8.8e-5 (bfloat16), 1.8e-11 (float32). The defaults sit about 100x above those,
far below what other numerics give (a rope theta of 10,000 instead of 100,000: KL > 1).

Pure logic over tensors: no NATS, no threads (the reference scheduler drives it from its engine thread,
the vLLM front end from its event loop).
"""

from __future__ import annotations

import math
import random
import sys
from collections import deque
from dataclasses import dataclass

import torch

from kite_shared.messages import TokenizedRequest

# KL(recomputed || reused) of the first token, nats, that a correct hit stays under, by KV storage dtype.
DEFAULT_TOLERANCES = {"float32": 1e-6, "float16": 1e-4, "bfloat16": 5e-3}


TOP_LOGPROBS = 20  # vLLM: log-probabilities kept of a sampled request's first token (vLLM's max_logprobs)


@dataclass
class ShadowCheck:
    """A served cache hit waiting for its recomputation."""

    request: TokenizedRequest  # as served (its adapter, salt and hashes): recomputed with reuse off
    model_fingerprint: str  # hex: the namespace whose blocks it reused
    num_reused_tokens: int
    reused_logits: torch.Tensor | None = None  # reference engine: first-token logits, float32 [vocab]
    reused_top_logprobs: dict[int, float] | None = None  # vLLM: token id -> log-probability, its top K


@dataclass(frozen=True)
class ShadowOutcome:
    check: ShadowCheck
    divergence: float  # KL(recomputed || reused), nats
    tolerance: float

    @property
    def diverged(self) -> bool:
        return self.divergence > self.tolerance


def first_token_divergence(recomputed: torch.Tensor, reused: torch.Tensor) -> float:
    """KL(recomputed || reused) of the two distributions the logits give, in nats (float64)."""
    log_p = torch.log_softmax(recomputed.double(), dim=-1)
    log_q = torch.log_softmax(reused.double(), dim=-1)
    return max(0.0, float((log_p.exp() * (log_p - log_q)).sum()))


def top_logprobs_divergence(recomputed: dict[int, float], reused: dict[int, float]) -> float:
    """KL(recomputed || reused) in nats over the recomputed top-K tokens plus one bucket for the rest.

    A token in the recomputed top K but not in the reused one gets the smallest reused log-probability,
    the most it can have there. The reused top K then holds at least as many tokens outside the bucketed
    ones, each at least that probable, so the reused rest bucket is never negative: only rounding takes it
    to zero, and it is floored at the smallest positive double rather than made an infinite divergence."""
    floor = min(reused.values()) if reused else -math.inf
    divergence = 0.0
    p_rest, q_rest = 1.0, 1.0
    for token, log_p in recomputed.items():
        log_q = reused.get(token, floor)
        divergence += math.exp(log_p) * (log_p - log_q)  # infinite only when nothing reused was reported
        p_rest -= math.exp(log_p)
        q_rest -= math.exp(log_q)
    if p_rest > 1e-12:
        divergence += p_rest * math.log(p_rest / max(q_rest, sys.float_info.min))
    return max(0.0, divergence)


class ShadowVerifier:
    def __init__(self, fraction: float, tolerance: float, max_pending: int = 4,
                 rng: random.Random | None = None) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"shadow fraction {fraction}: between 0 and 1")
        self.fraction = fraction
        self.tolerance = tolerance
        self.max_pending = max_pending
        self._rng = rng or random.Random()
        self._pending: deque[ShadowCheck] = deque()
        self.num_sampled = 0  # hits offered for a check
        self.num_dropped = 0  # offered while `max_pending` waited: never checked
        self.num_checked = 0
        self.num_diverged = 0

    @classmethod
    def for_storage_dtype(cls, fraction: float, storage_dtype: str, tolerance: float = 0.0,
                          max_pending: int = 4) -> "ShadowVerifier":
        """`tolerance` 0: the default of the KV storage dtype (DEFAULT_TOLERANCES)."""
        return cls(fraction, tolerance or DEFAULT_TOLERANCES[storage_dtype], max_pending)

    def draw(self) -> bool:
        """At admission: is this request sampled (its first-token logits kept)?"""
        return self.fraction > 0 and self._rng.random() < self.fraction

    def offer(self, check: ShadowCheck) -> None:
        """After the prefill of a sampled request that reused KV."""
        self.num_sampled += 1
        if len(self._pending) >= self.max_pending:
            self.num_dropped += 1
            return
        self._pending.append(check)

    def has_pending(self) -> bool:
        return bool(self._pending)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def take(self) -> ShadowCheck | None:
        return self._pending.popleft() if self._pending else None

    def judge(self, check: ShadowCheck, recomputed_logits: torch.Tensor) -> ShadowOutcome:
        """The reference engine's check: full first-token logits on both sides."""
        return self._outcome(check, first_token_divergence(recomputed_logits, check.reused_logits))

    def judge_top_logprobs(self, check: ShadowCheck, recomputed: dict[int, float]) -> ShadowOutcome:
        """vLLM's check: the first token's top-K log-probabilities on both sides."""
        return self._outcome(check, top_logprobs_divergence(recomputed, check.reused_top_logprobs or {}))

    def _outcome(self, check: ShadowCheck, divergence: float) -> ShadowOutcome:
        outcome = ShadowOutcome(check, divergence, self.tolerance)
        self.num_checked += 1
        self.num_diverged += outcome.diverged
        return outcome
