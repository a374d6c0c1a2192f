"""Moving stored KV to another position in a prompt (issue 40: reuse of a document wherever it stands).

A decoder with rotary position embeddings (RoPE) stores each key already rotated by its position p: per
pair of dimensions i, k(p) = R(p * inv_freq[i]) k. Rotations compose, R(a) R(b) = R(a + b), so the keys a
chunk of tokens had at positions p.. are its keys at q.. after one more rotation by q - p, exact up to
the arithmetic's rounding: the tokens attend to each other by relative position only, so every layer's
hidden states, and hence its keys before rotation and its values, are the same at q as at p
(tests/model/test_position_shift.py measures it on the default model). Values carry no position and stay
as they are.

That holds only where the angle is the position times a fixed frequency and nothing rescales the
magnitude: RoPE types "default", "linear" and "llama3" (static inverse frequencies, attention scaling 1).
"dynamic" and "longrope" change the frequencies with the sequence length and YaRN scales cos and sin, so
keys computed under them cannot be moved exactly: `PositionShift` refuses such a model at construction.

The rotation is the model's own: cos and sin from its rotary embedding module at the offset, applied with
transformers' `rotate_half` (the convention both transformers and vLLM use for these models, neox style).
What this does not settle: a moved chunk's tokens attended, when computed, only to what preceded them
then, not to what precedes them now; selective recompute (CacheBlend's KV deviation, EPIC's first tokens
of each chunk) repairs that, and is issue 40's next part.

Layout: blocks as the recyclable unit's payload, [num_layers, 2 (key, value), num_kv_heads, num_tokens,
head_dim] (kite_worker.engines.reference.kv_blocks); keys alone as [..., num_tokens, head_dim].
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import rotate_half

# RoPE types whose angle is position x a fixed inverse frequency, with no magnitude scaling.
COMPOSABLE_ROPE_TYPES = frozenset({"default", "linear", "llama3"})


class PositionShift:
    """Rotates a model's stored keys from the positions they were computed at to other positions."""

    def __init__(self, rotary_emb: torch.nn.Module) -> None:
        rope_type = getattr(rotary_emb, "rope_type", "default")
        scaling = float(getattr(rotary_emb, "attention_scaling", 1.0))
        if rope_type not in COMPOSABLE_ROPE_TYPES or scaling != 1.0:
            raise ValueError(f"RoPE type {rope_type!r} (attention scaling {scaling}) does not compose: keys "
                             f"computed under it cannot be moved exactly (composable: "
                             f"{', '.join(sorted(COMPOSABLE_ROPE_TYPES))}, scaling 1)")
        self.rotary_emb = rotary_emb

    @classmethod
    def of_model(cls, model: torch.nn.Module) -> "PositionShift":
        """For a transformers causal LM (its decoder's `rotary_emb`)."""
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        rotary_emb = getattr(decoder, "rotary_emb", None)
        if rotary_emb is None:
            raise ValueError(f"{type(model).__name__} has no rotary embedding: its keys carry no rotation to move")
        return cls(rotary_emb)

    def keys(self, keys: torch.Tensor, offset: int) -> torch.Tensor:
        """`keys` ([..., num_tokens, head_dim]) moved `offset` positions later (earlier if negative): a new
        tensor of the same dtype, rotated in float32 (the storage dtype's rounding is applied once)."""
        if offset == 0:
            return keys.clone()
        x = keys.to(torch.float32)
        position_ids = torch.full((1, 1), offset, dtype=torch.long, device=x.device)
        cos, sin = self.rotary_emb(x, position_ids)  # [1, 1, head_dim]: one angle for every token
        cos, sin = cos[0].to(torch.float32), sin[0].to(torch.float32)
        return (x * cos + rotate_half(x) * sin).to(keys.dtype)

    def blocks(self, kv: torch.Tensor, offset: int) -> torch.Tensor:
        """A unit's payload ([num_layers, 2, num_kv_heads, num_tokens, head_dim]) with its keys moved
        `offset` positions; its values are copied unchanged."""
        if kv.dim() != 5 or kv.shape[1] != 2:
            raise ValueError(f"expected [num_layers, 2, num_kv_heads, num_tokens, head_dim], got {list(kv.shape)}")
        moved = kv.clone()
        moved[:, 0] = self.keys(kv[:, 0], offset)
        return moved
