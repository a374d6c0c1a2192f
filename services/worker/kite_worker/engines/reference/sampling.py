"""Choose the next token from logits: greedy, or temperature + top-p with a per-request seeded generator."""

from __future__ import annotations

import torch

from kite_shared.messages import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    generator = torch.Generator()
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()
    return generator


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """`logits`: [vocab] float tensor of the last position."""
    if params.temperature == 0 or generator is None:
        return int(torch.argmax(logits).item())
    scaled = logits.float() / params.temperature
    if not bool(torch.isfinite(scaled).all()):
        return int(torch.argmax(logits).item())  # a temperature so small it overflows: the greedy limit
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, sorted_ids = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest set whose mass reaches top_p (the first token is always kept)
        keep = cumulative - sorted_probs < params.top_p
        keep[0] = True  # also when top_p rounds to 0 in float32 (e.g. 5e-324)
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(sorted_ids[choice].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())
