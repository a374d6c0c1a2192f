"""The quality guard of a lossy KV codec (KITE_KV_CODEC, or a tier's: KITE_KV_CODEC_WARM, _COLD; issue
17): a worker measures each lossy codec of its tiers at start and refuses to start when blocks reused from
a tier in that codec would change too many answers.

The measurement, on the reference engine's model (transformers, whatever KITE_ENGINE serves with: vLLM's
kernels are not needed to see what the codec does to the numbers): for each prompt of a fixed set, the
model computes the KV of every token but the last; the full blocks of that KV are passed through the codec
as a tier would store them (kite_shared.kv_codec) and, separately, stored losslessly in the storage dtype
(what reuse loads without a codec); the model continues greedily from the last prompt token from each.
Agreement is the share of generated tokens equal position by position; the first-token KL divergence
(lossless || codec) is measured beside it. Below KITE_KV_CODEC_MIN_AGREEMENT (default 99%) the worker
refuses to start and says the measured share. bench/bench_kv_codecs.py runs the same comparison (these
functions) over its own prompt set and prints the table in docs/benchmarks.md.

Cost: one model load and, per prompt, a prefill and three short greedy runs: about 30 s for the default
model on two cores, paid only when a lossy codec is configured.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kite_shared.config import ConfigError, ModelConfig
from kite_shared.model_store import LocalModel, load_causal_lm, load_tokenizer
from kite_shared.recyclable_unit import TORCH_DTYPE_TO_CODEC
from kite_shared.tier_codecs import TIERS
from kite_worker import codec_tensors

log = logging.getLogger(__name__)

GUARD_TOKENS = 24  # greedy tokens compared per prompt
# Varied, fixed prompts: facts, instructions, a document to answer from, arithmetic, code. Each is long
# enough (with the handbook) for a dozen full blocks, which is where stored KV matters.
_HANDBOOK = " ".join(
    f"Rule {i}: a request of kind {i} is answered within {i + 2} hours by team {chr(65 + i % 26)}, "
    f"logged with priority {i % 5}, and closed only after the customer confirms." for i in range(12))
GUARD_QUESTIONS = (
    "Which team answers a request of kind 7, and within how many hours?",
    "Summarise the rules above in two sentences for a new employee.",
    "Write a short, polite reply to a customer whose request of kind 3 is late.",
    "What is 17 times 23? Explain the steps.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three risks of closing a request before the customer confirms.",
    "Translate 'the request was closed yesterday' into French and German.",
    "Which priority do requests of kind 9 get, and why might that be?",
)


@dataclass(frozen=True)
class CodecQuality:
    codec: str
    agreement: float  # share of greedy tokens equal to the lossless run's
    num_identical: int  # continuations equal to the lossless run's entirely
    num_prompts: int
    kl_mean: float  # first-token KL(lossless || codec), nats
    kl_max: float


def through_codec(cache: DynamicCache, codec: str | None, block_size: int) -> DynamicCache:
    """A copy of `cache` whose full blocks went through `codec` (None: as computed)."""
    copy = DynamicCache()
    for layer_idx, layer in enumerate(cache.layers):
        keys, values = layer.keys.clone(), layer.values.clone()  # [1, heads, tokens, head dim]
        if codec is not None:
            for start in range(0, keys.shape[2] // block_size * block_size, block_size):
                end = start + block_size
                part = torch.stack([keys[:, :, start:end], values[:, :, start:end]], dim=1)
                decoded = codec_tensors.decode(codec_tensors.encode(part, codec), codec, tuple(part.shape), keys.dtype)
                keys[:, :, start:end], values[:, :, start:end] = decoded[:, 0], decoded[:, 1]
        copy.update(keys, values, layer_idx)
    return copy


@torch.inference_mode()
def continue_greedily(model, cache: DynamicCache, last_token: int, num_tokens: int) -> tuple[list[int], torch.Tensor]:
    """(greedy tokens, log-probabilities of the first one's distribution)."""
    token = torch.tensor([[last_token]])
    generated, first = [], None
    for _ in range(num_tokens):
        logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits[0, -1].float()
        if first is None:
            first = torch.log_softmax(logits, dim=-1)
        token = logits.argmax().view(1, 1)
        generated.append(int(token))
    return generated, first


@torch.inference_mode()
def compare(model, prompts: list[list[int]], reference: str | None, codecs: list[str], num_tokens: int,
            block_size: int) -> dict[str, CodecQuality]:
    """Each codec's continuations against `reference`'s (a codec, or None: the KV as computed)."""
    seen: dict[str, list[tuple[float, bool, float]]] = {codec: [] for codec in codecs}
    for ids in prompts:
        cache = model(input_ids=torch.tensor([ids[:-1]]), use_cache=True).past_key_values
        expected, expected_first = continue_greedily(model, through_codec(cache, reference, block_size), ids[-1],
                                                     num_tokens)
        for codec in codecs:
            tokens, first = continue_greedily(model, through_codec(cache, codec, block_size), ids[-1], num_tokens)
            seen[codec].append((sum(a == b for a, b in zip(expected, tokens)) / len(expected), expected == tokens,
                                float(torch.sum(expected_first.exp() * (expected_first - first)))))
    return {codec: CodecQuality(codec, statistics.mean(a for a, _, _ in rows), sum(same for _, same, _ in rows),
                                len(rows), statistics.mean(k for _, _, k in rows), max(k for _, _, k in rows))
            for codec, rows in seen.items()}


def check(local: LocalModel, cfg: ModelConfig, min_agreement: float) -> dict[str, CodecQuality]:
    """Measure each lossy codec of the tiers (KITE_KV_CODEC, _WARM, _COLD) against lossless storage;
    ConfigError (with the figure) when one is below the floor."""
    started = time.monotonic()
    tokenizer, model = load_tokenizer(local), load_causal_lm(local, cfg)
    prompts = []
    for question in GUARD_QUESTIONS:
        ids = tokenizer.apply_chat_template([{"role": "system", "content": "HANDBOOK: " + _HANDBOOK},
                                             {"role": "user", "content": question}],
                                            add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    lossless = TORCH_DTYPE_TO_CODEC[cfg.kv_storage_dtype]
    codecs = list(cfg.tier_codecs.lossy)
    qualities = compare(model, prompts, lossless, codecs, GUARD_TOKENS, cfg.block_size)
    del model
    elapsed = time.monotonic() - started
    for codec in codecs:
        quality = qualities[codec]
        names = [t for t in TIERS if getattr(cfg.tier_codecs, t) == codec]
        tiers = f"{names[0]} tier" if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]} tiers"
        summary = (f"KV codec {codec} ({tiers}): {100 * quality.agreement:.1f}% of greedy tokens equal to "
                   f"lossless {lossless} storage ({quality.num_identical} of {quality.num_prompts} continuations "
                   f"identical, first-token KL mean {quality.kl_mean:.1e}), measured in {elapsed:.0f} s")
        if quality.agreement < min_agreement:
            raise ConfigError(f"{summary}: below KITE_KV_CODEC_MIN_AGREEMENT={min_agreement:g}; refusing to store "
                              f"KV with it (lower the floor to accept these answers, or make that tier lossless)")
        log.warning("%s: at or above the floor %g; KV reused from the %s is lossy (answers may differ "
                    "from recomputation)", summary, min_agreement, tiers)
    return qualities
